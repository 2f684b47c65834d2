"""One parameter's Adam moments in a memory-mapped file of fixed-width row records.

File layout (all offsets in bytes)::

    [0, 4096)                header: MAGIC, then one line of JSON (format, version, name,
                             shape, dtype, layout, row_bytes, state_id), NUL-padded
    4096 + r * row_bytes     record of row r: m[r, :] then v[r, :], each W = prod(shape[1:])
                             elements of the parameter's dtype (row_bytes = 2 * W * itemsize)

The data starts on a page boundary, so a row is one contiguous read. The file is created with
``ftruncate``: untouched rows are holes that read as zeros (Adam's initial moments) and take
no disk space. Only the rows a step touches are ever read or written.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import StateError

MAGIC = b"DSA-TRAIN ROWS\n"
FORMAT = "dsa-train/rows"
VERSION = 1
HEADER_BYTES = 4096
LAYOUT = "m|v"  # per row: first moment, then second moment

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RowSpec:
    """What a row file must hold: the parameter's name, shape and dtype, and its state's id."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    state_id: str

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def row_width(self) -> int:
        width = 1
        for size in self.shape[1:]:
            width *= size
        return width

    @property
    def row_bytes(self) -> int:
        return 2 * self.row_width * DTYPES[self.dtype].itemsize

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.num_rows * self.row_bytes

    def header(self) -> bytes:
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "layout": LAYOUT,
            "row_bytes": self.row_bytes,
            "state_id": self.state_id,
        }
        raw = MAGIC + json.dumps(meta).encode() + b"\n"
        if len(raw) > HEADER_BYTES:
            raise StateError(
                f"parameter name '{self.name}' is too long for a row file header",
                hint="use a shorter parameter name",
            )
        return raw.ljust(HEADER_BYTES, b"\0")


def create_row_file(path: Path, spec: RowSpec) -> None:
    """Write a new, sparse row file (header, then holes) and make it durable."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, spec.header(), 0)
        os.ftruncate(fd, spec.file_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_row_header(path: Path) -> dict:
    """Read and check a row file's header; a :class:`StateError` says what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise StateError(f"cannot read row file '{path}': {e.strerror}") from e
    if not raw.startswith(MAGIC):
        raise StateError(
            f"row file '{path}' is corrupt: it does not start with the dsa-train row header",
            hint="the file was overwritten or is not a dsa-train row file; restore the state "
            "directory from a checkpoint or start a fresh one",
        )
    try:
        meta = json.loads(raw[len(MAGIC) :].split(b"\n", 1)[0])
    except ValueError as e:
        raise StateError(
            f"row file '{path}' is corrupt: its header is not valid JSON ({e})",
            hint="restore the state directory from a checkpoint or start a fresh one",
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateError(f"row file '{path}' is corrupt: its header names no '{FORMAT}' format")
    if meta.get("version") != VERSION:
        raise StateError(
            f"row file '{path}' has format version {meta.get('version')!r}, "
            f"this dsa-train reads version {VERSION}",
            hint="open it with the dsa-train version that wrote it, or start a fresh state_dir",
        )
    return meta


class RowFile:
    """An open, memory-mapped row file: ``moments`` is a ``(N, 2, W)`` tensor view of it."""

    def __init__(self, path: Path, spec: RowSpec) -> None:
        self.path = Path(path)
        self.spec = spec
        self._check(read_row_header(self.path))
        self._fd = os.open(self.path, os.O_RDWR)
        self._map: mmap.mmap | None = None
        if spec.num_rows * spec.row_width == 0:
            self.moments = torch.zeros((spec.num_rows, 2, spec.row_width), dtype=DTYPES[spec.dtype])
            return
        self._map = mmap.mmap(self._fd, spec.file_bytes, flags=mmap.MAP_SHARED)
        self.moments = torch.frombuffer(
            self._map,
            dtype=DTYPES[spec.dtype],
            count=spec.num_rows * 2 * spec.row_width,
            offset=HEADER_BYTES,
        ).view(spec.num_rows, 2, spec.row_width)

    def _check(self, meta: dict) -> None:
        spec = self.spec
        for field, expected in (
            ("name", spec.name),
            ("shape", list(spec.shape)),
            ("dtype", spec.dtype),
            ("layout", LAYOUT),
            ("state_id", spec.state_id),
        ):
            if meta.get(field) != expected:
                raise StateError(
                    f"row file '{self.path}' of parameter '{spec.name}' has {field} "
                    f"{meta.get(field)!r}, the manifest and parameter have {expected!r}",
                    hint="the file belongs to another parameter or state directory; restore "
                    "the state directory from a checkpoint or start a fresh one",
                )
        size = self.path.stat().st_size
        if size != spec.file_bytes:
            raise StateError(
                f"row file '{self.path}' of parameter '{spec.name}' is {size} bytes, "
                f"shape {list(spec.shape)} {spec.dtype} needs {spec.file_bytes}: "
                f"it was {'truncated' if size < spec.file_bytes else 'extended'}",
                hint="restore the state directory from a checkpoint or start a fresh one",
            )

    def flush(self) -> None:
        """Write the dirty pages back to disk and wait for them (``msync(MS_SYNC)``)."""
        if self._map is not None:
            self._map.flush()
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd < 0:
            return
        self.moments = None  # drop the view before unmapping: mmap refuses while it is exported
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self._fd)
        self._fd = -1
