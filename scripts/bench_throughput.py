#!/usr/bin/env python
"""Training throughput of one recipe with DiskSparseAdam and with torch's SparseAdam.

Each optimizer trains in a process of its own, started fresh for each measurement (the script
runs itself with the hidden ``--child dsa|sparse_adam``), with a fresh temporary run folder:
the optimizer state starts cold. Both train the same recipe from the same seed on the same
batches (the training loop's own epoch order, ``Training.step`` for each step). ``--repeats``
rounds alternate which optimizer goes first (ABBA...), so that both see the same machine
conditions; one process never holds both models, both optimizers' thread pools or both
OpenMP teams, which distorted the old step-by-step alternation in one process.

Each child times whole steps (forward, backward, optimizer) after ``--warmup`` untimed steps
(and ``--warm-epochs`` untimed epochs first, if asked) and reports items (triples, nodes or
edges) per second over the timed steps, the median step, the wall time and the process CPU
time of the timed steps (``time.process_time()``: every thread of the process). The parent
prints each round, the median over rounds and the spread (min-max) of the dsa / sparse_adam
ratios of throughput and of CPU time.

    python scripts/bench_throughput.py recipes/fb15k237-distmult.yaml --steps 200
    python scripts/bench_throughput.py recipes/cora-node2vec.yaml --steps 60 --repeats 5

``--dsa-set`` overrides DiskSparseAdam's recipe only, after ``--set``: a table on disk, which
torch's SparseAdam cannot train (it updates the weight in place), against SparseAdam's table in
RAM::

    python scripts/bench_throughput.py recipes/synthetic-10m-recsys.yaml --set model.embedding_storage=memory \
        --dsa-set model.embedding_storage=disk --steps 200 --warmup 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("dsa", "sparse_adam")
SCRIPT = Path(__file__).resolve()


# -- the child: one optimizer, one fresh process ---------------------------------------------
def train_child(
    kind: str,
    recipe_path: Path,
    overrides: list[str],
    *,
    steps: int,
    warmup: int,
    warm_epochs: int = 0,
    folder: Path | None = None,
) -> dict:
    """Train ``recipe_path`` with optimizer ``kind`` in a fresh temporary run folder (under
    ``folder``) and time ``steps`` steps after ``warm_epochs`` epochs and ``warmup`` steps.
    Meant to run in a process of its own: see :func:`spawn_child`."""
    from dsa_train.threads import prefer_sleeping_threads

    prefer_sleeping_threads()  # what `dsa-train run` does for its process, before torch loads
    import torch  # only the child pays for torch and the training code

    from dsa_train.data.order import Shuffle
    from dsa_train.memory import peak_rss_bytes
    from dsa_train.recipe import load_recipe
    from dsa_train.train.loop import Training
    from dsa_train.train.seeding import step_seed
    from dsa_train.runs.run_folder import RunFolder

    with tempfile.TemporaryDirectory(prefix=f"dsa-bench-{kind}-", dir=folder) as tmp:
        recipe = load_recipe(recipe_path, [*overrides, f"optimizer.kind={kind}"])
        run = RunFolder.create(recipe, Path(tmp) / "run")
        training = Training(recipe, run)
        try:
            began = time.perf_counter()
            training.setup(resume=False)
            setup_s = time.perf_counter() - began
            task, cfg = training.task, recipe.train
            items, batch = task.epoch_items(), cfg.batch_size
            per_epoch = math.ceil(items / batch)
            prefetch = recipe.model.embedding_storage == "disk"
            orders: dict[int, Shuffle] = {}

            def batch_at(i: int):  # the loop's epoch order (Training._train), epoch after epoch
                epoch, b = divmod(i, per_epoch)
                if epoch not in orders:
                    orders.clear()
                    orders[epoch] = Shuffle(items, step_seed(cfg.seed, -1 - epoch))
                return orders[epoch].slice(b * batch, (b + 1) * batch)

            untimed = warm_epochs * per_epoch + warmup
            durations, losses, timed_items = [], [], 0
            upcoming = batch_at(0)
            for i in range(untimed + steps):
                if i == untimed:
                    wall_began, cpu_began = time.perf_counter(), time.process_time()
                picked = upcoming
                upcoming = batch_at(i + 1)
                if prefetch:  # as the loop does: the next batch's rows are read while this one computes
                    task.prefetch(upcoming)
                step_began = time.perf_counter()
                loss = training.step(picked)
                if i >= untimed:
                    durations.append(time.perf_counter() - step_began)
                    losses.append(loss)
                    timed_items += len(picked)
            wall = time.perf_counter() - wall_began
            cpu = time.process_time() - cpu_began
        finally:
            training.close()
            run.release()
    return {
        "kind": kind,
        "recipe": recipe.name,
        "unit": task.unit,
        "epoch_items": items,
        "batch": batch,
        "dim": recipe.model.dim,
        "steps": steps,
        "warmup": warmup,
        "warm_epochs": warm_epochs,
        "items": timed_items,
        "items_per_s": timed_items / wall,
        "median_step_ms": statistics.median(durations) * 1e3,
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_wall": cpu / wall,
        "setup_s": setup_s,
        "loss_sum": math.fsum(losses),
        "last_loss": losses[-1],
        "peak_rss_mib": peak_rss_bytes() / (1 << 20),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "pid": os.getpid(),
    }


def spawn_child(
    kind: str,
    recipe_path: Path,
    overrides: list[str],
    *,
    steps: int,
    warmup: int,
    warm_epochs: int = 0,
    folder: Path | None = None,
    timeout: float | None = None,
) -> dict:
    """Run :func:`train_child` in a fresh Python process, its run folder in a temporary folder
    under ``folder`` that this process removes whatever happens (a child stopped by an error or
    a signal here is killed and leaves its files); returns the JSON object the child prints."""
    own = Path(tempfile.mkdtemp(prefix=f"dsa-bench-{kind}-", dir=folder))
    command = [
        sys.executable,
        str(SCRIPT),
        "--child",
        kind,
        str(Path(recipe_path).resolve()),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--warm-epochs",
        str(warm_epochs),
        "--dir",
        str(own),
    ]
    command += [f"--set={o}" for o in overrides]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout
        )  # kills and reaps it on any error
    finally:
        shutil.rmtree(own, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} child failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the {kind} child printed no JSON line:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


# -- the parent: rounds, medians, spreads ----------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratios(rounds: list[dict]) -> dict:
    """dsa / sparse_adam ratios of each round's throughput, wall time and CPU time."""
    per = {
        "throughput": [r["dsa"]["items_per_s"] / r["sparse_adam"]["items_per_s"] for r in rounds],
        "wall": [r["dsa"]["wall_s"] / r["sparse_adam"]["wall_s"] for r in rounds],
        "cpu": [r["dsa"]["cpu_s"] / r["sparse_adam"]["cpu_s"] for r in rounds],
    }
    return {key: {**spread(values), "rounds": values} for key, values in per.items()}


def medians(rounds: list[dict]) -> dict:
    fields = ("items_per_s", "median_step_ms", "wall_s", "cpu_s", "cpu_per_wall", "peak_rss_mib")
    return {kind: {f: statistics.median(r[kind][f] for r in rounds) for f in fields} for kind in KINDS}


def header(first: dict, args, what: str) -> str:
    warm = f" and {first['warm_epochs']} untimed epochs" if first["warm_epochs"] else ""
    return (
        f"{first['recipe']}: {first['epoch_items']:,} {first['unit']} per epoch, batch {first['batch']}, dim {first['dim']}; "
        f"{first['steps']} timed steps after {first['warmup']} untimed steps{warm}; torch {first['torch']}, "
        f"{first['threads']} threads, {first['cpus']} CPUs\n"
        f"each optimizer in a fresh process with a fresh run folder (the optimizer state starts cold), "
        f"{what}, {args.repeats} round{'s' * (args.repeats != 1)} alternating which optimizer goes first"
    )


def describe(result: dict) -> str:
    return (
        f"{result['kind']:12s} {result['items_per_s']:10,.0f} {result['unit']}/s  median step {result['median_step_ms']:7.1f} ms  "
        f"wall {result['wall_s']:7.2f} s  CPU {result['cpu_s']:7.2f} s ({result['cpu_per_wall']:.2f} cores)"
    )


def show_ratio(name: str, r: dict, unit: str = "x") -> str:
    return f"{name} {r['median']:.2f}{unit} (rounds {r['min']:.2f}-{r['max']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--warm-epochs", type=int, default=0, help="untimed whole epochs before the warmup steps")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each optimizer once a round (default 3)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    parser.add_argument(
        "--dsa-set",
        dest="dsa_overrides",
        action="append",
        default=[],
        help="override for DiskSparseAdam's run only, after --set (e.g. model.embedding_storage=disk)",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the children's temporary run folders go (default: the system's)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.warm_epochs < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1, --warmup and --warm-epochs at least 0")

    if args.child:
        parent = os.getppid()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the run folder is still removed
        try:  # stopped when the parent dies, even by SIGKILL (Linux), rather than train on unseen
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:
            pass
        try:
            result = train_child(
                args.child,
                args.recipe,
                args.overrides,
                steps=args.steps,
                warmup=args.warmup,
                warm_epochs=args.warm_epochs,
                folder=args.dir,
            )
        finally:
            if args.dir is not None and os.getppid() != parent:  # orphaned: the parent cannot remove its folder
                try:
                    args.dir.rmdir()  # empty by now (train_child's own folder is gone)
                except OSError:
                    pass
        print(json.dumps(result), flush=True)
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the child's folder (spawn_child)
    rounds = []
    for r in range(args.repeats):
        order = KINDS if r % 2 == 0 else KINDS[::-1]
        results = {}
        for kind in order:
            results[kind] = spawn_child(
                kind,
                args.recipe,
                args.overrides + (args.dsa_overrides if kind == "dsa" else []),
                steps=args.steps,
                warmup=args.warmup,
                warm_epochs=args.warm_epochs,
                folder=args.dir,
            )
        rounds.append({"order": list(order), **results})
        out = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the JSON document only
        if r == 0:
            print(header(results["dsa"], args, "one after the other"), file=out, flush=True)
        ratio = ratios([rounds[-1]])
        print(f"round {r + 1} ({order[0]} first):", file=out, flush=True)
        for kind in KINDS:
            print(f"  {describe(results[kind])}", file=out, flush=True)
        print(
            f"  dsa / sparse_adam: throughput {ratio['throughput']['median']:.2f}x, CPU time {ratio['cpu']['median']:.2f}x",
            file=out,
            flush=True,
        )
    summary = {"median": medians(rounds), "ratio": ratios(rounds)}
    same = all(r["dsa"]["loss_sum"] == r["sparse_adam"]["loss_sum"] for r in rounds)
    if args.json:
        first = rounds[0]["dsa"]
        setting = {
            k: first[k]
            for k in (
                "recipe",
                "unit",
                "epoch_items",
                "batch",
                "dim",
                "steps",
                "warmup",
                "warm_epochs",
                "torch",
                "threads",
                "cpus",
            )
        }
        print(
            json.dumps(
                {
                    "setting": {
                        **setting,
                        "repeats": args.repeats,
                        "overrides": args.overrides,
                        "dsa_overrides": args.dsa_overrides,
                        "state": "cold (fresh run folder per process)",
                    },
                    "rounds": rounds,
                    **summary,
                    "losses_identical": same,
                },
                indent=2,
            )
        )
        return
    unit = rounds[0]["dsa"]["unit"]
    print(f"median over {args.repeats} round{'s' * (args.repeats != 1)}:")
    for kind in KINDS:
        m = summary["median"][kind]
        print(
            f"  {kind:12s} {m['items_per_s']:10,.0f} {unit}/s  median step {m['median_step_ms']:7.1f} ms  "
            f"wall {m['wall_s']:7.2f} s  CPU {m['cpu_s']:7.2f} s ({m['cpu_per_wall']:.2f} cores)"
        )
    print(
        f"  dsa / sparse_adam: {show_ratio('throughput', summary['ratio']['throughput'])}, {show_ratio('CPU time', summary['ratio']['cpu'])}"
    )
    print(
        f"  losses of the timed steps: {'identical for both optimizers' if same else 'DIFFER between the optimizers'}"
    )


if __name__ == "__main__":
    main()
