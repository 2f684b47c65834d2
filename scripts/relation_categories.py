#!/usr/bin/env python
"""Filtered MRR by relation category (1-1, 1-N, N-1, N-N), as knowledge-graph papers report it.

A relation's category comes from its triples in every split (Bordes et al., NeurIPS 2013):
``tph`` is the mean number of tails per head, ``hpt`` the mean number of heads per tail;
"1" on a side when that mean is below 1.5, "N" otherwise (1-N: many tails per head). The
ranks are those `dsa-train eval RUN --save-ranks FILE` wrote; head and tail queries are
reported apart, since predicting the "N" side is the hard one.

    dsa-train eval runs/fb15k237-transe-... --save-ranks ranks.tsv
    DSA_DATA_ROOT=/path/to/datasets python scripts/relation_categories.py runs/fb15k237-transe-... ranks.tsv
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dsa_train.data import load_knowledge_graph
from dsa_train.recipe import load_recipe

CATEGORIES = ("1-1", "1-N", "N-1", "N-N")
THRESHOLD = 1.5


def categories(triples: np.ndarray, num_relations: int) -> np.ndarray:
    """Each relation's category index into :data:`CATEGORIES` (``triples``: ``(M, 3)`` ids)."""
    found = np.zeros(num_relations, dtype=np.int64)
    for r in range(num_relations):
        mine = triples[triples[:, 1] == r]
        if not len(mine):
            continue
        tph = len(np.unique(mine[:, [0, 2]], axis=0)) / len(np.unique(mine[:, 0]))
        hpt = len(np.unique(mine[:, [0, 2]], axis=0)) / len(np.unique(mine[:, 2]))
        found[r] = 2 * (hpt >= THRESHOLD) + (tph >= THRESHOLD)  # 0: 1-1, 1: 1-N, 2: N-1, 3: N-N
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run folder (its config.yaml names the dataset)")
    parser.add_argument("ranks", type=Path, help="the TSV `dsa-train eval --save-ranks` wrote")
    args = parser.parse_args()
    kg = load_knowledge_graph(load_recipe(args.run / "config.yaml").dataset)
    every = np.concatenate([kg.train.numpy(), kg.valid.numpy(), kg.test.numpy()]).astype(np.int64)
    kind = categories(every, kg.num_relations)
    rows = [line.split("\t") for line in args.ranks.read_text().splitlines()[1:]]
    side = np.array([r[0] for r in rows])
    relation = np.array([int(r[2]) for r in rows])
    rank = np.array([float(r[4]) for r in rows])
    table = {}
    print(f"{'category':<9} {'relations':>9} {'queries':>8} {'head MRR':>9} {'tail MRR':>9} {'MRR':>7}")
    for index, name in enumerate(CATEGORIES):
        mine = kind[relation] == index
        mrr = {
            s: float(np.mean(1 / rank[mine & (side == s)])) if (mine & (side == s)).any() else float("nan")
            for s in ("head", "tail")
        }
        both = float(np.mean(1 / rank[mine])) if mine.any() else float("nan")
        table[name] = {
            "relations": int((kind == index).sum()),
            "queries": int(mine.sum()),
            "head_mrr": mrr["head"],
            "tail_mrr": mrr["tail"],
            "mrr": both,
        }
        print(
            f"{name:<9} {table[name]['relations']:>9} {table[name]['queries']:>8} {mrr['head']:>9.4f} {mrr['tail']:>9.4f} {both:>7.4f}"
        )
    print(
        f"{'all':<9} {kg.num_relations:>9} {len(rank):>8} {np.mean(1 / rank[side == 'head']):>9.4f} {np.mean(1 / rank[side == 'tail']):>9.4f} {np.mean(1 / rank):>7.4f}"
    )
    print(json.dumps({"run": str(args.run), "categories": table}))


if __name__ == "__main__":
    main()
