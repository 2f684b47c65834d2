"""Read the rows the next step will touch into the page cache while this step computes.

A prefetch is a cache warm, never a copy: threads ``pread`` the rows' records of a row file
into a scratch buffer that is thrown away, which leaves the pages in the kernel's page cache,
the very memory the step's mapping then reads and writes. Nothing is kept on the side, so a
row is never read stale and no update is dropped, however consecutive batches overlap (the
original Disk Sparse Adam library loses updates exactly there: it prefetches copies).

Rows are sorted and deduplicated, runs of adjacent records merged into one read, and the runs
dealt out to ``threads`` readers in file order, so the disk sees many requests at once (the
queue depth a random-read workload needs) and each in ascending order.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .format import HEADER_BYTES
from .row_file import RowFile

#: Largest single read; longer runs of adjacent rows are split.
MAX_READ_BYTES = 1 << 20


def default_threads() -> int:
    """``$DSA_IO_THREADS``, else 16: enough requests in flight for an SSD, cheap when cached."""
    return max(1, int(os.environ.get("DSA_IO_THREADS", "16")))


def record_runs(rows: torch.Tensor, row_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` byte runs covering the records of ``rows``, ascending, merged
    where records are adjacent, none longer than :data:`MAX_READ_BYTES` (unless one record is)."""
    unique = torch.unique(rows.detach().to("cpu", torch.int64))
    if unique.numel() == 0:
        return []
    breaks = torch.nonzero(unique[1:] - unique[:-1] != 1).flatten() + 1
    starts = torch.cat([unique[:1], unique[breaks]]).tolist()
    ends = torch.cat([unique[breaks - 1], unique[-1:]]).tolist()
    per_read = max(1, MAX_READ_BYTES // row_bytes)
    runs = []
    for first, last in zip(starts, ends):
        for begin in range(first, last + 1, per_read):
            count = min(per_read, last + 1 - begin)
            runs.append((HEADER_BYTES + begin * row_bytes, count * row_bytes))
    return runs


class Prefetcher:
    """A pool of reader threads that pages row records in ahead of their use.

    ``submit(row_file, rows)`` returns at once; :meth:`wait` blocks until everything submitted
    has been read (a step never needs to: an unread row is simply read by the step itself).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._readers = ThreadPoolExecutor(self.threads, thread_name_prefix="dsa-prefetch")
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._buffers = threading.local()

    def submit(self, row_file: RowFile, rows: torch.Tensor) -> None:
        runs = record_runs(rows, row_file.spec.row_bytes)
        fd = row_file.fd
        shares = [runs[i :: self.threads] for i in range(min(self.threads, len(runs)))]
        futures = [self._readers.submit(self._read, fd, sorted(share)) for share in shares]
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + futures

    def _read(self, fd: int, runs: list[tuple[int, int]]) -> None:
        buffer = getattr(self._buffers, "buffer", None)
        if buffer is None:
            buffer = self._buffers.buffer = bytearray(max(MAX_READ_BYTES, 1 << 16))
        view = memoryview(buffer)
        for offset, length in runs:
            if length > len(view):  # one record larger than the buffer
                view = memoryview(bytearray(length))
            try:
                os.preadv(fd, [view[:length]], offset)
            except OSError:
                return  # the file was closed under us: the step reads what it needs itself

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.wait()
        self._readers.shutdown(wait=True)


_shared: Prefetcher | None = None
_shared_lock = threading.Lock()


def shared_prefetcher() -> Prefetcher:
    """The process's prefetcher, made on first use (``$DSA_IO_THREADS`` readers)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Prefetcher()
        return _shared
