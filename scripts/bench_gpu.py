#!/usr/bin/env python
"""DiskSparseAdam against torch.optim.SparseAdam with the tables on a CUDA GPU.

vram    peak ``torch.cuda.max_memory_allocated`` of an N x D float32 table and a few optimizer
        steps, each optimizer on its own, at ``--rows`` and at ``--big-rows``; next to
        SparseAdam's 3 x 4 x N x D bytes (weights and two moments). A SparseAdam that runs out
        of memory is reported as such.
speed   median optimizer step at ``--rows`` x ``--dim``, ``--lookups`` lookups per step, rows
        uniform and power-law; ``torch.cuda.synchronize()`` before and after each step. After
        a warm-up epoch that touches every row (SparseAdam's moments exist, DiskSparseAdam's
        sit in the page cache), steps alternate between the optimizers on the same gradients;
        the ratio is of the same run, and the weights are compared bit for bit at the end.
share   the host step's share of a whole GPU training step: a lookup of the batch's rows, a
        dense layer over them and the loss (forward and backward on the GPU), then the
        optimizer step, each phase timed between ``torch.cuda.synchronize()`` calls, for both
        optimizers after the same warm-up epoch; DiskSparseAdam's step runs on the host.
train   with ``--data-root``: training triples/s of ``--recipe`` (FB15k-237) on the GPU, by
        ``scripts/bench_throughput.py`` (the project's ``Training``, each optimizer in a fresh
        process, rounds alternating which goes first).

    python scripts/bench_gpu.py                          # 2M x 128, VRAM also at 20M x 128
    python scripts/bench_gpu.py --quick                  # 200k x 128, 1M x 128 (seconds)
    python scripts/bench_gpu.py --data-root ./datasets --json

Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsa_train import DiskSparseAdam
from dsa_train.data.synthetic import power_law_ids

MiB = 1 << 20
KINDS = {"sparse_adam": "SparseAdam", "dsa": "DiskSparseAdam"}
SCRIPTS = Path(__file__).resolve().parent


def gradient(rows: int, dim: int, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """An uncoalesced sparse gradient on the GPU, shaped like ``nn.Embedding(sparse=True)``'s."""
    values = torch.randn(ids.numel(), dim, device="cuda") * scale
    return torch.sparse_coo_tensor(ids.cuda()[None], values, (rows, dim), check_invariants=False)


def sample(rows: int, count: int, distribution: str, generator: torch.Generator) -> torch.Tensor:
    return (
        torch.randint(0, rows, (count,), generator=generator)
        if distribution == "uniform"
        else power_law_ids(rows, count, generator, 1.0)
    )


def optimizer(kind: str, param: torch.Tensor, state_dir: str):
    return (
        torch.optim.SparseAdam([param], lr=1e-3)
        if kind == "sparse_adam"
        else DiskSparseAdam([param], lr=1e-3, state_dir=state_dir)
    )


def vram_peak(kind: str, rows: int, args) -> int | None:
    """Bytes the table, its gradients and the optimizer took at their peak; None: out of memory."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        param = opt = None
        try:
            param = torch.nn.Parameter(torch.empty(rows, args.dim, device="cuda").normal_(std=0.01))
            opt = optimizer(kind, param, tmp)
            for _ in range(args.vram_steps):
                param.grad = gradient(rows, args.dim, sample(rows, args.lookups, "uniform", generator))
                opt.step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            if isinstance(opt, DiskSparseAdam):
                opt.close()
            del param, opt
            torch.cuda.empty_cache()


def vram_row(kind: str, rows: int, args) -> dict:
    peak = vram_peak(kind, rows, args)
    return {
        "rows": rows,
        "dim": args.dim,
        "kind": kind,
        "sparse_adam_model_mib": 3 * 4 * rows * args.dim / MiB,  # float32 weights, exp_avg, exp_avg_sq
        "peak_mib": None if peak is None else peak / MiB,
    }


def timed_step(opt, param, grad) -> float:
    param.grad = grad
    torch.cuda.synchronize()
    began = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def bench_speed(distribution: str, args) -> dict:
    rows, dim, lookups = args.rows, args.dim, args.lookups
    table = torch.randn(rows, dim, device="cuda") * 0.01
    params = {"sparse_adam": torch.nn.Parameter(table.clone()), "dsa": torch.nn.Parameter(table)}
    generator = torch.Generator().manual_seed(1)
    grads = [gradient(rows, dim, sample(rows, lookups, distribution, generator)) for _ in range(args.distinct_batches)]
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        opts = {kind: optimizer(kind, p, tmp) for kind, p in params.items()}
        try:
            order = torch.randperm(rows, generator=generator)
            for start in range(0, rows, lookups):  # the warm-up epoch: every row once
                grad = gradient(rows, dim, order[start : start + lookups], scale=1e-3)
                for kind in KINDS:
                    timed_step(opts[kind], params[kind], grad)
            times = {kind: [] for kind in KINDS}
            for k in range(args.steps):
                for kind in list(KINDS)[:: 1 if k % 2 == 0 else -1]:
                    times[kind].append(timed_step(opts[kind], params[kind], grads[k % len(grads)]))
            equal = torch.equal(params["dsa"], params["sparse_adam"])
        finally:
            opts["dsa"].close()
    median = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
    return {
        "distribution": distribution,
        "unique_rows": statistics.mean(g.coalesce()._nnz() for g in grads),
        "sparse_adam_ms": median["sparse_adam"],
        "dsa_ms": median["dsa"],
        "ratio": median["dsa"] / median["sparse_adam"],
        "weights_equal": equal,
    }


def bench_share(args) -> dict:
    """Forward + backward on the GPU against the optimizer step, median ms of each, per optimizer."""
    rows, dim, lookups = args.rows, args.dim, args.lookups
    table = torch.randn(rows, dim, device="cuda") * 0.01
    dense = torch.randn(dim, dim, device="cuda") / dim**0.5
    params = {"sparse_adam": torch.nn.Parameter(table.clone()), "dsa": torch.nn.Parameter(table)}
    generator = torch.Generator().manual_seed(2)
    batches = [sample(rows, lookups, "uniform", generator).cuda() for _ in range(args.distinct_batches)]
    phases = {kind: {"model_ms": [], "optimizer_ms": []} for kind in KINDS}
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        opts = {kind: optimizer(kind, p, tmp) for kind, p in params.items()}
        try:
            order = torch.randperm(rows, generator=generator)
            for start in range(0, rows, lookups):  # the same warm-up epoch as the speed regime
                grad = gradient(rows, dim, order[start : start + lookups], scale=1e-3)
                for kind in KINDS:
                    timed_step(opts[kind], params[kind], grad)
            for k in range(args.steps):
                for kind in list(KINDS)[:: 1 if k % 2 == 0 else -1]:
                    param, ids = params[kind], batches[k % len(batches)]
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    rows_out = torch.nn.functional.embedding(ids, param, sparse=True)
                    (rows_out @ dense).tanh().pow(2).mean().backward()
                    torch.cuda.synchronize()
                    middle = time.perf_counter()
                    opts[kind].step()
                    torch.cuda.synchronize()
                    phases[kind]["model_ms"].append((middle - began) * 1e3)
                    phases[kind]["optimizer_ms"].append((time.perf_counter() - middle) * 1e3)
                    param.grad = None
        finally:
            opts["dsa"].close()
    result = {}
    for kind, times in phases.items():
        model, step = statistics.median(times["model_ms"]), statistics.median(times["optimizer_ms"])
        result[kind] = {"model_ms": model, "optimizer_ms": step, "optimizer_share": step / (model + step)}
    return result


def bench_training(args) -> dict:
    """FB15k-237 on the GPU through the throughput benchmark's own processes and loop."""
    command = [
        sys.executable,
        str(SCRIPTS / "bench_throughput.py"),
        str(args.recipe),
        "--json",
        "--steps",
        str(args.train_steps),
        "--repeats",
        str(args.train_repeats),
        f"--set=dataset.root={Path(args.data_root).resolve()}",
        "--set=train.device=cuda",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_throughput.py failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {
        "recipe": report["setting"]["recipe"],
        "steps": args.train_steps,
        "repeats": args.train_repeats,
        **{f"{kind}_triples_per_s": report["median"][kind]["items_per_s"] for kind in KINDS},
        "ratio": report["ratio"]["throughput"]["median"],
        "losses_identical": report["losses_identical"],
    }


def show(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}")
    print(f"\nVRAM: peak max_memory_allocated over {result['vram_steps']} steps of {result['lookups']:,} lookups")
    print(f"{'table':>18}  {'optimizer':14}  {'peak MiB':>10}  {'3x4xNxD MiB':>11}  {'peak / 3x4xNxD':>14}")
    for r in result["vram"]:
        peak = "out of memory" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
        share = "" if r["peak_mib"] is None else f"{r['peak_mib'] / r['sparse_adam_model_mib']:.3f}"
        print(
            f"{r['rows']:>12,} x {r['dim']:<3}  {KINDS[r['kind']]:14}  {peak:>10}  {r['sparse_adam_model_mib']:>11,.0f}  {share:>14}"
        )
    print(f"\nstep time: {result['rows']:,} x {result['dim']}, median of {result['steps']} steps after a warm-up epoch")
    print(f"{'rows':10}  {'unique/step':>11}  {'SparseAdam':>10}  {'DiskSparseAdam':>14}  {'ratio':>6}  weights equal")
    for r in result["speed"]:
        print(
            f"{r['distribution']:10}  {r['unique_rows']:>11,.0f}  {r['sparse_adam_ms']:>8.2f}ms  {r['dsa_ms']:>12.2f}ms  "
            f"{r['ratio']:>6.2f}  {'bit for bit' if r['weights_equal'] else 'NO'}"
        )
    print(
        f"\nthe optimizer's share of a GPU step ({result['rows']:,} x {result['dim']}, uniform rows, median of {result['steps']} steps)"
    )
    for kind, r in result["share"].items():
        print(
            f"{KINDS[kind]:14}  forward+backward {r['model_ms']:>8.2f} ms  optimizer step {r['optimizer_ms']:>8.2f} ms  "
            f"share {100 * r['optimizer_share']:>5.1f}%"
        )
    t = result["training"]
    if t is not None:
        print(
            f"\ntraining {t['recipe']} on cuda ({t['steps']} timed steps, median of {t['repeats']} rounds): "
            f"SparseAdam {t['sparse_adam_triples_per_s']:,.0f} triples/s, DiskSparseAdam {t['dsa_triples_per_s']:,.0f} "
            f"triples/s, ratio {t['ratio']:.2f}, losses {'identical' if t['losses_identical'] else 'DIFFER'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="table rows for speed and VRAM (default 2M)")
    parser.add_argument("--big-rows", type=int, default=20_000_000, help="a larger table for VRAM only (default 20M)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lookups", type=int, default=65_536, help="lookups per step (default 65,536)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per optimizer and distribution")
    parser.add_argument(
        "--distinct-batches", type=int, default=8, help="different gradients the timed steps cycle through"
    )
    parser.add_argument("--vram-steps", type=int, default=5)
    parser.add_argument(
        "--state-dir", default=None, help="where DiskSparseAdam's moments go (default: a temporary folder)"
    )
    parser.add_argument("--data-root", default=None, help="a data root holding FB15k-237: also measure training")
    parser.add_argument("--recipe", type=Path, default=SCRIPTS.parent / "recipes" / "fb15k237-distmult.yaml")
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--train-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="200k and 1M rows, 10 timed steps")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device (torch.cuda.is_available() is False here); nothing was measured")
        return
    if args.quick:
        args.rows, args.big_rows, args.steps = 200_000, 1_000_000, 10
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        **{key: getattr(args, key) for key in ("rows", "dim", "lookups", "steps", "vram_steps")},
        "vram": [vram_row(kind, rows, args) for rows in (args.rows, args.big_rows) for kind in KINDS],
        "speed": [bench_speed(distribution, args) for distribution in ("uniform", "power-law")],
        "share": bench_share(args),
        "training": bench_training(args) if args.data_root else None,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)


if __name__ == "__main__":
    main()
