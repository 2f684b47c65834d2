"""Where a training step's time goes: torch's profiler over a window of steps of a recipe.

Trains the recipe (with ``--set`` overrides, as ``dsa-train run`` takes them) in this process
for ``--skip + --steps`` steps, profiles the last ``--steps`` and prints their mean wall time per
step and the operators that took the most CPU time. The profiler's own overhead is in the
figure: compare runs of this script with each other, not with a run's ``items_per_s``.

The FB15k-237 equal setting of docs/peers.md section 6, DistMult::

    python scripts/profile_step.py recipes/umls-distmult.yaml --set dataset.path=/tmp/peerdata/FB15k-237/raw \\
        --set model.dim=128 --set model.dropout=0 --set model.reciprocal=false \\
        --set model.normalize_entities=false --set train.batch_size=1024 --set train.negatives=32 \\
        --set train.batch_negatives=false --set train.loss=softplus --set optimizer.lr=0.01

Regime: one process on a warm machine, a fresh optimizer state (the first ``--skip`` steps
are its warm-up), the model's step and the optimizer's together.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="a recipe's path or shipped name")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    p.add_argument("--skip", type=int, default=20, help="steps before the profiled window")
    p.add_argument("--steps", type=int, default=60, help="steps profiled")
    p.add_argument("--rows", type=int, default=20, help="operators listed")
    args = p.parse_args()

    from dsa_train.threads import prefer_sleeping_threads

    prefer_sleeping_threads()  # as the dsa-train command does, before torch is imported
    from torch.profiler import ProfilerActivity, profile

    import dsa_train
    from dsa_train.train import loop

    step, window = loop.Training.step, {"done": 0, "seconds": 0.0, "profiler": None}
    last = args.skip + args.steps

    def timed_step(training, picked):
        window["done"] += 1
        if window["done"] == args.skip + 1:
            window["profiler"] = profile(activities=[ProfilerActivity.CPU])
            window["profiler"].__enter__()
        started = time.perf_counter()
        loss = step(training, picked)
        if window["done"] > args.skip:
            window["seconds"] += time.perf_counter() - started
        if window["done"] == last:
            window["profiler"].__exit__(None, None, None)
        return loss

    loop.Training.step = timed_step
    overrides = [*args.overrides, f"train.max_steps={last}", "eval.every_epochs=0", "eval.final_splits=[]"]
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        dsa_train.run(args.recipe, overrides=overrides, output=Path(tmp) / "run")
    if window["done"] < last:
        raise SystemExit(f"the run took {window['done']} steps, fewer than --skip + --steps = {last}")
    print(f"{args.steps} steps after {args.skip}: {window['seconds'] / args.steps * 1e3:.2f} ms/step (profiled)")
    print(window["profiler"].key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
