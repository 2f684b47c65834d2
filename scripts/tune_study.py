"""Tuned against shipped: for each graph, the shipped recipe trained once, then `dsa-train tune`
for a fixed wall time; prints the test MRR of both, the trials run and the wall time.

    python scripts/tune_study.py --data DIR --out DIR [--timeout 8m] [--graphs umls,nations,relations,sparse]

DIR of --data holds umls/ and nations/ (train/valid/test.txt). The generated graphs take the
shipped small-graph recipe (umls-transe.yaml: TransE, the settings that held across small
graphs) with their dataset swapped and 20 epochs (their training splits are 6-25x UMLS's).
Run it under `flock /work/heavy.lock` on a shared box: it trains for about 4 x (timeout + 2)
minutes. docs/tune.md keeps its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
GENERATED = {
    # many relations over few entities: every entity in many relations
    "relations": {
        "entities": 1000,
        "relations": 60,
        "triples": 30000,
        "valid": 1000,
        "test": 1000,
        "clusters": 20,
        "noise": 0.05,
        "zipf": 1.0,
        "seed": 1,
    },
    # a sparse long-tailed graph: many entities, few relations, strong popularity skew
    "sparse": {
        "entities": 8000,
        "relations": 3,
        "triples": 30000,
        "valid": 1000,
        "test": 1000,
        "clusters": 100,
        "noise": 0.1,
        "zipf": 1.5,
        "seed": 2,
    },
}


def recipe_for(graph: str, out: Path) -> Path:
    """The shipped recipe of a graph (UMLS, Nations), or the small-graph recipe on a generated one."""
    if graph in ("umls", "nations"):
        return RECIPES / f"{graph}-transe.yaml"
    data = yaml.safe_load((RECIPES / "umls-transe.yaml").read_text())
    data["name"] = f"{graph}-transe"
    data["dataset"] = {"kind": "synthetic", "synthetic": GENERATED[graph]}
    data["train"]["epochs"] = 20
    data["eval"]["every_epochs"] = 5
    path = out / f"{graph}-transe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def dsa_train(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dsa_train", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def test_mrr(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    finals = {
        r["split"]: r["both"]["mrr"] for r in records if r.get("kind") == "eval" and r["epoch"] == records[-1]["epochs"]
    }
    return finals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", default="8m")
    parser.add_argument("--graphs", default="umls,nations,relations,sparse")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["DSA_DATA_ROOT"] = str(args.data.resolve())
    print(
        "graph\tshipped valid MRR\tshipped test MRR\tshipped s\ttuned valid MRR\ttuned test MRR\ttrials (complete/pruned/failed)\ttune wall s",
        flush=True,
    )
    for graph in args.graphs.split(","):
        recipe = recipe_for(graph, args.out)
        shipped = args.out / f"{graph}-shipped"
        seconds = dsa_train("run", str(recipe), "-o", str(shipped))
        base = test_mrr(shipped)
        tune = args.out / f"{graph}-tune"
        wall = dsa_train("tune", str(recipe), "-o", str(tune), "--timeout", args.timeout)
        table = (tune / "trials.tsv").read_text().splitlines()[1:]
        states = [line.split("\t")[1] for line in table]
        best = json.loads((tune / "best-test.json").read_text())
        best_valid = max(float(line.split("\t")[2]) for line in table if line.split("\t")[1] == "COMPLETE")
        counts = "/".join(str(states.count(s)) for s in ("COMPLETE", "PRUNED", "FAIL"))
        print(
            f"{graph}\t{base['valid']:.4f}\t{base['test']:.4f}\t{seconds:.0f}\t{best_valid:.4f}\t{best['test']['both']['mrr']:.4f}\t{counts}\t{wall:.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
