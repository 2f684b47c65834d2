#!/usr/bin/env python
"""Which TransE settings hold across small knowledge graphs nobody tuned them for.

Trains ``recipes/umls-transe.yaml`` from the settings the study started with (``STUDY_BASE``)
and with each variant of them (one change at a time, then combinations) on UMLS and Nations
(TSV folders under ``--root``) and on generated graphs of other shapes, each run a fresh
``dsa-train run`` process, and prints every variant's filtered
test MRR per graph, its mean over the graphs and its worst ratio to the best variant of each
graph: settings that are good everywhere, not best on one, have a high worst ratio.

    python scripts/transe_defaults.py --root ../shared/datasets
    python scripts/transe_defaults.py --root ../shared/datasets --variants base,L1 --graphs umls,nations
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "recipes" / "umls-transe.yaml"

#: graph -> the --set overrides that make the base recipe train on it
GRAPHS = {
    "umls": ["dataset.kind=tsv", "dataset.path=umls"],
    "nations": ["dataset.kind=tsv", "dataset.path=nations"],
    # generated: a dense one the size of UMLS, and a sparser one with more entities
    "gen-dense": [
        "dataset.kind=synthetic",
        "dataset.synthetic.entities=300",
        "dataset.synthetic.relations=12",
        "dataset.synthetic.triples=8000",
        "dataset.synthetic.valid=500",
        "dataset.synthetic.test=500",
        "dataset.synthetic.clusters=12",
        "dataset.synthetic.seed=1",
    ],
    "gen-sparse": [
        "dataset.kind=synthetic",
        "dataset.synthetic.entities=3000",
        "dataset.synthetic.relations=30",
        "dataset.synthetic.triples=15000",
        "dataset.synthetic.valid=600",
        "dataset.synthetic.test=600",
        "dataset.synthetic.clusters=40",
        "dataset.synthetic.seed=2",
    ],
}

#: what every variant starts from: umls-transe as the study found it (L2 distance,
#: cross-entropy, dropout 0.1, dim 128, init 0.1, lr 0.003, entities unconstrained), pinned so
#: that the variants keep their meaning now that the recipe ships the winner, "unit entities+lr 0.01"
STUDY_BASE = [
    "model.p_norm=2",
    "train.loss=cross_entropy",
    "model.dropout=0.1",
    "model.dim=128",
    "model.init_std=0.1",
    "optimizer.lr=0.003",
    "model.normalize_entities=false",
]

#: variant -> its --set overrides on top of STUDY_BASE
VARIANTS = {
    "base": [],
    "L1": ["model.p_norm=1"],
    "no dropout": ["model.dropout=0"],
    "lr 0.01": ["optimizer.lr=0.01"],
    "dim 50": ["model.dim=50"],
    "init 0.01": ["model.init_std=0.01"],
    "softplus": ["train.loss=softplus"],
    "margin+L1 (TransE paper)": ["train.loss=margin", "train.margin=1", "model.p_norm=1"],
    "L1+lr 0.01": ["model.p_norm=1", "optimizer.lr=0.01"],
    "L1+no dropout": ["model.p_norm=1", "model.dropout=0"],
    "unit entities": ["model.normalize_entities=true"],
    "unit entities+L1": ["model.normalize_entities=true", "model.p_norm=1"],
    "unit entities+margin+L1 (TransE paper)": [
        "model.normalize_entities=true",
        "train.loss=margin",
        "train.margin=1",
        "model.p_norm=1",
    ],
    "unit entities+dim 50": ["model.normalize_entities=true", "model.dim=50"],
    "unit entities+lr 0.01": ["model.normalize_entities=true", "optimizer.lr=0.01"],
    "unit entities+lr 0.01+no dropout": ["model.normalize_entities=true", "optimizer.lr=0.01", "model.dropout=0"],
    "unit entities+L1+lr 0.01": ["model.normalize_entities=true", "model.p_norm=1", "optimizer.lr=0.01"],
}

COMMON = ["eval.every_epochs=0", "eval.final_splits=[test]", "train.checkpoint_every=0", "train.final_checkpoint=false"]


def test_mrr(graph: str, variant: str, root: Path, extra: list[str]) -> float:
    """Train the base recipe on ``graph`` with ``variant`` in a fresh process; its test MRR."""
    with tempfile.TemporaryDirectory(prefix="transe-defaults-") as tmp:
        sets = [*GRAPHS[graph], *STUDY_BASE, *VARIANTS[variant], *COMMON, f"dataset.root={root}", *extra]
        command = [sys.executable, "-m", "dsa_train", "run", str(BASE), "-o", f"{tmp}/run"]
        for s in sets:
            command += ["--set", s]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{graph} / {variant} failed:\n{done.stderr[-2000:]}")
        for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "summary":
                test = record["final"]["test"]
                return (test["head"]["mrr"] + test["tail"]["mrr"]) / 2
    raise SystemExit(f"{graph} / {variant}: no summary record")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        required=True,
        help="data root holding umls/ and nations/ (a writable copy: it imports there)",
    )
    parser.add_argument("--graphs", default=",".join(GRAPHS), help="comma-separated, of: " + ", ".join(GRAPHS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        help="a further override for every run (e.g. train.epochs=2)",
    )
    args = parser.parse_args()
    graphs, variants = args.graphs.split(","), args.variants.split(",")
    unknown = [g for g in graphs if g not in GRAPHS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown graph or variant: {', '.join(unknown)}")
    mrr = {v: {} for v in variants}
    for graph in graphs:
        for variant in variants:
            mrr[variant][graph] = test_mrr(graph, variant, args.root.resolve(), args.extra)
            print(f"{graph:>10}  {variant:<28} test MRR {mrr[variant][graph]:.4f}", flush=True)
    best = {g: max(mrr[v][g] for v in variants) for g in graphs}
    print(f"\n| variant | {' | '.join(graphs)} | mean | worst / best |\n|---|{'---|' * (len(graphs) + 2)}")
    for v in sorted(variants, key=lambda v: -min(mrr[v][g] / best[g] for g in graphs)):
        cells = " | ".join(f"{mrr[v][g]:.4f}" for g in graphs)
        mean = sum(mrr[v].values()) / len(graphs)
        print(f"| {v} | {cells} | {mean:.4f} | {min(mrr[v][g] / best[g] for g in graphs):.3f} |")


if __name__ == "__main__":
    main()
