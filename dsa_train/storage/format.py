"""The on-disk formats of a state directory, readable without torch.

A state directory holds ``manifest.json`` (see :func:`load_manifest`) and one row file per
parameter. A row file's layout (all offsets in bytes)::

    [0, 4096)                header: MAGIC, then one line of JSON (format, version, name,
                             shape, dtype, layout, row_bytes, state_id), NUL-padded
    4096 + r * row_bytes     record of row r: its slots in the order the layout names, each
                             W = prod(shape[1:]) elements of the parameter's dtype

Two layouts exist. ``m|v`` (an optimizer's row file: m[r, :] then v[r, :], row_bytes =
2 * W * itemsize) and ``w|m|v`` (a disk embedding table, see :mod:`.table`: the weight row,
then its moments, so one read serves the forward pass and the optimizer step). The data
starts on a page boundary, so a row is one contiguous read. Moments are created with
``ftruncate``: untouched rows are holes that read as zeros (Adam's initial moments) and take
no disk space.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import StateError

MAGIC = b"DSA-TRAIN ROWS\n"
ROWS_FORMAT = "dsa-train/rows"
ROWS_VERSION = 1
HEADER_BYTES = 4096
LAYOUT = "m|v"  # an optimizer row file: per row, first moment, then second moment
TABLE_LAYOUT = "w|m|v"  # a disk embedding table: per row, weight, then its two moments
#: Smaller optimizer state (DiskSparseAdam's ``first_moment="bfloat16"`` and/or
#: ``second_moment="row"``): m stored in bfloat16, v kept as one value per row.
COMPACT_LAYOUTS = ("m:bfloat16|v", "m|v:row", "m:bfloat16|v:row")
LAYOUTS = (LAYOUT, TABLE_LAYOUT, *COMPACT_LAYOUTS)


@dataclass(frozen=True)
class Slot:
    """One field of a row record: its name, element dtype, element count and byte offset."""

    name: str
    dtype: str
    count: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.count * ITEMSIZE[self.dtype]


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

STATE_FORMAT = "dsa-train/disk-sparse-adam-state"
STATE_VERSION = 1
MANIFEST = "manifest.json"
ROWS_SUFFIX = ".rows"
PENDING_SUFFIX = ".rows.pending"


@dataclass(frozen=True)
class RowSpec:
    """What a row file must hold: the parameter's name, shape, dtype and layout, and the id of
    its state directory (or, for a table, of the table itself)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    state_id: str
    layout: str = LAYOUT

    @property
    def slots(self) -> int:
        return len(self.layout.split("|"))

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
    def fields(self) -> list[Slot]:
        """The record's slots in order: ``name`` or ``name:bfloat16`` (that dtype instead of
        the parameter's) or ``name:row`` (one value per row instead of one per element)."""
        fields, offset = [], 0
        for part in self.layout.split("|"):
            name, _, kind = part.partition(":")
            dtype = kind if kind in ITEMSIZE else self.dtype
            slot = Slot(name, dtype, 1 if kind == "row" else self.row_width, offset)
            fields.append(slot)
            offset += slot.nbytes
        return fields

    @property
    def row_bytes(self) -> int:
        last = self.fields[-1]
        size = last.offset + last.nbytes
        return size if self.layout in (LAYOUT, TABLE_LAYOUT) else -(-size // 8) * 8  # compact: 8-aligned

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.num_rows * self.row_bytes

    def header(self) -> bytes:
        meta = {
            "format": ROWS_FORMAT,
            "version": ROWS_VERSION,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "layout": self.layout,
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
    """Write a new, sparse row file (header, then holes) and make it durable.

    A leftover of ours at ``path`` (a pending file a killed process left) is replaced; a link
    or anything but a regular file there is refused, never written through.
    """
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isfile(path):
            raise StateError(
                f"'{path}' is in the way of a new row file and is not a regular file (a link or a folder)",
                hint="remove it, or use another state_dir",
            )
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
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
    return parse_row_header(raw, f"row file '{path}'")


def parse_row_header(raw: bytes, where: str) -> dict:
    """Check a row file's header block ``raw`` (``where`` names it in errors) and return its
    JSON; a :class:`StateError` says what is wrong."""
    if not raw.startswith(MAGIC):
        raise StateError(
            f"{where} is corrupt: it does not start with the dsa-train row header",
            hint="the file was overwritten or is not a dsa-train row file; restore the state "
            "directory from a checkpoint or start a fresh one",
        )
    try:
        meta = json.loads(raw[len(MAGIC) :].split(b"\n", 1)[0])
    except ValueError as e:
        raise StateError(
            f"{where} is corrupt: its header is not valid JSON ({e})",
            hint="restore the state directory from a checkpoint or start a fresh one",
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != ROWS_FORMAT:
        raise StateError(f"{where} is corrupt: its header names no '{ROWS_FORMAT}' format")
    if meta.get("version") != ROWS_VERSION:
        raise StateError(
            f"{where} has format version {meta.get('version')!r}, this dsa-train reads version {ROWS_VERSION}",
            hint="open it with the dsa-train version that wrote it, or start a fresh state_dir",
        )
    return meta


def manifest_checksum(manifest: dict) -> str:
    """BLAKE2b of the manifest's canonical JSON without its own ``checksum`` field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written: JSON with its checksum, so a flipped bit is caught on load."""
    return json.dumps({**manifest, "checksum": manifest_checksum(manifest)}, indent=2, sort_keys=True).encode()


def load_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as e:
        raise StateError(
            f"manifest '{path}' is corrupt: {e}",
            hint="restore the state directory from a checkpoint or start a fresh one",
        ) from None
    except OSError as e:
        raise StateError(f"cannot read manifest '{path}': {e.strerror}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != STATE_FORMAT:
        raise StateError(
            f"manifest '{path}' is not a DiskSparseAdam state manifest "
            f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})",
            hint="point state_dir at a DiskSparseAdam state directory or a new one",
        )
    if manifest.get("version") != STATE_VERSION:
        raise StateError(
            f"manifest '{path}' has format version {manifest.get('version')!r}, "
            f"this dsa-train reads version {STATE_VERSION}",
            hint="open it with the dsa-train version that wrote it, or start a fresh state_dir",
        )
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise StateError(
            f"manifest '{path}' is corrupt: its checksum does not match its content (edited or damaged)",
            hint="restore the state directory from a checkpoint or start a fresh one",
        )
    params = manifest.get("params")
    fields_ok = isinstance(params, dict) and all(
        isinstance(e, dict)
        and isinstance(e.get("shape"), list)
        and isinstance(e.get("step"), int)
        and isinstance(e.get("file"), str)
        and "/" not in e["file"]
        and e.get("layout", LAYOUT) in LAYOUTS
        and (e.get("layout", LAYOUT) != TABLE_LAYOUT or isinstance(e.get("table"), str))
        for e in params.values()
    )
    if not fields_ok or not isinstance(manifest.get("clean"), bool) or not isinstance(manifest.get("state_id"), str):
        raise StateError(
            f"manifest '{path}' is corrupt: a field is missing or has the wrong type",
            hint="restore the state directory from a checkpoint or start a fresh one",
        )
    return manifest


def moments_file(state_dir: Path, entry: dict) -> Path:
    """Where a manifest entry's moments live: its row file in the state directory, or the
    disk embedding table (layout ``w|m|v``) that holds them next to the weights."""
    if entry.get("layout", LAYOUT) == TABLE_LAYOUT:
        return Path(entry["table"])
    return Path(state_dir) / entry["file"]
