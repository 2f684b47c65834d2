"""Bring the rows the next step will touch into memory while this step computes.

A prefetch is a cache warm, never a copy: reader threads page the rows' records in through
the row file's own mapping (one touch of every page a record spans faults it in), so the
pages sit in the page cache and in this process's page tables, the very memory the step then
reads and writes. Nothing is kept on the side, so a row is never read stale and
no update is dropped, however consecutive batches overlap (the original Disk Sparse Adam
library loses updates exactly there: it prefetches copies).

The rows are deduplicated and sorted, and each of ``threads`` readers takes one ascending
slice of them, so the disk sees many requests at once (the queue depth a random-read workload
needs). Page faults from a thread pool beat explicit ``pread`` calls from the same number of
Python threads here: a fault costs no Python per row, and the touching loop releases the GIL
for the whole slice (``scripts/bench_out_of_core.py`` measures both). When the rows are about
to be trained, their pages are also made writable ahead of the step (``claim``): a row's
first write then faults nothing, where it would otherwise fault again to mark the page
dirty (and a never-written page of a fresh file be faulted twice).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from . import native
from ..storage.row_file import RowFile

PAGE_BYTES = mmap.PAGESIZE
#: Rows one torch operation of the fallback pages in: below torch's parallel grain, so a
#: reader thread never opens a thread team of its own (each calling thread would get one).
TORCH_CHUNK_ROWS = 16384
#: Fewer rows than this per reader are not worth waking a thread for.
MIN_ROWS_PER_READER = 512


def default_threads() -> int:
    """``$DSA_IO_THREADS``, else 16: enough requests in flight for an SSD, cheap when cached."""
    return max(1, int(os.environ.get("DSA_IO_THREADS", "16")))


def page_in(records: torch.Tensor, rows: torch.Tensor, *, claim: bool = False) -> None:
    """Fault in the pages of ``records[rows]`` (``records``: ``(N, slots, W)`` of a mapping;
    ``rows``: int64, contiguous).

    With ``claim`` the pages are made writable as well (the step will write these rows): a
    page of a fresh file then costs one fault instead of two. The compiled kernel does it;
    without it, pages are only read, by torch operations on chunks small enough to run on
    the calling thread.
    """
    row_bytes = records.stride(0) * records.element_size()
    kernel = native.load()
    if kernel is not None:
        kernel.touch_rows(records.data_ptr(), rows, row_bytes, row_bytes, PAGE_BYTES, claim)
        return
    flat = records.view(records.shape[0], -1)
    for chunk in torch.split(rows, TORCH_CHUNK_ROWS):
        if row_bytes > PAGE_BYTES:
            torch.index_select(flat, 0, chunk)
        else:  # a record of at most a page spans at most two: its first and last elements reach both
            torch.index_select(flat[:, 0], 0, chunk)
            torch.index_select(flat[:, -1], 0, chunk)


class Prefetcher:
    """A pool of reader threads that pages row records in ahead of their use.

    ``submit(row_file, rows)`` returns at once; :meth:`wait` blocks until everything submitted
    has been read (a step never needs to: a row not read yet is simply read by the step).
    The readers run no multi-threaded torch operation, and idle readers sleep.
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._readers = ThreadPoolExecutor(self.threads, thread_name_prefix="dsa-prefetch")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, row_file: RowFile, rows: torch.Tensor, *, claim: bool = False) -> None:
        """Page in the records of ``rows``; with ``claim`` (the rows are about to be updated,
        and the file is mapped writable) also make their pages writable."""
        records = row_file.records
        if records is None or records.numel() == 0:
            return
        unique = torch.unique(rows.detach().to("cpu", torch.int64))  # sorted
        readers = max(1, min(self.threads, len(unique) // MIN_ROWS_PER_READER))
        shares = [s for s in torch.tensor_split(unique, readers) if len(s)]
        futures = [self._readers.submit(page_in, records, share, claim=claim) for share in shares]
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + futures

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
