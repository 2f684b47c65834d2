#!/usr/bin/env python
"""What partition order costs in quality: a recipe trained in random order and in partition
order, the same number of epochs and steps, and their test metrics side by side: a knowledge
graph's filtered MRR and Hits@10, node2vec's probe accuracy (and link-prediction MRR where
the graph holds edges out).

Both runs keep the table on disk (model.embedding_storage: disk) and start from the same
seed; the partitioned ones set train.order: partitioned with each --partitions and --buffer.
The target is the first metric within 0.01 of random order's. Runs go to a temporary folder
that is removed at the end, whatever happens.

    DSA_DATA_ROOT=/path/to/datasets python scripts/bench_partition_quality.py --recipe fb15k237-transe
    DSA_DATA_ROOT=/path/to/datasets python scripts/bench_partition_quality.py --recipe cora-node2vec
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


def scores(metrics: dict) -> dict[str, float]:
    """The figures compared, the headline first: a knowledge graph's MRR and Hits@10, a node
    embedding's probe accuracy and link-prediction MRR (whichever the graph has)."""
    if "both" in metrics:
        return {"MRR": metrics["both"]["mrr"], "Hits@10": metrics["both"]["hits_at_10"]}
    found = {"accuracy": metrics["probe"]["accuracy"]} if "probe" in metrics else {}
    return found | ({"link MRR": metrics["link"]["mrr"]} if "link" in metrics else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="fb15k237-transe", help="a recipe file or a shipped recipe's name")
    parser.add_argument("--partitions", default="4", help="comma-separated partition counts (default 4)")
    parser.add_argument("--buffer", type=int, default=2, help="partitions in memory (default 2)")
    parser.add_argument("--split", default="test", help="the split whose MRR is compared (one of eval.final_splits)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="recipe override key=value, for every run"
    )
    args = parser.parse_args()
    common = ["model.embedding_storage=disk", f"eval.final_splits=[{args.split}]", *args.overrides]
    configurations = [("random", [])] + [
        (
            f"partitioned P={p} C={min(args.buffer, int(p))}",
            ["train.order=partitioned", f"train.partitions={p}", f"train.buffer={min(args.buffer, int(p))}"],
        )
        for p in args.partitions.split(",")
    ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="dsa-partition-quality-") as tmp:
        for i, (name, extra) in enumerate(configurations):
            summary = run(args.recipe, Path(tmp) / f"run{i}", [*common, *extra])
            figures = scores(summary["final"][args.split])
            results[name] = {**figures, "steps": summary["step"], "seconds": summary["wall_seconds"]}
            shown = ", ".join(f"{k} {v:.4f}" for k, v in figures.items())
            print(
                f"{name}: {shown}, {summary['step']:,} steps, {summary['wall_seconds']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    names = list(scores(summary["final"][args.split]))
    headline, base = names[0], results["random"][names[0]]
    print(f"\n{args.recipe} ({', '.join(common)}), {args.split} split:")
    print(
        f"{'order':<28} "
        + " ".join(f"{n:>9}" for n in names)
        + f" {headline + ' - random':>18} {'steps':>7} {'wall':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:<28} "
            + " ".join(f"{r[n]:>9.4f}" for n in names)
            + f" {r[headline] - base:>+18.4f} {r['steps']:>7,} {r['seconds']:>6.0f}s"
        )
    worst = min(r[headline] - base for r in results.values())
    print(f"largest {headline} loss against random order: {-worst:.4f} (target <= 0.01)")
    print(json.dumps({"recipe": args.recipe, "overrides": common, "results": results}))


if __name__ == "__main__":
    main()
