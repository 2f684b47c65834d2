"""The on-disk dataset format: a folder of memory-mapped arrays and a manifest, written once.

Every dataset a recipe names (a TSV folder, a PyG dataset, a generated graph) is imported
once into a folder under the data root (see :func:`import_folder`), and every later run,
``--resume`` or ``eval`` maps it instead of parsing or generating it again::

    <data root>/imported/<slug>/
      manifest.json   {"format": "dsa-train/dataset", "version": 1, "kind": "kg" | "graph",
                       "name", "meta": {counts...}, "sources": {what it was made from},
                       "arrays": {name: {"shape": [...], "dtype": "int32"}}}
      <name>.npy      one array each (NumPy's .npy format with a 128-byte header), mapped
                      read-only and advised MADV_RANDOM; never read whole
      <subfolder>/    anything a builder writes itself (the filter index, say)

``sources`` records what the dataset was made from (each source file's size and mtime, or a
generator's settings, and the importer's version): a dataset whose sources differ is stale
and imported again. A dataset is built in ``.partial-<slug>-<random>/`` next to its place,
every file fsynced, the manifest written last, then renamed into place (an old version is
renamed aside first and removed after): a killed import leaves no half dataset, only a
partial folder that the next import removes. A reader opens the folder by a descriptor
(never through a link) and maps every array through it at once, so a concurrent re-import,
which renames a new folder into place, can never mix the files of two versions.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError, StateError
from ..fsutil import DirectoryLock, fsync_all, fsync_directory, read_json_object
from ..memory import release_free_heap

logger = logging.getLogger(__name__)

FORMAT = "dsa-train/dataset"
VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = ".partial-"
RETIRED = ".retired-"
HEADER_BYTES = 128  # every array's .npy header, padded: data starts 64-byte aligned
NPY_MAGIC = b"\x93NUMPY\x01\x00"

SPLITS = ("train", "valid", "test")  # the splits of every dataset (arrays, files or node sets)
MAX_PARTITIONS = 256  # scratch partitions of one import step: each keeps a few files open


def partition_count(work_bytes: int, memory_bytes: int) -> int:
    """The power of two of scratch partitions (at most :data:`MAX_PARTITIONS`) that cuts
    ``work_bytes`` of an import step into pieces of at most ``memory_bytes`` each."""
    needed = max(1, -(-work_bytes // max(memory_bytes, 1)))
    return min(MAX_PARTITIONS, 1 << (needed - 1).bit_length())


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version-1.0 ``.npy`` header of exactly :data:`HEADER_BYTES` bytes."""
    descr = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    body = repr(descr).encode("latin1")
    room = HEADER_BYTES - len(NPY_MAGIC) - 2 - 1
    if len(body) > room:
        raise ValueError(f"array header {body!r} does not fit {HEADER_BYTES} bytes")
    return NPY_MAGIC + (HEADER_BYTES - 10).to_bytes(2, "little") + body.ljust(room) + b"\n"


class Appender:
    """An array of rows whose count is known only at the end: rows are appended in chunks
    and the header written by :meth:`finish`."""

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape, self.rows = path, np.dtype(dtype), tuple(row_shape), 0
        self._file = open(path, "xb")
        self._file.write(bytes(HEADER_BYTES))

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype).reshape((-1, *self.row_shape))
        if rows.size:
            self._file.write(memoryview(rows).cast("B"))
        self.rows += len(rows)

    def finish(self) -> tuple[int, ...]:
        shape = (self.rows, *self.row_shape)
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, shape))
        self._file.close()
        return shape


class DatasetWriter:
    """Builds a dataset folder under a partial name; :meth:`commit` renames it into place.

    Use it as a context manager: leaving the block by an exception removes the partial folder.
    """

    def __init__(self, folder: Path, *, kind: str, name: str, sources: dict) -> None:
        self.folder, self.kind, self.name, self.sources = Path(folder), kind, name, sources
        self.partial = self.folder.with_name(f"{PARTIAL}{self.folder.name}-{uuid.uuid4().hex[:12]}")
        self.meta: dict = {}
        self.arrays: dict[str, dict] = {}
        self._open: dict[str, Appender] = {}
        self.partial.mkdir(parents=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            for appender in self._open.values():
                appender._file.close()
            shutil.rmtree(self.partial, ignore_errors=True)

    def path(self, name: str) -> Path:
        """Where a builder writes a file or folder of its own (listed by the commit)."""
        return self.partial / name

    def create(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A new zero-filled array of known shape, mapped writable (flushed by :meth:`commit`)."""
        dtype = np.dtype(dtype)
        path = self.partial / f"{name}.npy"
        with open(path, "xb") as f:
            f.write(npy_header(dtype, shape))
            f.truncate(HEADER_BYTES + int(np.prod(shape)) * dtype.itemsize)
        self.arrays[name] = {"shape": list(shape), "dtype": dtype.name}
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r+", offset=HEADER_BYTES, shape=tuple(shape))

    def appender(self, name: str, dtype, row_shape: tuple[int, ...] = ()) -> Appender:
        """An array of ``row_shape`` rows appended in chunks (its length is found at commit)."""
        appender = Appender(self.partial / f"{name}.npy", dtype, row_shape)
        self._open[name] = appender
        return appender

    def blocks(self, name: str, rows: int = 1 << 20):
        """The rows of an array written so far (an appender is finished first), ``rows`` at a
        time, read with plain reads: a later step of the build (the filter index) reads the id
        arrays back without mapping them, so resident memory stays bounded by the block."""
        if name in self._open:
            self._finish(name)
        shape, dtype = tuple(self.arrays[name]["shape"]), np.dtype(self.arrays[name]["dtype"])
        width = int(np.prod(shape[1:]))
        with open(self.partial / f"{name}.npy", "rb") as f:
            f.seek(HEADER_BYTES)
            for start in range(0, shape[0], rows):
                count = min(rows, shape[0] - start)
                yield np.fromfile(f, dtype, count * width).reshape((count, *shape[1:]))

    def _finish(self, name: str) -> None:
        """Write an appended array's header and list it for the manifest."""
        appender = self._open.pop(name)
        self.arrays[name] = {"shape": list(appender.finish()), "dtype": appender.dtype.name}

    def put(self, name: str, array: np.ndarray | torch.Tensor) -> None:
        """Write a whole (small) array."""
        array = array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
        target = self.create(name, array.shape, array.dtype)
        if array.size:
            target[...] = array
            target.flush()

    def commit(self) -> None:
        """Fsync everything, write the manifest, and rename the folder into place."""
        for name in list(self._open):
            self._finish(name)
        fsync_all(sorted(self.partial.rglob("*")))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "name": self.name,
            "meta": self.meta,
            "sources": self.sources,
            "arrays": self.arrays,
        }
        with open(self.partial / MANIFEST, "x") as f:
            f.write(json.dumps(manifest, indent=2))
            f.flush()
            os.fsync(f.fileno())
        fsync_directory(self.partial)
        retired = None
        if self.folder.exists() or self.folder.is_symlink():
            _check_ours(self.folder)
            retired = self.folder.with_name(f"{RETIRED}{self.folder.name}-{uuid.uuid4().hex[:12]}")
            os.rename(self.folder, retired)  # a link is renamed aside, never followed
        os.rename(self.partial, self.folder)
        fsync_directory(self.folder.parent)
        if retired is not None:
            _remove_entry(retired)


def _check_ours(folder: Path) -> None:
    """Refuse to replace what is not a dataset we imported (a link is only a name: replacing
    it never touches what it points to)."""
    if folder.is_symlink():
        return
    manifest = read_json_object(folder / MANIFEST) if folder.is_dir() else None
    if manifest is None or manifest.get("format") != FORMAT:
        raise DatasetError(
            f"'{folder}' is in the way of an import and is not a dataset dsa-train imported; nothing was changed",
            hint="move it out of the imported/ folder and run again",
        )


def _remove_entry(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


class Dataset:
    """An imported dataset, opened: its manifest and every array, mapped read-only."""

    def __init__(self, folder: Path, manifest: dict, arrays: dict[str, np.ndarray], fd: int) -> None:
        self.folder, self.manifest, self._arrays, self._fd = folder, manifest, arrays, fd
        self.fresh = False  # imported just now (not found already imported)

    @property
    def meta(self) -> dict:
        return self.manifest["meta"]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def array(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The array as a tensor over the same read-only mapping (indexing it reads only those rows)."""
        with warnings.catch_warnings():  # a read-only mapping gives a read-only tensor: fine
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._arrays[name])

    def close(self) -> None:
        """Release the folder's descriptor (the mapped arrays stay valid while referenced)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def has(self, name: str) -> bool:
        return name in self._arrays

    def subfolder(self, name: str) -> Path:
        """A folder a builder wrote (see :meth:`DatasetWriter.path`), by the path this dataset
        was opened through (``/proc/self/fd``), so it is this version's even after a re-import."""
        return Path(f"/proc/self/fd/{self._fd}") / name

    @classmethod
    def open(cls, folder: Path) -> Dataset:
        """Open an imported dataset; a ``DatasetError`` names what is missing or damaged."""
        folder = Path(folder)
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            raise DatasetError(f"imported dataset '{folder}' cannot be opened: {e.strerror}", hint=REIMPORT) from None
        try:
            manifest = read_manifest(folder, fd)
            arrays = {name: _map(folder, fd, name, spec) for name, spec in manifest["arrays"].items()}
        except BaseException:
            os.close(fd)
            raise
        return cls(folder, manifest, arrays, fd)


REIMPORT = "remove the folder and run again: it is imported anew from its sources"


def read_manifest(folder: Path, fd: int | None = None) -> dict:
    manifest = read_json_object(MANIFEST, dir_fd=fd) if fd is not None else read_json_object(folder / MANIFEST)
    if manifest is None or manifest.get("format") != FORMAT:
        raise DatasetError(f"'{folder}' is not an imported dataset (no readable {MANIFEST})", hint=REIMPORT)
    if manifest.get("version") != VERSION:
        raise DatasetError(
            f"imported dataset '{folder}' has format version {manifest.get('version')!r}, this dsa-train reads {VERSION}",
            hint=REIMPORT,
        )
    if not isinstance(manifest.get("arrays"), dict) or not isinstance(manifest.get("meta"), dict):
        raise DatasetError(f"imported dataset '{folder}' has a damaged {MANIFEST}", hint=REIMPORT)
    return manifest


def _map(folder: Path, fd: int, name: str, spec: dict) -> np.ndarray:
    """Map ``<name>.npy`` (relative to the folder's descriptor), checking it against the manifest."""
    path = folder / f"{name}.npy"
    try:
        shape, dtype = tuple(int(n) for n in spec["shape"]), np.dtype(spec["dtype"])
        file_fd = os.open(f"{name}.npy", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    except (KeyError, TypeError, ValueError):
        raise DatasetError(
            f"imported dataset '{folder}' describes array '{name}' badly in its {MANIFEST}", hint=REIMPORT
        ) from None
    except OSError as e:
        raise DatasetError(f"'{path}' cannot be opened: {e.strerror}", hint=REIMPORT) from None
    with os.fdopen(file_fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise DatasetError(f"'{path}' is not a regular file", hint=REIMPORT)
        header = f.read(HEADER_BYTES)
        size = os.fstat(f.fileno()).st_size
        expected = HEADER_BYTES + int(np.prod(shape)) * dtype.itemsize
        if header != npy_header(dtype, shape) or size != expected:
            raise DatasetError(
                f"'{path}' does not hold the {list(shape)} {dtype.name} array its manifest lists "
                f"({size:,} bytes, expected {expected:,}): truncated or changed",
                hint=REIMPORT,
            )
        if size == HEADER_BYTES:
            return np.zeros(shape, dtype)
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        mapping.madvise(mmap.MADV_RANDOM)  # rows are read where batches and walks land: no readahead
        return np.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape)), offset=HEADER_BYTES).reshape(shape)


def imports_root(data_root: Path) -> Path:
    """Where imported datasets live: ``<data root>/imported``."""
    return Path(data_root) / "imported"


def _import_failed(e: OSError, what: str) -> DatasetError:
    """The error of an import that could not write: a read-only data root says so (the
    import, and PyG's ``processed/`` folder beside ``raw/``, are written there), a full disk
    says to free space."""
    where = f" ('{e.filename}')" if e.filename and f"'{e.filename}'" not in what else ""
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DatasetError(
            f"{what}: {e.strerror}{where}. The data root must be writable: each dataset is imported "
            "once into its imported/ folder (and PyG writes processed/ beside raw/)",
            hint="copy the dataset's folder into a writable folder and set DSA_DATA_ROOT (or dataset.root) to that folder",
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DatasetError(
            f"{what}: {e.strerror}{where}",
            hint="free space on that disk (or set DSA_DATA_ROOT to a bigger one) and run again",
        )
    return DatasetError(
        f"{what}: {e.strerror or e}{where}", hint="check that folder and run again (the import starts afresh)"
    )


def import_folder(
    folder: Path,
    *,
    kind: str,
    name: str,
    sources: dict,
    build: Callable[[DatasetWriter], None],
) -> Dataset:
    """The dataset at ``folder``, imported by ``build(writer)`` unless a current one is there.

    A dataset made from other ``sources`` (a changed file, other generator settings, an older
    importer) is imported again. Two processes importing the same data root take turns: the
    second gets a ``DatasetError`` naming the first.
    """
    folder = Path(folder)
    current = _current(folder, sources)
    if current is not None:
        return current
    parent = folder.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _import_failed(e, f"cannot create '{parent}' to import '{name}' into") from None
    if parent.is_symlink():
        raise DatasetError(
            f"'{parent}' is a symbolic link; dsa-train never writes through a link it did not make",
            hint=f"point DSA_DATA_ROOT (or dataset.root) at the real folder '{parent.parent.resolve()}' lives in, or remove the link",
        )
    lock = DirectoryLock(parent, purpose="dataset import folder", follow_link=False)
    try:
        lock.acquire()
    except StateError as e:
        raise DatasetError(
            f"another process is importing into '{parent}': {getattr(e, 'message', e)}",
            hint="wait for it to finish and run again (the import is reused)",
        ) from None
    except OSError as e:
        raise _import_failed(e, f"cannot lock '{parent}' to import '{name}' into") from None
    try:
        current = _current(folder, sources)  # the other process may have imported it meanwhile
        if current is not None:
            return current
        for entry in os.scandir(parent):  # left by a killed import of this dataset
            if entry.name.startswith((f"{PARTIAL}{folder.name}-", f"{RETIRED}{folder.name}-")):
                _remove_entry(Path(entry.path))
        if folder.exists() or folder.is_symlink():
            logger.info(f"the sources of '{folder}' changed: importing '{name}' again")
        with DatasetWriter(folder, kind=kind, name=name, sources=sources) as writer:
            build(writer)
            writer.commit()
    except OSError as e:
        raise _import_failed(e, f"importing '{name}' into '{folder}' failed") from None
    finally:
        lock.release()
        release_free_heap()  # the import's threads' freed buffers, before training allocates its own
    dataset = Dataset.open(folder)
    dataset.fresh = True
    return dataset


def _current(folder: Path, sources: dict) -> Dataset | None:
    """The dataset at ``folder`` if it is intact and made from ``sources``."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    try:
        dataset = Dataset.open(folder)
    except DatasetError:
        return None
    if dataset.manifest.get("sources") != sources:
        dataset.close()
        return None
    return dataset


def file_sources(paths: list[Path], **extra) -> dict:
    """What a dataset made from these files records of them: path, size and modification time."""
    described = []
    for path in paths:
        info = path.stat()
        described.append({"path": str(path.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns})
    return {"files": described, **extra}
