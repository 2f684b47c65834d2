"""A read-only look into a state directory: never locks, never holds a row file in memory.

It reads the manifest, the row files' sizes and a sample of rows (one ``pread`` per run of
consecutive rows, so nothing is mapped and nothing else is read), which keeps it fast and
small on tables of any size, and usable while a training run holds the directory (the values
may then move). Asked rows are streamed in chunks, and :meth:`StateInspector.check` scans
every row that holds data the same way, a few thousand rows at a time. Each row file is
checked against the manifest (size, header) before any row is read. It needs numpy only, not
torch, so ``dsa-train inspect-state`` starts in a fraction of a second.

The ``optimizer_state/`` of a checkpoint is read as that checkpoint holds it: a row file kept
as a delta (``<file>.delta``, see :mod:`.deltas`) is read through its chain (the base's
records with every delta's laid over them, nothing written), and a disk table's moments come
from the checkpoint's ``tables/`` (its base or delta), not from the live table the manifest
names. :meth:`StateInspector.chain` lists the files of a chain and their bytes. A chain may
start at a virtual base (see :mod:`.deltas`): zeros, or a table's initial weights, which are
drawn again from its seed (this one needs torch, imported only then).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import StateError
from ..fsutil import lock_holder as live_holder  # noqa: F401  (re-exported: the CLI asks who holds a directory)
from .deltas import DELTA_SUFFIX, ChainReader, VirtualBase, chain_of
from .format import (
    LAYOUT,
    MANIFEST,
    TABLE_LAYOUT,
    RowSpec,
    load_manifest,
    moments_file,
    parse_row_header,
    read_row_header,
)

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
    chain: list[dict] | None = None  # in a checkpoint: [{"file", "bytes"}], base first, when it has deltas


class StateInspector:
    """The manifest and sampled rows of a state directory (with ``checkpoint``: that checkpoint's copy of one).

    Every method that reads rows first checks the parameter's row file against the manifest
    (present, its header, its size: see :meth:`row_file`), so a truncated or swapped file is a
    :class:`StateError` that names it, never a numpy error.
    """

    def __init__(self, path: Path, *, checkpoint: Path | None = None) -> None:
        self.path = Path(path)
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None  # a checkpoint's copy: its folder
        if not (self.path / MANIFEST).is_file():
            raise StateError(
                f"'{path}' is not a DiskSparseAdam state directory (it has no {MANIFEST})",
                hint="pass a state directory (e.g. ./opt_state_cache) or a run folder (runs/<name>)",
            )
        self.manifest = load_manifest(self.path / MANIFEST)

    @property
    def params(self) -> dict[str, dict]:
        return self.manifest["params"]

    def chain(self, name: str) -> list:
        """The files that make the parameter's records: ``[row file]``, or in a checkpoint that
        keeps it as a delta, ``[base, delta, ..., delta]``, the base a file or a
        :class:`~.deltas.VirtualBase` (see :mod:`.deltas`)."""
        entry = self._entry(name)
        checkpoint = self.checkpoint
        if checkpoint is not None and entry.get("layout", LAYOUT) == TABLE_LAYOUT:
            path = checkpoint / "tables" / entry["file"]  # the checkpoint's version of the table
        else:
            path = moments_file(self.path, entry)
        delta = path.with_name(path.name + DELTA_SUFFIX)
        if checkpoint is not None and not os.path.lexists(path) and os.path.lexists(delta):
            return chain_of(delta)
        return [path]

    def _reader(self, name: str) -> ChainReader:
        base, spec, _, _ = self.row_file(name)
        return ChainReader([base, *self.chain(name)[1:]], spec.row_bytes)

    def _entry(self, name: str) -> dict:
        if name not in self.params:
            raise StateError(
                f"state directory '{self.path}' has no parameter '{name}'", hint=f"it has {', '.join(self.params)}"
            )
        return self.params[name]

    def spec(self, name: str) -> RowSpec:
        """The record layout the manifest gives the parameter ``name``."""
        entry = self._entry(name)
        return RowSpec(name, tuple(entry["shape"]), entry["dtype"], "", entry.get("layout", LAYOUT))

    def row_file(self, name: str) -> tuple[Path | VirtualBase, RowSpec, int, int]:
        """The parameter's row file (for a disk table: the table file; in a checkpoint, its
        chain's base), its layout, its size and the bytes it takes on disk, once checked:
        present, a valid header that agrees with the manifest, and exactly the size the
        manifest's shape and layout need. A virtual base takes none."""
        entry = self._entry(name)
        spec = self.spec(name)
        path = self.chain(name)[0]
        restore = (
            "restore the state directory (and its disk table) from a checkpoint"
            if spec.layout == TABLE_LAYOUT
            else "restore the state directory from a checkpoint"
        ) + ", or start a fresh one"
        if entry.get("row_bytes") != spec.row_bytes:
            raise StateError(
                f"manifest '{self.path / MANIFEST}' gives parameter '{name}' records of {entry.get('row_bytes')!r} bytes, "
                f"but its shape {list(spec.shape)} and layout '{spec.layout}' make {spec.row_bytes}",
                hint=restore,
            )
        if isinstance(path, VirtualBase):  # no file: its header is the chain's first delta's
            size, allocated = path.file_bytes, 0
            meta = parse_row_header(path.header, f"the header block of '{path.where}'")
        else:
            try:
                info = os.stat(path)
            except FileNotFoundError:
                raise StateError(f"row file '{path}' of parameter '{name}' is missing", hint=restore) from None
            except OSError as e:
                raise StateError(
                    f"cannot read row file '{path}' of parameter '{name}': {e.strerror}", hint=restore
                ) from e
            size, allocated = info.st_size, info.st_blocks * 512
        if size != spec.file_bytes:
            raise StateError(
                f"row file '{path}' of parameter '{name}' is {size:,} bytes, but {spec.num_rows:,} rows of "
                f"{spec.row_bytes:,} bytes (shape {list(spec.shape)}, layout '{spec.layout}') need {spec.file_bytes:,} "
                f"({'truncated' if size < spec.file_bytes else 'longer than its manifest says'})",
                hint=restore,
            )
        if not isinstance(path, VirtualBase):
            meta = read_row_header(path)
        theirs = (meta.get("shape"), meta.get("layout", LAYOUT), meta.get("row_bytes"))
        if theirs != (list(spec.shape), spec.layout, spec.row_bytes):
            raise StateError(
                f"row file '{path}' holds shape {theirs[0]}, layout '{theirs[1]}', records of {theirs[2]} bytes, but the "
                f"manifest gives parameter '{name}' shape {list(spec.shape)}, layout '{spec.layout}', {spec.row_bytes}",
                hint=restore,
            )
        return path, spec, size, allocated

    def check_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Refuse any ``[start, stop)`` range outside the parameter's rows, before reading."""
        num_rows = self.spec(name).num_rows
        for start, stop in ranges:
            if not 0 <= start < stop <= num_rows:
                shown = f"{start}" if stop == start + 1 else f"{start}:{stop}"
                raise StateError(
                    f"parameter '{name}' has {num_rows:,} rows (0 to {num_rows - 1:,}); rows [{shown}] are out of range",
                    hint=f"ask for rows in 0:{num_rows} (a range stops before its end)",
                )

    def read_rows(self, name: str, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``m`` and ``v`` of the given rows, as float64 ``(len(rows), W)`` arrays (a row-wise
        v is repeated across the row). Each run of consecutive rows is one ``pread``."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        spec = self.spec(name)
        if len(rows) and (rows.min() < 0 or rows.max() >= spec.num_rows):
            bad = rows[(rows < 0) | (rows >= spec.num_rows)][:5].tolist()
            raise StateError(
                f"parameter '{name}' has {spec.num_rows:,} rows; rows {bad} are out of range",
                hint=f"ask for rows in 0:{spec.num_rows} (a range stops before its end)",
            )
        spec = self.spec(name)
        raw = np.zeros((len(rows), spec.row_bytes), dtype=np.uint8)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        with self._reader(name) as reader:
            for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(rows)]):
                for a in range(lo, hi, CHUNK_ROWS):
                    b = min(hi, a + CHUNK_ROWS)
                    raw[a:b] = reader.read(int(rows[a]), int(rows[a]) + b - a)
        return _moments(raw, spec)

    def iter_rows(self, name: str, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[range, np.ndarray, np.ndarray]]:
        """The rows of ``[start, stop)`` ranges, streamed: ``(rows, m, v)`` per chunk of at most
        a few thousand rows (and a few MiB), never the whole selection at once."""
        self.check_ranges(name, ranges)
        spec = self.spec(name)
        chunk = _chunk_rows(spec.row_bytes)
        with self._reader(name) as reader:
            for start, stop in ranges:
                for a in range(start, stop, chunk):
                    b = min(stop, a + chunk)
                    yield (range(a, b), *_moments(reader.read(a, b), spec))

    def sample_rows(self, name: str, count: int, seed: int = SAMPLE_SEED) -> list[int]:
        num_rows = self._entry(name)["shape"][0]
        if num_rows <= count:
            return list(range(num_rows))
        return sorted(set(np.random.default_rng(seed).integers(0, num_rows, count).tolist()))

    def summary(self, name: str, *, sample: int = 2048) -> ParamSummary:
        entry = self._entry(name)
        _, _, size, allocated = self.row_file(name)
        chain = self.chain(name)
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
            apparent_bytes=size,
            allocated_bytes=allocated,
            touched_rows_fraction=touched,
            sampled_rows=len(rows),
            chain=[{"file": str(p), "bytes": 0 if isinstance(p, VirtualBase) else os.stat(p).st_size} for p in chain]
            if len(chain) > 1
            else None,
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

    def check(self, name: str, *, progress: Callable[[int], None] | None = None, first: int = 5) -> dict:
        """Scan every row of the parameter for values Adam cannot have produced.

        Reports rows whose ``m`` or ``v`` is NaN or infinite, whose ``v`` is negative (a
        running mean of squares never is) and, in a disk table, whose weight is not finite.
        Rows are read in chunks of a few thousand with ``pread``; holes (rows never touched:
        zeros) are skipped, not read. ``progress(rows)`` is called as the scan moves on (in
        row numbers passed, read or skipped). A flipped bit that leaves a value finite and
        plausible is not detectable here: checkpoints carry digests for that.

        Returns ``{"rows", "rows_read", "bad_rows", "problems": {kind: {"rows", "first"}}}``,
        ``kind`` one of :data:`PROBLEMS` (only those found).
        """
        spec = self.spec(name)
        slots = {slot.name: slot for slot in spec.fields}
        chunk = _chunk_rows(spec.row_bytes)
        counts = dict.fromkeys(PROBLEMS, 0)
        firsts: dict[str, list[int]] = {kind: [] for kind in PROBLEMS}
        rows_read = bad_rows = position = 0
        with self._reader(name) as reader:
            for lo, hi in reader.data_rows():
                for a in range(lo, hi, chunk):
                    b = min(hi, a + chunk)
                    records = reader.read(a, b)
                    values = {key: _values(records, slot) for key, slot in slots.items()}
                    found = {
                        "m_not_finite": ~np.isfinite(values["m"]).all(axis=1),
                        "v_not_finite": ~np.isfinite(values["v"]).all(axis=1),
                        "v_negative": (values["v"] < 0).any(axis=1),
                    }
                    if "w" in values:
                        found["w_not_finite"] = ~np.isfinite(values["w"]).all(axis=1)
                    any_bad = np.zeros(b - a, dtype=bool)
                    for kind, mask in found.items():
                        hits = np.flatnonzero(mask)
                        counts[kind] += len(hits)
                        if len(firsts[kind]) < first:
                            firsts[kind] += (hits[: first - len(firsts[kind])] + a).tolist()
                        any_bad |= mask
                    bad_rows += int(any_bad.sum())
                    rows_read += b - a
                    if progress is not None:
                        progress(b - position)
                    position = b
        if progress is not None and position < spec.num_rows:
            progress(spec.num_rows - position)
        problems = {kind: {"rows": counts[kind], "first": firsts[kind]} for kind in PROBLEMS if counts[kind]}
        return {"rows": spec.num_rows, "rows_read": rows_read, "bad_rows": bad_rows, "problems": problems}


#: What :meth:`StateInspector.check` looks for, and how to say it.
PROBLEMS = {
    "m_not_finite": "m is NaN or infinite",
    "v_not_finite": "v is NaN or infinite",
    "v_negative": "v is negative",
    "w_not_finite": "the weight is NaN or infinite",
}
CHUNK_ROWS = 4096  # rows per pread when streaming or scanning
CHUNK_BYTES = 4 << 20  # and at most this many bytes


def _chunk_rows(record: int) -> int:
    return max(1, min(CHUNK_ROWS, CHUNK_BYTES // record))


def _values(records: np.ndarray, slot) -> np.ndarray:
    """One slot of ``(rows, record)`` uint8 records, in its own dtype (bfloat16 as float32)."""
    values = np.ascontiguousarray(records[:, slot.offset : slot.offset + slot.nbytes]).view(_NUMPY[slot.dtype])
    if slot.dtype == "bfloat16":  # the top half of a float32
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values


def _moments(records: np.ndarray, spec: RowSpec) -> tuple[np.ndarray, np.ndarray]:
    """``m`` and ``v`` (float64, ``(rows, W)``) of ``(rows, record)`` uint8 records."""
    fields = {slot.name: _values(records, slot).astype(np.float64) for slot in spec.fields}
    return fields["m"], np.broadcast_to(fields["v"], (len(records), spec.row_width))


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
