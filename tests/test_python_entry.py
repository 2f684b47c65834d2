"""dsa_train.run(...): training a recipe from Python, as `dsa-train run` does, in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dsa_train
from dsa_train.cli.app import app
from dsa_train.errors import ConfigError, DsaError
from dsa_train.recipe import load_recipe
from dsa_train.recipe.find import find_recipe
from dsa_train.runs.run_folder import MetricsLog

from .helpers import error_at_step

# 40 steps of quickstart (of its 79 an epoch), a checkpoint every 20, the final test evaluation
QUICK = {"train.max_steps": 40, "train.checkpoint_every": 20, "train.log_every": 10, "eval.final_splits": ["test"]}
QUICK_SET = ["train.max_steps=40", "train.checkpoint_every=20", "train.log_every=10", "eval.final_splits=[test]"]


def records(folder):
    timings = MetricsLog.MACHINE_FIELDS
    return [{k: v for k, v in r.items() if k not in timings} for r in MetricsLog.read(folder / "metrics.jsonl")]


def test_run_returns_the_trained_run_and_writes_what_the_cli_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the CLI's run gets the same data root and output dir
    trained = dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "py")
    assert trained.weights("entities").shape == (2000, 64)
    names = trained.names("entities", [0, 1, 2, 3])
    scores = trained.score(names[:2], trained.names("relations", [0, 1]), names[2:])
    assert scores.shape == (2,) and torch.isfinite(scores).all()

    cli = CliRunner().invoke(
        app, ["run", "quickstart", "-o", str(tmp_path / "cli"), *sum([["--set", s] for s in QUICK_SET], [])]
    )
    assert cli.exit_code == 0, cli.output
    ours, theirs = records(tmp_path / "py"), records(tmp_path / "cli")
    assert [r["kind"] for r in ours].count("train") == 4
    assert ours == theirs  # line for line, timings aside: the same lifecycle under both


def test_run_takes_a_recipe_object_or_a_path_and_overrides_as_key_value_strings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(find_recipe(Path("quickstart")))
    from_object = dsa_train.run(recipe, overrides=["train.max_steps=5", "eval.final_splits=[]"], output=tmp_path / "a")
    from_path = dsa_train.run(
        find_recipe(Path("quickstart")),
        overrides={"train.max_steps": 5, "eval.final_splits": []},
        output=tmp_path / "b",
    )
    assert torch.equal(from_object.weights("entities"), from_path.weights("entities"))


def test_bad_input_is_named_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="train.epochs"):
        dsa_train.run("quickstart", overrides={"train.epochs": -1}, output=tmp_path / "x")
    with pytest.raises(DsaError, match="neither a file nor the name of a recipe"):
        dsa_train.run("no-such-recipe")
    with pytest.raises(TypeError, match="not one string"):
        dsa_train.run("quickstart", overrides="train.epochs=1")
    assert not (tmp_path / "x").exists()


def test_an_error_inside_training_leaves_a_run_that_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    whole = dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "whole")
    with (
        error_at_step(30),
        pytest.raises(RuntimeError, match="injected error at step 30"),
    ):  # after step 20's checkpoint
        dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "broken")
    assert (tmp_path / "broken" / "checkpoints").is_dir()
    resumed = dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "broken", resume=True)
    assert torch.equal(resumed.weights("entities"), whole.weights("entities"))
    assert records(tmp_path / "broken")[-1] == records(tmp_path / "whole")[-1]  # the same summary
    again = dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "broken", resume=True)  # finished: as it is
    assert torch.equal(again.weights("entities"), whole.weights("entities"))


def test_a_new_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with error_at_step(0), pytest.raises(RuntimeError, match="injected error at step 0"):
        dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "never")
    assert not (tmp_path / "never").exists()
