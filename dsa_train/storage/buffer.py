"""A buffer of whole partitions of a table file, for partition-ordered training.

A partition is a contiguous range of a table's rows (its ``[w | m | v]`` records). The buffer
keeps the partitions the current steps need in memory and moves the rest through the disk
whole: :meth:`PartitionBuffer.prepare` starts reading a partition the next steps will need
with large sequential reads on a background thread (while this step trains), :meth:`hold`
waits for the ones needed now, and :meth:`release` writes a partition no longer needed back
in one sequential write-out and drops its pages. So a table far beyond RAM is read and
written at the disk's sequential rate, where rows in random order cost one random read each.

A held partition stays at its addresses in the file's mapping, the very memory the optimizer
updates rows in (no tensor is swapped), but mapped copy-on-write and copied in whole when it
is read (:meth:`RowFile.hold_rows`): steps then write to this process's memory, with neither
a page fault nor the kernel's dirty-page throttling, and a release writes back the pages that
:meth:`RowFile.reserve` saw written, which every write to the records announces first
(DiskSparseAdam's steps and ``load_rows`` do). Residency is only speed: a row outside the
buffer is still read and written correctly, one page at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from .row_file import RowFile


class PartitionBuffer:
    """Partitions ``spans[p] = (first_row, stop_row)`` of ``rows`` moved whole between the disk
    and memory. :attr:`stats` counts bytes and seconds of reads, write-outs and waits, and
    the most partitions in memory at once (read in and not yet written back, the one being
    read included)."""

    def __init__(self, rows: RowFile, spans: list[tuple[int, int]]) -> None:
        self.rows, self.spans = rows, spans
        self._io = ThreadPoolExecutor(1, thread_name_prefix="dsa-partitions")  # one stream: the disk reads sequentially
        self._lock = threading.Lock()
        self._loads: dict[int, Future] = {}  # partition -> its read (done or in flight)
        self._drops: dict[int, Future] = {}
        self._resident: set[int] = set()  # read in (or being read) and not written back: the IO thread's own
        self.stats = {
            "read_bytes": 0,
            "read_seconds": 0.0,
            "written_bytes": 0,
            "write_seconds": 0.0,
            "wait_seconds": 0.0,
            "loads": 0,
            "peak_partitions": 0,
        }

    @property
    def held(self) -> set[int]:
        """The partitions read in (or being read) and not released."""
        with self._lock:
            return set(self._loads)

    def prepare(self, partitions: Iterable[int]) -> None:
        """Start reading these partitions in the background (returns at once)."""
        with self._lock:
            for p in partitions:
                if p not in self._loads:
                    drop = self._drops.pop(p, None)  # released, then wanted again: after its write-out
                    self._loads[p] = self._io.submit(self._read, p, drop)

    def hold(self, partitions: Iterable[int]) -> None:
        """Wait until these partitions are read in (reading any not asked for yet)."""
        partitions = list(partitions)
        self.prepare(partitions)
        started = time.perf_counter()
        for p in partitions:
            self._loads[p].result()
        self.stats["wait_seconds"] += time.perf_counter() - started

    def release(self, partitions: Iterable[int]) -> None:
        """Write these partitions back and drop them from memory, in the background."""
        with self._lock:
            for p in partitions:
                if self._loads.pop(p, None) is not None:
                    self._drops[p] = self._io.submit(self._drop, p)

    def close(self) -> None:
        """Finish the reads and write-outs under way."""
        self._io.shutdown(wait=True)

    def _read(self, partition: int, after: Future | None) -> None:
        if after is not None:
            after.result()
        self._resident.add(partition)
        self.stats["peak_partitions"] = max(self.stats["peak_partitions"], len(self._resident))
        started = time.perf_counter()
        self.stats["read_bytes"] += self.rows.hold_rows(*self.spans[partition])
        self.stats["read_seconds"] += time.perf_counter() - started
        self.stats["loads"] += 1

    def _drop(self, partition: int) -> None:
        started = time.perf_counter()
        self.stats["written_bytes"] += self.rows.drop_rows(*self.spans[partition])
        self.stats["write_seconds"] += time.perf_counter() - started
        self._resident.discard(partition)
