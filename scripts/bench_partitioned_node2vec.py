#!/usr/bin/env python
"""node2vec in random and in partition order on a node table beyond RAM, in one run.

The recipe (default `recipes/synthetic-100m-node2vec-partitioned.yaml`: 10^8 nodes, a 38.4 GB
table of [w | m | v] records, P = 32 partitions, a buffer of C = 6) is built twice through
the tasks `dsa-train run` builds, on one table file under --dir (made once; --keep keeps it for
the next run, with its optimizer state):

1. random order: --random-steps steps of `batch_size` start nodes, from a cold page cache,
   the next batch's start rows prefetched (the walks are drawn inside the step, so the rest of
   their rows are page faults, as in `dsa-train run`);
2. partition order: from a cold cache, --pools pools of `train.pool_pairs` walk pairs each
   (every state of the buffer schedule, so every partition read and written back as an
   epoch reads them), the pool's walks drawn inside the steps as in `dsa-train run`.

A step of either order trains `batch_size x walks_per_node x windows x (context_size - 1)`
positive pairs (and `negatives` as many negative ones), so the figure both share is positive
pairs per second, every wait for the disk and every pool draw included. Prints each order's
pairs/s, seconds a step, the partitions read and written, and the ratio.

    python scripts/bench_partitioned_node2vec.py --dir /ssd/bench                   # 10^8 nodes
    python scripts/bench_partitioned_node2vec.py --dir /tmp/b --quick               # a check that it runs
    python scripts/bench_partitioned_node2vec.py --dir /ssd/bench --keep --set train.buffer=4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dsa_train.memory import PeakRssAnon
from dsa_train.recipe import load_recipe
from dsa_train.runs.optimizer_state import build_optimizer
from dsa_train.train.tables import TableSite
from dsa_train.train.tasks import make_task

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def row_file(task):
    """The node table's RowFile (under a SlotTable in partition order)."""
    table = task.model.embedding
    return (table.table if hasattr(table, "partitions") else table).table.rows


def train(recipe, folder: Path, steps: int | None, label: str) -> dict:
    """``steps`` steps (None: the partition order's first ``pools`` pools) from a cold cache."""
    torch.manual_seed(recipe.train.seed)
    task = make_task(recipe, torch.device("cpu"), TableSite(folder / "tables"))
    ((_, weight),) = task.sparse_parameters()  # one state for both orders' view of the one table
    optimizer = build_optimizer(recipe.optimizer, [("nodes", weight)], folder / "state")
    batch = recipe.train.batch_size
    c = recipe.model.node2vec
    pairs_per_step = batch * c.walks_per_node * (c.walk_length - c.context_size + 2) * (c.context_size - 1)
    order = task.epoch_order(1, task.epoch_items())
    rows = row_file(task)
    rows.evict()
    seconds, done, started = 0.0, 0, time.perf_counter()
    upcoming = order.slice(0, batch)
    while done < steps and len(upcoming):
        picked, upcoming = upcoming, order.slice((done + 1) * batch, (done + 2) * batch)
        if len(upcoming):
            task.prefetch(upcoming)
        step_started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(picked)
        loss.backward()
        optimizer.step()
        seconds += time.perf_counter() - step_started
        done += 1
        if done % 20 == 0:
            print(
                f"  {label}: {done}/{steps} steps, {done * pairs_per_step / seconds:,.0f} pairs/s",
                file=sys.stderr,
                flush=True,
            )
    buffer = task.buffer_summary() or {}
    task.close()
    optimizer.close()
    return {
        "steps": done,
        "seconds": seconds,
        "step_s": seconds / max(done, 1),
        "pairs_per_s": done * pairs_per_step / seconds,
        "wall_s": time.perf_counter() - started,
        "buffer": buffer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="folder on the disk to measure (the table goes there)")
    parser.add_argument("--recipe", type=Path, default=RECIPES / "synthetic-100m-node2vec-partitioned.yaml")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides (as dsa-train run --set)"
    )
    parser.add_argument("--random-steps", type=int, default=40, help="steps of random order")
    parser.add_argument("--pools", type=int, default=1, help="pools of partition order (each reads every partition)")
    parser.add_argument("--keep", action="store_true", help="keep the table and its optimizer state for the next run")
    parser.add_argument("--quick", action="store_true", help="20,000 nodes, P 4, C 2: a check that it all runs")
    args = parser.parse_args()
    quick = [
        "dataset.graph.nodes=20000",
        "train.partitions=4",
        "train.buffer=2",
        "train.pool_pairs=200000",
        "train.batch_size=256",
    ]
    overrides = (quick if args.quick else []) + args.set
    random_recipe = load_recipe(args.recipe, [*overrides, "train.order=random"])
    partitioned = load_recipe(args.recipe, [*overrides, "train.order=partitioned"])
    if args.quick:
        args.random_steps = 5
    args.dir.mkdir(parents=True, exist_ok=True)
    if not args.keep:
        shutil.rmtree(args.dir / "tables", ignore_errors=True)
        shutil.rmtree(args.dir / "state", ignore_errors=True)
    t = partitioned.train
    c = partitioned.model.node2vec
    per_start = c.walks_per_node * (c.walk_length - c.context_size + 2) * (c.context_size - 1)
    pool_starts = max(t.batch_size, t.pool_pairs // per_start)
    pool_steps = -(-pool_starts // t.batch_size)
    print(
        f"recipe {partitioned.name}: {partitioned.dataset.graph.nodes:,} nodes x {partitioned.model.dim}; P = {t.partitions}, C = {t.buffer}, "
        f"pools of {pool_starts * per_start:,} pairs ({pool_steps} steps of {t.batch_size} start nodes, {t.batch_size * per_start:,} pairs)"
    )
    results = {}
    with PeakRssAnon() as peak:
        results["random"] = train(random_recipe, args.dir, args.random_steps, "random")
        results["partitioned"] = train(partitioned, args.dir, pool_steps * args.pools, "partitioned")
    print(f"\n{'order':<12} {'steps':>6} {'s/step':>7} {'pairs/s':>10}")
    for name, r in results.items():
        print(f"{name:<12} {r['steps']:>6} {r['step_s']:>7.2f} {r['pairs_per_s']:>10,.0f}")
    ratio = results["partitioned"]["pairs_per_s"] / results["random"]["pairs_per_s"]
    b = results["partitioned"]["buffer"]
    print(
        f"partitioned / random: {ratio:.1f}x; partitioned read {b.get('read_bytes', 0) / 1e9:.1f} GB in {b.get('read_seconds', 0):.0f} s and "
        f"wrote {b.get('written_bytes', 0) / 1e9:.1f} GB in {b.get('write_seconds', 0):.0f} s on the buffer's thread, "
        f"waited {b.get('wait_seconds', 0):.1f} s; peak RssAnon {peak.peak / 2**20:,.0f} MiB"
    )
    print(
        json.dumps(
            {"recipe": partitioned.name, "results": results, "ratio": ratio, "peak_rss_anon_mib": peak.peak / 2**20}
        )
    )
    if not args.keep:
        shutil.rmtree(args.dir / "tables", ignore_errors=True)
        shutil.rmtree(args.dir / "state", ignore_errors=True)


if __name__ == "__main__":
    main()
