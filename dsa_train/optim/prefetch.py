"""Bring the rows the next step will touch into memory while this step computes.

A prefetch is a cache warm, never a copy: reader threads page the rows' records in through
the row file's own mapping (a read of each record's first and last element faults in its
pages), so the pages sit in the page cache and in this process's page tables, the very memory
the step then reads and writes. Nothing is kept on the side, so a row is never read stale and
no update is dropped, however consecutive batches overlap (the original Disk Sparse Adam
library loses updates exactly there: it prefetches copies).

The rows are deduplicated and sorted, and each of ``threads`` readers takes one ascending
slice of them, so the disk sees many requests at once (the queue depth a random-read workload
needs). Page faults from a thread pool beat explicit ``pread`` calls from the same number of
Python threads here: a fault costs no Python per row, and torch releases the GIL for the
whole slice (``scripts/bench_out_of_core.py`` measures both).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .row_file import RowFile

PAGE_BYTES = 4096


def default_threads() -> int:
    """``$DSA_IO_THREADS``, else 16: enough requests in flight for an SSD, cheap when cached."""
    return max(1, int(os.environ.get("DSA_IO_THREADS", "16")))


def page_in(records: torch.Tensor, rows: torch.Tensor, row_bytes: int) -> None:
    """Fault in the pages of ``records[rows]`` (``records``: ``(N, slots, W)`` of a mapping).

    A record of at most a page spans at most two pages: its first and last elements reach
    both. A larger one is read whole.
    """
    if row_bytes > PAGE_BYTES:
        torch.index_select(records, 0, rows)
        return
    flat = records.view(records.shape[0], -1)
    torch.index_select(flat[:, 0], 0, rows)
    torch.index_select(flat[:, -1], 0, rows)


class Prefetcher:
    """A pool of reader threads that pages row records in ahead of their use.

    ``submit(row_file, rows)`` returns at once; :meth:`wait` blocks until everything submitted
    has been read (a step never needs to: a row not read yet is simply read by the step).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._readers = ThreadPoolExecutor(self.threads, thread_name_prefix="dsa-prefetch")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, row_file: RowFile, rows: torch.Tensor) -> None:
        records = row_file.records
        if records is None or records.numel() == 0:
            return
        unique = torch.unique(rows.detach().to("cpu", torch.int64))  # sorted
        shares = [s for s in torch.tensor_split(unique, min(self.threads, max(1, len(unique)))) if len(s)]
        futures = [self._readers.submit(page_in, records, share, row_file.spec.row_bytes) for share in shares]
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
