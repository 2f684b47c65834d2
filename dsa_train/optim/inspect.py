"""A read-only look into a state directory: never locks, never reads a row file whole.

It reads the manifest, the row files' sizes and a sample of rows (one ``pread`` per row, so
nothing is mapped and nothing else is read), which keeps it fast and small on tables of any
size, and usable while a training run holds the directory (the values may then move). It
needs numpy only, not torch, so ``dsa-train inspect-state`` starts in a fraction of a second.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import StateError
from ..fsutil import DirectoryLock
from .format import HEADER_BYTES, LAYOUT, MANIFEST, RowSpec, load_manifest, moments_file, read_row_header

_NUMPY = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16}
SAMPLE_SEED = 20_261_202  # not 0: a table trained with seed-0 lookups must not match its own sample


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

    def read_rows(self, name: str, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``m`` and ``v`` of the given rows, as float64 ``(len(rows), W)`` arrays (a row-wise
        v is repeated across the row)."""
        entry = self._entry(name)
        num_rows, width = entry["shape"][0], math.prod(entry["shape"][1:])
        bad = [r for r in rows if not 0 <= r < num_rows]
        if bad:
            raise StateError(f"parameter '{name}' has {num_rows} rows; rows {bad[:5]} are out of range")
        path = moments_file(self.path, entry)
        read_row_header(path)
        spec = RowSpec(name, tuple(entry["shape"]), entry["dtype"], "", entry.get("layout", LAYOUT))
        record = entry["row_bytes"]
        with open(path, "rb") as f:
            raw = b"".join(os.pread(f.fileno(), record, HEADER_BYTES + r * record) for r in rows)
        records = np.frombuffer(raw, dtype=np.uint8).reshape(len(rows), record)
        fields = {slot.name: _decode(records[:, slot.offset : slot.offset + slot.nbytes], slot.dtype) for slot in spec.fields}
        return fields["m"], np.broadcast_to(fields["v"], (len(rows), width))

    def sample_rows(self, name: str, count: int, seed: int = SAMPLE_SEED) -> list[int]:
        num_rows = self._entry(name)["shape"][0]
        if num_rows <= count:
            return list(range(num_rows))
        return sorted(set(np.random.default_rng(seed).integers(0, num_rows, count).tolist()))

    def summary(self, name: str, *, sample: int = 2048) -> ParamSummary:
        entry = self._entry(name)
        stat = moments_file(self.path, entry).stat()
        rows = self.sample_rows(name, sample)
        _, v = self.read_rows(name, rows)
        touched = float((v != 0).any(axis=1).mean()) if len(rows) else 0.0
        return ParamSummary(
            name=name,
            shape=entry["shape"],
            dtype=entry["dtype"],
            layout=entry["layout"],
            step=entry["step"],
            file=entry.get("table", entry["file"]),
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
        m, v = self.read_rows(name, self.sample_rows(name, sample, seed=SAMPLE_SEED + 1))
        touched = (v != 0).any(axis=1)
        m, v = m[touched], v[touched]
        group = next((g for g in self.manifest.get("groups", []) if name in g.get("params", [])), None)
        result = {"sampled_touched_rows": int(touched.sum()), "m": _describe(m), "v": _describe(v)}
        if group and entry["step"] > 0 and len(v):
            beta1, beta2 = group["betas"]
            t = entry["step"]
            step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
            result["effective_lr"] = _describe((step_size / (np.sqrt(v) + group["eps"])).mean(axis=1))
        return result


def _decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Bytes of one slot, ``(rows, nbytes)`` uint8, as float64 values."""
    values = np.ascontiguousarray(raw).view(_NUMPY[dtype])
    if dtype == "bfloat16":  # the top half of a float32
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float64)


def _describe(values: np.ndarray) -> dict:
    if values.size == 0:
        return {}
    flat = values.ravel()
    p01, median, p99 = np.quantile(flat, [0.01, 0.5, 0.99])
    return {
        "mean": float(flat.mean()),
        "std": float(flat.std()),
        "min": float(flat.min()),
        "p01": float(p01),
        "median": float(median),
        "p99": float(p99),
        "max": float(flat.max()),
    }
