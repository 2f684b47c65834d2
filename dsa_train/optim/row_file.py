"""A row file (see :mod:`.format`) memory-mapped as a ``(N, slots, W)`` tensor of records.

An optimizer's row file has the slots ``m|v``; a disk embedding table ``w|m|v``. Only the rows
a step touches are ever read or written. The mapping is advised ``MADV_RANDOM``: a row that
is not in the page cache costs one page read, not the kernel's readahead window, and a
row's update dirties one page. A writable file's cached pages are dropped when it is opened
(:func:`~dsa_train.fsutil.drop_cached`): whatever wrote it whole left large folios there,
which would be written back whole for every row updated in them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import StateError
from ..fsutil import drop_cached, libc, write_back
from .format import HEADER_BYTES, LAYOUT, TABLE_LAYOUT, RowSpec, read_row_header

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RowFile:
    """An open, memory-mapped row file.

    ``m`` and ``v`` are ``(N, W)`` views of the moments (``(N, 1)`` for a row-wise v). In the
    full-precision layouts (``m|v``, ``w|m|v``) ``records`` is the ``(N, slots, W)`` view of
    the whole file's records and ``moments`` its ``(N, 2, W)`` view of the ``m|v`` slots (what
    the compiled kernel updates); in the compact layouts both are ``None``.
    Opened with ``writable=False`` the mapping is read-only (a checkpoint's copy, say).
    A writable file's clean cached pages are dropped first (:func:`~dsa_train.fsutil.drop_cached`:
    a copy or restore written whole leaves large folios, each written back whole for every row
    updated in it), unless ``keep_cache``: a file just written a page at a time, whose cached
    pages are worth keeping warm (:meth:`Table.create <dsa_train.optim.table.Table.create>`).
    """

    def __init__(self, path: Path, spec: RowSpec, *, writable: bool = True, keep_cache: bool = False) -> None:
        self.path = Path(path)
        self.spec = spec
        self._check(read_row_header(self.path))
        self.writable = writable
        self._fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        self._map: mmap.mmap | None = None
        self._base = 0  # the mapping's address
        # byte ranges mapped copy-on-write (held partitions) -> which of their pages were written
        self._private: dict[tuple[int, int], np.ndarray] = {}
        self._private_lock = threading.Lock()
        if spec.num_rows * spec.row_width == 0:
            raw = torch.zeros((spec.num_rows, spec.row_bytes), dtype=torch.uint8)
        else:
            if writable and not keep_cache:
                drop_cached(self._fd)
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._map = mmap.mmap(self._fd, spec.file_bytes, access=access)
            self._map.madvise(mmap.MADV_RANDOM)
            with warnings.catch_warnings():  # a read-only mapping gives a read-only tensor: fine
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(self._map, dtype=torch.uint8, count=spec.num_rows * spec.row_bytes, offset=HEADER_BYTES)
            raw = flat.view(spec.num_rows, spec.row_bytes)
            self._base = flat.data_ptr() - HEADER_BYTES
        fields = {slot.name: raw[:, slot.offset : slot.offset + slot.nbytes].view(DTYPES[slot.dtype]) for slot in spec.fields}
        self.m, self.v = fields["m"], fields["v"]
        self.records = self.moments = None
        if spec.layout in (LAYOUT, TABLE_LAYOUT):
            self.records = raw.view(DTYPES[spec.dtype]).view(spec.num_rows, spec.slots, spec.row_width)
            self.moments = self.records[:, spec.slots - 2 :]

    @property
    def fd(self) -> int:
        return self._fd

    def _check(self, meta: dict) -> None:
        spec = self.spec
        for field, expected in (
            ("name", spec.name),
            ("shape", list(spec.shape)),
            ("dtype", spec.dtype),
            ("layout", spec.layout),
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

    def reserve(self, lookups: torch.Tensor) -> None:
        """Make sure the disk can take this step's writes to these rows before any is made.

        A write into a hole of a memory-mapped file on a full disk kills the process with
        SIGBUS, with no chance to report it. So, when free space is short of the worst case
        (every row landing in a new page, plus a spare), the rows' pages are allocated here
        with ``posix_fallocate``, which fails cleanly with ENOSPC. With room to spare this
        costs one ``statvfs``.

        Every write to the file's records comes after this call, so it is also where the
        pages of held rows (see :meth:`hold_rows`) are marked written.
        """
        self._mark_written(lookups)
        page = mmap.PAGESIZE
        worst = lookups.numel() * max(self.spec.row_bytes, page) + SPARE_BYTES
        disk = os.statvfs(self.path)
        if disk.f_bavail * disk.f_frsize >= worst:
            return
        rows = torch.unique(lookups.cpu())
        first = (HEADER_BYTES + rows * self.spec.row_bytes) // page
        last = (HEADER_BYTES + (rows + 1) * self.spec.row_bytes - 1) // page
        try:
            for start, stop in _page_runs(first.tolist(), last.tolist()):
                os.posix_fallocate(self._fd, start * page, (stop - start) * page)
        except OSError as e:
            raise StateError(
                f"the disk is full: no room for the rows this step writes to '{self.path}' "
                f"({disk.f_bavail * disk.f_frsize / 2**20:.0f} MiB free); nothing was written",
                hint="free some space (or move state_dir to a bigger disk) and continue; the state is intact",
            ) from e

    def flush(self) -> None:
        """Write the dirty pages back to disk and wait for them (``msync(MS_SYNC)``), held
        partitions' rows first (see :meth:`hold_rows`)."""
        self._write_private()
        if self._map is not None:
            self._map.flush()
        os.fsync(self._fd)

    def evict(self) -> None:
        """Write the file back, then drop its pages from this mapping and the page cache, as
        if the machine had needed the memory (benchmarks use it to start from a cold cache)."""
        self.flush()
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)  # unmap our pages, or the cache keeps them
        drop_cached(self._fd)

    def _byte_range(self, first: int, stop: int, *, inside: bool) -> tuple[int, int]:
        """Rows ``[first, stop)`` as a page-aligned byte range of the file: every page they
        touch, or (``inside``) only the pages that hold nothing but these rows."""
        page, row = mmap.PAGESIZE, self.spec.row_bytes
        start, end = HEADER_BYTES + first * row, HEADER_BYTES + stop * row
        if inside:
            return -(-start // page) * page, max(-(-start // page) * page, end // page * page)
        return start // page * page, min(-(-end // page) * page, self.spec.file_bytes)

    def read_rows(self, first: int, stop: int, *, chunk_bytes: int = 8 << 20) -> int:
        """Read rows ``[first, stop)`` into the page cache with large sequential reads (the
        file's own readahead: the mapping's ``MADV_RANDOM`` applies to its faults only), so
        the steps that follow find their records there. Returns the bytes read."""
        start, end = self._byte_range(first, stop, inside=False)
        buffer = memoryview(bytearray(min(chunk_bytes, max(end - start, 1))))
        done = start
        while done < end:
            got = os.preadv(self._fd, [buffer[: min(len(buffer), end - done)]], done)
            if got <= 0:
                break
            done += got
        return done - start

    def hold_rows(self, first: int, stop: int) -> int:
        """Read rows ``[first, stop)`` in (:meth:`read_rows`) and hold them: their pages are
        mapped copy-on-write and copied into this process's memory at once
        (``MADV_POPULATE_WRITE``), so the rows a step updates are this process's own memory
        instead of dirty pages of the file. Dirty file pages past the kernel's limits
        (``vm.dirty_ratio``) are written back while training, a page at a time, and throttle
        the steps that dirty them; and a copy-on-write page copied at its first write costs a
        fault inside the step (7 us each here, three times the step's own work when each row
        is on a page of its own). A held range is written back only when it is dropped or
        the file flushed: the pages :meth:`reserve` saw rows written on, in sequential runs.
        Pages shared with rows outside the range stay mapped as before. Returns the bytes read."""
        done = self.read_rows(first, stop)
        start, end = self._byte_range(first, stop, inside=True)
        if self.writable and self._map is not None and end > start:
            with self._private_lock:
                if (start, end) not in self._private:
                    _remap(self._base, start, end, self._fd, private=True)
                    self._private[(start, end)] = np.zeros((end - start) // mmap.PAGESIZE, dtype=bool)
                    _populate(self._base + start, end - start)
            drop_cached(self._fd, start, end - start)  # the copies are ours: the cache's can go
        return done

    def _mark_written(self, rows: torch.Tensor) -> None:
        """Mark the pages of ``rows`` that lie in held ranges as written."""
        if not self._private:
            return
        page, row = mmap.PAGESIZE, self.spec.row_bytes
        rows = rows.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        ends = (HEADER_BYTES + rows * row - 1 + row) // page
        pages = np.concatenate([(HEADER_BYTES + rows * row) // page, ends])
        with self._private_lock:
            for (start, end), written in self._private.items():
                inside = pages[(pages >= start // page) & (pages < end // page)]
                written[inside - start // page] = True

    def drop_rows(self, first: int, stop: int) -> int:
        """Write rows ``[first, stop)`` back in one sequential write-out and drop their pages
        from this mapping and the page cache (pages shared with rows outside the range stay).
        Nothing is lost or stale: a dropped page is read from the file again by its next
        access. Returns the bytes dropped."""
        start, end = self._byte_range(first, stop, inside=True)
        if end <= start:
            return 0
        with self._private_lock:
            if (start, end) in self._private:
                _write_pages(self._base, start, self._private.pop((start, end)), self._fd)
                _remap(self._base, start, end, self._fd, private=False)  # the copies go, the file's pages come back
            elif self._map is not None:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)  # our page tables go; their dirty bits pass to the cache
        if self.writable:
            write_back(self._fd, start, end - start)
        drop_cached(self._fd, start, end - start)
        return end - start

    def _write_private(self) -> None:
        """Write every held range's rows to the file (they stay held)."""
        with self._private_lock:
            for start, written in sorted((start, written) for (start, _), written in self._private.items()):
                _write_pages(self._base, start, written, self._fd)

    def close(self) -> None:
        if self._fd < 0:
            return
        self._write_private()  # held rows reach the file as a shared mapping's would
        # Drop our views and the map, but never unmap by hand: tensors made from the mapping
        # (a DiskEmbedding's weight, a prefetch in flight) hold the map object, and unmapping
        # under them would crash the process. The kernel unmaps when the last one is gone.
        self.records = self.moments = self.m = self.v = None
        self._map = None
        os.close(self._fd)
        self._fd = -1


MAP_SHARED, MAP_PRIVATE, MAP_FIXED = 0x01, 0x02, 0x10
MADV_POPULATE_WRITE = 23
PROT_READ, PROT_WRITE = 0x1, 0x2
WRITE_CHUNK = 8 << 20


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc with ``mmap`` and ``madvise`` typed for addresses."""
    found = libc()
    found.mmap.restype = ctypes.c_void_p
    found.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    found.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return found


def _remap(base: int, start: int, end: int, fd: int, *, private: bool) -> None:
    """Map bytes ``[start, end)`` of the file again at the same addresses of the mapping at
    ``base`` (``MAP_FIXED``: every tensor viewing them stays valid), copy-on-write or shared.
    Replacing a mapping passes its dirty pages' state to the page cache, as unmapping does."""
    typed, address = _libc(), base + start
    flags = (MAP_PRIVATE if private else MAP_SHARED) | MAP_FIXED
    got = typed.mmap(address, end - start, PROT_READ | PROT_WRITE, flags, fd, start)
    if got != address:
        error = ctypes.get_errno()
        raise OSError(error, f"remapping bytes {start}-{end} of a row file failed: {os.strerror(error)}")
    typed.madvise(address, end - start, mmap.MADV_RANDOM)  # a new mapping forgets the advice


def _populate(address: int, length: int) -> None:
    """Copy a copy-on-write range's pages into this process's memory now
    (``MADV_POPULATE_WRITE``, Linux 5.14), instead of one fault per page at its first write
    inside a step. An older kernel refuses the advice; its pages are then copied at first write."""
    if _libc().madvise(address, length, MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() != errno.EINVAL:
        error = ctypes.get_errno()
        raise OSError(error, f"copying a held range of a row file into memory failed: {os.strerror(error)}")


def _write_pages(base: int, start: int, written: np.ndarray, fd: int) -> None:
    """``pwrite`` the pages marked ``written`` of the copy-on-write mapping's bytes from
    ``start`` to the same bytes of the file, run by run; a page never written holds the
    file's bytes and is skipped."""
    page = mmap.PAGESIZE
    edges = np.flatnonzero(np.diff(np.concatenate([[0], written.view(np.int8), [0]])))  # runs: [edges[0], edges[1]), ...
    memory = memoryview((ctypes.c_char * (len(written) * page)).from_address(base + start)).cast("B")
    for a, b in zip(edges[0::2] * page, edges[1::2] * page):
        done = a
        while done < b:
            done += os.pwrite(fd, memory[done : min(b, done + WRITE_CHUNK)], start + done)


SPARE_BYTES = 64 << 20  # room kept free for manifests, metadata and the file system's own needs


def _page_runs(first: list[int], last: list[int]):
    """Merge the page ranges [first[i], last[i]] (sorted by first) into disjoint runs."""
    start, stop = None, None
    for a, b in zip(first, last):
        if start is None:
            start, stop = a, b + 1
        elif a <= stop:
            stop = max(stop, b + 1)
        else:
            yield start, stop
            start, stop = a, b + 1
    if start is not None:
        yield start, stop
