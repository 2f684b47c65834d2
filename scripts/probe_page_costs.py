#!/usr/bin/env python
"""What a row's first touch costs on this machine: the price of one 4 KiB page, by kind.

A step of DiskSparseAdam writes each touched row's record through a shared mapping of its
state file; the first write to a page of a fresh (sparse) file allocates a page-cache page,
zero-fills it and reserves its block. SparseAdam pays the same kind of price for its
anonymous state (it zeroes all of it in its first step). This probe touches the same random
pages of a 2 GiB region in several ways, each in a fresh file (or mapping), and prints the
cost per page:

    anonymous         first write to anonymous memory (what SparseAdam's zeroing pays)
    hole write        first write to a page of a sparse file through a shared mapping
    hole read+write   a read, then a write (what a kernel that reads a record first pays)
    fallocated write  the same after posix_fallocate of the whole file (no hole left)
    pwrite            a 4 KiB pwrite into the hole, then the mapped write
    clean page write  a page written and written back before (a long run's steady state)
    fresh memory      new anonymous memory in 240 MiB chunks, chunk by chunk: on a virtual
                      machine whose host backs guest memory only when it is first touched
                      (and takes freed memory back), a page costs several times more once the
                      recently freed memory is used up

    python scripts/probe_page_costs.py [--dir DIR] [--pages 65536]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

import numpy as np

PAGE = mmap.PAGESIZE
SIZE = 2 << 30


def timed(touch) -> float:
    start = time.perf_counter()
    touch()
    return time.perf_counter() - start


def probe(kind: str, pages: np.ndarray, folder: str) -> float:
    """Seconds to touch ``pages`` the way ``kind`` says, in a fresh file or mapping."""
    if kind == "anonymous":
        mapping = mmap.mmap(-1, SIZE)
        view = np.frombuffer(mapping, dtype=np.uint8)
        return timed(lambda: view.__setitem__(pages * PAGE, 1))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        fd = os.open(os.path.join(tmp, "rows"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            if kind == "fallocated write":
                os.posix_fallocate(fd, 0, SIZE)
            mapping = mmap.mmap(fd, SIZE)
            mapping.madvise(mmap.MADV_RANDOM)
            view = np.frombuffer(mapping, dtype=np.uint8)
            write = lambda: view.__setitem__(pages * PAGE, 1)  # noqa: E731
            if kind == "hole read+write":
                return timed(lambda: (int(view[pages * PAGE].sum()), write()))
            if kind == "pwrite":
                zeros = bytes(PAGE)
                return timed(lambda: ([os.pwrite(fd, zeros, int(p) * PAGE) for p in pages], write()))
            if kind == "clean page write":
                write()
                mapping.flush()
            return timed(write)
        finally:
            os.close(fd)


def fresh_memory(chunks: int) -> list[float]:
    """Microseconds per page of each new 240 MiB anonymous chunk, all kept mapped."""
    kept, costs = [], []
    for _ in range(chunks):
        mapping = mmap.mmap(-1, 240 << 20)
        view = np.frombuffer(mapping, dtype=np.uint8)
        costs.append(timed(lambda view=view: view.__setitem__(slice(None, None, PAGE), 1)) / (len(view) // PAGE) * 1e6)
        kept.append(mapping)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="folder on the disk the state would live on (default: temp dir)")
    parser.add_argument("--pages", type=int, default=65536, help="random pages touched per probe")
    parser.add_argument("--chunks", type=int, default=12, help="240 MiB chunks of fresh memory to probe")
    args = parser.parse_args()
    pages = np.unique(np.random.default_rng(0).integers(0, SIZE // PAGE, args.pages))
    print(f"{len(pages):,} random pages of a 2 GiB region, microseconds per page")
    for kind in ("anonymous", "hole write", "hole read+write", "fallocated write", "pwrite", "clean page write"):
        print(f"  {kind:18s} {probe(kind, pages, args.dir) / len(pages) * 1e6:6.2f}")
    costs = fresh_memory(args.chunks)
    print("fresh anonymous memory, 240 MiB chunks in turn: " + " ".join(f"{c:.1f}" for c in costs))


if __name__ == "__main__":
    main()
