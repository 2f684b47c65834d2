"""A run folder: what one training run leaves on disk.

::

    runs/<recipe>-<timestamp>/
      config.yaml          the resolved recipe (with overrides), as run
      metrics.jsonl        one JSON object per logged step, epoch, evaluation and the summary
      optimizer_state/     the live DiskSparseAdam state directory
      checkpoints/<step>/  model weights, optimizer state, trainer state; see checkpoint.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import ConfigError, StateError
from ..fsutil import DirectoryLock, atomic_write_bytes
from ..recipe import Recipe, load_recipe, recipe_to_yaml


TRAINER = "trainer.json"  # a checkpoint folder is complete when this is in it (checkpoint.py)
PARTIAL = ".partial-"  # prefix of a checkpoint folder being written
DOOMED = ".deleting-"  # prefix of an old checkpoint folder being removed


def scratch_folders(checkpoints: Path) -> list[Path]:
    """Checkpoint folders a killed save or prune left behind (never complete checkpoints)."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.name.startswith((PARTIAL, DOOMED)) and p.is_dir())


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.name.isdigit() and (p / TRAINER).is_file())


class RunFolder:
    CONFIG = "config.yaml"
    METRICS = "metrics.jsonl"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tables_dir(self) -> Path:
        """The disk embedding tables (``model.embedding_storage: disk``): weights and moments."""
        return self.path / "tables"

    def state_dir(self, recipe: Recipe) -> Path:
        return Path(recipe.optimizer.state_dir) if recipe.optimizer.state_dir else self.path / "optimizer_state"

    @classmethod
    def create(cls, recipe: Recipe, path: Path | None = None) -> RunFolder:
        """A new run folder (``path``, else ``<output.dir>/<name>-<timestamp>``)."""
        if path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            name = recipe.output.run_name or f"{recipe.name}-{stamp}"
            path = Path(recipe.output.dir) / name
        if path.exists() and any(path.iterdir()):
            raise StateError(
                f"run folder '{path}' already exists and is not empty",
                hint="pass --resume to continue it, or choose another --output",
            )
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        run.write_config(recipe)
        return run

    @classmethod
    def find(cls, path: Path) -> RunFolder:
        """An existing run folder; a ``StateError`` says what is missing."""
        run = cls(path)
        if not run.config_path.is_file():
            raise StateError(
                f"'{path}' is not a run folder (it has no {cls.CONFIG})",
                hint="pass the folder that `dsa-train run` created, for example runs/<recipe>-<timestamp>",
            )
        return run

    @classmethod
    def newest(cls, recipe: Recipe) -> RunFolder:
        """The newest run folder of this recipe under ``output.dir`` (for ``--resume``)."""
        parent = Path(recipe.output.dir)
        pattern = recipe.output.run_name or f"{recipe.name}-*"
        candidates = sorted(
            (p for p in parent.glob(pattern) if (p / cls.CONFIG).is_file()), key=lambda p: p.stat().st_mtime
        )
        if not candidates:
            raise StateError(
                f"no run of recipe '{recipe.name}' to resume under '{parent}' (looked for {pattern})",
                hint="start it without --resume, or pass the run folder with --output",
            )
        return cls(candidates[-1])

    def lock(self) -> DirectoryLock:
        """Hold the run folder for one training process (released by the kernel if it dies)."""
        lock = DirectoryLock(self.path, purpose="run folder")
        lock.acquire()
        return lock

    def write_config(self, recipe: Recipe) -> None:
        atomic_write_bytes(self.config_path, recipe_to_yaml(recipe).encode())

    def read_config(self, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
        try:
            return load_recipe(self.config_path, overrides)
        except ConfigError as e:
            raise ConfigError(e.problems, source=f"run config '{self.config_path}'") from None


class MetricsLog:
    """Append-only JSON lines, flushed per record; cut back on resume to the checkpoint's."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records = len(self.read(self.path)) if self.path.exists() else 0
        self._file = open(self.path, "a")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records += 1

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def truncate(path: Path, records: int) -> None:
        """Keep the first ``records`` records (what a resumed run's checkpoint had logged)."""
        if path.exists():
            kept = path.read_text().splitlines()[:records]
            atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())

    @staticmethod
    def read(path: Path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
