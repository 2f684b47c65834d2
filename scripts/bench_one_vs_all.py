#!/usr/bin/env python
"""What 1-vs-all training (train.candidates: all) does to DiskSparseAdam's advantage.

A knowledge-graph step with sampled candidates touches a few thousand entity rows, so
DiskSparseAdam reads and writes a few thousand records; with every entity a candidate, every
row gets a gradient and an update at every step, as it would with a dense optimizer. This
script trains the same generated graph (N entities x D, DistMult, batch B) in-process, each
configuration from the same seed:

    candidates  sampled | all
    optimizer   dsa (DiskSparseAdam, moments in a memory-mapped file) | sparse_adam (torch's, in RAM)

and prints, per configuration, seconds a step, distinct entity rows updated a step, and the
growth of anonymous memory from the optimizer's creation, after the last step (SparseAdam's
moments; DiskSparseAdam's stay on disk) and at its peak during the steps (sampled every 2 ms:
1-vs-all's 2B x N score matrices dominate it). A fifth configuration scores the entities in
chunks (train.entity_chunk, default N / 4), to show what chunking costs in time and saves
at the peak. The table is
in RAM (model.embedding_storage: memory) and the moments file in the page cache: the regime
where 1-vs-all is possible at all. Beyond RAM, a 1-vs-all step reads and writes every record
of the table, so it runs at the disk's sequential rate per step, whatever the order.

    python scripts/bench_one_vs_all.py                  # 50,000 x 128, batch 256, 20 steps
    python scripts/bench_one_vs_all.py --entities 14541 --steps 50    # FB15k-237's size
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dsa_train.memory import PeakRssAnon, rss_anon_bytes
from dsa_train.recipe import parse_recipe
from dsa_train.runs.optimizer_state import build_optimizer
from dsa_train.train.tasks import make_task

RECIPE = """\
name: one-vs-all
dataset:
  kind: synthetic
  root: {root}
  synthetic: {{entities: {entities}, relations: 50, triples: {triples}, valid: 100, test: 100, clusters: 100, seed: 0}}
model: {{kind: distmult, dim: {dim}, init_std: 0.05}}
train: {{batch_size: {batch}, negatives: 1024, candidates: {candidates}, entity_chunk: {chunk}}}
optimizer: {{kind: {optimizer}, lr: 0.01}}
"""


def measure(args, candidates: str, optimizer_kind: str, root: Path, chunk: int) -> dict:
    text = RECIPE.format(
        entities=args.entities,
        triples=10 * args.entities,
        dim=args.dim,
        batch=args.batch,
        candidates=candidates,
        chunk=chunk,
        optimizer=optimizer_kind,
        root=root / "data",
    )
    recipe = parse_recipe(text)
    torch.manual_seed(0)
    task = make_task(recipe, torch.device("cpu"))
    before = rss_anon_bytes()
    optimizer = build_optimizer(
        recipe.optimizer, task.sparse_parameters(), root / f"state-{candidates}-{optimizer_kind}-{chunk}"
    )
    times, rows = [], 0
    with PeakRssAnon() as sampler:
        for step in range(args.steps + 2):  # the first two steps warm up (the kernel, the moments' first pages)
            picked = torch.arange(step * args.batch, (step + 1) * args.batch)
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(picked)
            loss.backward()
            touched = task.model.node_emb.weight.grad.coalesce()._indices()[0].numel()
            optimizer.step()
            if step >= 2:
                times.append(time.perf_counter() - started)
                rows += touched
    state = rss_anon_bytes() - before
    if hasattr(optimizer, "close"):
        optimizer.close()
    return {
        "step_s": sum(times) / len(times),
        "rows_per_step": rows / len(times),
        "optimizer_anon_mib": max(state, 0) / 2**20,
        "peak_anon_mib": max(sampler.peak - before, 0) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=50_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256, help="triples per step (2 x batch queries)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--chunk", type=int, default=None, help="train.entity_chunk of the chunked 1-vs-all row (default: entities / 4)"
    )
    args = parser.parse_args()
    chunk = args.chunk or -(-args.entities // 4)
    configurations = [  # (name, candidates, optimizer, entity_chunk)
        ("sampled, dsa", "sampled", "dsa", args.entities),
        ("sampled, sparse_adam", "sampled", "sparse_adam", args.entities),
        ("all, dsa", "all", "dsa", args.entities),
        ("all, sparse_adam", "all", "sparse_adam", args.entities),
        (f"all in chunks of {chunk}, dsa", "all", "dsa", chunk),
    ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="dsa-one-vs-all-") as tmp:
        for name, candidates, optimizer, entity_chunk in configurations:
            results[name] = r = measure(args, candidates, optimizer, Path(tmp), entity_chunk)
            print(
                f"{name:<28} {r['step_s']:.3f} s/step, {r['rows_per_step']:,.0f} rows updated/step, "
                f"anonymous memory +{r['optimizer_anon_mib']:,.0f} MiB after the steps (moments in RAM), "
                f"+{r['peak_anon_mib']:,.0f} MiB at the peak (and the steps' scores)",
                flush=True,
            )
    for candidates in ("sampled", "all"):
        ratio = results[f"{candidates}, dsa"]["step_s"] / results[f"{candidates}, sparse_adam"]["step_s"]
        print(f"{candidates}: DiskSparseAdam's step / SparseAdam's = {ratio:.2f}")
    chunked = results[f"all in chunks of {chunk}, dsa"]
    print(
        f"chunks of {chunk}: step time {chunked['step_s'] / results['all, dsa']['step_s']:.2f}x one chunk's, "
        f"peak anonymous memory +{chunked['peak_anon_mib']:,.0f} MiB against +{results['all, dsa']['peak_anon_mib']:,.0f} MiB"
    )
    print(json.dumps({"entities": args.entities, "dim": args.dim, "batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
