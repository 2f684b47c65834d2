"""A read-only look into a state directory: never locks, never reads a row file whole.

It reads the manifest, the row files' sizes and a sample of rows (through a read-only memory
map, so only the sampled pages are touched), which keeps it fast and small on tables of any
size, and usable while a training run holds the directory (the values may then move).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import StateError
from ..fsutil import DirectoryLock
from .row_file import HEADER_BYTES, read_row_header
from .state_dir import MANIFEST, load_manifest

_NUMPY = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16}


@dataclass
class ParamSummary:
    name: str
    shape: list[int]
    dtype: str
    layout: str
    step: int
    file: str
    apparent_bytes: int
    allocated_bytes: int
    touched_rows_fraction: float  # estimated from a sample of rows: rows whose v is not all zero
    sampled_rows: int


def live_holder(directory: Path) -> str | None:
    """Who holds the directory's lock, or ``None``; looks without taking any lock."""
    lock = Path(directory) / DirectoryLock.FILE_NAME
    try:
        info = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return None
    pid = info.get("pid")
    if not pid or not _holds_flock(pid, lock):
        return None
    return f"pid {pid} ({info.get('command', '?')}, since {info.get('since', '?')})"


def _holds_flock(pid: int, lock: Path) -> bool:
    """Whether process ``pid`` holds an flock on ``lock`` (from /proc/locks; else: is it alive)."""
    try:
        inode = lock.stat().st_ino
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "FLOCK" in fields and str(pid) in fields and any(p.endswith(f":{inode}") for p in fields):
                    return True
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


class StateInspector:
    """The manifest and sampled rows of a state directory (or of a run folder's)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise StateError(
                f"'{path}' is not a DiskSparseAdam state directory (it has no {MANIFEST})",
                hint="pass a state directory (e.g. ./opt_state_cache) or a run folder (runs/<name>)",
            )
        self.manifest = load_manifest(self.path / MANIFEST)

    @classmethod
    def of(cls, path: Path) -> StateInspector:
        """Inspect ``path``: a state directory, or a run folder's ``optimizer_state/``."""
        path = Path(path)
        if not (path / MANIFEST).is_file() and (path / "config.yaml").is_file():
            return cls(path / "optimizer_state")
        return cls(path)

    @property
    def params(self) -> dict[str, dict]:
        return self.manifest["params"]

    def _entry(self, name: str) -> dict:
        if name not in self.params:
            raise StateError(f"state directory '{self.path}' has no parameter '{name}'", hint=f"it has {', '.join(self.params)}")
        return self.params[name]

    def _rows(self, name: str) -> np.memmap:
        entry = self._entry(name)
        path = self.path / entry["file"]
        read_row_header(path)
        shape = entry["shape"]
        width = math.prod(shape[1:])
        if shape[0] * width == 0:
            return np.zeros((shape[0], 2, width), dtype=_NUMPY[entry["dtype"]])
        return np.memmap(path, dtype=_NUMPY[entry["dtype"]], mode="r", offset=HEADER_BYTES, shape=(shape[0], 2, width))

    def read_rows(self, name: str, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``m`` and ``v`` of the given rows, as float32 ``(len(rows), W)`` tensors."""
        entry = self._entry(name)
        bad = [r for r in rows if not 0 <= r < entry["shape"][0]]
        if bad:
            raise StateError(f"parameter '{name}' has {entry['shape'][0]} rows; rows {bad[:5]} are out of range")
        records = torch.from_numpy(np.array(self._rows(name)[rows]))
        if entry["dtype"] == "bfloat16":
            records = records.view(torch.bfloat16)
        records = records.float()
        return records[:, 0], records[:, 1]

    def sample_rows(self, name: str, count: int, seed: int = 0) -> list[int]:
        num_rows = self._entry(name)["shape"][0]
        if num_rows <= count:
            return list(range(num_rows))
        generator = torch.Generator().manual_seed(seed)
        return sorted(torch.randint(0, num_rows, (count,), generator=generator).unique().tolist())

    def summary(self, name: str, *, sample: int = 2048) -> ParamSummary:
        entry = self._entry(name)
        stat = (self.path / entry["file"]).stat()
        rows = self.sample_rows(name, sample)
        _, v = self.read_rows(name, rows)
        touched = float((v != 0).any(dim=1).float().mean()) if len(rows) else 0.0
        return ParamSummary(
            name=name,
            shape=entry["shape"],
            dtype=entry["dtype"],
            layout=entry["layout"],
            step=entry["step"],
            file=entry["file"],
            apparent_bytes=stat.st_size,
            allocated_bytes=stat.st_blocks * 512,
            touched_rows_fraction=touched,
            sampled_rows=len(rows),
        )

    def statistics(self, name: str, *, sample: int = 10_000) -> dict:
        """Distribution of m, v and the per-row effective learning rate over sampled touched rows.

        The effective learning rate of a row is the mean over its elements of
        ``lr * sqrt(1 - beta2^t) / (1 - beta1^t) / (sqrt(v) + eps)``: the step a unit first
        moment would take there.
        """
        entry = self._entry(name)
        m, v = self.read_rows(name, self.sample_rows(name, sample, seed=1))
        touched = (v != 0).any(dim=1)
        m, v = m[touched], v[touched]
        group = next((g for g in self.manifest.get("groups", []) if name in g.get("params", [])), None)
        result = {"sampled_touched_rows": int(touched.sum()), "m": _describe(m), "v": _describe(v)}
        if group and entry["step"] > 0 and len(v):
            beta1, beta2 = group["betas"]
            t = entry["step"]
            step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
            result["effective_lr"] = _describe((step_size / (v.sqrt() + group["eps"])).mean(dim=1))
        return result


def _describe(values: torch.Tensor) -> dict:
    if values.numel() == 0:
        return {}
    flat = values.flatten().double()
    q = torch.quantile(flat[torch.randperm(len(flat))[:1_000_000]], torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
    return {
        "mean": flat.mean().item(),
        "std": flat.std().item() if len(flat) > 1 else 0.0,
        "min": flat.min().item(),
        "p01": q[0].item(),
        "median": q[1].item(),
        "p99": q[2].item(),
        "max": flat.max().item(),
    }
