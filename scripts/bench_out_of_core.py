#!/usr/bin/env python
"""Train a knowledge-graph entity table larger than RAM, and measure it against the disk.

One run, on the disk under --dir (put it on the SSD you will train from):

1. Size: N x D entities as a DiskEmbedding table of [w | m | v] records (3 x 4 x N x D bytes).
   The default 50M x 64 is 38.4 GB; if the disk has less room, N shrinks and it says so.
   torch.optim.SparseAdam would need the same 3 x 4 x N x D bytes in RAM (weights, exp_avg,
   exp_avg_sq): the script compares that with MemTotal instead of trying (it would be killed).
2. Disk: this disk's random-read rate, 4 KiB reads with O_DIRECT (no page cache) from
   --io-threads threads at once, and at queue depth 1.
3. Page-in: the same number of cold rows read (a) by the mapping's own page faults from one
   thread (what a step without prefetch does), (b) by page faults from a thread pool (what
   DiskSparseAdam's prefetcher does), and (c) by explicit preads from a thread pool.
4. Training: TransE-style steps (a batch of triples, each head and tail a row, plus shared
   negative rows) with DiskSparseAdam, for uniform and power-law (Zipf 1) entity access,
   each without and with prefetch of the next batch, from a cold page cache. Reports
   touched rows per second, step time, the ratio with/without prefetch (target <= 0.6), the
   rows/s as a fraction of the disk's random-read rate (target >= 0.5), and the peak
   resident anonymous memory of the process (target < 2 GB).

    python scripts/bench_out_of_core.py --dir /ssd/bench              # 50M x 64 (38 GB of disk)
    python scripts/bench_out_of_core.py --dir /tmp/b --quick          # 1M x 32, a minute
    python scripts/bench_out_of_core.py --dir /ssd/bench --keep       # reuse the table next time
    python scripts/bench_out_of_core.py --dir /ssd/b --rows 10000000 --dim 128 --device cuda   # VRAM vs N
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from dsa_train import DiskEmbedding, DiskSparseAdam
from dsa_train.data.synthetic import power_law_ids
from dsa_train.memory import PeakRssAnon
from dsa_train.storage.format import HEADER_BYTES
from dsa_train.optim.prefetch import Prefetcher

GB = 1e9
PAGE = 4096
RELATIONS = 1000


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def choose_rows(wanted: int, dim: int, directory: Path, spare: float) -> int:
    free = shutil.disk_usage(directory).free
    record = 3 * dim * 4
    existing = directory / "entities.table"
    if existing.exists():
        free += existing.stat().st_size
    fits = int((free - spare) // record)
    return max(1, min(wanted, fits))


def direct_io_supported(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:  # tmpfs and some others: no O_DIRECT
        return False


def disk_random_reads(path: Path, threads: int, seconds: float) -> float:
    """4 KiB O_DIRECT reads per second at random page offsets of ``path``, ``threads`` at once
    (buffered reads of an evicted file where the file system has no O_DIRECT)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct_io_supported(path) else 0)
    size = path.stat().st_size
    pages = size // PAGE
    deadline = time.perf_counter() + seconds
    counts = [0] * threads

    def reader(index: int) -> None:
        fd = os.open(path, flags)
        buffer = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT wants
        rng = random.Random(index)
        try:
            while time.perf_counter() < deadline:
                for _ in range(32):
                    os.preadv(fd, [buffer], rng.randrange(pages) * PAGE)
                counts[index] += 32
        finally:
            os.close(fd)
            buffer.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(reader, range(threads)))
    return sum(counts) / (time.perf_counter() - started)


def page_in_rates(emb: DiskEmbedding, rows: int, threads: int, seed: int) -> dict[str, float]:
    """Cold rows per second read three ways (see the module docstring), each from a cold cache."""
    table = emb.table
    generator = torch.Generator().manual_seed(seed)
    results = {}

    def fault(chunk: torch.Tensor) -> None:
        table.rows.records.index_select(0, chunk)

    for name in ("mmap, 1 thread", f"mmap, {threads} threads", f"pread, {threads} threads"):
        table.rows.evict()
        picked = torch.randint(0, emb.num_embeddings, (rows,), generator=generator).sort().values
        started = time.perf_counter()
        if name.startswith("mmap, 1 "):
            torch.set_num_threads(1)
            for chunk in picked.split(256):
                fault(chunk)
            torch.set_num_threads(os.cpu_count() or 1)
        elif name.startswith("mmap"):
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fault, [picked[i::threads] for i in range(threads)]))
        else:
            offsets = (HEADER_BYTES + picked * table.spec.row_bytes).tolist()
            with ThreadPoolExecutor(threads) as pool:
                list(
                    pool.map(
                        lambda share: pread_records(table.rows.fd, share, table.spec.row_bytes),
                        [offsets[i::threads] for i in range(threads)],
                    )
                )
        results[name] = rows / (time.perf_counter() - started)
    return results


def pread_records(fd: int, offsets: list[int], length: int) -> None:
    """The alternative to page faults: explicit preads of each record into a scratch buffer."""
    buffer = bytearray(length)
    for offset in offsets:
        os.preadv(fd, [buffer], offset)


def make_batches(num_rows, steps, batch, negatives, access, seed):
    g = torch.Generator().manual_seed(seed)
    draw = (
        (lambda n: torch.randint(0, num_rows, (n,), generator=g))
        if access == "uniform"
        else (lambda n: power_law_ids(num_rows, n, g, 1.0))
    )
    return [
        (
            draw(batch),
            torch.randint(0, RELATIONS, (batch,), generator=g),
            draw(batch),
            torch.randint(0, num_rows, (negatives,), generator=g),
        )
        for _ in range(steps)
    ]


def train(emb, relations, optimizer, batches, prefetcher: Prefetcher | None) -> dict:
    """TransE steps (cross-entropy of each tail query's answer against the shared negatives)."""
    times, touched = [], 0
    for i, (heads, rels, tails, negatives) in enumerate(batches):
        if prefetcher is not None and i + 1 < len(batches):
            h, _, t, n = batches[i + 1]
            prefetcher.submit(emb.table.rows, torch.cat([h, t, n]))
        started = time.perf_counter()
        rows = torch.cat([heads, tails, negatives])
        unique, inverse = torch.unique(rows, return_inverse=True)
        device = emb.output_device
        vectors = emb(unique)[inverse.to(device)]
        h, t, n = vectors.split([len(heads), len(tails), len(negatives)])
        query = h + relations(rels.to(device))
        positive = -(query - t).norm(dim=1, keepdim=True)
        negative = -torch.cdist(query, n)
        loss = F.cross_entropy(
            torch.cat([positive, negative], 1), torch.zeros(len(heads), dtype=torch.long, device=device)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        touched += len(unique)
    if prefetcher is not None:
        prefetcher.wait()
    seconds = sum(times)
    return {
        "steps": len(times),
        "median_step_s": statistics.median(times),
        "mean_step_s": seconds / len(times),
        "rows_per_step": touched / len(times),
        "rows_per_s": touched / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="folder on the disk to measure (the table goes there)")
    parser.add_argument("--rows", type=int, default=50_000_000, help="entities (shrunk to what the disk holds)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="training steps per configuration")
    parser.add_argument("--batch", type=int, default=1024, help="triples per step")
    parser.add_argument("--negatives", type=int, default=1024, help="shared negative entities per step")
    parser.add_argument("--io-threads", type=int, default=32, help="threads for the disk probe and the prefetcher")
    parser.add_argument("--disk-seconds", type=float, default=8.0, help="length of each disk probe")
    parser.add_argument("--spare-gb", type=float, default=8.0, help="disk space to leave free")
    parser.add_argument("--keep", action="store_true", help="keep the table and its state for the next run (reused)")
    parser.add_argument("--quick", action="store_true", help="1M x 32, 8 steps: a check that it all runs")
    parser.add_argument("--device", default="cpu", help="where the model computes (cuda: reports the VRAM peak too)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.dim, args.steps, args.disk_seconds, args.batch, args.negatives = 1_000_000, 32, 8, 1.0, 256, 256
    args.dir.mkdir(parents=True, exist_ok=True)
    ram = mem_total_bytes()
    rows = choose_rows(args.rows, args.dim, args.dir, args.spare_gb * GB)
    table_bytes = 3 * 4 * rows * args.dim
    print(f"RAM {ram / GB:.1f} GB; disk free at {args.dir}: {shutil.disk_usage(args.dir).free / GB:.1f} GB")
    if rows < args.rows:
        print(f"the disk holds {rows:,} x {args.dim} rows, not {args.rows:,} (keeping {args.spare_gb:.0f} GB free)")
    print(
        f"table {rows:,} x {args.dim}: weights and moments {table_bytes / GB:.1f} GB on disk = "
        f"{table_bytes / ram:.2f}x RAM; torch.optim.SparseAdam would need the same {table_bytes / GB:.1f} GB "
        f"in RAM{' (more than this machine has: it cannot allocate)' if table_bytes > ram else ''}"
    )

    path, state = args.dir / "entities.table", args.dir / "state"
    if not args.keep:  # with --keep, the table and its optimizer state are reused together
        path.unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)
    started, last = time.perf_counter(), [0.0]

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 15 or done == total:
            last[0] = time.perf_counter()
            print(f"  writing the table: {done / total:6.1%}", file=sys.stderr, flush=True)

    reused = path.exists()
    emb = DiskEmbedding(rows, args.dim, path=path, std=0.01, progress=progress)
    seconds = time.perf_counter() - started
    if not reused:
        print(f"created in {seconds:.0f} s ({table_bytes / seconds / 1e6:.0f} MB/s, chunked: never N x D in memory)")
    emb.table.rows.evict()

    rate_parallel = disk_random_reads(path, args.io_threads, args.disk_seconds)
    rate_serial = disk_random_reads(path, 1, args.disk_seconds)
    how = "O_DIRECT" if direct_io_supported(path) else "no O_DIRECT on this file system: buffered, cache evicted"
    print(
        f"disk random 4 KiB reads ({how}): {rate_parallel:,.0f}/s with {args.io_threads} threads, {rate_serial:,.0f}/s at depth 1"
    )

    page_in = page_in_rates(emb, 4 * args.batch * 4, args.io_threads, seed=1)
    print("cold rows paged in: " + ", ".join(f"{name} {rate:,.0f}/s" for name, rate in page_in.items()))

    emb.to(args.device)
    relations = torch.nn.Embedding(RELATIONS, args.dim, sparse=True).to(args.device)
    torch.nn.init.normal_(relations.weight, std=0.01)
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    optimizer = DiskSparseAdam([("entities", emb.weight), ("relations", relations.weight)], lr=1e-3, state_dir=state)
    results = {}
    with PeakRssAnon() as peak:
        for access in ("uniform", "power-law"):
            for mode in ("no prefetch", "prefetch"):
                emb.table.rows.evict()
                batches = make_batches(
                    rows, args.steps, args.batch, args.negatives, access, seed=hash((access, mode)) % 1000
                )
                prefetcher = Prefetcher(args.io_threads) if mode == "prefetch" else None
                results[(access, mode)] = train(emb, relations, optimizer, batches, prefetcher)
                if prefetcher is not None:
                    prefetcher.close()
    optimizer.close()

    print(f"\n{'access':<10} {'mode':<12} {'rows/step':>9} {'step (median)':>14} {'rows/s':>9} {'of disk':>8}")
    for (access, mode), r in results.items():
        print(
            f"{access:<10} {mode:<12} {r['rows_per_step']:>9,.0f} {r['median_step_s'] * 1000:>11,.0f} ms "
            f"{r['rows_per_s']:>9,.0f} {r['rows_per_s'] / rate_parallel:>8.2f}"
        )
    for access in ("uniform", "power-law"):
        ratio = results[(access, "prefetch")]["mean_step_s"] / results[(access, "no prefetch")]["mean_step_s"]
        print(f"{access}: step time with prefetch / without = {ratio:.2f} (target <= 0.6)")
    print(f"peak resident anonymous memory (RssAnon): {peak.peak / 2**20:,.0f} MiB (target < 2,048 MiB)")
    vram = torch.cuda.max_memory_allocated() if cuda else None
    if cuda:
        print(
            f"GPU memory peak (torch.cuda.max_memory_allocated): {vram / 2**20:,.0f} MiB; SparseAdam with the "
            f"table on the GPU needs 3 x 4 x N x D = {table_bytes / 2**20:,.0f} MiB"
        )
    summary = {
        "rows": rows,
        "dim": args.dim,
        "table_gb": table_bytes / GB,
        "ram_gb": ram / GB,
        "disk_reads_per_s": rate_parallel,
        "disk_reads_per_s_depth1": rate_serial,
        "page_in_rows_per_s": page_in,
        "train": {f"{a}/{m}": r for (a, m), r in results.items()},
        "peak_rss_anon_mib": peak.peak / 2**20,
        "cuda_max_memory_allocated_mib": vram / 2**20 if cuda else None,
    }
    print(json.dumps(summary))
    emb.table.close()
    if not args.keep:
        shutil.rmtree(state, ignore_errors=True)
        path.unlink()


if __name__ == "__main__":
    main()
