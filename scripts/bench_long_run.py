#!/usr/bin/env python
"""A long run of one optimizer per process: per-minute step times and the disk bytes written.

Short step benchmarks time a few hundred steps while the pages just written are still dirty
in memory; what a user meets is the hour after that. Each optimizer here runs alone in a
fresh process for its whole window, on uniformly random or power-law rows (65,536 lookups a
step by default, a gradient of random values), and reports per minute: the median step, the
disk bytes written (the block device's sectors written, from ``/sys/dev/block``, so the
kernel's write-back is counted whoever starts it), the process's anonymous memory, and the
median time to make a batch: work that touches no optimizer state, so a minute in which it
slows as much as the step was a slow minute of the machine, not of the optimizer.

dsa          DiskSparseAdam, state in ``--state-dir``, checkpointed after every ``--checkpoint-minutes``
             minutes of stepping (between two minutes: no minute's figures hold a checkpoint)
             as a training run does (``CheckpointStore.save`` of the table and the state:
             bases or deltas of the changed rows; ``--checkpoint flush``: ``flush()`` only);
             each checkpoint's seconds, the disk bytes written during it and the bytes its
             files hold are reported apart (written / held: 1.0 means each byte once)
sparse_adam  torch.optim.SparseAdam, table and state in RAM: the baseline of the ratios
floor        the step's memory-traffic floor: torch gathers the touched rows of w, m and v
             (all in RAM), does the Adam arithmetic and scatters them back
batches      (only with ``--only``) the making of batches alone, no step: how much the
             machine's own speed varies from minute to minute over the same window

The three run one after another in the same invocation, on the same machine state, and the
ratios are of their steady-state medians (the minutes after the first). ``--table disk``
makes the weight a DiskEmbedding (records ``[w | m | v]`` on disk, prefetch of the next
batch on), for a table larger than RAM; SparseAdam and the floor are then skipped unless
they fit.

    python scripts/bench_long_run.py --rows 10000000 --dim 64 --minutes 10
    python scripts/bench_long_run.py --rows 2000000 --dim 128 --minutes 10 --distribution power
    python scripts/bench_long_run.py --rows 10000000 --dim 64 --state-dir /dev/shm --minutes 10
    python scripts/bench_long_run.py --rows 100000000 --dim 64 --table disk --minutes 10 --only dsa
    python scripts/bench_long_run.py --rows 10000000 --dim 64 --minutes 10 --busy 1    # another job on one core throughout

``--busy N`` starts N processes that each keep one core and the memory bus busy for the whole
invocation (every optimizer meets the same load): the busy-machine regime.
"""

from __future__ import annotations

import argparse
import json
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
from dsa_train.memory import host_available_bytes, rss_anon_bytes
from dsa_train.optim.prefetch import shared_prefetcher
from dsa_train.runs.checkpoint_store import CheckpointStore

MiB, GiB = 1 << 20, 1 << 30
KINDS = ("sparse_adam", "dsa", "floor", "batches")


def block_device_stat(path: Path) -> Path | None:
    """``/sys/dev/block/M:m/stat`` of the device holding ``path`` (None on tmpfs and the like)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def sectors_written(stat: Path | None) -> int | None:
    return int(stat.read_text().split()[6]) if stat is not None else None


def batches(args, seed: int):
    """Endless uncoalesced sparse gradients shaped like ``nn.Embedding(sparse=True)``'s."""
    generator = torch.Generator().manual_seed(seed)
    shape = (args.rows, args.dim)
    while True:
        if args.distribution == "uniform":
            rows = torch.randint(0, args.rows, (args.lookups,), generator=generator)
        else:
            rows = power_law_ids(args.rows, args.lookups, generator, args.zipf)
        yield torch.sparse_coo_tensor(rows[None], torch.randn(args.lookups, args.dim, generator=generator), shape)


class FloorStep:
    """The memory-traffic floor of a sparse Adam step: gather the touched rows of w, m, v,
    the Adam arithmetic (bias correction included), scatter them back."""

    def __init__(self, weight: torch.Tensor, lr=1e-3, betas=(0.9, 0.999), eps=1e-8) -> None:
        self.w, self.lr, self.betas, self.eps, self.t = weight, lr, betas, eps, 0
        self.m, self.v = torch.zeros_like(weight), torch.zeros_like(weight)

    def step(self, grad: torch.Tensor) -> None:
        self.t += 1
        grad = grad.coalesce()
        rows, g = grad.indices()[0], grad.values()
        (b1, b2), t = self.betas, self.t
        m = self.m.index_select(0, rows).lerp_(g, 1 - b1)
        v = self.v.index_select(0, rows).mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = self.lr * (1 - b2**t) ** 0.5 / (1 - b1**t)
        w = self.w.index_select(0, rows).addcdiv_(m, v.sqrt().add_(self.eps), value=-step_size)
        self.m.index_copy_(0, rows, m)
        self.v.index_copy_(0, rows, v)
        self.w.index_copy_(0, rows, w)


def run_child(args) -> dict:
    """One optimizer, alone in this process, for ``--minutes``."""
    kind = args.child
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.state_dir, prefix="bench-long-") as tmp:
        stat = block_device_stat(Path(tmp))
        table = None
        if args.table == "disk":
            table = DiskEmbedding(args.rows, args.dim, path=Path(tmp) / "table", std=1.0, seed=0)
            weight = table.weight
        else:
            weight = torch.nn.Parameter(torch.randn(args.rows, args.dim))
        budget = {} if args.memory_budget is None else {"memory_budget": args.memory_budget}
        opt = None
        if kind == "dsa":
            opt = DiskSparseAdam([("weight", weight)], lr=1e-3, state_dir=Path(tmp) / "state", **budget)
            model = table if table is not None else torch.nn.ParameterDict({"weight": weight})
            store = CheckpointStore(Path(tmp) / "checkpoints")
            CheckpointStore.count_from_creation(
                opt
            )  # a fresh run's: its first checkpoint may be a delta on the files as made
        elif kind == "sparse_adam":
            opt = torch.optim.SparseAdam([weight], lr=1e-3)
        floor = FloorStep(weight.data) if kind == "floor" else None
        prefetch = shared_prefetcher() if table is not None else None
        grads = batches(args, seed=1)
        minutes = []  # one entry per minute of stepping; checkpoints fall between minutes
        checkpoints = []
        run_seconds, stepped = args.minutes * 60, 0.0
        checkpoint_every = max(1, round(args.checkpoint_minutes * 60 / args.minute_seconds))  # in whole minutes
        grad = next(grads)
        while stepped < run_seconds:
            window = min(args.minute_seconds, run_seconds - stepped)
            steps, batch_times = [], []
            sectors, minute_start = sectors_written(stat), time.perf_counter()
            while time.perf_counter() - minute_start < window:
                t0 = time.perf_counter()
                nxt = next(grads)  # made before the step, so the prefetch of the next batch can overlap it
                batch_times.append(time.perf_counter() - t0)
                if kind == "batches":
                    steps.append(batch_times[-1])
                    continue
                if prefetch is not None:
                    prefetch.submit(table.table.rows, nxt._indices()[0], claim=True)
                t0 = time.perf_counter()
                if floor is not None:
                    floor.step(grad)
                else:
                    weight.grad = grad
                    opt.step()
                    weight.grad = None
                steps.append(time.perf_counter() - t0)
                grad = nxt
            seconds = time.perf_counter() - minute_start
            minutes.append(_minute(steps, batch_times, sectors, sectors_written(stat), seconds))
            stepped += seconds
            due = kind == "dsa" and args.checkpoint_minutes and len(minutes) % checkpoint_every == 0
            if due and stepped < run_seconds:
                before = sectors_written(stat)
                t0 = time.perf_counter()
                held = checkpoint(args, store, model, opt, len(checkpoints) + 1)
                checkpoints.append(
                    {
                        "at_min": round(stepped / 60, 2),
                        "s": round(time.perf_counter() - t0, 2),
                        "MiB": _mib(before, sectors_written(stat)),
                        **held,
                    }
                )
        if prefetch is not None:
            prefetch.wait()
        rss = rss_anon_bytes()
        residency = None
        if opt is not None and kind == "dsa":
            residency = {k.replace("_bytes", "") + "_MiB": round(v / MiB) for k, v in opt.residency().items()}
            opt.close()
        if table is not None:
            table.table.close()
    steady_minutes = minutes[1:] or minutes
    steady = [m["median_ms"] for m in steady_minutes]
    batch = [m["batch_median_ms"] for m in steady_minutes]
    step_per_batch = [s / b for s, b in zip(steady, batch) if b]  # the step in units of the machine's speed that minute
    written = sum(m["MiB_written"] or 0 for m in minutes)
    hours = sum(m["seconds"] for m in minutes) / 3600
    return {
        "kind": kind,
        "minutes": minutes,
        "checkpoints": checkpoints,
        "steady_median_ms": round(statistics.median(steady), 1),
        "best_minute_ms": min(steady),
        "worst_minute_ms": max(steady),
        "batch_worst_over_best": round(max(batch) / min(batch), 2),
        "step_per_batch_worst_over_best": round(max(step_per_batch) / min(step_per_batch), 2),
        "GB_written_per_hour_between_checkpoints": round(written / 1024 * 1.073741824 / hours, 2) if stat else None,
        "rss_anon_MiB_at_end": round(rss / MiB),
        "residency_MiB": residency,
    }


def checkpoint(args, store: CheckpointStore, model: torch.nn.Module, opt: DiskSparseAdam, number: int) -> dict:
    """One checkpoint as ``--checkpoint`` says; what its files hold on disk (MiB) and how each
    row file went in (a base or a delta)."""
    if args.checkpoint == "flush":
        opt.flush()
        os.sync()  # what the flush made dirty elsewhere (the manifest) counts here too
        return {}
    folder = store.save(number, model, opt, {"run_id": "bench", "step": number}, keep=2)
    files = [p for p in folder.rglob("*") if p.is_file()]
    rows = {
        p.name: "delta" if p.name.endswith(".delta") else "base"
        for p in files
        if p.suffix in (".rows", ".delta") or p.parent.name == "tables"
    }
    return {"MiB_held": round(sum(p.stat().st_blocks * 512 for p in files) / MiB, 1), "row_files": rows}


def _mib(before, after) -> float | None:
    return None if before is None else round((after - before) * 512 / MiB, 1)


def _minute(steps: list[float], batch_times: list[float], sectors, sectors_now, seconds: float) -> dict:
    """One minute of stepping. ``batch_median_ms`` times the making of a batch, which touches
    nothing of the optimizer: the machine's own speed that minute, to read a slow minute by."""
    return {
        "steps": len(steps),
        "median_ms": round(statistics.median(steps) * 1e3, 2) if steps else None,
        "batch_median_ms": round(statistics.median(batch_times) * 1e3, 2) if batch_times else None,
        "MiB_written": _mib(sectors, sectors_now),
        "seconds": round(seconds, 1),
        "rss_anon_MiB": round(rss_anon_bytes() / MiB),
    }


def child(args, kind: str, minutes: float) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--minutes", str(minutes)]
    for flag in (
        "rows",
        "dim",
        "lookups",
        "distribution",
        "zipf",
        "state_dir",
        "table",
        "checkpoint_minutes",
        "minute_seconds",
        "checkpoint",
        "memory_budget",
    ):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"kind": kind, "error": f"exit {out.returncode}: {out.stderr.strip()[-500:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def busy_load(workers: int) -> list[subprocess.Popen]:
    """``workers`` processes that keep a core and the memory bus busy (a 2048 x 2048 float32
    matrix product and a 256 MiB copy, over and over, each on one thread): another user's job
    on the same machine, for the busy-machine regime."""
    loop = (
        "import os; os.environ['OMP_NUM_THREADS'] = '1'\nimport torch\ntorch.set_num_threads(1)\n"
        "a = torch.randn(2048, 2048); b = torch.empty(64 << 20); c = torch.empty_like(b)\n"
        "while True:\n    a @ a\n    c.copy_(b)\n"
    )
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(workers)]


def fits_in_ram(args) -> bool:
    room = host_available_bytes()
    return room is None or 3 * 4 * args.rows * args.dim * 1.2 < room


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=65_536)
    parser.add_argument("--distribution", choices=("uniform", "power"), default="uniform")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="DiskSparseAdam's minutes of stepping (checkpoints come on top)"
    )
    parser.add_argument("--reference-minutes", type=float, default=3.0, help="SparseAdam's and the floor's windows")
    parser.add_argument(
        "--checkpoint-minutes", type=float, default=5.0, help="checkpoint DiskSparseAdam this often (0: never)"
    )
    parser.add_argument(
        "--checkpoint", choices=("save", "flush"), default="save", help="a training run's checkpoint, or flush() only"
    )
    parser.add_argument(
        "--minute-seconds", type=float, default=60.0, help="the reporting window's length (a 'minute'; short for tests)"
    )
    parser.add_argument("--state-dir", default=None, help="where the state lives (default: the temp dir)")
    parser.add_argument("--table", choices=("memory", "disk"), default="memory")
    parser.add_argument("--memory-budget", default=None, help="DiskSparseAdam's memory_budget (default: its own)")
    parser.add_argument("--only", choices=KINDS, action="append", help="run only these (repeatable)")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="processes that load the machine (a core and the memory bus each) throughout",
    )
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    kinds = args.only or [
        k for k in KINDS if k == "dsa" or (k != "batches" and (args.table == "memory" or fits_in_ram(args)))
    ]
    print(
        f"# {args.rows:,} x {args.dim}, {args.lookups:,} {args.distribution} lookups a step, table in {args.table}, "
        f"state in {args.state_dir or tempfile.gettempdir()}, memory_budget {args.memory_budget or 'default'}, "
        f"{args.busy} busy processes beside it",
        flush=True,
    )
    results = {}
    load = busy_load(args.busy)
    try:
        for kind in kinds:
            results[kind] = child(args, kind, args.minutes if kind in ("dsa", "batches") else args.reference_minutes)
            print(json.dumps(results[kind]), flush=True)
    finally:
        for worker in load:
            worker.kill()
    dsa = results.get("dsa", {})
    if "steady_median_ms" in dsa:
        print(
            f"DiskSparseAdam: steady {dsa['steady_median_ms']} ms a step, worst minute / best minute "
            f"{dsa['worst_minute_ms'] / dsa['best_minute_ms']:.2f} (the making of a batch, which touches no optimizer "
            f"state: {dsa['batch_worst_over_best']:.2f}; the step over it: {dsa['step_per_batch_worst_over_best']:.2f}), "
            f"GB written an hour between checkpoints "
            f"{dsa['GB_written_per_hour_between_checkpoints']}, checkpoints {dsa['checkpoints']}"
        )
        evicted = (dsa["residency_MiB"] or {}).get("evicted_MiB")
        between = sum(m["MiB_written"] or 0 for m in dsa["minutes"])
        if evicted:
            print(
                f"past the budget: {evicted:,} MiB of changed pages left memory, {between:,.0f} MiB reached the disk "
                f"between checkpoints ({between / evicted:.2f}x)"
            )
        for c in dsa["checkpoints"]:
            if c.get("MiB_held") and c["MiB"] is not None:
                print(
                    f"checkpoint at minute {c['at_min']}: {c['s']} s, {c['MiB']:,.0f} MiB written for {c['MiB_held']:,.0f} MiB "
                    f"held ({c['MiB'] / c['MiB_held']:.2f}x), row files {c['row_files']}"
                )
        for other in ("sparse_adam", "floor"):
            if "steady_median_ms" in results.get(other, {}):
                print(f"DiskSparseAdam / {other}: {dsa['steady_median_ms'] / results[other]['steady_median_ms']:.2f}")
    machine = results.get("batches", {})
    if "steady_median_ms" in machine:
        print(
            f"the making of batches alone: {machine['steady_median_ms']} ms a batch, worst minute / best minute "
            f"{machine['worst_minute_ms'] / machine['best_minute_ms']:.2f} (the machine's own variation)"
        )


if __name__ == "__main__":
    main()
