"""How dsa-train sets up torch's threads: they sleep when idle, unless the user says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
from dsa_train.threads import prefer_sleeping_threads
{before}
applied = prefer_sleeping_threads()
print(applied, os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize(
    ("user_choice", "before", "expected"),
    [
        ({}, "", "True None PASSIVE"),  # the default dsa-train gives its processes
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "", "False None ACTIVE"),  # a user's own choice is kept
        ({"GOMP_SPINCOUNT": "20000"}, "", "False 20000 None"),
        ({}, "import torch", "False None None"),  # too late once torch has loaded libgomp: nothing changed
    ],
)
def test_threads_sleep_when_idle_unless_the_user_says_otherwise(user_choice, before, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user_choice)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_the_cli_sets_the_policy_before_torch_is_imported():
    """The console script's module imports no torch, so its main() is early enough."""
    code = "import sys, dsa_train.cli.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_training_keeps_the_cycle_collector_off_what_lives_as_long_as_it(tmp_path):
    """Objects alive after setup (torch's ~300,000 among them) are frozen out of the cycle
    collector's full passes while the training runs, and handed back when it closes."""
    import gc
    from pathlib import Path

    from dsa_train.recipe import load_recipe
    from dsa_train.train.loop import Training
    from dsa_train.runs.run_folder import RunFolder

    recipe_path = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml"
    recipe = load_recipe(
        recipe_path, ["dataset.synthetic.triples=3000", "dataset.synthetic.valid=100", "dataset.synthetic.test=100"]
    )
    training = Training(recipe, RunFolder.create(recipe, tmp_path / "run"))
    gc.unfreeze()  # whatever ran before in this process (another test) froze nothing we count
    assert gc.get_freeze_count() == 0
    try:
        training.setup(resume=False)
        assert gc.get_freeze_count() > 10_000
    finally:
        training.close()
    assert gc.get_freeze_count() == 0
