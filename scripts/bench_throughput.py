#!/usr/bin/env python
"""Training throughput of one recipe with DiskSparseAdam and with torch's SparseAdam.

Both optimizers train their own copy of the recipe's model (same initialisation, same
batches, same negatives or walks), in one process, alternating step by step so that both see
the same machine; the figure is items (triples, nodes or edges) per second over whole
training steps (forward, backward and optimizer steps), median over the timed steps, and
its ratio. Works for every recipe: knowledge graphs, node2vec, GraphSAGE.

    python scripts/bench_throughput.py recipes/fb15k237-distmult.yaml --steps 200
    python scripts/bench_throughput.py recipes/cora-node2vec.yaml --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsa_train.recipe import load_recipe
from dsa_train.train.loop import Training
from dsa_train.train.run_folder import RunFolder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    args = parser.parse_args()

    trainings = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dsa", "sparse_adam"):
            recipe = load_recipe(args.recipe, [*args.overrides, f"optimizer.kind={kind}"])
            training = Training(recipe, RunFolder.create(recipe, Path(tmp) / kind))
            training.setup(resume=False)
            trainings[kind] = training
        items = trainings["dsa"].task.epoch_items()
        batch = recipe.train.batch_size
        order = torch.randperm(items, generator=torch.Generator().manual_seed(0))
        times = {kind: [] for kind in trainings}
        for i in range(args.warmup + args.steps):
            start = (i * batch) % max(items - batch, 1)
            picked = order[start : start + batch]
            kinds = list(trainings) if i % 2 == 0 else list(trainings)[::-1]
            for kind in kinds:
                began = time.perf_counter()
                trainings[kind].step(picked)
                if i >= args.warmup:
                    times[kind].append(time.perf_counter() - began)
        for training in trainings.values():
            training.close()
    rate = {kind: batch / statistics.median(t) for kind, t in times.items()}
    unit = trainings["dsa"].task.unit
    print(f"{args.recipe.name}: {items:,} {unit} per epoch, batch {batch}, dim {recipe.model.dim}, "
          f"{args.steps} timed steps, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for kind in trainings:
        print(f"  {kind:12s} {rate[kind]:10,.0f} {unit}/s   (median step {statistics.median(times[kind]) * 1e3:.1f} ms)")
    print(f"  dsa / sparse_adam throughput: {rate['dsa'] / rate['sparse_adam']:.2f}x")


if __name__ == "__main__":
    main()
