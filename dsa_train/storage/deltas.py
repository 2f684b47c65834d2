"""Row-file deltas: the records of a row file that changed, written alone.

A *delta* holds a set of records copied out of a row file (see :mod:`.format`), so that a
snapshot of a file costs the rows written since the previous snapshot, not the file (which
rows: :mod:`dsa_train.runs.changed_rows` counts them, from the optimizer's write hook). Its layout (offsets in
bytes, integers little-endian)::

    [0, 4096)                      DELTA_MAGIC, then one line of JSON, NUL-padded:
                                     format "dsa-train/row-delta", version 2
                                     (1: no virtual parents),
                                     file         the target's path inside its snapshot folder
                                     file_bytes   the target's size; row_bytes its record size
                                     rows         how many records follow (R)
                                     parent       {"snapshot", "id", "digest", "delta"}: the
                                                  snapshot folder whose version of ``file``
                                                  this applies to, that snapshot's id, the
                                                  digest of the parent file (a base copy, or
                                                  ``file + ".delta"`` when ``delta`` is true);
                                                  or {"virtual": "initial" | "zeros"}: a base
                                                  no file holds (see below)
                                     base, links  the snapshot holding the chain's full copy
                                                  (or the virtual base's name), and how many
                                                  deltas lead from it to here
                                     chain_bytes  record bytes of those deltas, this one included
    [4096, 8192)                   the target's header block (row files keep theirs there)
    [8192, 8192 + 8 R)             the R row indices, int64, strictly increasing
    [8192 + 8 R, ... + R row_bytes) the R records, in the order of the indices

Snapshot folders are siblings (``<root>/<snapshot>/<file>``): a delta at
``<root>/S/<file>.delta`` applies to ``<root>/<parent.snapshot>/<file>`` (or its ``.delta``),
whose name sorts strictly before ``S``, so a chain always ends, at a full copy (its *base*)
or at a *virtual* base, a version of the file as it was made, which no file holds
(:class:`VirtualBase`): ``"zeros"``, a row file as created (every record zero), or
``"initial"``, a disk table as ``Table.create`` wrote it, drawn again from the creation
parameters in its header (see :mod:`.table`). A virtual base's header is the header block of
the chain's first delta. The version of the file in snapshot S is the base with every delta
of the chain written over it, oldest first (:func:`materialise`); :class:`ChainReader` reads
rows of that version without writing it out. Knowing what a snapshot folder is for (a
checkpoint) is not this module's business: it only follows the names.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import StateError
from ..fsutil import copy_sparse, data_extents, write_digested
from .format import HEADER_BYTES, parse_row_header

DELTA_MAGIC = b"DSA-TRAIN DELTA\n"
DELTA_FORMAT = "dsa-train/row-delta"
DELTA_VERSION = 2  # 2: a parent may be virtual
DELTA_READABLE = (1, 2)
DELTA_SUFFIX = ".delta"
INDEX_OFFSET = 2 * HEADER_BYTES  # the delta's own header, then the target's header block
GATHER_ROWS = 1 << 16  # records scattered per chunk
WRITE_BYTES = 1 << 22  # records gathered and written per chunk of a delta: hashed while the next is gathered
WRITE_BUFFERS = 3  # the ring those chunks are gathered into
MAX_CHAIN = 64  # a longer chain is damage (the writer compacts long before)
VIRTUAL = ("initial", "zeros")  # bases no file holds: a table as created, a row file as created
_SNAPSHOT = re.compile(r"[0-9]{1,20}")


def snapshot_path(root: Path, snapshot: str, file: str, *, delta: bool) -> Path:
    """Where the version of ``file`` in ``snapshot`` lives below the snapshots' ``root``."""
    return Path(root) / snapshot / (file + DELTA_SUFFIX if delta else file)


class Written(NamedTuple):
    """A delta as written: its size in bytes and its :func:`~dsa_train.fsutil.file_digest`."""

    size: int
    digest: str


class LiveRows(NamedTuple):
    """A row file at ``path`` and a ``(rows, row_bytes)`` uint8 view of its records through
    a mapping this process already holds (the one its writer writes through): records
    gathered from it cost no page faults for the rows the writer touched, where a fresh
    mapping faults on every page."""

    path: Path
    records: np.ndarray


def write_delta(source: Path | LiveRows, rows: np.ndarray, target: Path, meta: dict) -> Written:
    """Write the records ``rows`` (sorted, unique) of the row file ``source`` as a delta at
    ``target`` (created exclusively, never through a link; fsynced). ``meta`` gives ``file``,
    ``parent``, ``base``, ``links`` and ``chain_bytes``. Returns its size and its digest,
    computed from the bytes as they were written (on a second thread, while the next records
    are gathered), so the delta is never read back."""
    rows = np.ascontiguousarray(rows, dtype="<i8")
    live = source.records if isinstance(source, LiveRows) else None
    source = source.path if isinstance(source, LiveRows) else source
    with _Mapped(source) as src:
        row_bytes, num_rows = _row_geometry(src.size, meta["row_bytes"], source)
        if live is None or live.shape != (num_rows, row_bytes) or live.dtype != np.uint8:
            live = src.records(row_bytes, num_rows)
        if len(rows) and (rows[0] < 0 or rows[-1] >= num_rows or np.any(np.diff(rows) <= 0)):
            raise ValueError(f"delta rows of '{source}' must be sorted, unique and below {num_rows}")
        header = {"format": DELTA_FORMAT, "version": DELTA_VERSION, "file_bytes": src.size, "rows": len(rows), **meta}
        raw = DELTA_MAGIC + json.dumps(header).encode() + b"\n"
        size = INDEX_OFFSET + len(rows) * (8 + row_bytes)
        chunks = _delta_chunks(raw.ljust(HEADER_BYTES, b"\0") + src.bytes[:HEADER_BYTES].tobytes(), rows, live)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                return Written(size, write_digested(fd, size, chunks, depth=WRITE_BUFFERS))
            finally:
                os.close(fd)
        finally:
            chunks.close()  # lets go of its view of the mapping


def _delta_chunks(headers: bytes, rows: np.ndarray, records: np.ndarray):
    """A delta's bytes in order: its headers, the indices, then the records gathered from
    the mapped file ``WRITE_BYTES`` at a time into a ring of ``WRITE_BUFFERS`` buffers."""
    yield headers
    yield rows
    per = max(1, WRITE_BYTES // records.shape[1])
    ring = [np.empty((min(per, len(rows)), records.shape[1]), dtype=np.uint8) for _ in range(WRITE_BUFFERS)]
    for n, begin in enumerate(range(0, len(rows), per)):
        chunk = rows[begin : begin + per]
        buffer = ring[n % WRITE_BUFFERS][: len(chunk)]
        np.take(records, chunk, axis=0, out=buffer)  # one copy, straight from the mapping
        yield buffer


def read_delta_header(path: Path) -> dict:
    """The header of the delta at ``path``, checked against the file's size; a
    :class:`StateError` names what is wrong."""
    fd = _open_regular(path)
    try:
        raw, size = os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)
    meta = None
    if raw.startswith(DELTA_MAGIC):
        try:
            meta = json.loads(raw[len(DELTA_MAGIC) :].split(b"\n", 1)[0])
        except ValueError:
            meta = None
    if not isinstance(meta, dict) or meta.get("format") != DELTA_FORMAT:
        raise StateError(f"delta '{path}' is corrupt: it does not start with a dsa-train delta header", hint=_RESTORE)
    if meta.get("version") not in DELTA_READABLE:
        raise StateError(
            f"delta '{path}' has version {meta.get('version')!r}, this dsa-train reads {', '.join(map(str, DELTA_READABLE))}",
            hint=_RESTORE,
        )
    ints = ("file_bytes", "row_bytes", "rows", "links", "chain_bytes")
    parent = meta.get("parent")
    well_formed = (
        all(isinstance(meta.get(k), int) and meta[k] >= 0 for k in ints)
        and meta["row_bytes"] > 0
        and (meta["file_bytes"] - HEADER_BYTES) % meta["row_bytes"] == 0
        and isinstance(parent, dict)
        and (_is_virtual(parent, meta) or _is_snapshot(parent))
        and isinstance(meta.get("file"), str)
        and all(part not in ("", ".", "..") for part in meta["file"].split("/"))
    )
    if not well_formed:
        raise StateError(f"delta '{path}' is corrupt: a header field is missing or has the wrong type", hint=_RESTORE)
    expected = INDEX_OFFSET + meta["rows"] * (8 + meta["row_bytes"])
    if size != expected:
        raise StateError(
            f"delta '{path}' is {size} bytes, its header says {expected}: it was truncated or extended", hint=_RESTORE
        )
    return meta


def _is_snapshot(parent: dict) -> bool:
    return (
        isinstance(parent.get("snapshot"), str)
        and _SNAPSHOT.fullmatch(parent["snapshot"]) is not None
        and isinstance(parent.get("delta"), bool)
    )


def _is_virtual(parent: dict, meta: dict) -> bool:
    """A parent ``{"virtual": kind}``: only the first delta of a chain has one."""
    return (
        set(parent) == {"virtual"}
        and parent["virtual"] in VIRTUAL
        and meta.get("base") == parent["virtual"]
        and meta.get("links") == 1
    )


def is_virtual(parent: dict) -> bool:
    """Whether a delta's ``parent`` is a virtual base (the header was checked on reading)."""
    return "virtual" in parent


class VirtualBase:
    """The base of a chain that no file holds (see the module docstring): ``kind`` is
    ``"zeros"`` or ``"initial"``, ``header`` the target's header block (from the chain's first
    delta), ``file_bytes`` and ``row_bytes`` its geometry. Made by :func:`chain_of`, which
    checks that an ``"initial"`` header names creation parameters; the guard that this torch
    draws what the table was made with is checked when its rows are first drawn."""

    def __init__(self, kind: str, header: bytes, file_bytes: int, row_bytes: int, where: Path) -> None:
        self.kind, self.header, self.file_bytes, self.row_bytes, self.where = (
            kind,
            header,
            file_bytes,
            row_bytes,
            Path(where),
        )
        self.num_rows = (file_bytes - HEADER_BYTES) // row_bytes
        self._initial = None
        if kind == "initial":
            meta = _header_meta(header)
            if meta is None or not isinstance(meta.get("creation"), dict) or _geometry(meta) != (file_bytes, row_bytes):
                raise StateError(
                    f"delta '{where}' applies to the initial version of its table, but its header block names no creation "
                    "parameters of a table of its size",
                    hint=_RESTORE,
                )

    @property
    def name(self) -> str:
        """How listings show it."""
        return (
            "initial (drawn again from the table's seed)" if self.kind == "initial" else "zeros (a row file as created)"
        )

    def records(self, rows: np.ndarray) -> np.ndarray:
        """The ``(len(rows), row_bytes)`` uint8 records of ``rows`` (sorted, unique)."""
        if self.kind == "zeros":
            return np.zeros((len(rows), self.row_bytes), dtype=np.uint8)
        return self._table().records(rows)

    def write(self, target: Path) -> None:
        """Write this version at ``target`` (new, never through a link; fsynced)."""
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            if self.kind == "zeros":
                os.pwrite(fd, self.header, 0)
                os.ftruncate(fd, self.file_bytes)  # holes: zeros that take no space
                os.fsync(fd)
            else:
                self._table().write(fd)
        finally:
            os.close(fd)

    def _table(self):
        if self._initial is None:
            from .table import InitialTable  # torch: only a table's initial version needs it

            self._initial = InitialTable(_header_meta(self.header), f"delta '{self.where}'")
        return self._initial

    def __str__(self) -> str:
        return self.name


def _header_meta(header: bytes) -> dict | None:
    try:
        return parse_row_header(header, "a header block")
    except StateError:
        return None


def _geometry(meta: dict) -> tuple[int, int] | None:
    try:
        row_bytes = meta["row_bytes"]
        return HEADER_BYTES + meta["shape"][0] * row_bytes, row_bytes
    except (KeyError, TypeError, IndexError):
        return None


def chain_of(path: Path) -> list:
    """The versions that make the one at ``path``: ``[base, delta, ..., path]``, the base a
    file or a :class:`VirtualBase`; a plain row file is its own chain. Each parent must sort
    strictly before its child."""
    chain: list = [Path(path)]
    while chain[-1].name.endswith(DELTA_SUFFIX):
        meta = read_delta_header(chain[-1])
        if is_virtual(meta["parent"]):
            fd = _open_regular(chain[-1])
            try:
                header = os.pread(fd, HEADER_BYTES, HEADER_BYTES)
            finally:
                os.close(fd)
            chain.append(
                VirtualBase(meta["parent"]["virtual"], header, meta["file_bytes"], meta["row_bytes"], chain[-1])
            )
            break
        snapshot_dir = chain[-1]
        for _ in meta["file"].split("/"):
            snapshot_dir = snapshot_dir.parent
        parent = meta["parent"]
        if not parent["snapshot"] < snapshot_dir.name or len(chain) > MAX_CHAIN:
            raise StateError(
                f"delta '{chain[-1]}' names the parent snapshot {parent['snapshot']!r}, which is not older than its own",
                hint=_RESTORE,
            )
        chain.append(snapshot_path(snapshot_dir.parent, parent["snapshot"], meta["file"], delta=parent["delta"]))
    return chain[::-1]


def materialise(chain: list, target: Path) -> None:
    """Write the version a chain makes to ``target`` (new, never through a link; fsynced): its
    base copied (a virtual one written: a table drawn again, chunk by chunk), then each delta."""
    if isinstance(chain[0], VirtualBase):
        chain[0].write(target)
    else:
        copy_sparse(chain[0], target)
    if len(chain) == 1:
        return
    with _Mapped(target, writable=True) as out:
        for delta in chain[1:]:
            meta = read_delta_header(delta)
            if meta["file_bytes"] != out.size:
                raise StateError(
                    f"delta '{delta}' is for a file of {meta['file_bytes']} bytes, its base has {out.size}",
                    hint=_RESTORE,
                )
            records = out.records(meta["row_bytes"], (out.size - HEADER_BYTES) // meta["row_bytes"])
            with _Mapped(delta) as d:
                index, values = d.delta_arrays(meta)
                _check_index(index, records.shape[0], delta)
                out.bytes[:HEADER_BYTES] = d.bytes[HEADER_BYTES:INDEX_OFFSET]
                for begin in range(0, len(index), GATHER_ROWS):
                    records[index[begin : begin + GATHER_ROWS]] = values[begin : begin + GATHER_ROWS]
        out.flush()


class ChainReader:
    """Rows of the version a chain makes (see :func:`chain_of`), read without writing it out:
    the base's records with each delta's laid over them. Nothing is read but what is asked:
    :meth:`read` takes a range with one ``pread`` of the base (nothing mapped), :meth:`gather`
    any rows (the base mapped read-only on first use); a virtual base's records are made."""

    def __init__(self, chain: list, row_bytes: int) -> None:
        self.chain = [p if isinstance(p, VirtualBase) else Path(p) for p in chain]
        self.row_bytes = row_bytes
        self.virtual = self.chain[0] if isinstance(self.chain[0], VirtualBase) else None
        self._fd = -1 if self.virtual is not None else _open_regular(self.chain[0])
        self._mapped: _Mapped | None = None
        self.size = self.virtual.file_bytes if self.virtual is not None else os.fstat(self._fd).st_size
        self.num_rows = (self.size - HEADER_BYTES) // row_bytes
        self._deltas = []
        try:
            for path in self.chain[1:]:
                meta = read_delta_header(path)
                if meta["file_bytes"] != self.size or meta["row_bytes"] != row_bytes:
                    raise StateError(
                        f"delta '{path}' does not fit its base '{self.chain[0]}' (size or record)", hint=_RESTORE
                    )
                mapped = _Mapped(path)
                index, values = mapped.delta_arrays(meta)
                _check_index(index, self.num_rows, path)
                self._deltas.append((mapped, index, values))
        except BaseException:
            self.close()
            raise

    def header(self) -> bytes:
        """The version's header block (the newest delta's copy, else the base's)."""
        if self._deltas:
            return bytes(self._deltas[-1][0].bytes[HEADER_BYTES:INDEX_OFFSET])
        return self.virtual.header if self.virtual is not None else os.pread(self._fd, HEADER_BYTES, 0)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a ``(stop - start, row_bytes)`` uint8 array."""
        if self.virtual is not None:
            out = self.virtual.records(np.arange(start, stop, dtype=np.int64))
        else:
            size = (stop - start) * self.row_bytes
            data = os.pread(self._fd, size, HEADER_BYTES + start * self.row_bytes)
            if len(data) != size:  # the file shrank since it was opened
                raise StateError(
                    f"row file '{self.chain[0]}' ended at byte {HEADER_BYTES + start * self.row_bytes + len(data):,} while it was read",
                    hint="something truncated it while it was read; restore it from a checkpoint",
                )
            out = np.frombuffer(bytearray(data), dtype=np.uint8).reshape(stop - start, self.row_bytes)
        for _, index, values in self._deltas:
            lo, hi = np.searchsorted(index, [start, stop])
            out[index[lo:hi] - start] = values[lo:hi]
        return out

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The records of any ``rows`` (int64, in range, any order, repeats allowed), as a
        ``(len(rows), row_bytes)`` uint8 array: each distinct row read once, from the newest
        delta holding it, else from the base."""
        unique, inverse = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1), return_inverse=True)
        if len(unique) and (unique[0] < 0 or unique[-1] >= self.num_rows):
            raise IndexError(f"rows must lie in [0, {self.num_rows}), got {unique[0]} .. {unique[-1]}")
        if self.virtual is not None:
            out = self.virtual.records(unique)
        else:
            if self._mapped is None:
                self._mapped = _Mapped(self.chain[0])
            out = np.take(self._mapped.records(self.row_bytes, self.num_rows), unique, axis=0)
        for _, index, values in self._deltas:
            if not len(index):
                continue
            position = np.minimum(np.searchsorted(index, unique), len(index) - 1)
            found = index[position] == unique
            out[found] = values[position[found]]
        return out[inverse]

    def data_rows(self) -> list[tuple[int, int]]:
        """``[lo, hi)`` row ranges that may hold data, sorted and merged: the base's data
        extents (holes, rows never written, are zeros) and every delta's rows."""
        starts, stops = [], []
        if self.virtual is not None:  # zeros hold no data; an initial table's weights are everywhere
            extents = [(HEADER_BYTES, self.size)] if self.virtual.kind == "initial" else []
        else:
            try:
                os.lseek(self._fd, 0, os.SEEK_DATA)
                extents = list(data_extents(self._fd, self.size))
            except OSError as e:
                extents = [] if e.errno == errno.ENXIO else [(0, self.size)]  # ENXIO: all hole
        for begin, end in extents:
            starts.append(max(0, (begin - HEADER_BYTES) // self.row_bytes))
            stops.append(min(self.num_rows, max(0, -(-(end - HEADER_BYTES) // self.row_bytes))))
        ranges = [np.array(starts, dtype=np.int64), np.array(stops, dtype=np.int64)]
        for _, index, _ in self._deltas:
            breaks = np.flatnonzero(np.diff(index) != 1) + 1
            ranges[0] = np.concatenate([ranges[0], index[np.r_[0, breaks]] if len(index) else index])
            ranges[1] = np.concatenate(
                [ranges[1], index[np.r_[breaks - 1, len(index) - 1]] + 1 if len(index) else index]
            )
        order = np.argsort(ranges[0], kind="stable")
        merged: list[tuple[int, int]] = []
        for lo, hi in zip(ranges[0][order].tolist(), ranges[1][order].tolist()):
            if lo >= hi:
                continue
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    def close(self) -> None:
        for mapped, _, _ in self._deltas:
            mapped.close()
        self._deltas = []
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ChainReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_RESTORE = "the checkpoint is damaged: resume from an older one"


def _open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``path``, never opened through a link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError as e:
        raise StateError(f"cannot open '{path}': {e.strerror} (missing, or a link)", hint=_RESTORE) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StateError(f"'{path}' is not a regular file", hint=_RESTORE)
    return fd


def _row_geometry(size: int, row_bytes: int, path: Path) -> tuple[int, int]:
    if row_bytes <= 0 or size < HEADER_BYTES or (size - HEADER_BYTES) % row_bytes:
        raise StateError(
            f"row file '{path}' is {size} bytes, not a header and whole records of {row_bytes} bytes", hint=_RESTORE
        )
    return row_bytes, (size - HEADER_BYTES) // row_bytes


def _check_index(index: np.ndarray, num_rows: int, path: Path) -> None:
    if len(index) and (index[0] < 0 or index[-1] >= num_rows or np.any(np.diff(index) <= 0)):
        raise StateError(
            f"delta '{path}' is corrupt: its row indices are not sorted, unique rows of its file", hint=_RESTORE
        )


class _Mapped:
    """A file mapped whole (read-only, or writable), as bytes and as record arrays."""

    def __init__(self, path: Path, *, writable: bool = False) -> None:
        self._fd = _open_regular(path, os.O_RDWR if writable else os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self._map = (
            mmap.mmap(self._fd, self.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
            if self.size
            else None
        )
        self.bytes = np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else np.zeros(0, np.uint8)
        if not writable:
            self.bytes = self.bytes.view()
            self.bytes.flags.writeable = False

    def records(self, row_bytes: int, num_rows: int) -> np.ndarray:
        return self.bytes[HEADER_BYTES : HEADER_BYTES + num_rows * row_bytes].reshape(num_rows, row_bytes)

    def delta_arrays(self, meta: dict) -> tuple[np.ndarray, np.ndarray]:
        """A delta's ``(R,)`` row indices and ``(R, row_bytes)`` records, as views."""
        rows, row_bytes = meta["rows"], meta["row_bytes"]
        index = self.bytes[INDEX_OFFSET : INDEX_OFFSET + 8 * rows].view("<i8")
        values = self.bytes[INDEX_OFFSET + 8 * rows :].reshape(rows, row_bytes)
        return index, values

    def flush(self) -> None:
        if self._map is not None:
            self._map.flush()
        os.fsync(self._fd)

    def close(self) -> None:
        self.bytes = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the kernel unmaps with it
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> _Mapped:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
