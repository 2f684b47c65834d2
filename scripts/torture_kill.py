#!/usr/bin/env python
"""Kill a training run with SIGKILL again and again, resume it each time, and compare.

A small recipe is trained once without interruption (the reference). Then the same recipe
is started, killed with SIGKILL at a chosen moment, resumed with --resume, killed again, and
so on; the moments cycle through "step" (somewhere inside training steps), "checkpoint"
(while a checkpoint is being written) and "evaluation" (while a split is being ranked).
Finally the run is resumed to the end, and its final weights, optimizer moments and whole
metrics history (losses and metrics; timings aside) must equal the reference's bit for bit.

With ``--storage disk`` the entity table is a disk table (weights and moments in one file)
in a larger graph, checkpointed every 3 steps, so checkpoints are deltas of the rows written
(the first one of a fresh run a delta on the table as it was made) and their chains are
compacted every few checkpoints; a fourth moment, "compaction", kills while a checkpoint
that compacts a chain is written (the newest complete one ends a chain of the longest
allowed length). The final checkpoints' tables are compared as their chains make them.

    python scripts/torture_kill.py --kills 21
    python scripts/torture_kill.py --kills 20 --storage disk
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RECIPE = """\
name: torture
description: a small run to kill again and again
dataset:
  kind: synthetic
  synthetic: {entities: 600, relations: 8, triples: 6000, valid: 300, test: 300, clusters: 12, seed: 3}
model: {kind: distmult, dim: 32, init_std: 0.05, dropout: 0.1}
train: {epochs: %(epochs)d, batch_size: 128, negatives: 128, log_every: 2, checkpoint_every: 6, keep_checkpoints: 2}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 1, final_splits: [valid, test]}
"""
DISK_RECIPE = """\
name: torture
description: a disk table, checkpointed as deltas, to kill again and again
dataset:
  kind: synthetic
  synthetic: {entities: 20000, relations: 8, triples: 6000, valid: 200, test: 200, clusters: 12, seed: 3}
model: {kind: distmult, dim: 16, init_std: 0.05, dropout: 0.1, embedding_storage: disk}
train: {epochs: %(epochs)d, batch_size: 64, negatives: 16, log_every: 2, checkpoint_every: 3, keep_checkpoints: 2}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 1, final_splits: [valid, test]}
"""
MOMENTS = {"memory": ("step", "checkpoint", "evaluation"), "disk": ("step", "checkpoint", "compaction", "evaluation")}


def dsa_train() -> list[str]:
    found = shutil.which("dsa-train", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    return [found] if found else [sys.executable, "-m", "dsa_train.cli"]


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by the kill
            break
    return out


def moment_reached(moment: str, run: Path, seen: int) -> bool:
    if moment == "checkpoint":
        return (
            any(p.name.startswith(".partial-") for p in (run / "checkpoints").glob(".*"))
            if (run / "checkpoints").is_dir()
            else False
        )
    if moment == "compaction":  # a checkpoint is written after one that ends a chain of MAX_LINKS deltas
        return moment_reached("checkpoint", run, seen) and chain_is_full(run)
    logged = records(run)
    if moment == "evaluation":  # the epoch record is written; its evaluation runs now
        return len(logged) > seen and logged[-1].get("kind") == "epoch"
    return len(logged) > seen and logged[-1].get("kind") == "train"


def chain_is_full(run: Path) -> bool:
    from dsa_train.storage.deltas import read_delta_header
    from dsa_train.runs.checkpoint_rows import MAX_LINKS
    from dsa_train.runs.checkpoint_store import CheckpointStore

    complete = CheckpointStore(run / "checkpoints").complete()
    deltas = list((complete[-1] / "tables").glob("*.delta")) if complete else []
    try:
        return bool(deltas) and read_delta_header(deltas[0])["links"] == MAX_LINKS
    except Exception:  # removed or replaced while read: not this time
        return False


def kill_at(moment: str, recipe: Path, run: Path, resume: bool, rng: random.Random, timeout: float) -> str:
    """Start (or resume) the run, SIGKILL it at the moment; how it went, in words."""
    seen = len(records(run))
    command = [*dsa_train(), "run", str(recipe), "--output", str(run)] + (["--resume"] if resume else [])
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    while process.poll() is None and time.monotonic() - started < timeout:
        if moment_reached(moment, run, seen):
            if moment == "step":
                time.sleep(rng.uniform(0, 0.05))
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            step = max((r.get("step", 0) for r in records(run)), default=0)
            return f"killed during {moment:10s} (about step {step})"
        time.sleep(0.001)
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        return f"killed after {timeout:.0f} s waiting for the {moment}"
    return f"finished before the {moment} came (exit {process.returncode})"


def comparable(run: Path) -> list[dict]:
    from dsa_train.runs.run_folder import MetricsLog

    return [{k: v for k, v in r.items() if k not in MetricsLog.MACHINE_FIELDS} for r in records(run)]


def records_of(checkpoint: Path, name: str) -> np.ndarray:
    """Every record of a checkpoint's version of a row file (a base, or a delta read through
    its chain, which may start at the table as it was made), past the header (which names the
    run's own table and state ids)."""
    from dsa_train.storage.deltas import DELTA_SUFFIX, ChainReader, chain_of, read_delta_header
    from dsa_train.storage.format import read_row_header

    path = checkpoint / name
    if not path.exists():
        path = path.with_name(path.name + DELTA_SUFFIX)
    chain = chain_of(path)
    row_bytes = (read_delta_header(path) if path.name.endswith(DELTA_SUFFIX) else read_row_header(path))["row_bytes"]
    with ChainReader(chain, row_bytes) as reader:
        return reader.read(0, reader.num_rows)


def same_tensors(a: dict, b: dict) -> bool:
    """The same keys, at least one tensor among them, and equal tensors under each (a
    comparison over ``a``'s keys alone would pass keys missing from ``b``, or no tensors)."""
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    return (
        a.keys() == b.keys()
        and bool(tensors)
        and all(isinstance(b[k], torch.Tensor) and torch.equal(a[k], b[k]) for k in tensors)
    )


def same_run(a: Path, b: Path, storage: str) -> dict[str, bool]:
    final_a = sorted((a / "checkpoints").iterdir())[-1]
    final_b = sorted((b / "checkpoints").iterdir())[-1]
    weights_a, weights_b = torch.load(final_a / "model.pt"), torch.load(final_b / "model.pt")
    rows = ["optimizer_state/rel_emb.weight.rows"]
    rows += ["tables/entities.table"] if storage == "disk" else ["optimizer_state/node_emb.weight.rows"]
    moments = all(np.array_equal(records_of(final_a, name), records_of(final_b, name)) for name in rows)
    return {
        "same final step": final_a.name == final_b.name,
        "weights equal": same_tensors(weights_a, weights_b),
        "moments equal" if storage == "memory" else "table (weights and moments) and moments equal": moments,
        "history equal": comparable(a) == comparable(b),
    }


def torture(
    kills: int, workdir: Path, seed: int = 0, timeout: float = 120.0, log=print, storage: str = "memory"
) -> dict:
    rng = random.Random(seed)
    recipe = workdir / "torture.yaml"
    moments = MOMENTS[storage]
    text = RECIPE if storage == "memory" else DISK_RECIPE
    recipe.write_text(text % {"epochs": kills // len(moments) + 2})  # a cycle of moments takes about an epoch
    reference, victim = workdir / "reference", workdir / "victim"
    done = subprocess.run(
        [*dsa_train(), "run", str(recipe), "--output", str(reference)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{done.stderr}")
    counts = dict.fromkeys(moments, 0)
    for i in range(kills):
        moment = moments[i % len(moments)]
        outcome = kill_at(moment, recipe, victim, resume=victim.exists(), rng=rng, timeout=timeout)
        counts[moment] += outcome.startswith("killed during")
        log(f"kill {i + 1:3d}: {outcome}")
    final = subprocess.run(
        [*dsa_train(), "run", str(recipe), "--output", str(victim), "--resume"], capture_output=True, text=True
    )
    if final.returncode != 0:
        raise SystemExit(f"the final resume failed:\n{final.stderr}")
    return {"kills": counts, **same_run(reference, victim, storage)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=21, help="how many times to SIGKILL the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill timing")
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--storage",
        choices=sorted(MOMENTS),
        default="memory",
        help="the entity table in memory, or on disk (delta checkpoints)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = torture(args.kills, workdir, args.seed, storage=args.storage)
    counts = result.pop("kills")
    landed = ", ".join(f"{n} during a{'n' if moment[0] in 'aeiou' else ''} {moment}" for moment, n in counts.items())
    print(f"{sum(counts.values())} kills landed ({landed}), then a final --resume:")
    for check, ok in result.items():
        print(f"  {check}: {'yes' if ok else 'NO'}")
    sys.exit(0 if all(result.values()) else 1)


if __name__ == "__main__":
    main()
