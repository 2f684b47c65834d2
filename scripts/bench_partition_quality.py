#!/usr/bin/env python
"""What partition order costs in quality: a recipe trained in random order and in partition
order, the same number of epochs and steps, and their filtered test MRR side by side.

Both runs keep the entity table on disk (model.embedding_storage: disk) and start from the
same seed; the partitioned ones set train.order: partitioned with each --partitions and
--buffer. The target is an MRR within 0.01 of random order's. Runs go to a temporary folder
that is removed at the end, whatever happens.

    DSA_DATA_ROOT=/path/to/datasets python scripts/bench_partition_quality.py --recipe fb15k237-transe
    python scripts/bench_partition_quality.py --recipe quickstart --partitions 2,4,8 --buffer 2
    python scripts/bench_partition_quality.py --recipe umls-transe --set train.epochs=50
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(recipe: str, folder: Path, overrides: list[str]) -> dict:
    """Train ``recipe`` into ``folder``; its summary record (final metrics, seconds)."""
    command = [sys.executable, "-m", "dsa_train", "run", recipe, "-o", str(folder)]
    for override in overrides:
        command += ["--set", override]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["kind"] == "summary")
    summary["wall_seconds"] = time.perf_counter() - started
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="fb15k237-transe", help="a recipe file or a shipped recipe's name")
    parser.add_argument("--partitions", default="4", help="comma-separated partition counts (default 4)")
    parser.add_argument("--buffer", type=int, default=2, help="partitions in memory (default 2)")
    parser.add_argument("--split", default="test", help="the split whose MRR is compared (one of eval.final_splits)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value, for every run")
    args = parser.parse_args()
    common = ["model.embedding_storage=disk", f"eval.final_splits=[{args.split}]", *args.overrides]
    configurations = [("random", [])] + [
        (f"partitioned P={p} C={min(args.buffer, int(p))}", ["train.order=partitioned", f"train.partitions={p}", f"train.buffer={min(args.buffer, int(p))}"])
        for p in args.partitions.split(",")
    ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="dsa-partition-quality-") as tmp:
        for i, (name, extra) in enumerate(configurations):
            summary = run(args.recipe, Path(tmp) / f"run{i}", [*common, *extra])
            metrics = summary["final"][args.split]["both"]
            results[name] = {"mrr": metrics["mrr"], "hits_at_10": metrics["hits_at_10"], "steps": summary["step"], "seconds": summary["wall_seconds"]}
            print(f"{name}: MRR {metrics['mrr']:.4f}, Hits@10 {metrics['hits_at_10']:.4f}, {summary['step']:,} steps, {summary['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
    base = results["random"]["mrr"]
    print(f"\n{args.recipe} ({', '.join(common)}), {args.split} split:")
    print(f"{'order':<28} {'MRR':>7} {'Hits@10':>8} {'MRR - random':>13} {'steps':>7} {'wall':>7}")
    for name, r in results.items():
        print(f"{name:<28} {r['mrr']:>7.4f} {r['hits_at_10']:>8.4f} {r['mrr'] - base:>+13.4f} {r['steps']:>7,} {r['seconds']:>6.0f}s")
    worst = min(r["mrr"] - base for r in results.values())
    print(f"largest MRR loss against random order: {-worst:.4f} (target <= 0.01)")
    print(json.dumps({"recipe": args.recipe, "overrides": common, "results": results}))


if __name__ == "__main__":
    main()
