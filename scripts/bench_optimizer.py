#!/usr/bin/env python
"""Benchmark DiskSparseAdam against torch.optim.SparseAdam on the same sparse gradients.

Two measurements, each for uniformly random rows and for rows drawn from a power law
(Zipf, hot rows scattered over the table as in real embedding workloads):

speed   optimizer step time with N x D tables, L lookups per step, after a warm-up epoch that
        touches every row (so DiskSparseAdam's state sits in the page cache, as SparseAdam's
        sits in RAM). Steps alternate between the two optimizers on the same gradient;
        the figure is the ratio of median step times (target: <= 0.5).
memory  growth of resident anonymous memory (RssAnon) caused by the optimizer at a larger N,
        each optimizer in a fresh subprocess (target for DiskSparseAdam: <= 64 MiB plus a few
        times the batch's gradient rows; SparseAdam adds 2 x 4 x N x D bytes).

    python scripts/bench_optimizer.py                # the full benchmark (~10 minutes, 16 GB RAM)
    python scripts/bench_optimizer.py --quick        # a small version (~1 minute)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dsa_train import DiskSparseAdam
from dsa_train.data.synthetic import power_law_ids
from dsa_train.memory import PeakRssAnon, rss_anon_bytes

MiB = 1 << 20


def sample_rows(num_rows: int, count: int, distribution: str, generator: torch.Generator, zipf: float) -> torch.Tensor:
    """Row indices, uniform or power-law (hot rows scattered over the table, as in real ones)."""
    if distribution == "uniform":
        return torch.randint(0, num_rows, (count,), generator=generator)
    return power_law_ids(num_rows, count, generator, zipf)


def make_gradients(num_rows, dim, lookups, count, distribution, zipf, seed):
    """``count`` uncoalesced sparse gradients shaped like ``nn.Embedding(sparse=True)``'s."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.sparse_coo_tensor(
            sample_rows(num_rows, lookups, distribution, g, zipf)[None],
            torch.randn(lookups, dim, generator=g),
            (num_rows, dim),
            check_invariants=False,
        )
        for _ in range(count)
    ]


def warm_up_epoch(num_rows, dim, lookups, seed):
    """Gradients that together touch every row once, in random order."""
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    for start in range(0, num_rows, lookups):
        rows = perm[start : start + lookups]
        yield torch.sparse_coo_tensor(rows[None], torch.randn(len(rows), dim) * 1e-3, (num_rows, dim), check_invariants=False)


def bench_speed(args, distribution) -> dict:
    torch.manual_seed(0)
    table = torch.randn(args.rows, args.dim)
    reference_param = torch.nn.Parameter(table)
    ours_param = torch.nn.Parameter(table.clone())
    del table
    grads = make_gradients(args.rows, args.dim, args.lookups, args.distinct_batches, distribution, args.zipf, seed=1)
    unique = statistics.mean(g.coalesce()._nnz() for g in grads)
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        reference = torch.optim.SparseAdam([reference_param], lr=1e-3)
        ours = DiskSparseAdam([ours_param], lr=1e-3, state_dir=tmp)
        try:
            for grad in warm_up_epoch(args.rows, args.dim, args.lookups, seed=2):
                for param, opt in ((reference_param, reference), (ours_param, ours)):
                    param.grad = grad
                    opt.step()
            times = {"SparseAdam": [], "DiskSparseAdam": []}
            for i in range(args.warmup + args.steps):
                grad = grads[i % len(grads)]
                pairs = [("SparseAdam", reference_param, reference), ("DiskSparseAdam", ours_param, ours)]
                for name, param, opt in pairs if i % 2 == 0 else pairs[::-1]:  # alternate who goes first
                    param.grad = grad
                    start = time.perf_counter()
                    opt.step()
                    elapsed = time.perf_counter() - start
                    if i >= args.warmup:
                        times[name].append(elapsed)
            same = torch.equal(reference_param, ours_param)
        finally:
            ours.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "distribution": distribution,
        "rows": args.rows,
        "dim": args.dim,
        "lookups": args.lookups,
        "unique_rows_per_step": round(unique),
        "steps": args.steps,
        "sparse_adam_ms": round(med["SparseAdam"] * 1e3, 1),
        "disk_sparse_adam_ms": round(med["DiskSparseAdam"] * 1e3, 1),
        "ratio": round(med["DiskSparseAdam"] / med["SparseAdam"], 3),
        "ratio_of_totals": round(sum(times["DiskSparseAdam"]) / sum(times["SparseAdam"]), 3),
        "bitwise_equal_weights": same,
    }


def memory_child(args) -> dict:
    """Runs in a fresh process: RssAnon growth of one optimizer over a few steps."""
    param = torch.nn.Parameter(torch.empty(args.memory_rows, args.dim).fill_(0.01))
    grads = make_gradients(args.memory_rows, args.dim, args.lookups, 2, args.child_distribution, args.zipf, seed=3)
    # The first torch optimizer of a process imports torch's compiler machinery (~67 MB);
    # every optimizer pays it once, SparseAdam too, so it is paid here before the baseline.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        gc.collect()
        baseline = rss_anon_bytes()
        try:
            with PeakRssAnon() as peak:
                if args.child_optimizer == "dsa":
                    opt = DiskSparseAdam([param], lr=1e-3, state_dir=tmp)
                else:
                    opt = torch.optim.SparseAdam([param], lr=1e-3)
                for i in range(args.memory_steps):
                    param.grad = grads[i % len(grads)]
                    opt.step()
                param.grad = None
                after = rss_anon_bytes()
                if args.child_optimizer == "dsa":
                    opt.close()
        except (MemoryError, RuntimeError) as e:  # torch reports a failed allocation as RuntimeError
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"peak_growth_mib": round((peak.peak - baseline) / MiB, 1), "growth_after_steps_mib": round((after - baseline) / MiB, 1)}


def bench_memory(args, distribution) -> dict:
    results = {}
    for optimizer in ("dsa", "sparse_adam"):
        cmd = [sys.executable, __file__, "--child-optimizer", optimizer, "--child-distribution", distribution]
        cmd += ["--memory-rows", str(args.memory_rows), "--dim", str(args.dim), "--lookups", str(args.lookups)]
        cmd += ["--memory-steps", str(args.memory_steps), "--zipf", str(args.zipf)]
        if args.state_dir:
            cmd += ["--state-dir", args.state_dir]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            results[optimizer] = {"error": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
        else:
            results[optimizer] = json.loads(out.stdout.strip().splitlines()[-1])
    batch_mib = args.lookups * args.dim * 4 / MiB
    return {
        "distribution": distribution,
        "rows": args.memory_rows,
        "dim": args.dim,
        "lookups": args.lookups,
        "batch_gradient_mib": round(batch_mib, 1),
        "disk_sparse_adam": results["dsa"],
        "sparse_adam": results["sparse_adam"],
        "sparse_adam_moments_mib": round(2 * 4 * args.memory_rows * args.dim / MiB, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="table rows for the speed test")
    parser.add_argument("--dim", type=int, default=128, help="embedding dimension")
    parser.add_argument("--lookups", type=int, default=65_536, help="row lookups per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps after the warm-up epoch")
    parser.add_argument("--distinct-batches", type=int, default=6, help="distinct gradients, cycled")
    parser.add_argument("--memory-rows", type=int, default=10_000_000, help="table rows for the memory test")
    parser.add_argument("--memory-steps", type=int, default=8, help="steps in the memory test")
    parser.add_argument("--distribution", nargs="+", default=["uniform", "powerlaw"], choices=["uniform", "powerlaw"])
    parser.add_argument("--zipf", type=float, default=1.0, help="power-law exponent")
    parser.add_argument("--state-dir", default=None, help="where the state files go (default: the system temp dir)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes: N=200k speed, N=1M memory, D=64, 8192 lookups")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--child-optimizer", choices=["dsa", "sparse_adam"], help=argparse.SUPPRESS)
    parser.add_argument("--child-distribution", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_optimizer:
        print(json.dumps(memory_child(args)))
        return
    if args.quick:
        args.rows, args.memory_rows, args.dim, args.lookups, args.steps = 200_000, 1_000_000, 64, 8192, 20

    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "speed": [], "memory": []}
    for distribution in args.distribution:
        if not args.skip_speed:
            print(f"speed, {distribution} rows ...", file=sys.stderr, flush=True)
            report["speed"].append(bench_speed(args, distribution))
        if not args.skip_memory:
            print(f"memory, {distribution} rows ...", file=sys.stderr, flush=True)
            report["memory"].append(bench_memory(args, distribution))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


def print_table(report: dict) -> None:
    print(f"torch {report['torch']}, {report['threads']} threads")
    if report["speed"]:
        print("\nOptimizer step time (state in the page cache), median over the timed steps")
        print(f"{'rows':>10} {'N x D':>14} {'lookups':>8} {'unique':>8} {'SparseAdam':>11} {'DiskSparseAdam':>15} {'ratio':>6}  equal")
        for r in report["speed"]:
            print(
                f"{r['distribution']:>10} {r['rows']:>10,}x{r['dim']:<3} {r['lookups']:>8,} {r['unique_rows_per_step']:>8,} "
                f"{r['sparse_adam_ms']:>9.1f}ms {r['disk_sparse_adam_ms']:>13.1f}ms {r['ratio']:>6.2f}  {r['bitwise_equal_weights']}"
            )
    if report["memory"]:
        print("\nOptimizer memory: growth of RssAnon (MiB), peak during the steps")
        print(f"{'rows':>10} {'N x D':>15} {'batch grad':>10} {'SparseAdam':>11} {'DiskSparseAdam':>15}")
        for r in report["memory"]:
            cells = [
                str(r[k].get("peak_growth_mib", r[k].get("error"))) for k in ("sparse_adam", "disk_sparse_adam")
            ]
            print(
                f"{r['distribution']:>10} {r['rows']:>11,}x{r['dim']:<3} {r['batch_gradient_mib']:>10} {cells[0]:>11} {cells[1]:>15}"
            )


if __name__ == "__main__":
    main()
