"""Seeded runs repeat bit for bit (docs/guarantees.md, "Exactness"): small versions (a few
``--set`` overrides) of three shipped recipes, a knowledge graph (quickstart), node2vec
(karate-node2vec) and DLRM (recsys-quickstart), each run whole in two separate processes
(slow: about 15 s each on 2 cores), each with its own data root (the dataset generated or imported again). Their metrics.jsonl, timing
and memory fields aside, and every tensor of their final checkpoints (model.pt, optimizer.pt,
the optimizer's row-file records) are equal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train.runs.checkpoint_store import CheckpointStore

from .test_checkpoint_deltas import history

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from torture_kill import records_of  # noqa: E402

SMALL = {
    "quickstart": {
        "dataset.synthetic.entities": 300,
        "dataset.synthetic.triples": 3000,
        "dataset.synthetic.valid": 100,
        "dataset.synthetic.test": 100,
        "model.dim": 16,
        "train.epochs": 1,
        "train.max_steps": 6,
        "train.batch_size": 128,
        "train.negatives": 32,
        "train.checkpoint_every": 3,
        "train.log_every": 1,
    },
    "karate-node2vec": {"train.epochs": 3, "eval.every_epochs": 2},
    "recsys-quickstart": {
        "dataset.clicks.samples": 4000,
        "dataset.clicks.valid": 500,
        "dataset.clicks.test": 500,
        "dataset.clicks.ids": 500,
        "model.recsys.rows": 500,
        "train.batch_size": 256,
    },
}

CHILD = textwrap.dedent(
    """
    import sys
    from typer.testing import CliRunner
    from dsa_train.cli.app import app

    for name, sets in {runs!r}.items():
        args = [a for key, value in sets.items() for a in ("--set", f"{{key}}={{value}}")]
        done = CliRunner().invoke(app, ["run", name, "--output", f"{out}/{{name}}", *args])
        if done.exit_code:
            sys.exit(f"{{name}}: {{done.output}}")
    """
)


def final_tensors(run: Path) -> dict:
    """Every tensor of the run's final checkpoint: its .pt files' (flattened) and its row files'
    records (past their headers, which name the run's own ids)."""
    final = CheckpointStore(run / "checkpoints").complete()[-1]
    tensors = {}
    for path in sorted(final.rglob("*")):
        name = str(path.relative_to(final))
        if path.suffix == ".pt":
            tensors.update(flatten(name, torch.load(path, weights_only=False)))
        elif path.name.endswith((".rows", ".table", ".delta")):
            tensors[name] = torch.from_numpy(np.array(records_of(final, name.removesuffix(".delta"))))
    return tensors


def flatten(prefix: str, obj) -> dict:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flatten(f"{prefix}/{key}", value).items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in flatten(f"{prefix}/{i}", value).items()}
    return {}


@pytest.mark.slow  # two processes, each importing torch_geometric and running three recipes: ~30 s on 2 cores
def test_seeded_runs_of_shipped_recipes_repeat_bit_for_bit_across_processes(tmp_path):
    runs = SMALL
    children = []
    for n in (1, 2):
        env = {**os.environ, "DSA_DATA_ROOT": str(tmp_path / f"data{n}")}
        script = CHILD.format(runs=runs, out=str(tmp_path / f"runs{n}"))
        children.append(subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True))
    for child in children:
        _, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
    for name in runs:
        first, second = tmp_path / "runs1" / name, tmp_path / "runs2" / name
        records = history(first)
        assert any("loss" in r for r in records) and any(r.get("kind") == "eval" for r in records), records
        assert history(second) == records, name
        ours, theirs = final_tensors(first), final_tensors(second)
        assert ours and ours.keys() == theirs.keys(), (name, sorted(ours), sorted(theirs))
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), f"{name}: {key} differs between the two processes"
