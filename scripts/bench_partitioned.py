#!/usr/bin/env python
"""Partition-ordered training against random order on a table larger than RAM, in one run.

The table is bench_out_of_core.py's (N x D entities as [w | m | v] records, 50M x 64 = 38.4 GB
by default; --keep reuses it) and so are the steps: TransE, a batch of triples (head and tail
rows) plus shared negative rows, with DiskSparseAdam. Measured, each from a cold page cache:

1. the disk's sequential rates: a partition of the table read cold, and a scratch file written
   and fsynced, in 8 MiB requests;
2. random order: uniform rows over the whole table, without and with the prefetcher (--steps
   steps each, from a cold cache);
3. in memory: the same steps with every row they touch already in memory (uniform over the
   first C partitions, read in first), twice: in the page cache through the shared mapping
   (what random order gets from a table that fits in RAM; the rows faulted in by the
   prefetcher, so the cache holds single pages, as training leaves it), and held
   copy-on-write as partition order holds its buffer. Shared pages that steps dirty faster
   than the disk writes them back hit the kernel's dirty limits (vm.dirty_ratio) and
   throttle the steps;
4. partitioned order: P partitions, a buffer of C, the buffer states of
   dsa_train.data.partition_order.buffer_schedule from the start of an epoch (--states of them,
   the first of which loads C partitions with nothing to overlap). A state trains its
   buckets' share of the epoch's triples (--triples-per-entity x N triples an epoch, spread
   evenly over the P x P buckets: 1 is synthetic-100m's ratio, the sparsest shipped), rows and
   negatives uniform over the buffer; the PartitionBuffer reads the next state's partition
   while the state trains and writes back the one it drops. Its rate counts the steps and
   every wait for a partition.

Touched rows per second (distinct rows per step, summed, over the time of the steps and the
waits) for each, and the ratios the targets name: partitioned / random with prefetch (>= 5)
and partitioned / in memory (>= 0.5).

    python scripts/bench_partitioned.py --dir /ssd/bench                 # 50M x 64, P 16, C 4
    python scripts/bench_partitioned.py --dir /tmp/b --quick             # 1M x 32: a check that it runs
    python scripts/bench_partitioned.py --dir /ssd/bench --keep --partitions 32 --buffer 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from bench_out_of_core import GB, RELATIONS, choose_rows, make_batches, mem_total_bytes, train
from dsa_train import DiskEmbedding, DiskSparseAdam
from dsa_train.data.buckets import EntityPartitions
from dsa_train.data.partition_order import buffer_schedule
from dsa_train.memory import PeakRssAnon
from dsa_train.storage.buffer import PartitionBuffer
from dsa_train.optim.prefetch import Prefetcher

CHUNK = 8 << 20


def sequential_write_rate(directory: Path, size: int) -> float:
    """Bytes per second of writing ``size`` bytes to a new file in 8 MiB requests, fsync included."""
    path = directory / "sequential-write.probe"
    block = os.urandom(CHUNK)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for offset in range(0, size, CHUNK):
            os.pwrite(fd, block, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    return size / (time.perf_counter() - started)


def buffer_batches(layout: EntityPartitions, held, steps: int, batch: int, negatives: int, seed: int) -> list:
    """``steps`` batches whose heads, tails and negatives are uniform over the rows of the
    partitions ``held`` (the table's rows are its slots: the layout's permutation is not needed)."""
    g = torch.Generator().manual_seed(seed)
    held = torch.tensor(list(held))
    total = layout.count(held)

    def draw(n: int) -> torch.Tensor:
        return layout.spread(held, torch.randint(0, total, (n,), generator=g))

    return [
        (draw(batch), torch.randint(0, RELATIONS, (batch,), generator=g), draw(batch), draw(negatives))
        for _ in range(steps)
    ]


def partitioned(emb, relations, optimizer, args, rows: int) -> dict:
    """The first ``args.states`` buffer states of an epoch, each with its share of the triples."""
    layout = EntityPartitions(rows, args.partitions, seed=0)
    buffer = PartitionBuffer(emb.table.rows, [layout.span(p) for p in range(args.partitions)])
    schedule = buffer_schedule(args.partitions, args.buffer)[: args.states]
    per_bucket = args.triples_per_entity * rows / args.partitions**2
    steps_seconds = waits = touched = steps = 0.0
    for k, (held, buckets) in enumerate(schedule):
        started = time.perf_counter()
        buffer.hold(held)
        buffer.release(buffer.held - set(held))
        if k + 1 < len(schedule):
            buffer.prepare(schedule[k + 1][0])  # read ahead while this state trains
        wait = time.perf_counter() - started
        waits += wait
        count = max(1, round(len(buckets) * per_bucket / args.batch))
        result = train(
            emb, relations, optimizer, buffer_batches(layout, held, count, args.batch, args.negatives, seed=k), None
        )
        steps_seconds += result["steps"] * result["mean_step_s"]
        touched += result["rows_per_step"] * result["steps"]
        steps += result["steps"]
        print(
            f"  state {k + 1}/{len(schedule)}: {len(buckets)} buckets, {result['steps']:,} steps, "
            f"{result['rows_per_s']:,.0f} rows/s in its steps; waited {wait:.1f} s for partitions",
            file=sys.stderr,
            flush=True,
        )
    buffer.release(buffer.held)
    buffer.close()
    stats = buffer.stats
    return {
        "states": len(schedule),
        "steps": int(steps),
        "rows_per_step": touched / steps,
        "step_seconds": steps_seconds,
        "wait_seconds": waits,
        "rows_per_s": touched / (steps_seconds + waits),
        "partition_gb": layout.block * emb.table.spec.row_bytes / GB,
        "read_gb": stats["read_bytes"] / GB,
        "read_seconds": stats["read_seconds"],
        "released_gb": stats["written_bytes"] / GB,
        "write_back_seconds": stats["write_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="folder on the disk to measure (the table goes there)")
    parser.add_argument("--rows", type=int, default=50_000_000, help="entities (shrunk to what the disk holds)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--buffer", type=int, default=4, help="partitions in memory at once")
    parser.add_argument("--states", type=int, default=4, help="buffer states of the epoch to run (from its start)")
    parser.add_argument("--triples-per-entity", type=float, default=1.0, help="the epoch's triples over N")
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="steps of each random-order and in-memory configuration (enough to reach the kernel's dirty-page limits)",
    )
    parser.add_argument("--batch", type=int, default=1024, help="triples per step")
    parser.add_argument("--negatives", type=int, default=1024, help="shared negative entities per step")
    parser.add_argument("--io-threads", type=int, default=32, help="threads of the prefetcher")
    parser.add_argument("--spare-gb", type=float, default=8.0, help="disk space to leave free")
    parser.add_argument("--keep", action="store_true", help="keep the table for the next run (reused)")
    parser.add_argument("--quick", action="store_true", help="1M x 32, P 8, C 2: a check that it all runs")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.dim, args.steps, args.batch, args.negatives, args.partitions, args.buffer, args.states = (
            1_000_000,
            32,
            8,
            256,
            256,
            8,
            2,
            3,
        )
    args.dir.mkdir(parents=True, exist_ok=True)
    ram = mem_total_bytes()
    rows = choose_rows(args.rows, args.dim, args.dir, args.spare_gb * GB)
    table_bytes = 3 * 4 * rows * args.dim
    print(
        f"RAM {ram / GB:.1f} GB; table {rows:,} x {args.dim} = {table_bytes / GB:.1f} GB on disk = {table_bytes / ram:.2f}x RAM; "
        f"{args.partitions} partitions of {table_bytes / args.partitions / GB:.2f} GB, a buffer of {args.buffer}"
    )
    path, state = args.dir / "entities.table", args.dir / "state"
    if not args.keep:  # with --keep, the table and its optimizer state are reused together
        path.unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)
    started = time.perf_counter()
    emb = DiskEmbedding(rows, args.dim, path=path, std=0.01)
    print(f"table ready in {time.perf_counter() - started:.0f} s")
    layout = EntityPartitions(rows, args.partitions, seed=0)

    emb.table.rows.evict()
    started = time.perf_counter()
    read = emb.table.rows.read_rows(*layout.span(0))
    read_rate = read / (time.perf_counter() - started)
    write_rate = sequential_write_rate(args.dir, min(int(2 * GB), read))
    print(
        f"disk, sequential: read {read_rate / 1e6:,.0f} MB/s (a partition, cold), write {write_rate / 1e6:,.0f} MB/s (fsync included)"
    )

    relations = torch.nn.Embedding(RELATIONS, args.dim, sparse=True)
    torch.nn.init.normal_(relations.weight, std=0.01)
    optimizer = DiskSparseAdam([("entities", emb.weight), ("relations", relations.weight)], lr=1e-3, state_dir=state)
    results = {}
    with PeakRssAnon() as peak:
        for mode in ("no prefetch", "prefetch"):
            emb.table.rows.evict()
            prefetcher = Prefetcher(args.io_threads) if mode == "prefetch" else None
            batches = make_batches(rows, args.steps, args.batch, args.negatives, "uniform", seed=len(mode))
            results[f"random, {mode}"] = train(emb, relations, optimizer, batches, prefetcher)
            if prefetcher is not None:
                prefetcher.close()
        held = range(min(args.buffer, args.partitions))
        warm = [layout.span(p) for p in held]
        for name, hold in (("in the page cache", False), ("held in memory", True)):
            emb.table.rows.evict()
            if hold:
                for first, stop in warm:
                    emb.table.rows.hold_rows(first, stop)
            else:  # faulted in through the mapping, as training's own reads leave them: single pages
                filler = Prefetcher(args.io_threads)
                for first, stop in warm:
                    filler.submit(emb.table.rows, torch.arange(first, stop))
                filler.close()
            train(
                emb, relations, optimizer, buffer_batches(layout, held, 5, args.batch, args.negatives, seed=99), None
            )  # warm-up: torch's first calls
            results[name] = train(
                emb,
                relations,
                optimizer,
                buffer_batches(layout, held, args.steps, args.batch, args.negatives, seed=98),
                None,
            )
            if hold:
                for first, stop in warm:
                    emb.table.rows.drop_rows(first, stop)
        emb.table.rows.evict()
        results["partitioned"] = part = partitioned(emb, relations, optimizer, args, rows)
    optimizer.close()

    print(f"\n{'order':<22} {'steps':>6} {'rows/step':>9} {'rows/s':>10}")
    for name, r in results.items():
        print(f"{name:<22} {r['steps']:>6,} {r['rows_per_step']:>9,.0f} {r['rows_per_s']:>10,.0f}")
    vs_random = part["rows_per_s"] / results["random, prefetch"]["rows_per_s"]
    vs_cache = part["rows_per_s"] / results["in the page cache"]["rows_per_s"]
    vs_held = part["rows_per_s"] / results["held in memory"]["rows_per_s"]
    print(
        f"partitioned / random with prefetch: {vs_random:.1f}x (target >= 5); / in the page cache: {vs_cache:.2f}, "
        f"/ held in memory: {vs_held:.2f} (target >= 0.5)"
    )
    print(
        f"partitioned: {part['states']} states, {part['step_seconds']:.0f} s of steps, {part['wait_seconds']:.1f} s waiting for partitions; "
        f"read {part['read_gb']:.1f} GB in {part['read_seconds']:.0f} s, wrote back {part['released_gb']:.1f} GB in {part['write_back_seconds']:.0f} s "
        f"(on the buffer's thread, beside the steps)"
    )
    print(
        f"peak resident anonymous memory (RssAnon): {peak.peak / 2**20:,.0f} MiB: the buffer's {args.buffer} (+1 being read) partitions of {part['partition_gb']:.2f} GB, held in memory"
    )
    summary = {
        "rows": rows,
        "dim": args.dim,
        "table_gb": table_bytes / GB,
        "ram_gb": ram / GB,
        "partitions": args.partitions,
        "buffer": args.buffer,
        "triples_per_entity": args.triples_per_entity,
        "sequential_read_mb_s": read_rate / 1e6,
        "sequential_write_mb_s": write_rate / 1e6,
        "results": results,
        "partitioned_over_random_prefetch": vs_random,
        "partitioned_over_page_cache": vs_cache,
        "partitioned_over_held": vs_held,
        "peak_rss_anon_mib": peak.peak / 2**20,
    }
    print(json.dumps(summary))
    emb.table.close()
    if not args.keep:
        shutil.rmtree(state, ignore_errors=True)
        path.unlink()


if __name__ == "__main__":
    main()
