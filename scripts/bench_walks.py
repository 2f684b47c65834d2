#!/usr/bin/env python
"""Walk-sampling throughput of the pure-torch sampler on a generated graph.

Imports the synthetic graph of a recipe (by default the 10M-node one; generated once under the
data root, ``$DSA_DATA_ROOT`` or ./datasets, and mapped from there), then times batches of
walks from random start nodes, uniform (p = q = 1, DeepWalk) and biased (node2vec's p and q,
rejection sampling), and prints walk steps per second.

    python scripts/bench_walks.py [--recipe recipes/synthetic-10m-node2vec.yaml] [--walks 100000] [--nodes N]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from dsa_train.data import load_graph
from dsa_train.data.walks import WalkSampler
from dsa_train.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipe",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "recipes" / "synthetic-10m-node2vec.yaml",
    )
    parser.add_argument("--walks", type=int, default=100_000, help="walks per timed batch")
    parser.add_argument("--length", type=int, default=20, help="steps per walk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=None, help="override the recipe's node count")
    args = parser.parse_args()
    dataset = load_recipe(args.recipe).dataset
    if args.nodes:
        dataset = dataclasses.replace(dataset, graph=dataclasses.replace(dataset.graph, nodes=args.nodes))
    started = time.perf_counter()
    graph = load_graph(dataset)
    print(
        f"{graph} (imported or opened in {time.perf_counter() - started:.1f} s); torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    generator = torch.Generator().manual_seed(0)
    for p, q in ((1.0, 1.0), (0.5, 2.0), (4.0, 0.25)):
        sampler = WalkSampler(graph.rowptr, graph.col, p=p, q=q, use_pyg_lib=False, max_degree=graph.max_degree)
        sampler.walks(torch.randint(0, graph.num_nodes, (1000,), generator=generator), 2)  # warms up
        times = []
        for _ in range(args.repeats):
            start = torch.randint(0, graph.num_nodes, (args.walks,), generator=generator)
            began = time.perf_counter()
            sampler.walks(start, args.length)
            times.append(time.perf_counter() - began)
        best = min(times)
        print(
            f"  p={p:<4} q={q:<4} {args.walks * args.length / best:14,.0f} walk steps/s   ({args.walks:,} walks of {args.length} in {best:.2f} s)"
        )


if __name__ == "__main__":
    main()
