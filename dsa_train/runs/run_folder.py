"""A run folder: what one training run leaves on disk.

::

    runs/<recipe>-<timestamp>/
      run.json             the marker: format, the run's id and its optimizer state's id
      config.yaml          the resolved recipe (with overrides), as run
      metrics.jsonl        one JSON object per logged step, epoch, evaluation and the summary
      optimizer_state/     the live DiskSparseAdam state directory
      checkpoints/<step>/  model weights, optimizer state, trainer state, row files as bases or
                           deltas on an earlier checkpoint; see checkpoint_store.py, docs/checkpoints.md
      .lock                who holds the run (the lock itself is on the folder: fsutil.DirectoryLock)

dsa-train recognises a run folder by its marker, never by a folder name, and never follows a
symbolic link inside one: a run whose ``checkpoints/``, ``tables/`` or ``optimizer_state/``
is a link is refused.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from ..errors import ConfigError, StateError
from ..fsutil import DirectoryLock, atomic_write_bytes, create_owned_folder, read_json_object
from ..recipe import Recipe, load_recipe, recipe_to_yaml
from ..storage.format import MANIFEST as STATE_MANIFEST
from .checkpoint_layout import CHECKPOINTS, TABLES


# A torchrun job's run folder (see sharded_run.py): rank folders under ranks/, and on rank 0's
# machine checkpoints.json, the steps every rank has checkpointed.
JOB_MANIFEST = "checkpoints.json"
JOB_FORMAT = "dsa-train/sharded-checkpoints"
RANKS = "ranks"
RANK_NAME = re.compile(r"(\d+)-of-(\d+)")

RUN_FORMAT = "dsa-train/run"
RUN_VERSION = 1
STATE_DIR = "optimizer_state"  # a run's live DiskSparseAdam state (unless optimizer.state_dir), and a checkpoint's copy


def read_marker(folder: Path) -> dict | None:
    """A run folder's ``run.json`` if it is a valid dsa-train run marker, else ``None``."""
    marker = read_json_object(Path(folder) / RunFolder.MARKER)
    if marker is None or marker.get("format") != RUN_FORMAT or not isinstance(marker.get("run_id"), str):
        return None
    return marker


class RunFolder:
    CONFIG = "config.yaml"
    METRICS = "metrics.jsonl"
    MARKER = "run.json"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock: DirectoryLock | None = None
        self._created = False  # made by create() in this process

    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tables_dir(self) -> Path:
        """The disk embedding tables (``model.embedding_storage: disk``): weights and moments."""
        return self.path / TABLES

    def state_dir(self, recipe: Recipe) -> Path:
        """Where the run's optimizer state goes: the recipe's ``optimizer.state_dir``, else
        ``optimizer_state/`` in the run folder."""
        return Path(recipe.optimizer.state_dir) if recipe.optimizer.state_dir else self.path / STATE_DIR

    @property
    def live_state_dir(self) -> Path:
        """Where the run's optimizer state is, from the run folder alone: the directory its
        marker records (a recipe's own ``optimizer.state_dir``), else ``optimizer_state/``."""
        recorded = (read_marker(self.path) or {}).get("state_dir")
        return Path(recorded) if isinstance(recorded, str) and recorded else self.path / STATE_DIR

    @property
    def marker(self) -> dict:
        """The run's marker (``run.json``); a ``StateError`` if it is missing or not ours."""
        marker = read_marker(self.path)
        if marker is None:
            raise StateError(
                f"'{self.path}' has no valid {self.MARKER}, the marker dsa-train writes into every run folder",
                hint="it was made by an older dsa-train or edited; start a new run",
            )
        return marker

    @property
    def run_id(self) -> str:
        return self.marker["run_id"]

    def record_state_id(self, state_id: str | None, state_dir: Path | None = None) -> None:
        """Remember which optimizer state directory is this run's (checked before it is reset)
        and, when it is not the run folder's own ``optimizer_state/``, where it is."""
        marker = self.marker
        where = (
            str(Path(state_dir).resolve())
            if state_dir is not None and Path(state_dir) != self.path / STATE_DIR
            else None
        )
        if marker.get("state_id") != state_id or marker.get("state_dir") != where:
            record = {**marker, "state_id": state_id, **({"state_dir": where} if where else {})}
            if not where:
                record.pop("state_dir", None)
            atomic_write_bytes(self.path / self.MARKER, json.dumps(record, indent=2).encode())

    @classmethod
    def create(cls, recipe: Recipe, path: Path | None = None) -> RunFolder:
        """A new run folder (``path``, else ``<output.dir>/<name>-<timestamp>``), locked before
        anything is written into it."""
        if path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            name = recipe.output.run_name or f"{recipe.name}-{stamp}"
            if name in (".", "..") or Path(name).name != name or "\0" in name:
                raise ConfigError(
                    [f"run folder name {name!r} is not a plain folder name"],
                    hint="set name or output.run_name to a plain name",
                )
            path = Path(recipe.output.dir) / name
        run = cls(path)
        run._lock = create_owned_folder(  # locked before the first byte
            run.path,
            "run folder",
            link_hint="pass a real folder with --output",
            busy_hint="pass --resume to continue it, or choose another --output",
        )
        run._created = True
        path = run.path
        try:
            marker = {
                "format": RUN_FORMAT,
                "version": RUN_VERSION,
                "run_id": uuid.uuid4().hex,
                "state_id": None,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            atomic_write_bytes(path / cls.MARKER, json.dumps(marker, indent=2).encode())
            run.write_config(recipe)
        except BaseException:
            run.release()
            raise
        return run

    @classmethod
    def find(cls, path: Path) -> RunFolder:
        """An existing run folder; a ``StateError`` says what is missing or wrong."""
        run = cls(path)
        if not os.path.lexists(path):
            raise StateError(
                f"run folder '{path}' does not exist",
                hint="pass the folder that `dsa-train run` created, for example runs/<recipe>-<timestamp> (ls runs/ lists them)",
            )
        if not run.config_path.is_file():
            raise StateError(
                f"'{path}' is not a run folder (it has no {cls.CONFIG})",
                hint="pass the folder that `dsa-train run` created, for example runs/<recipe>-<timestamp>",
            )
        run.check_layout()
        return run

    def check_layout(self) -> None:
        """Refuse a run folder whose own files or folders are symbolic links, or that has no marker."""
        for name in (CHECKPOINTS, TABLES, STATE_DIR, self.CONFIG, self.METRICS, self.MARKER):  # never links
            if (self.path / name).is_symlink():
                raise StateError(
                    f"'{self.path / name}' is a symbolic link; dsa-train never follows links inside a run folder",
                    hint="replace it with the real folder or file (or move the whole run folder instead)",
                )
        self.marker  # noqa: B018  (raises without one)

    @classmethod
    def newest(cls, recipe: Recipe) -> RunFolder:
        """The newest run folder of this recipe under ``output.dir`` (for ``--resume``)."""
        parent = Path(recipe.output.dir)
        pattern = glob.escape(recipe.output.run_name) if recipe.output.run_name else f"{glob.escape(recipe.name)}-*"
        candidates = sorted(
            (
                p
                for p in parent.glob(pattern)
                if not p.is_symlink() and read_marker(p) is not None and (p / cls.CONFIG).is_file()
            ),
            key=lambda p: p.stat().st_mtime,
        )
        if not candidates:
            raise StateError(
                f"no run of recipe '{recipe.name}' to resume under '{parent}' (looked for {pattern})",
                hint="start it without --resume, or pass the run folder with --output",
            )
        return cls.find(candidates[-1])

    def lock(self) -> DirectoryLock:
        """Hold the run folder for one training process (released by the kernel if it dies)."""
        if self._lock is None:
            lock = DirectoryLock(self.path, purpose="run folder")
            lock.acquire()
            self._lock = lock
        return self._lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def discard(self) -> None:
        """Remove a run folder this process created and that holds nothing worth keeping (a
        run that failed before its first step). Only for a folder ``create`` made (it refuses a
        non-empty one, so all inside is the run's); links inside are removed, never followed."""
        if not self._created:
            raise RuntimeError("discard() is for a run folder this process created")
        shutil.rmtree(self.path, ignore_errors=True)

    def write_config(self, recipe: Recipe) -> None:
        atomic_write_bytes(self.config_path, recipe_to_yaml(recipe).encode())

    def read_config(self, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
        try:
            return load_recipe(self.config_path, overrides)
        except ConfigError as e:
            raise ConfigError(e.problems, source=f"run config '{self.config_path}'") from None


class MetricsLog:
    """Append-only JSON lines, flushed per record; cut back on resume to the checkpoint's."""

    MACHINE_FIELDS = (
        "seconds",
        "items_per_s",
        "peak_rss_mib",
        "peak_rss_anon_mib",
        "optimizer_ram_mib",
        "optimizer_memory_budget_mib",
    )
    """The fields of a record that measure the machine (time, speed, memory), not the training:
    two runs of one recipe, one of them resumed, differ in these alone."""

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
        lines = Path(path).read_text(errors="replace").splitlines() if path.exists() else []
        if len(lines) < records:
            raise StateError(
                f"'{path}' has {len(lines)} records, but the checkpoint was taken after {records}: "
                "the metrics log was cut short behind the run's back",
                hint="restore the metrics log, or start the run again without --resume",
            )
        if path.exists():
            atomic_write_bytes(path, "".join(line + "\n" for line in lines[:records]).encode())

    @staticmethod
    def read(path: Path) -> list[dict]:
        """The records; a ``StateError`` names the first line that is not a JSON object."""
        records = []
        for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                raise StateError(
                    f"'{path}' line {number} is not a JSON record ({line[:60]!r}): the metrics log was edited or damaged",
                    hint="restore the line or remove it and the lines after it; training only appends to this file",
                )
            records.append(record)
        return records


def rank_folder_name(rank: int, world_size: int) -> str:
    """The name of a rank's run folder under a job's ``ranks/``: ``00001-of-00002``."""
    return f"{rank:05d}-of-{world_size:05d}"


def rank_name(name: str) -> tuple[int, int] | None:
    """``"00001-of-00002"`` -> ``(1, 2)``; ``None`` for any other name."""
    match = RANK_NAME.fullmatch(name)
    if match is None:
        return None
    rank, world = int(match[1]), int(match[2])
    return (rank, world) if 0 <= rank < world else None


def job_checkpoints(job: Path | None, *, dir_fd: int | None = None) -> tuple[int, list[int]] | None:
    """The world size and the complete steps (oldest first) ``<job>/checkpoints.json`` gives,
    read without following a link; ``None`` when it is missing or not a valid one of ours."""
    manifest = read_json_object(JOB_MANIFEST if dir_fd is not None else Path(job) / JOB_MANIFEST, dir_fd=dir_fd)
    if manifest is None or manifest.get("format") != JOB_FORMAT:
        return None
    world, complete = manifest.get("world_size"), manifest.get("complete")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1 or not isinstance(complete, list):
        return None
    return world, sorted({s for s in complete if isinstance(s, int) and not isinstance(s, bool) and s >= 0})


def is_job(folder: Path) -> bool:
    """Whether ``folder`` is a torchrun job's run folder: it has rank folders (``ranks/``, on
    every machine of the job) or the job's ``checkpoints.json`` (rank 0's), and is not an
    optimizer state directory (whose ``manifest.json`` says what it is, whatever else it holds).
    The one test of it: ``eval``, the reader, ``clean`` and ``inspect-state`` all ask here."""
    folder = Path(folder)
    marked = os.path.lexists(folder / RANKS) or os.path.lexists(folder / JOB_MANIFEST)
    return marked and not os.path.lexists(folder / STATE_MANIFEST)
