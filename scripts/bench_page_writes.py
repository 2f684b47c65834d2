#!/usr/bin/env python
"""Bytes written to the disk per row a DiskSparseAdam step updates in a disk table.

A step updates each touched row's record (weights and moments) through a shared mapping of
the table file; the kernel writes a dirty page-cache folio back whole. Pages faulted in
through the mapping are single 4 KiB pages, but a file written or read sequentially (the
table's creation, a copy, a restore, a backup tool reading it) leaves large folios in the
cache (Linux 6.x: up to 2 MiB on ext4 from 6.16, XFS, btrfs), and a row updated in one of
those writes the whole folio back. The row files drop their cached pages when opened, and
copies drop theirs (``dsa_train.fsutil.drop_cached``).

Three regimes, the same seeded steps on a fresh table each, in one run:

    fresh           the table as DiskEmbedding creates it (written a page at a time: cached
                    as single pages)
    reopened        created, closed, its cache dropped, then read whole with pread (what a
                    copy, a restore or a backup tool leaves: large folios) and reopened, which
                    drops the cached pages again: cold, but a row writes one page back
    large folios    the same without that drop: what every fresh table was before its
                    creation wrote a page at a time (the baseline)

Each prints the bytes the process caused to be written (``/proc/self/io`` write_bytes,
through the final flush), per row updated, against the 4 KiB pages the rows lie on.

    python scripts/bench_page_writes.py [--dir DIR] [--rows 20000000] [--dim 16] [--steps 50] [--batch 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from dsa_train import DiskEmbedding, DiskSparseAdam
from dsa_train.storage.table import table_of

PAGE = 4096


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))


def run(folder: Path, args, regime: str) -> tuple[int, int, int, float, float]:
    """Train ``args.steps`` steps of uniform random rows, then flush; returns (bytes written,
    bytes of the pages the updated rows lie on, rows updated, seconds stepping, seconds
    flushing)."""
    path = folder / "table.table"
    table = DiskEmbedding(args.rows, args.dim, path=path, std=0.01)
    if regime != "fresh":
        table.table.close()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size, offset = os.fstat(fd).st_size, 0
            while offset < size:
                offset += len(os.pread(fd, 8 << 20, offset))
        finally:
            os.close(fd)
        with (
            mock.patch("dsa_train.storage.row_file.drop_cached")
            if regime == "large folios"
            else contextlib.nullcontext()
        ):
            table = DiskEmbedding(args.rows, args.dim, path=path, std=0.01)
    optimizer = DiskSparseAdam([table.weight], lr=1e-3, state_dir=folder / "state")
    row_bytes = table_of(table.weight).rows.spec.row_bytes
    generator = torch.Generator().manual_seed(0)
    before, started, pages, updated = written_bytes(), time.perf_counter(), set(), 0
    for _ in range(args.steps):
        rows = torch.randint(args.rows, (args.batch,), generator=generator)
        optimizer.zero_grad()
        table(rows).square().sum().backward()
        optimizer.step()
        unique = rows.unique()
        updated += len(unique)
        pages.update(((unique * row_bytes) // PAGE).tolist())
    stepped = time.perf_counter()
    optimizer.flush()
    table.flush()
    return written_bytes() - before, len(pages) * PAGE, updated, stepped - started, time.perf_counter() - stepped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="folder for the tables (default: a temporary one)")
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="page-writes-", dir=args.dir))
    try:
        warmup = argparse.Namespace(**{**vars(args), "rows": 4096, "steps": 3})
        (root / "warm-up").mkdir()
        run(
            root / "warm-up", warmup, "fresh"
        )  # the optimizer's kernel loaded, torch warmed up: not in the first regime's figures
        shutil.rmtree(root / "warm-up")
        results = {}
        for name in ("fresh", "reopened", "large folios"):
            folder = root / name.replace(" ", "-")
            folder.mkdir()
            results[name] = run(folder, args, name)
            shutil.rmtree(folder)
            written, page_bytes, updated, seconds, flushing = results[name]
            print(
                f"{name:>12}: {written / 2**20:9,.0f} MiB written for {updated:,} row updates "
                f"({written / updated / 1024:7.1f} KiB per row; the rows' pages: {page_bytes / 2**20:,.0f} MiB), "
                f"{args.steps / seconds:.1f} steps/s, flush {flushing:.1f} s"
            )
        ratio = results["large folios"][0] / max(results["fresh"][0], 1)
        print(
            f"large folios / fresh: {ratio:.1f}x the bytes written  ({args.rows:,} x {args.dim} table, {args.steps} steps of {args.batch})"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
