"""A KGE step's loss scored a slice of queries at a time (``train.query_chunk``) against all
queries at once: time of the loss's forward and backward pass, and its peak anonymous memory.

Each slice's gradient is taken as it is scored (``dsa_train/models/early_gradients.py``); the
reference is the same step with one slice (``query_chunk`` as large as the step), which is
the unsliced loss bit for bit. Times are medians over alternating repeats in one process
(the variants take turns, so a slow minute of the machine hits them alike); memory is the
growth of ``RssAnon`` during one step, each variant in a fresh process.

    python scripts/bench_query_chunk.py                          # TransE, DistMult, RotatE; ~3 min
    python scripts/bench_query_chunk.py --models transe --batch-size 2048 --negatives 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsa_train.memory import PeakRssAnon, rss_anon_bytes
from dsa_train.models.scoring import SCORING_FUNCTIONS
from dsa_train.recipe.schema import TrainConfig
from dsa_train.train.kge import SLICE_SCORES, query_chunk, sampled_loss

ENTITIES, RELATIONS = 200_000, 100


def make_step(kind: str, batch: int, negatives: int, dim: int):
    """A function that runs one step's loss forward and backward with a given slice size."""
    torch.manual_seed(0)
    model = SCORING_FUNCTIONS.get(kind)(ENTITIES, RELATIONS, dim)
    candidates = negatives + 2 * batch  # the step's answers join the negatives (batch_negatives)

    def step(chunk: int) -> None:
        g = torch.Generator().manual_seed(1)
        heads, tails, negs = (torch.randint(0, ENTITIES, (k,), generator=g) for k in (batch, batch, negatives))
        relations = torch.randint(0, RELATIONS, (2 * batch,), generator=g)
        rows = model.node_emb(torch.cat([heads, tails, tails, heads, negs]))
        anchors, answers = rows[: 2 * batch], rows[2 * batch : 4 * batch]
        shared = torch.cat([answers, rows[4 * batch :]])
        rel = model.rel_emb(relations)
        sides = [
            (anchors[:batch], rel[:batch], answers[:batch], "tail"),
            (anchors[batch:], rel[batch:], answers[batch:], "tail"),
        ]
        masked = torch.zeros(2 * batch, candidates, dtype=torch.bool)
        cfg = TrainConfig(loss="cross_entropy", margin=1.0, query_chunk=chunk)  # the recipe's section, every key
        sampled_loss(model, cfg, sides, shared, masked).backward()
        model.zero_grad(set_to_none=True)

    return step, candidates


def memory_of(kind: str, batch: int, negatives: int, dim: int, chunk: int) -> float:
    """MiB of RssAnon one step adds, measured in a fresh process."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_query_chunk as b; "
        f"print(b.peak_growth({kind!r}, {batch}, {negatives}, {dim}, {chunk}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def peak_growth(kind: str, batch: int, negatives: int, dim: int, chunk: int) -> float:
    step, _ = make_step(kind, batch, negatives, dim)
    before = rss_anon_bytes()
    with PeakRssAnon(interval=0.001) as peak:
        step(chunk)
    return (peak.peak - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="transe,distmult,rotate")
    parser.add_argument("--batch-size", type=int, default=2048, help="triples a step (2 x as many queries)")
    parser.add_argument("--negatives", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    queries = 2 * args.batch_size
    results = []
    for kind in args.models.split(","):
        step, candidates = make_step(kind, args.batch_size, args.negatives, args.dim)
        default = query_chunk(TrainConfig(), candidates)
        chunks = sorted({queries, 2048, 1024, default, max(1, default // 2), 128} - {0}, reverse=True)
        chunks = [c for c in chunks if c <= queries]
        times: dict[int, list[float]] = {c: [] for c in chunks}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            for c in chunks:
                started = time.perf_counter()
                step(c)
                times[c].append(time.perf_counter() - started)
        whole = statistics.median(times[queries][1:])
        print(
            f"{kind}: {queries:,} queries x {candidates:,} candidates, dim {args.dim}; "
            f"default slice {default:,} queries ({SLICE_SCORES:,} scores)"
        )
        for c in chunks:
            median = statistics.median(times[c][1:])
            mib = memory_of(kind, args.batch_size, args.negatives, args.dim, c)
            label = "all at once" if c == queries else f"{c:,} at a time" + (" (default)" if c == default else "")
            print(f"  {label:>24}: {median * 1000:7.0f} ms  {median / whole:5.2f}x   peak +{mib:7,.0f} MiB")
            results.append({"model": kind, "chunk": c, "ms": median * 1000, "ratio": median / whole, "peak_mib": mib})
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
