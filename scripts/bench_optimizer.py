#!/usr/bin/env python
"""Benchmark DiskSparseAdam against torch.optim.SparseAdam on the same sparse gradients.

Step time in three regimes, each for uniformly random rows and for rows drawn from a power
law (Zipf, hot rows scattered over the table as in real embedding workloads). Every
(regime, distribution, repeat) runs in a fresh process holding both optimizers, which take
turns on each step (who goes first alternates), so the ratio is measured on one machine state:

cold         a fresh state directory and a fresh SparseAdam, one epoch of steps (N / L, every
             row about once). SparseAdam zeroes its whole 2 x 4 x N x D state in its first
             step; DiskSparseAdam pays for each row's record when the row is first touched.
             Reports the epoch's total (the figure a one-epoch run feels), the issue's window
             of steps 4-11 (the first step excluded, which hides SparseAdam's zeroing) and the
             last step.
warm         after a warm-up epoch that touches every row, so DiskSparseAdam's state sits in
             the page cache as SparseAdam's sits in RAM: a long run's steady state. Also times
             a 512 x 512 matmul before the optimizers exist and right after each one's step,
             the CPU the process burns in half a second of idleness after the steps, and its
             thread count (the optimizer's pools must leave torch's own ops as fast as before).
out-of-core  the weight is a DiskEmbedding (records [w | m | v] in one file) evicted from the
             page cache, so every touched row is read from disk inside the step; SparseAdam
             keeps its table and state in RAM. The training loop overlaps these reads with
             the forward and backward pass (scripts/bench_out_of_core.py measures that); here
             nothing hides them.

memory       growth of resident anonymous memory (RssAnon) caused by the optimizer at a larger
             N, each optimizer in a fresh subprocess (target for DiskSparseAdam: <= 64 MiB
             plus a few times the batch's gradient rows; SparseAdam adds 2 x 4 x N x D bytes).

    python scripts/bench_optimizer.py                # everything (~15 minutes, 16 GB RAM)
    python scripts/bench_optimizer.py --quick        # a small version (~2 minutes)
    python scripts/bench_optimizer.py --regime cold --repeats 5 --skip-memory
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsa_train import DiskEmbedding, DiskSparseAdam
from dsa_train.data.synthetic import power_law_ids
from dsa_train.memory import PeakRssAnon, rss_anon_bytes

MiB = 1 << 20
REGIMES = ("cold", "warm", "out-of-core")
WINDOW = slice(3, 11)  # steps 4-11: the window the issue measured


def sample_rows(num_rows: int, count: int, distribution: str, generator: torch.Generator, zipf: float) -> torch.Tensor:
    """Row indices, uniform or power-law (hot rows scattered over the table, as in real ones)."""
    if distribution == "uniform":
        return torch.randint(0, num_rows, (count,), generator=generator)
    return power_law_ids(num_rows, count, generator, zipf)


def gradients(num_rows, dim, lookups, distribution, zipf, seed):
    """Endless uncoalesced sparse gradients shaped like ``nn.Embedding(sparse=True)``'s."""
    g = torch.Generator().manual_seed(seed)
    while True:
        rows = sample_rows(num_rows, lookups, distribution, g, zipf)
        yield torch.sparse_coo_tensor(
            rows[None], torch.randn(lookups, dim, generator=g), (num_rows, dim), check_invariants=False
        )


def warm_up_epoch(num_rows, dim, lookups, seed):
    """Gradients that together touch every row once, in random order."""
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    for start in range(0, num_rows, lookups):
        rows = perm[start : start + lookups]
        yield torch.sparse_coo_tensor(
            rows[None], torch.randn(len(rows), dim) * 1e-3, (num_rows, dim), check_invariants=False
        )


class Turns:
    """Both optimizers step on the same gradient, taking turns at going first; wall and CPU
    seconds of every step are kept, and ``after_step(name)`` runs untimed after each."""

    def __init__(self, pairs, after_step=None) -> None:
        self.pairs, self.after_step = pairs, after_step
        self.wall = {name: [] for name, _, _ in pairs}
        self.cpu = {name: [] for name, _, _ in pairs}

    def step(self, index: int, grad) -> None:
        for name, param, opt in self.pairs if index % 2 == 0 else self.pairs[::-1]:
            param.grad = grad
            wall, cpu = time.perf_counter(), time.process_time()
            opt.step()
            self.wall[name].append(time.perf_counter() - wall)
            self.cpu[name].append(time.process_time() - cpu)
            param.grad = None
            if self.after_step:
                self.after_step(name)


def matmul_ms(repeats: int, a: torch.Tensor) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, a)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def speed_child(args) -> dict:
    """One regime, one distribution, in this (fresh) process."""
    regime, distribution = args.child_regime, args.child_distribution
    n, dim, lookups = args.rows, args.dim, args.lookups
    seed = 1000 * args.child_repeat
    torch.manual_seed(seed)
    a = torch.randn(512, 512)
    matmul_ms(20, a)  # the first calls start torch's thread team: not what is compared
    before = matmul_ms(60, a)
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        disk = None
        if regime == "out-of-core":
            disk = DiskEmbedding(n, dim, path=Path(tmp) / "table", std=1.0, seed=seed)
            ours_param = disk.weight
            reference_param = torch.nn.Parameter(disk.weight.detach().clone())
        else:
            reference_param = torch.nn.Parameter(torch.randn(n, dim))
            ours_param = torch.nn.Parameter(reference_param.detach().clone())
        reference = torch.optim.SparseAdam([reference_param], lr=1e-3)
        ours = DiskSparseAdam([ours_param], lr=1e-3, state_dir=Path(tmp) / "state")
        after = {"SparseAdam": [], "DiskSparseAdam": []}
        pairs = [("SparseAdam", reference_param, reference), ("DiskSparseAdam", ours_param, ours)]
        try:
            if regime == "warm":
                warm = Turns(pairs)
                for i, grad in enumerate(warm_up_epoch(n, dim, lookups, seed + 1)):
                    warm.step(i, grad)
                turns = Turns(pairs, after_step=lambda name: after[name].extend(matmul_ms(5, a)))
                steps = args.steps
            elif regime == "out-of-core":
                ours.flush()
                disk.table.rows.evict()  # every row's record is on disk only
                turns, steps = Turns(pairs), args.ooc_steps
            else:
                turns, steps = Turns(pairs), math.ceil(n / lookups)
            grads = gradients(n, dim, lookups, distribution, args.zipf, seed + 2)
            for i in range(steps):
                turns.step(i, next(grads))
            same = torch.equal(reference_param, ours_param)
            idle = time.process_time()
            time.sleep(0.5)
            idle_cpu_ms = (time.process_time() - idle) * 1e3
        finally:
            ours.close()
            if disk is not None:
                disk.table.close()
    wall = turns.wall
    ratio = lambda part: statistics.median(wall["DiskSparseAdam"][part]) / statistics.median(wall["SparseAdam"][part])  # noqa: E731
    result = {
        "regime": regime,
        "distribution": distribution,
        "repeat": args.child_repeat,
        "steps": len(wall["SparseAdam"]),
        "unique_rows_per_step": round(
            statistics.mean(
                len(torch.unique(g._indices()))
                for g, _ in zip(gradients(n, dim, lookups, distribution, args.zipf, seed + 2), range(3))
            )
        ),
        "sparse_adam_ms": round(statistics.median(wall["SparseAdam"]) * 1e3, 1),
        "disk_sparse_adam_ms": round(statistics.median(wall["DiskSparseAdam"]) * 1e3, 1),
        "ratio": round(ratio(slice(None)), 3),
        "ratio_of_totals": round(sum(wall["DiskSparseAdam"]) / sum(wall["SparseAdam"]), 3),
        "cpu_ratio_of_totals": round(sum(turns.cpu["DiskSparseAdam"]) / sum(turns.cpu["SparseAdam"]), 3),
        "bitwise_equal_weights": same,
        "idle_cpu_ms_per_s": round(idle_cpu_ms * 2, 1),
        "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
    }
    if regime == "cold":
        result["first_step_ms"] = {k: round(v[0] * 1e3) for k, v in wall.items()}
        result["window_ratio"] = round(ratio(WINDOW), 3)
        result["last_step_ratio"] = round(wall["DiskSparseAdam"][-1] / wall["SparseAdam"][-1], 3)
    if regime == "warm":
        base = statistics.median(before)
        result["matmul_ms"] = {
            "before": round(base, 3),
            **{k: round(statistics.median(v), 3) for k, v in after.items()},
        }
        result["matmul_after_dsa_vs_before"] = round(statistics.median(after["DiskSparseAdam"]) / base, 3)
        result["matmul_after_dsa_vs_after_sparse_adam"] = round(
            statistics.median(after["DiskSparseAdam"]) / statistics.median(after["SparseAdam"]), 3
        )
    return result


def child(args, **flags) -> dict:
    """Run this script with ``--child-*`` flags in a fresh process; its last stdout line is JSON."""
    cmd = [sys.executable, __file__, "--rows", str(args.rows), "--dim", str(args.dim), "--lookups", str(args.lookups)]
    cmd += ["--steps", str(args.steps), "--ooc-steps", str(args.ooc_steps), "--zipf", str(args.zipf)]
    cmd += ["--memory-rows", str(args.memory_rows), "--memory-steps", str(args.memory_steps)]
    if args.state_dir:
        cmd += ["--state-dir", args.state_dir]
    for flag, value in flags.items():
        cmd += [f"--{flag.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_child(args) -> dict:
    """Runs in a fresh process: RssAnon growth of one optimizer over a few steps."""
    param = torch.nn.Parameter(torch.empty(args.memory_rows, args.dim).fill_(0.01))
    grads = gradients(args.memory_rows, args.dim, args.lookups, args.child_distribution, args.zipf, seed=3)
    grads = [next(grads), next(grads)]
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
    return {
        "peak_growth_mib": round((peak.peak - baseline) / MiB, 1),
        "growth_after_steps_mib": round((after - baseline) / MiB, 1),
    }


def bench_memory(args, distribution) -> dict:
    results = {opt: child(args, child_optimizer=opt, child_distribution=distribution) for opt in ("dsa", "sparse_adam")}
    return {
        "distribution": distribution,
        "rows": args.memory_rows,
        "dim": args.dim,
        "lookups": args.lookups,
        "batch_gradient_mib": round(args.lookups * args.dim * 4 / MiB, 1),
        "disk_sparse_adam": results["dsa"],
        "sparse_adam": results["sparse_adam"],
        "sparse_adam_moments_mib": round(2 * 4 * args.memory_rows * args.dim / MiB, 1),
    }


def summarise(runs: list[dict]) -> list[dict]:
    """Per regime and distribution: the headline ratio of every repeat, its median and spread."""
    headline = {"cold": "ratio_of_totals", "warm": "ratio", "out-of-core": "ratio"}
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if "error" not in run:
            groups.setdefault((run["regime"], run["distribution"]), []).append(run)
    summary = []
    for (regime, distribution), group in groups.items():
        row = {"regime": regime, "distribution": distribution, "repeats": len(group)}
        keys = [headline[regime]] + (["window_ratio", "last_step_ratio"] if regime == "cold" else [])
        keys += ["matmul_after_dsa_vs_before", "matmul_after_dsa_vs_after_sparse_adam"] if regime == "warm" else []
        for key in keys:
            values = [r[key] for r in group]
            row[key] = {
                "median": round(statistics.median(values), 3),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
        row["bitwise_equal_weights"] = all(r["bitwise_equal_weights"] for r in group)
        summary.append(row)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="table rows for the speed test")
    parser.add_argument("--dim", type=int, default=128, help="embedding dimension")
    parser.add_argument("--lookups", type=int, default=65_536, help="row lookups per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per optimizer in the warm regime")
    parser.add_argument("--ooc-steps", type=int, default=6, help="timed steps in the out-of-core regime")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per regime and distribution")
    parser.add_argument("--regime", nargs="+", default=list(REGIMES), choices=REGIMES)
    parser.add_argument("--memory-rows", type=int, default=10_000_000, help="table rows for the memory test")
    parser.add_argument("--memory-steps", type=int, default=8, help="steps in the memory test")
    parser.add_argument("--distribution", nargs="+", default=["uniform", "powerlaw"], choices=["uniform", "powerlaw"])
    parser.add_argument("--zipf", type=float, default=1.0, help="power-law exponent")
    parser.add_argument("--state-dir", default=None, help="where the state files go (default: the system temp dir)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: N=200k speed, N=1M memory, D=64, 8192 lookups"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    for hidden in ("child-optimizer", "child-distribution", "child-regime"):
        parser.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    parser.add_argument("--child-repeat", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_optimizer:
        print(json.dumps(memory_child(args)))
        return
    if args.child_regime:
        print(json.dumps(speed_child(args)))
        return
    if args.quick:
        args.rows, args.memory_rows, args.dim, args.lookups, args.steps = 200_000, 1_000_000, 64, 8192, 20

    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "runs": [], "memory": []}
    if not args.skip_speed:
        for repeat in range(args.repeats):
            for distribution in args.distribution:
                for regime in args.regime:
                    print(
                        f"{regime}, {distribution} rows, repeat {repeat + 1}/{args.repeats} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    run = child(args, child_regime=regime, child_distribution=distribution, child_repeat=repeat)
                    report["runs"].append(
                        run if "error" not in run else {**run, "regime": regime, "distribution": distribution}
                    )
        report["speed"] = summarise(report["runs"])
    if not args.skip_memory:
        for distribution in args.distribution:
            print(f"memory, {distribution} rows ...", file=sys.stderr, flush=True)
            report["memory"].append(bench_memory(args, distribution))
    report["setup"] = {"rows": args.rows, "dim": args.dim, "lookups": args.lookups}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


def spread(cell: dict) -> str:
    return f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def print_table(report: dict) -> None:
    setup = report["setup"]
    print(
        f"torch {report['torch']}, {report['threads']} threads; {setup['rows']:,} x {setup['dim']} table, {setup['lookups']:,} lookups a step"
    )
    errors = [r for r in report["runs"] if "error" in r]
    for r in errors:
        print(f"  {r['regime']} {r['distribution']}: {r['error']}")
    if report.get("speed"):
        print("\nDiskSparseAdam step time / SparseAdam's, median over repeats (min-max); each repeat a fresh process")
        print(f"{'regime':>12} {'rows':>9} {'repeats':>7}  {'ratio':<18} {'steps 4-11':<18} {'last step':<18} equal")
        for r in report["speed"]:
            head = r.get("ratio_of_totals") or r.get("ratio")
            window = spread(r["window_ratio"]) if "window_ratio" in r else ""
            last = spread(r["last_step_ratio"]) if "last_step_ratio" in r else ""
            print(
                f"{r['regime']:>12} {r['distribution']:>9} {r['repeats']:>7}  {spread(head):<18} {window:<18} {last:<18} {r['bitwise_equal_weights']}"
            )
        print(
            "  cold: one epoch from a fresh state, ratio of the epoch's total time; warm and out-of-core: median step"
        )
        for r in report["runs"]:
            if r.get("regime") == "cold" and "first_step_ms" in r:
                print(
                    f"  cold {r['distribution']} repeat {r['repeat'] + 1}: first step SparseAdam {r['first_step_ms']['SparseAdam']} ms, "
                    f"DiskSparseAdam {r['first_step_ms']['DiskSparseAdam']} ms; median step {r['sparse_adam_ms']} / {r['disk_sparse_adam_ms']} ms"
                )
        warm = [r for r in report["speed"] if r["regime"] == "warm"]
        if warm:
            print(
                "\nTorch ops after a step: a 512 x 512 matmul right after DiskSparseAdam's step / before any optimizer existed"
            )
            for r in warm:
                print(
                    f"  {r['distribution']:>9}: {spread(r['matmul_after_dsa_vs_before'])}; "
                    f"/ right after SparseAdam's step: {spread(r['matmul_after_dsa_vs_after_sparse_adam'])}"
                )
            idle = [r["idle_cpu_ms_per_s"] for r in report["runs"] if r.get("regime") == "warm"]
            threads = [r["threads"] for r in report["runs"] if r.get("regime") == "warm"]
            print(
                f"  CPU burnt while idle after the steps: at most {max(idle)} ms/s; threads in the process: {max(threads)}"
            )
    if report["memory"]:
        print("\nOptimizer memory: growth of RssAnon (MiB), peak during the steps")
        print(f"{'rows':>10} {'N x D':>15} {'batch grad':>10} {'SparseAdam':>11} {'DiskSparseAdam':>15}")
        for r in report["memory"]:
            cells = [str(r[k].get("peak_growth_mib", r[k].get("error"))) for k in ("sparse_adam", "disk_sparse_adam")]
            print(
                f"{r['distribution']:>10} {r['rows']:>11,}x{r['dim']:<3} {r['batch_gradient_mib']:>10} {cells[0]:>11} {cells[1]:>15}"
            )


if __name__ == "__main__":
    main()
