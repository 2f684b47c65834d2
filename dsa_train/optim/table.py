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
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import StateError
from ..fsutil import fsync_directory
from .format import HEADER_BYTES, MAGIC, TABLE_LAYOUT, RowSpec, read_row_header
from .row_file import DTYPES, RowFile, dtype_name

#: Rows initialised per chunk. Fixed, so a table's initial weights depend on its seed only.
INIT_CHUNK_ROWS = 1 << 16
WRITE_ROWS = 1 << 12  # records assembled and written per pwrite
INITS = ("normal", "uniform", "xavier_uniform", "zeros")


def init_chunk(init: str, chunk: torch.Tensor, generator: torch.Generator, *, std: float, bound: float, num_rows: int) -> None:
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

    def __init__(self, path: Path, spec: RowSpec, meta: dict, *, writable: bool) -> None:
        self.path = Path(path)
        self.spec = spec
        self.moments_of: str | None = meta.get("moments_of")
        self.writable = writable
        self.rows = RowFile(self.path, spec, writable=writable)
        self.weight = self.rows.records[:, 0].view(spec.shape)

    @property
    def table_id(self) -> str:
        return self.spec.state_id

    @classmethod
    def open(cls, path: str | Path, shape: tuple[int, ...], dtype: torch.dtype, *, writable: bool = True) -> Table:
        """Open the table at ``path``; a :class:`StateError` if it has another shape or dtype."""
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
        return cls(path, spec, meta, writable=writable)

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
    ) -> Table:
        """Write a new table: weights initialised chunk by chunk from ``seed``, moments zero.

        ``progress(rows_done, rows)`` is called after each chunk.
        """
        if init not in INITS:
            raise ValueError(f"Invalid init {init!r}: use one of {', '.join(INITS)}")
        if dtype_name(dtype) not in DTYPES:
            raise ValueError(f"Invalid dtype {dtype}: a table holds {', '.join(DTYPES)}")
        path = Path(path)
        spec = RowSpec(name, tuple(shape), dtype_name(dtype), uuid.uuid4().hex, TABLE_LAYOUT)
        partial = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:12]}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)  # never through a link
        try:
            os.pwrite(fd, table_header(spec, moments_of=None), 0)
            os.ftruncate(fd, spec.file_bytes)
            num_rows, width = spec.num_rows, spec.row_width
            block = torch.empty((min(INIT_CHUNK_ROWS, num_rows), width), dtype=dtype)
            records = torch.zeros((min(WRITE_ROWS, num_rows), 3, width), dtype=dtype)
            for index, begin in enumerate(range(0, num_rows, INIT_CHUNK_ROWS)):
                weights = block[: min(INIT_CHUNK_ROWS, num_rows - begin)]
                generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
                init_chunk(init, weights, generator, std=std, bound=bound, num_rows=num_rows)
                for start in range(0, len(weights), WRITE_ROWS):
                    part = weights[start : start + WRITE_ROWS]
                    records[: len(part), 0] = part
                    raw = records[: len(part)].view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy()
                    _pwrite_all(fd, memoryview(raw).cast("B"), HEADER_BYTES + (begin + start) * spec.row_bytes)
                if progress is not None:
                    progress(begin + len(weights), num_rows)
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
        return cls.open(path, shape, dtype)

    def adopt(self, state_id: str) -> None:
        """Record that the optimizer state ``state_id`` owns the moments (header rewrite, fsynced)."""
        if self.moments_of == state_id:
            return
        fd = self.rows.fd
        os.pwrite(fd, table_header(self.spec, moments_of=state_id), 0)
        os.fsync(fd)
        self.moments_of = state_id

    def flush(self) -> None:
        self.rows.flush()

    def close(self) -> None:
        self.weight = None
        self.rows.close()


def table_header(spec: RowSpec, *, moments_of: str | None) -> bytes:
    """The 4 KiB header of a table file: the row-file header plus ``moments_of``."""
    meta = json.loads(spec.header()[len(MAGIC) :].split(b"\n", 1)[0])
    raw = MAGIC + json.dumps({**meta, "moments_of": moments_of}).encode() + b"\n"
    return raw.ljust(HEADER_BYTES, b"\0")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def table_of(param: torch.Tensor) -> Table | None:
    """The disk table a parameter is the weight of, or ``None`` (see ``DiskEmbedding``)."""
    return getattr(param, "_dsa_table", None)
