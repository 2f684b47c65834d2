"""A row file (see :mod:`.format`) memory-mapped as a ``(N, slots, W)`` tensor of records.

An optimizer's row file has the slots ``m|v``; a disk embedding table ``w|m|v``. Only the rows
a step touches are ever read or written. The mapping is advised ``MADV_RANDOM``: a row that
is not in the page cache costs one page read, not the kernel's readahead window. A writable
file is mapped copy-on-write, so the rows a step changes stay in this process's memory and
reach the file only when it is flushed, or when the memory budget makes them leave (see
:mod:`.residency`); where the kernel cannot tell this process which pages it changed (no
``/proc/self/pagemap``) it is mapped shared, and the kernel writes it back when it likes.
A writable file's cached pages are dropped when it is opened
(:func:`~dsa_train.fsutil.drop_cached`): whatever wrote it whole left large folios there.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import StateError
from ..fsutil import copy_sparse, drop_cached, write_back
from .residency import PageResidency, pagemap_readable
from .format import HEADER_BYTES, LAYOUT, TABLE_LAYOUT, RowSpec, read_row_header

MAP_NORESERVE = 0x4000  # Linux; the mmap module does not name it

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
    pages are worth keeping warm (:meth:`Table.create <dsa_train.storage.table.Table.create>`).
    """

    def __init__(self, path: Path, spec: RowSpec, *, writable: bool = True, keep_cache: bool = False) -> None:
        self.path = Path(path)
        self.spec = spec
        self._check(read_row_header(self.path))
        self.writable = writable
        self._fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        self._map: mmap.mmap | None = None
        self._base = 0  # the mapping's address
        #: The changed pages this process holds and their write-back (``None``: a read-only
        #: or shared mapping, whose pages the kernel writes back).
        self.residency: PageResidency | None = None
        self._lock = threading.Lock()  # the residency's bookkeeping: steps, flushes and the IO thread
        self._owner = os.getpid()  # a forked child (a DataLoader worker) holds copies of our pages: never its to write
        if spec.num_rows * spec.row_width == 0:
            raw = torch.zeros((spec.num_rows, spec.row_bytes), dtype=torch.uint8)
        else:
            if writable and not keep_cache:
                drop_cached(self._fd)
            private = writable and pagemap_readable()
            if private:
                # MAP_NORESERVE: the kernel would otherwise charge the whole file to the commit
                # limit, and refuse a table larger than RAM; the memory budget bounds our copies.
                try:
                    self._map = mmap.mmap(
                        self._fd,
                        spec.file_bytes,
                        flags=mmap.MAP_PRIVATE | MAP_NORESERVE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    )
                except OSError as e:
                    if e.errno != errno.ENOMEM:
                        raise
                    private = False  # strict overcommit (vm.overcommit_memory=2): the kernel's write-back, as before
            if not private:
                self._map = mmap.mmap(
                    self._fd, spec.file_bytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
                )
            self._map.madvise(mmap.MADV_RANDOM)
            with warnings.catch_warnings():  # a read-only mapping gives a read-only tensor: fine
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(
                    self._map, dtype=torch.uint8, count=spec.num_rows * spec.row_bytes, offset=HEADER_BYTES
                )
            raw = flat.view(spec.num_rows, spec.row_bytes)
            self._base = flat.data_ptr() - HEADER_BYTES
            if private:
                self.residency = PageResidency(self._base, spec.file_bytes, self._fd)
        self._raw = raw
        fields = {
            slot.name: raw[:, slot.offset : slot.offset + slot.nbytes].view(DTYPES[slot.dtype]) for slot in spec.fields
        }
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

        Every write a step makes to the file's records comes after this call, so it is also
        where their pages are marked for the memory budget and the held ranges (see
        :mod:`.residency`).
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
                # never past the file's end: fallocate would grow the file to a whole page, and a
                # row file whose size is not a header and whole records is refused as damaged
                end = min(stop * page, self.spec.file_bytes)
                os.posix_fallocate(self._fd, start * page, end - start * page)
        except OSError as e:
            raise StateError(
                f"the disk is full: no room for the rows this step writes to '{self.path}' "
                f"({disk.f_bavail * disk.f_frsize / 2**20:.0f} MiB free); nothing was written",
                hint="free some space (or move state_dir to a bigger disk) and continue; the state is intact",
            ) from e

    def set_budget(self, budget: int | None) -> None:
        """Let at most ``budget`` bytes of changed pages stay in memory (``None``: no limit)."""
        if self.residency is not None:
            with self._lock:
                self.residency.budget = budget

    def make_room(self) -> int:
        """Before a step's writes, its pages marked by :meth:`reserve`: if they and the changed
        pages exceed the budget, the coldest others are written out and dropped, down to 97%
        of it, so the writes do not take the moments' memory past the budget (a step that
        alone needs more keeps its own pages and no others). Returns the bytes that left."""
        if self.residency is None:
            return 0
        with self._lock:
            return self._trim_past_budget()

    def settle(self) -> int:
        """After a step: its pages may leave again; if the changed pages exceed the budget,
        write the coldest out and drop them, down to 97% of it (so that a step does not evict
        again at once). Returns the bytes that left memory."""
        if self.residency is None:
            return 0
        with self._lock:
            self.residency.end_step()
            return self._trim_past_budget()

    def _trim_past_budget(self) -> int:
        """(The lock held.) Past the budget, the coldest changed pages leave, down to 97% of it."""
        if not self.residency.over_budget():
            return 0
        return self.residency.trim(int(self.residency.budget * SETTLE_TO))

    def shed(self, nbytes: int) -> int:
        """Memory is short: write at least ``nbytes`` of changed pages out of memory now, whatever
        the budget. Returns the bytes that left memory."""
        if self.residency is None or nbytes <= 0:
            return 0
        with self._lock:
            return self.residency.shed(nbytes)

    def write_out_rows(self, first: int, stop: int) -> None:
        """Write the changed pages of rows ``[first, stop)`` to the file and drop their copies
        (no fsync): for a writer that fills a table range by range outside any step (loading
        weights), so that memory holds one range at a time, not the table."""
        if self.residency is not None:
            start, end = self._byte_range(first, stop, inside=False)
            with self._lock:
                self.residency.write_out(start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE))

    def resident_bytes(self) -> int:
        """Bytes of changed pages held in this process's memory (0 for a shared mapping)."""
        if self.residency is None:
            return 0
        with self._lock:
            return self.residency.changed_bytes()

    def write_stats(self) -> dict[str, int]:
        """Bytes this mapping wrote to the file so far (``written_bytes``: flushes and evictions)
        and the bytes of changed pages the budget sent out of memory (``evicted_bytes``)."""
        if self.residency is None:
            return {"written_bytes": 0, "evicted_bytes": 0}
        return dict(self.residency.stats)

    def flush(self) -> None:
        """Write every changed row to the file and wait for the disk (``fsync``): the changed
        pages of a copy-on-write mapping in sequential runs (held ranges stay held), else
        the dirty pages of the shared mapping (``msync``)."""
        if self.residency is not None:
            if os.getpid() != self._owner:
                return
            with self._lock:
                self.residency.write_out()
        elif self._map is not None and self.writable:
            self._map.flush()
        os.fsync(self._fd)

    def copy_to(self, target: Path) -> None:
        """Copy the file as this process sees it to ``target`` (new, never through a link,
        holes kept, fsynced) without writing the file itself: the pages this process changed
        are written from its memory, the rest copied from the file by the kernel. A
        checkpoint's base of a live row file so writes each byte once; the changed pages stay
        in memory, changed, until a flush or the budget writes them to the file."""
        if self.residency is None or os.getpid() != self._owner:
            self.flush()  # a shared mapping: its dirty pages are the kernel's to write
            copy_sparse(self.path, target)
            return
        with self._lock:
            changed = self.residency.changed_pages()
            copy_sparse(
                self.path,
                target,
                replaced=self.residency.byte_runs(changed),
                fill=lambda fd: self.residency.copy_pages(changed, fd),
            )

    @property
    def record_bytes(self) -> np.ndarray | None:
        """The records as ``(N, row_bytes)`` uint8, through this process's mapping (its changed
        rows included): what a checkpoint's delta gathers from; ``None`` once closed."""
        return self._raw.numpy() if self._raw is not None else None

    def evict(self) -> None:
        """Write the file back, then drop its pages from this mapping and the page cache, as
        if the machine had needed the memory (benchmarks use it to start from a cold cache)."""
        self.flush()
        if self.residency is not None:
            with self._lock:
                self.residency.drop_all()
        elif self._map is not None:
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
        copied into this process's memory at once (``MADV_POPULATE_WRITE``) and pinned there
        (the memory budget never evicts them), so a step's first write to a row faults
        nothing (a copy-on-write fault costs 7 us here, three times the step's own work when
        each row is on a page of its own). A held range is written back when it is dropped or
        the file flushed: only the pages a step wrote, in sequential runs. Pages shared with
        rows outside the range are left as they are. Returns the bytes read."""
        done = self.read_rows(first, stop)
        start, end = self._byte_range(first, stop, inside=True)
        if self.residency is not None and end > start:
            with self._lock:
                self.residency.hold(start // mmap.PAGESIZE, end // mmap.PAGESIZE)
            drop_cached(self._fd, start, end - start)  # the copies are ours: the cache's can go
        return done

    def _mark_written(self, rows: torch.Tensor) -> None:
        """Mark the pages of ``rows`` as written by a step (for the budget and held ranges)."""
        if self.residency is None or (self.residency.unbounded and not self.residency.pinned):
            return
        page, row = mmap.PAGESIZE, self.spec.row_bytes
        rows = rows.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        first = (HEADER_BYTES + rows * row) // page
        last = (HEADER_BYTES + rows * row + row - 1) // page
        with self._lock:
            if row <= page:
                self.residency.mark(first, last)
            else:
                self.residency.mark_ranges(first, last)

    def drop_rows(self, first: int, stop: int) -> int:
        """Write rows ``[first, stop)`` back in one sequential write-out and drop their pages
        from this mapping and the page cache (pages shared with rows outside the range stay).
        Nothing is lost or stale: a dropped page is read from the file again by its next
        access. Returns the bytes dropped."""
        start, end = self._byte_range(first, stop, inside=True)
        if end <= start:
            return 0
        if self.residency is not None:
            with self._lock:
                self.residency.release(start // mmap.PAGESIZE, end // mmap.PAGESIZE)
        elif self._map is not None:
            self._map.madvise(
                mmap.MADV_DONTNEED, start, end - start
            )  # our page tables go; their dirty bits pass to the cache
        if self.writable:
            write_back(self._fd, start, end - start)
        drop_cached(self._fd, start, end - start)
        return end - start

    def close(self) -> None:
        if self._fd < 0:
            return
        if (
            self.residency is not None and os.getpid() == self._owner
        ):  # changed rows reach the file as a shared mapping's would
            with self._lock:
                self.residency.write_out()
        # Drop our views and the map, but never unmap by hand: tensors made from the mapping
        # (a DiskEmbedding's weight, a prefetch in flight) hold the map object, and unmapping
        # under them would crash the process. The kernel unmaps when the last one is gone.
        self.records = self.moments = self.m = self.v = self._raw = None
        self._map = None
        os.close(self._fd)
        self._fd = -1


SETTLE_TO = 0.97  # an eviction leaves the changed pages at this share of the budget
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
