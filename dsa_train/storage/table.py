"""Disk embedding tables: an embedding's weights and Adam moments in one row file.

A table file is a row file (see :mod:`.format`) with the layout ``w|m|v``: record ``r`` holds
weight row ``r`` and, next to it, that row's first and second moments. A disk embedding keeps
its weight there (the parameter is a view of the mapping), and :class:`DiskSparseAdam`, given
such a parameter, keeps the moments in the same records instead of a row file of its own, so
a touched row costs one contiguous read and one write instead of three.

The header also names the optimizer state directory whose moments the table holds
(``moments_of``, ``null`` until one adopts it), so moments trained under one optimizer are
never silently continued by another with fresh step counters.

A new table is written under a temporary name, in chunks of rows (never one ``N x D`` tensor
in memory), fsynced and renamed into place: a file at ``path`` is always complete.

A new table is a pure function of its shape, dtype and creation parameters (moments zero), so
its header also records them, as ``creation``::

    {"init": "normal", "std": 0.01, "bound": 0.1, "seed": 0, "chunk_rows": 65536,
     "first_chunk_digest": BLAKE2b-128 (hex) of chunk 0's weight bytes as written,
     "torch": the torch version that drew them}

and, for a table that is a slice of a larger one (a rank's shard of a table sharded over
several processes), ``"first_row"`` and ``"total_rows"``: its rows are rows
``[first_row, first_row + N)`` of a ``total_rows``-row table, drawn in that table's chunks,
so the shards of every layout together hold the same initial weights;
so a checkpoint can hold the rows written since creation only, on the *initial* version
(:class:`InitialTable`: re-created in full, or read chunk by chunk, from those parameters).
The digest guards re-creation: a torch that draws other numbers from the same seed is refused
with a :class:`StateError` naming both versions, never used. A header without ``creation``
(an older table) still opens; its checkpoints start from a full copy.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import StateError
from ..fsutil import drop_cached, fsync_directory
from ..memory import host_available_bytes
from .format import HEADER_BYTES, MAGIC, TABLE_LAYOUT, RowSpec, read_row_header
from .row_file import DTYPES, RowFile, dtype_name

#: Rows initialised per chunk. Fixed, so a table's initial weights depend on its seed only.
INIT_CHUNK_ROWS = 1 << 16
WRITE_ROWS = 1 << 12  # records assembled per chunk of writes
PAGE_BYTES = mmap.PAGESIZE
INITS = ("normal", "uniform", "xavier_uniform", "zeros")
CACHED_CHUNKS = 4  # initial weight chunks an InitialTable keeps (8 MiB each at 32 float32 columns)


def init_chunk(
    init: str, chunk: torch.Tensor, generator: torch.Generator, *, std: float, bound: float, num_rows: int
) -> None:
    """Fill ``chunk`` (rows of an ``N x D`` weight) in place.

    ``normal``: N(0, std^2); ``uniform``: U(-bound, bound); ``xavier_uniform``:
    U(-a, a) with a = sqrt(6 / (N + D)) (Glorot), the whole table's fan-in and fan-out;
    ``zeros``: 0.
    """
    if init == "normal":
        chunk.normal_(0.0, std, generator=generator)
    elif init == "uniform":
        chunk.uniform_(-bound, bound, generator=generator)
    elif init == "xavier_uniform":
        a = math.sqrt(6.0 / (num_rows + chunk[0].numel()))
        chunk.uniform_(-a, a, generator=generator)
    else:
        chunk.zero_()


class Table:
    """An open table file: ``weight`` (``(N, *row_shape)``) and ``rows.moments`` are views of
    one mapping. Create one with :meth:`create`, open an existing one with :meth:`open`."""

    def __init__(self, path: Path, spec: RowSpec, meta: dict, *, writable: bool, keep_cache: bool = False) -> None:
        self.path = Path(path)
        self.spec = spec
        self.moments_of: str | None = meta.get("moments_of")
        self.creation: dict | None = meta.get("creation")  # None: an older table, made before it was recorded
        self.writable = writable
        self.rows = RowFile(self.path, spec, writable=writable, keep_cache=keep_cache)
        self.weight = self.rows.records[:, 0].view(spec.shape)

    @property
    def table_id(self) -> str:
        return self.spec.state_id

    @classmethod
    def open(
        cls,
        path: str | Path,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        writable: bool = True,
        keep_cache: bool = False,
    ) -> Table:
        """Open the table at ``path``; a :class:`StateError` if it has another shape or dtype.
        ``keep_cache``: see :class:`~dsa_train.storage.row_file.RowFile`."""
        path = Path(path)
        meta = read_row_header(path)
        expected = {"layout": TABLE_LAYOUT, "shape": list(shape), "dtype": dtype_name(dtype)}
        for field, value in expected.items():
            if meta.get(field) != value:
                raise StateError(
                    f"table '{path}' has {field} {meta.get(field)!r}, but {value!r} was asked for",
                    hint="open it with the shape and dtype it was made with, or give a new path",
                )
        spec = RowSpec(meta["name"], tuple(shape), dtype_name(dtype), meta["state_id"], TABLE_LAYOUT)
        return cls(path, spec, meta, writable=writable, keep_cache=keep_cache)

    @classmethod
    def create(
        cls,
        path: str | Path,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        name: str,
        init: str = "normal",
        std: float = 1.0,
        bound: float = 0.1,
        seed: int = 0,
        progress: Callable[[int, int], None] | None = None,
        first_row: int = 0,
        total_rows: int | None = None,
    ) -> Table:
        """Write a new table: weights initialised chunk by chunk from ``seed``, moments zero.

        ``progress(rows_done, rows)`` is called after each chunk. With ``total_rows``, the
        table holds rows ``[first_row, first_row + shape[0])`` of a ``total_rows``-row table
        drawn from ``seed`` (a shard: see the module docstring).
        """
        if init not in INITS:
            raise ValueError(f"Invalid init {init!r}: use one of {', '.join(INITS)}")
        if total_rows is not None and not 0 <= first_row <= total_rows - shape[0]:
            raise ValueError(f"rows [{first_row}, {first_row + shape[0]}) are not rows of a {total_rows}-row table")
        if dtype_name(dtype) not in DTYPES:
            raise ValueError(f"Invalid dtype {dtype}: a table holds {', '.join(DTYPES)}")
        path = Path(path)
        spec = RowSpec(name, tuple(shape), dtype_name(dtype), uuid.uuid4().hex, TABLE_LAYOUT)
        creation = {"init": init, "std": std, "bound": bound, "seed": seed, "chunk_rows": INIT_CHUNK_ROWS}
        if total_rows is not None:
            creation.update(first_row=first_row, total_rows=total_rows)
        partial = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:12]}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)  # never through a link
        by_page = _stays_cached(spec.file_bytes)
        try:
            digest = _write_initial(fd, spec, creation, progress, by_page=by_page)
            creation = {**creation, "first_chunk_digest": digest, "torch": torch.__version__}
            os.pwrite(fd, table_header(spec, moments_of=None, creation=creation), 0)
            os.fsync(fd)
        except BaseException as e:  # interrupted or failed: no half-written table is left
            partial.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise StateError(
                    f"could not write table '{path}' ({spec.file_bytes / 2**30:.2f} GiB): {e.strerror}",
                    hint="free space on that disk or give a path on a bigger one",
                ) from e
            raise
        finally:
            os.close(fd)
        os.replace(partial, path)
        fsync_directory(path.parent)
        return cls.open(path, shape, dtype, keep_cache=by_page)  # a page at a time: its cached pages stay warm

    def adopt(self, state_id: str) -> None:
        """Record that the optimizer state ``state_id`` owns the moments (header rewrite, fsynced)."""
        if self.moments_of == state_id:
            return
        fd = self.rows.fd
        os.pwrite(fd, table_header(self.spec, moments_of=state_id, creation=self.creation), 0)
        os.fsync(fd)
        self.moments_of = state_id

    def flush(self) -> None:
        self.rows.flush()

    def close(self) -> None:
        self.weight = None
        self.rows.close()


def table_header(spec: RowSpec, *, moments_of: str | None, creation: dict | None) -> bytes:
    """The 4 KiB header of a table file: the row-file header plus ``moments_of`` and, for a
    table that records them, its ``creation`` parameters (see the module docstring)."""
    meta = json.loads(spec.header()[len(MAGIC) :].split(b"\n", 1)[0])
    extra = {"moments_of": moments_of, **({"creation": creation} if creation is not None else {})}
    raw = MAGIC + json.dumps({**meta, **extra}).encode() + b"\n"
    return raw.ljust(HEADER_BYTES, b"\0")


def initial_weights(
    creation: dict, shape: tuple[int, ...], dtype: torch.dtype, index: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Chunk ``index`` of a new table's weights, ``(rows, W)``: rows ``[index * chunk_rows,
    ...)`` as :meth:`Table.create` draws them (its own generator, seeded ``seed * 1_000_003 +
    index``), in the first rows of ``out`` (a ``(chunk_rows, W)`` buffer) if given."""
    num_rows, chunk_rows = shape[0], creation["chunk_rows"]
    rows, width = min(chunk_rows, num_rows - index * chunk_rows), math.prod(shape[1:])
    weights = out[:rows] if out is not None else torch.empty((rows, width), dtype=dtype)
    generator = torch.Generator().manual_seed(creation["seed"] * 1_000_003 + index)
    init_chunk(creation["init"], weights, generator, std=creation["std"], bound=creation["bound"], num_rows=num_rows)
    return weights


def drawn_shape(creation: dict, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the table whose chunks a table of ``shape`` is drawn from (itself, or the
    whole table a shard is a slice of)."""
    return (creation.get("total_rows", shape[0]), *shape[1:])


def _chunk_digest(weights: torch.Tensor) -> str:
    raw = weights.view(torch.int16) if weights.dtype == torch.bfloat16 else weights
    return hashlib.blake2b(memoryview(raw.contiguous().numpy()).cast("B"), digest_size=16).hexdigest()


def _stays_cached(file_bytes: int) -> bool:
    """Whether a new table of ``file_bytes`` is written a page at a time, to stay in the page
    cache as single pages for the first steps: when it fits in the memory this process can
    still take (or that is unknown). One ``pwrite`` a page costs more than large writes once
    the kernel writes pages back while they are made (measured here, 24 GB of RAM: 3.8 GB
    5.6 s against 7.5 s, 19.2 GB 60 s against 32 s, 38.4 GB 94 s against 50 s), and pays for
    itself in the first epoch's reads only while the table stays cached. A larger table is
    written in large writes and its pages, large folios, are dropped when it is opened (see
    :func:`~dsa_train.fsutil.drop_cached`)."""
    room = host_available_bytes()
    return room is None or file_bytes <= room


def _write_initial(
    fd: int, spec: RowSpec, creation: dict, progress: Callable[[int, int], None] | None, *, by_page: bool
) -> str:
    """Size the file at ``fd`` for ``spec`` and write every record as a new table holds it
    (the weights drawn chunk by chunk into one buffer, zero moments), one page per ``pwrite``
    if ``by_page``; the header and the fsync are the caller's. Returns the digest of the
    first chunk's weights."""
    os.ftruncate(fd, spec.file_bytes)
    dtype, num_rows, chunk_rows = DTYPES[spec.dtype], spec.num_rows, creation["chunk_rows"]
    first, drawn = creation.get("first_row", 0), drawn_shape(creation, spec.shape)
    block = torch.empty((min(chunk_rows, drawn[0]), spec.row_width), dtype=dtype)
    records = torch.zeros((min(WRITE_ROWS, num_rows), 3, spec.row_width), dtype=dtype)
    digest = ""
    for index in range(first // chunk_rows, (first + num_rows - 1) // chunk_rows + 1):
        weights = initial_weights(creation, drawn, dtype, index, out=block)
        if not digest:
            digest = _chunk_digest(weights)  # the first chunk drawn, whole
        lo, hi = max(first - index * chunk_rows, 0), min(first + num_rows - index * chunk_rows, len(weights))
        begin = index * chunk_rows + lo - first  # the table's row of weights[lo]
        for start in range(lo, hi, WRITE_ROWS):
            part = weights[start : min(start + WRITE_ROWS, hi)]
            records[: len(part), 0] = part
            raw = records[: len(part)].view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy()
            _pwrite_all(
                fd, memoryview(raw).cast("B"), HEADER_BYTES + (begin + start - lo) * spec.row_bytes, by_page=by_page
            )
        if progress is not None:
            progress(begin + hi - lo, num_rows)
    return digest


class InitialTable:
    """A table as :meth:`Table.create` wrote it, from the ``creation`` parameters its header
    ``meta`` records (a checkpoint's *initial* base): written whole with :meth:`write`, or read
    rows at a time with :meth:`records`, which draws only the 65,536-row chunks the rows fall
    in (the last :data:`CACHED_CHUNKS` kept). Made only after the guard: this torch must draw
    the first chunk the table was made with, else a :class:`StateError` names both versions."""

    def __init__(self, meta: dict, where: str) -> None:
        creation = meta.get("creation")
        if meta.get("layout") != TABLE_LAYOUT or not isinstance(creation, dict):
            raise StateError(f"{where} names no creation parameters of a table to re-create it from", hint=_DAMAGED)
        try:
            self.spec = RowSpec(meta["name"], tuple(meta["shape"]), meta["dtype"], meta["state_id"], TABLE_LAYOUT)
            self.dtype = DTYPES[self.spec.dtype]
            if creation["init"] not in INITS or creation["chunk_rows"] <= 0:
                raise ValueError(creation["init"])
            self.first_row, self.drawn = creation.get("first_row", 0), drawn_shape(creation, self.spec.shape)
            first = _chunk_digest(
                initial_weights(creation, self.drawn, self.dtype, self.first_row // creation["chunk_rows"])
            )
        except (KeyError, TypeError, ValueError):
            raise StateError(f"{where} has malformed creation parameters: {creation}", hint=_DAMAGED) from None
        if first != creation.get("first_chunk_digest"):
            raise StateError(
                f"table '{self.spec.name}' cannot be re-created from its seed: it was made under torch "
                f"{creation.get('torch')}, and torch {torch.__version__} draws other initial weights from the same seed "
                f"(first chunk digest {first}, recorded {creation.get('first_chunk_digest')})",
                hint=f"resume or evaluate it with torch {creation.get('torch')} (pip install torch=={creation.get('torch')}); "
                "its checkpoints hold the rows written since creation, the rest is drawn again from the seed",
            )
        self.creation = creation
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()

    def write(self, fd: int, progress: Callable[[int, int], None] | None = None) -> None:
        """Write the whole table (header included) to the empty file at ``fd``; fsynced, and
        its pages dropped from the cache (deltas are applied to it row by row next)."""
        _write_initial(fd, self.spec, self.creation, progress, by_page=False)
        os.pwrite(fd, table_header(self.spec, moments_of=None, creation=self.creation), 0)
        os.fsync(fd)
        drop_cached(fd)

    def records(self, rows: np.ndarray) -> np.ndarray:
        """The ``(len(rows), row_bytes)`` uint8 records of ``rows`` (sorted): weights drawn
        again, moments zero."""
        out = np.zeros((len(rows), self.spec.row_bytes), dtype=np.uint8)
        weight_bytes = self.spec.row_width * self.dtype.itemsize
        drawn_rows = rows + self.first_row
        chunks = drawn_rows // self.creation["chunk_rows"]
        bounds = np.flatnonzero(np.diff(chunks)) + 1
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(rows)]):
            index = int(chunks[lo])
            out[lo:hi, :weight_bytes] = self._chunk(index)[drawn_rows[lo:hi] - index * self.creation["chunk_rows"]]
        return out

    def _chunk(self, index: int) -> np.ndarray:
        if index in self._chunks:
            self._chunks.move_to_end(index)
            return self._chunks[index]
        weights = initial_weights(self.creation, self.drawn, self.dtype, index)
        raw = weights.view(torch.int16) if self.dtype == torch.bfloat16 else weights
        self._chunks[index] = raw.numpy().view(np.uint8).reshape(len(weights), -1)
        if len(self._chunks) > CACHED_CHUNKS:
            self._chunks.popitem(last=False)
        return self._chunks[index]


_DAMAGED = "the checkpoint is damaged: resume from an older one"


def _pwrite_all(fd: int, view: memoryview, offset: int, *, by_page: bool) -> None:
    """Write ``view`` at ``offset``; with ``by_page`` one page-cache page per ``pwrite``. A
    larger write fills the cache with large folios (Linux 6.x), each written back whole when
    a training step later updates one row in it; page-sized writes leave single pages, so a
    new table stays cached for the first steps and a row's update writes one page back (see
    :func:`~dsa_train.fsutil.drop_cached`; ``scripts/bench_page_writes.py``)."""
    while view:
        written = os.pwrite(fd, view[: PAGE_BYTES - offset % PAGE_BYTES] if by_page else view, offset)
        view, offset = view[written:], offset + written


#: Which table each registered weight parameter views: ``id(param) -> (weak reference to the
#: parameter, table)``. A parameter's own attributes are not used: ``copy``/``deepcopy`` and
#: ``Module._apply`` would carry or lose them behind the registry's back.
_WEIGHTS: dict[int, tuple[weakref.ref, Table]] = {}


def register_weight(param: torch.Tensor, table: Table) -> None:
    """Record that ``param`` is the weight of ``table`` (its rows are the table's records),
    so that :class:`DiskSparseAdam` keeps the moments in the same records. The entry goes
    when the parameter is collected."""
    key = id(param)
    _WEIGHTS[key] = (weakref.ref(param, lambda _ref, key=key: _WEIGHTS.pop(key, None)), table)


def table_of(param: torch.Tensor) -> Table | None:
    """The disk table a parameter is the weight of (see :func:`register_weight`), or ``None``."""
    entry = _WEIGHTS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None
