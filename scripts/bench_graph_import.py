#!/usr/bin/env python
"""Time and memory of the out-of-core graph: generating it, then node2vec steps reading it.

Uses the graph settings of a recipe (default recipes/synthetic-100m-node2vec.yaml: a
degree-corrected SBM, 100 communities, 4 edges per node asked) at --nodes nodes. Each phase
runs in a fresh process that reports its wall time, its peak RSS (VmHWM: anonymous and
file pages, so the mapped CSR counts) and its peak anonymous RSS (RssAnon sampled every 2 ms
by dsa_train.memory.PeakRssAnon), each also as the rise over the process's start (torch):

1. generate: import the graph under --dir (the CSR written out of core);
2. steps: --steps node2vec batches of the recipe's sizes (walks from batch_size start nodes,
   their windows and the negative windows: what Node2VecTask.loss draws before the table),
   then the evaluation's node sample (probe nodes and their labels);
3. with --run: the recipe itself, end to end (`dsa-train run`, --run-steps steps, its disk
   table created under --dir and removed after, final evaluation; no checkpoints: see
   scripts/bench_checkpoint.py), on the graph imported in phase 1.

    python scripts/bench_graph_import.py                         # 10^7 nodes (~1 min)
    python scripts/bench_graph_import.py --nodes 100000000       # the recipe's 10^8 (~10 min)
    python scripts/bench_graph_import.py --nodes 1000000 --run   # plus a whole run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "synthetic-100m-node2vec.yaml"
MiB = 2**20


def child(phase: str, recipe: Path, nodes: int, root: Path, steps: int, run_steps: int) -> None:
    """One phase, in this process; prints one JSON line."""

    import torch

    from dsa_train.data import load_graph
    from dsa_train.memory import PeakRssAnon, peak_rss_bytes, rss_anon_bytes
    from dsa_train.recipe import load_recipe

    config = load_recipe(recipe, [f"dataset.graph.nodes={nodes}", f"dataset.root={root}"])
    base_anon, base_hwm = rss_anon_bytes(), peak_rss_bytes()
    result: dict = {}
    started = time.perf_counter()
    with PeakRssAnon() as anon:
        if phase == "generate":
            graph = load_graph(config.dataset)
            result["graph"] = str(graph)
            result["disk_mib"] = round(sum(p.stat().st_size for p in graph.dataset.folder.iterdir()) / MiB, 1)
        elif phase == "steps":
            from dsa_train.data.walks import WalkSampler
            from dsa_train.models.node import windows
            from dsa_train.train.node2vec import _sampled

            graph = load_graph(config.dataset)
            c, batch = config.model.node2vec, config.train.batch_size
            sampler = WalkSampler(graph.rowptr, graph.col, p=c.p, q=c.q, max_degree=graph.max_degree)
            torch.manual_seed(0)
            for _ in range(steps):
                picked = torch.randint(0, graph.num_nodes, (batch,))
                positive = windows(sampler.walks(picked.repeat(c.walks_per_node), c.walk_length), c.context_size)
                starts = picked.repeat(c.walks_per_node * c.negatives)
                negative = windows(
                    torch.cat([starts[:, None], torch.randint(0, graph.num_nodes, (len(starts), c.walk_length))], 1),
                    c.context_size,
                )
                result["windows"] = len(positive) + len(negative)
            result["steps_seconds"] = round(time.perf_counter() - started, 2)
            began = time.perf_counter()
            nodes = torch.cat([_sampled(graph.nodes("train"), 0), _sampled(graph.nodes("test"), 1)]).unique()
            result["probe_nodes"], result["labels_read"] = (
                len(nodes),
                int(graph.labels[nodes].long().bincount().count_nonzero()),
            )
            result["eval_sample_seconds"] = round(time.perf_counter() - began, 2)
        else:
            from dsa_train.cli.app import app

            out = root / "run"
            args = [
                "run",
                str(recipe),
                "--output",
                str(out),
                "--set",
                f"dataset.graph.nodes={nodes}",
                "--set",
                f"dataset.root={root}",
                "--set",
                f"train.max_steps={run_steps}",
                "--set",
                f"train.log_every={max(1, run_steps // 2)}",
                "--set",
                "train.checkpoint_every=0",
                "--set",
                "train.final_checkpoint=false",
            ]
            try:
                app(args, standalone_mode=False)
            finally:
                shutil.rmtree(out, ignore_errors=True)
    result.update(
        seconds=round(time.perf_counter() - started, 2),
        peak_rss_anon_mib=round(anon.peak / MiB, 1),
        rise_rss_anon_mib=round((anon.peak - base_anon) / MiB, 1),
        vm_hwm_mib=round(peak_rss_bytes() / MiB, 1),
        start_vm_hwm_mib=round(base_hwm / MiB, 1),
    )
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000_000)
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="whose dataset.graph and node2vec sizes to use")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="data root for the graph, kept there (default: a temporary folder, removed)",
    )
    parser.add_argument("--steps", type=int, default=20, help="node2vec batches in phase 2")
    parser.add_argument("--run", action="store_true", help="also run the recipe end to end (phase 3)")
    parser.add_argument("--run-steps", type=int, default=20)
    parser.add_argument("--child", choices=["generate", "steps", "run"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-graph-"))
    if args.child:
        child(args.child, args.recipe, args.nodes, root, args.steps, args.run_steps)
        return
    print(f"synthetic graph of {args.recipe.name} at {args.nodes:,} nodes, data root {root}")
    phases = ["generate", "steps"] + (["run"] if args.run else [])
    try:
        for phase in phases:
            command = [
                sys.executable,
                __file__,
                "--child",
                phase,
                "--nodes",
                str(args.nodes),
                "--recipe",
                str(args.recipe),
                "--dir",
                str(root),
                "--steps",
                str(args.steps),
                "--run-steps",
                str(args.run_steps),
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{phase} failed:\n{done.stderr[-4000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            details = ", ".join(
                f"{k} {v}"
                for k, v in result.items()
                if k not in ("seconds", "peak_rss_anon_mib", "rise_rss_anon_mib", "vm_hwm_mib", "start_vm_hwm_mib")
            )
            print(
                f"  {phase:<9} {result['seconds']:8.1f} s   peak RssAnon {result['peak_rss_anon_mib']:8,.1f} MiB "
                f"(+{result['rise_rss_anon_mib']:,.1f} over the start)   VmHWM {result['vm_hwm_mib']:8,.1f} MiB "
                f"(start {result['start_vm_hwm_mib']:,.1f})\n            {details}"
            )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
