"""Which pages of a row file live in this process's memory, and when they are written back.

A writable row file is mapped copy-on-write (``MAP_PRIVATE``): the first write to a page copies
it into this process's anonymous memory, and from then on the kernel never writes it back on
its own. Between checkpoints the disk sees nothing; what is written, and when, is decided
here:

- :meth:`PageResidency.write_out` (a flush: a checkpoint, ``close()``) finds every page this
  process changed by asking the kernel (``/proc/self/pagemap``: a changed page is anonymous,
  an unchanged one is the file's), so a write through any view of the mapping is found, not
  only the optimizer's; it writes them to the file in sequential runs and drops the copies,
  which leaves the bytes in the page cache (clean after the fsync, droppable under pressure).
- Past the memory budget, :meth:`PageResidency.trim` picks pages to leave memory by CLOCK
  (a reference bit per page, set when a step writes it, cleared as the hand passes) and writes
  each once as it leaves.
- When the machine runs short of memory anyway (other processes, an evaluation), the
  optimizer writes changed pages out early (:func:`memory_shortfall`, :meth:`PageResidency.shed`):
  anonymous pages cannot be dropped by the kernel without swap, so the budget gives way first.
- Held ranges (the partition buffer) are copied in whole and pinned: the budget never evicts
  them, and only their pages a step wrote are written back.

The bookkeeping is one byte per 4 KiB page of the file (0.024% of it).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import re

import numpy as np

from ..fsutil import libc
from ..memory import host_available_bytes, host_total_bytes

PAGE = mmap.PAGESIZE
RESIDENT, REFERENCED, PINNED, CLEAN, STEP = 1, 2, 4, 8, 16
NOT_REFERENCED, NOT_CLEAN, NOT_STEP = 0xFF ^ REFERENCED, 0xFF ^ CLEAN, 0xFF ^ STEP
PAGEMAP_CHUNK = 1 << 20  # pages whose pagemap entries are read at once (8 MiB)
WRITE_CHUNK = 8 << 20
MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23
DEFAULT_BUDGET = "75%"
BUDGET_FORMS = (
    "give bytes such as 2147483648, a size such as '2GiB' or '512MB', or a share of free memory such as '50%'"
)
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61
FREE_FLOOR_SHARE, FREE_FLOOR_MIN = 0.05, 256 << 20  # free memory the budget gives way to keep


@functools.cache
def pagemap_readable() -> bool:
    """Whether this process can tell its changed pages from the file's (``/proc/self/pagemap``)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        return len(os.pread(fd, 8, 0)) == 8
    except OSError:
        return False
    finally:
        os.close(fd)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def resolve_budget(budget: int | str | None) -> int:
    """``memory_budget`` in bytes: an int, a size (``"2GiB"``, ``"512MB"``), or a percentage of
    the memory this process can still take (``"75%"``, the default), shared by the processes
    ``torchrun`` started on this machine (``LOCAL_WORLD_SIZE``)."""
    if budget is None:
        budget = DEFAULT_BUDGET
    if isinstance(budget, bool) or not isinstance(budget, (int, str)) or isinstance(budget, int) and budget < 0:
        raise ValueError(f"Invalid memory_budget: {budget!r} ({BUDGET_FORMS})")
    if isinstance(budget, int):
        return budget
    text = budget.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 <= share <= 100:
            raise ValueError(f"Invalid memory_budget: {budget!r} (a share of free memory runs from '0%' to '100%')")
        room = host_available_bytes() or 0
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        return int(room * share / 100 / local)
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"Invalid memory_budget: {budget!r} ({BUDGET_FORMS})")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])


def memory_shortfall() -> int:
    """Bytes by which the memory this process can still take is below the floor it keeps free
    (5% of the machine's memory, at least 256 MiB); 0 when there is enough, or when unknown."""
    room, total = host_available_bytes(), host_total_bytes()
    if room is None or total is None:
        return 0
    return max(0, max(FREE_FLOOR_MIN, int(total * FREE_FLOOR_SHARE)) - room)


class PageResidency:
    """The resident pages of one copy-on-write mapping of a file and their write-back.

    ``base`` is the mapping's address, ``file_bytes`` its length (the file's), ``fd`` the file
    to write to, ``budget`` the bytes of changed pages it may keep (``None``: no limit)."""

    def __init__(self, base: int, file_bytes: int, fd: int, budget: int | None = None) -> None:
        self.base, self.fd, self.file_bytes = base, fd, file_bytes
        self.pages = -(-file_bytes // PAGE)
        self.flags = np.zeros(self.pages, dtype=np.uint8)
        self.budget = budget
        self.hand = 0  # the CLOCK hand
        self._marked = 0  # pages marked since the last count: an upper bound of the growth
        self._step_pages: list[np.ndarray] = []  # the pages the current step marked (STEP)
        self._resident = 0  # pages flagged RESIDENT at the last count
        self.pinned = False  # some range is held
        self.stats = {"written_bytes": 0, "evicted_bytes": 0}

    @property
    def unbounded(self) -> bool:
        return self.budget is None or self.budget >= self.pages * PAGE

    def changed_bytes(self) -> int:
        """Bytes of the pages this process holds its own copies of now, by the kernel's page tables."""
        return len(self.changed_pages()) * PAGE

    def resident_bytes(self) -> int:
        """Bytes of the pages the steps' marks count as held (what the budget is checked against)."""
        self._resident = int(np.count_nonzero(self.flags & RESIDENT))
        self._marked = 0
        return self._resident * PAGE

    # -- marks --------------------------------------------------------------------------
    def mark(self, first_page: np.ndarray, last_page: np.ndarray) -> None:
        """Record that a step writes the pages ``first_page[i]..last_page[i]`` (a record spans
        at most two pages when it is at most a page long, which these callers ensure; longer
        records are marked page by page by :meth:`mark_ranges`)."""
        if self.unbounded and not self.pinned:
            return
        for pages in (first_page, last_page):
            self.flags[pages] = (self.flags[pages] | (RESIDENT | REFERENCED | STEP)) & NOT_CLEAN
            self._step_pages.append(pages)
        self._marked += len(first_page) * 2

    def end_step(self) -> None:
        """The step whose pages :meth:`mark` recorded has written them: they may leave again."""
        for pages in self._step_pages:
            self.flags[pages] &= NOT_STEP
        self._step_pages.clear()

    def mark_ranges(self, first_page: np.ndarray, last_page: np.ndarray) -> None:
        """:meth:`mark` for records longer than a page."""
        if self.unbounded and not self.pinned:
            return
        spans = last_page - first_page + 1
        pages = np.repeat(first_page, spans) + (np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans))
        self.mark(pages, pages)

    # -- the budget ---------------------------------------------------------------------
    def over_budget(self) -> bool:
        if self.unbounded:
            return False
        if (self._resident + self._marked) * PAGE <= self.budget:
            return False
        return self.resident_bytes() > self.budget

    def trim(self, target_bytes: int) -> int:
        """Evict pages by CLOCK until at most ``target_bytes`` of changed pages remain: each is
        written to the file once and its copy dropped. Returns the bytes evicted."""
        excess = self._resident - target_bytes // PAGE
        victims, clean = [], []
        scanned = 0
        while excess > 0 and scanned < 2 * self.pages:
            stop = min(self.hand + PAGEMAP_CHUNK, self.pages)
            chunk = self.flags[self.hand : stop]
            # (a page the current step is about to write, STEP, never leaves before the write)
            candidates = np.flatnonzero((chunk & (RESIDENT | REFERENCED | PINNED | STEP)) == RESIDENT)
            if len(candidates) >= excess:
                candidates = candidates[:excess]
                stop = self.hand + int(candidates[-1]) + 1
                chunk = self.flags[self.hand : stop]
            clean.append((chunk[candidates] & CLEAN) != 0)
            chunk[candidates] = 0  # chosen: a second pass of the hand must not choose them again
            chunk &= NOT_REFERENCED  # the hand passed: a page must be written again to stay
            victims.append(candidates + self.hand)
            excess -= len(candidates)
            scanned += stop - self.hand
            self.hand = 0 if stop >= self.pages else stop
        if not victims:
            return 0
        pages, clean = np.concatenate(victims), np.concatenate(clean)
        order = np.argsort(pages)
        pages, clean = pages[order], clean[order]
        try:
            self._write(pages[~clean])
        except BaseException:
            self.flags[pages] |= RESIDENT  # still in memory, still to be written
            raise
        self._drop(pages)
        self._resident -= len(pages)
        self.stats["evicted_bytes"] += len(pages) * PAGE
        return len(pages) * PAGE

    def shed(self, nbytes: int) -> int:
        """Evict at least ``nbytes`` of changed pages now, whatever the budget (memory is short):
        by CLOCK where the steps' marks are kept, else the kernel's page tables are walked from
        the hand. Returns the bytes evicted."""
        if not self.unbounded or self.pinned:
            return self.trim(max(0, self.resident_bytes() - nbytes))
        needed, evicted = -(-nbytes // PAGE), 0
        for _ in range(-(-self.pages // PAGEMAP_CHUNK) + 1):  # once round the file at most
            if evicted >= needed:
                break
            stop = min(self.hand + PAGEMAP_CHUNK, self.pages)
            pages = self.changed_pages(self.hand, stop)[: needed - evicted]
            self._write(pages)
            self._drop(pages)
            evicted += len(pages)
            self.hand = 0 if stop >= self.pages else stop
        self.stats["evicted_bytes"] += evicted * PAGE
        return evicted * PAGE

    # -- write-back ---------------------------------------------------------------------
    def changed_pages(self, first: int = 0, stop: int | None = None) -> np.ndarray:
        """The pages in ``[first, stop)`` this process holds its own copies of (anonymous,
        or swapped out), by the kernel's page tables."""
        stop = self.pages if stop is None else stop
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        found = []
        try:
            first_virtual = self.base // PAGE
            for start in range(first, stop, PAGEMAP_CHUNK):
                count = min(PAGEMAP_CHUNK, stop - start)
                raw = _pread_all(fd, count * 8, (first_virtual + start) * 8)
                entries = np.frombuffer(raw, dtype=np.uint64)
                own = ((entries & _PRESENT) != 0) & ((entries & _FILE) == 0) | ((entries & _SWAPPED) != 0)
                found.append(np.flatnonzero(own) + start)
        finally:
            os.close(fd)
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def write_out(self, first: int = 0, stop: int | None = None, *, keep_pinned: bool = True) -> int:
        """Write every changed page in ``[first, stop)`` to the file (held pages only where a
        step wrote them) and drop the copies of the pages not held; no fsync. Returns the
        bytes written."""
        stop = self.pages if stop is None else stop
        pages = self.changed_pages(first, stop)
        flags = self.flags[pages]
        written = self._write(pages[(flags & CLEAN) == 0])
        held = (flags & PINNED) != 0 if keep_pinned else np.zeros(len(pages), dtype=bool)
        self._drop(pages[~held])
        region = self.flags[first:stop]
        if keep_pinned:
            region[:] = np.where((region & PINNED) != 0, RESIDENT | PINNED | CLEAN, 0)
        else:
            region[:] = 0
        self.pinned = bool(np.any(self.flags & PINNED))
        self.resident_bytes()
        return written

    def hold(self, first: int, stop: int) -> None:
        """Copy pages ``[first, stop)`` into this process's memory now and pin them there."""
        if stop <= first:
            return
        _madvise(self.base + first * PAGE, (stop - first) * PAGE, MADV_POPULATE_WRITE, tolerate_einval=True)
        self.flags[first:stop] = RESIDENT | PINNED | CLEAN
        self.pinned = True
        self.resident_bytes()

    def release(self, first: int, stop: int) -> int:
        """Write the held pages ``[first, stop)`` a step changed, drop every copy there. Returns
        the bytes written."""
        written = self.write_out(first, stop, keep_pinned=False)
        _madvise(self.base + first * PAGE, (stop - first) * PAGE, MADV_DONTNEED)  # the file's pages we mapped, too
        return written

    def drop_all(self) -> None:
        """Drop every copy (after :meth:`write_out`): the mapping shows the file again."""
        _madvise(self.base, self.pages * PAGE, MADV_DONTNEED)
        self.flags[:] = 0
        self.pinned = False
        self.resident_bytes()

    def byte_runs(self, pages: np.ndarray) -> list[tuple[int, int]]:
        """Sorted ``pages`` as the byte ranges ``[start, end)`` of the file they cover."""
        return [(a * PAGE, min(b * PAGE, self.file_bytes)) for a, b in _runs(pages)]

    def copy_pages(self, pages: np.ndarray, fd: int) -> int:
        """``pwrite`` ``pages`` (sorted) of the mapping to the same bytes of another file ``fd``
        (a copy of this one: a checkpoint's base); this file is not written. Returns the bytes."""
        written = 0
        for start, end in self.byte_runs(pages):
            memory = (ctypes.c_char * (end - start)).from_address(self.base + start)
            view = memoryview(memory).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done : done + WRITE_CHUNK], start + done)
            written += end - start
        return written

    def _write(self, pages: np.ndarray) -> int:
        """``pwrite`` ``pages`` (sorted) of the mapping to the same bytes of the file, run by run."""
        written = self.copy_pages(pages, self.fd)
        self.stats["written_bytes"] += written
        return written

    def _drop(self, pages: np.ndarray) -> None:
        for a, b in _runs(pages):
            _madvise(self.base + a * PAGE, (b - a) * PAGE, MADV_DONTNEED)


def _runs(pages: np.ndarray):
    """Sorted page numbers as runs ``[a, b)`` of consecutive pages."""
    if len(pages) == 0:
        return
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(pages)]])
    yield from zip(pages[starts].tolist(), (pages[ends - 1] + 1).tolist())


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < size:
        got = os.pread(fd, size - done, offset + done)
        if not got:
            raise OSError(f"/proc/self/pagemap ended at byte {offset + done}")
        parts.append(got)
        done += len(got)
    return b"".join(parts)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The process's libc (:func:`~dsa_train.fsutil.libc`) with ``madvise`` typed for addresses."""
    found = libc()
    found.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return found


def _madvise(address: int, length: int, advice: int, *, tolerate_einval: bool = False) -> None:
    if length and _libc().madvise(address, length, advice) != 0:
        error = ctypes.get_errno()
        if tolerate_einval and error == errno.EINVAL:  # MADV_POPULATE_WRITE before Linux 5.14: copied at first write
            return
        raise OSError(error, f"madvise({advice}) on a row file's mapping failed: {os.strerror(error)}")
