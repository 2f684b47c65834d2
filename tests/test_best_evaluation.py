"""``eval.select_best`` and ``eval.patience``: the final figures come from the checkpoint of the
best validation evaluation, and training stops once the evaluations stop improving.

References: the run's own evaluation records (the best is their arg-max, the stopping epoch
follows from them by counting), and ``dsa-train eval --checkpoint`` of the best step, a
separate reading of that checkpoint."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.recipe import parse_recipe
from dsa_train.errors import ConfigError
from dsa_train.runs.run_folder import MetricsLog

from .helpers import error_at_step

# lr 0.3 on a small graph: valid MRR rises, then falls as the model overfits
RECIPE = """\
name: best
dataset:
  kind: synthetic
  synthetic: {entities: 150, relations: 4, triples: 1500, valid: 80, test: 80, clusters: 6, seed: 2}
model: {kind: distmult, dim: 16, init_std: 0.1}
train: {epochs: %(epochs)d, batch_size: 128, negatives: 32, checkpoint_every: 5, keep_checkpoints: 1}
optimizer: {kind: dsa, lr: 0.3}
eval: {every_epochs: 1, final_splits: [valid, test], select_best: %(best)s, patience: %(patience)d}
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def records(run, kind):
    return [r for r in MetricsLog.read(run / "metrics.jsonl") if r["kind"] == kind]


def train(tmp_path, name, *, epochs=8, best="true", patience=0, extra=()):
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(RECIPE % {"epochs": epochs, "best": best, "patience": patience})
    out = tmp_path / name
    result = invoke("run", recipe, "--output", out, *extra)
    return out, result


def during_training(run):
    """The evaluations made during training: (step, epoch, valid MRR)."""
    evals = records(run, "eval")
    finals = len(parse_recipe((run / "config.yaml").read_text()).eval.final_splits)
    return [(r["step"], r["epoch"], r["both"]["mrr"]) for r in evals[:-finals]]


def test_final_figures_come_from_the_best_validation_checkpoint(tmp_path):
    out, result = train(tmp_path, "best")
    assert result.exit_code == 0, result.stderr
    evaluated = during_training(out)
    assert [epoch for _, epoch, _ in evaluated] == list(range(1, 9))  # the last epoch competes too
    step, epoch, mrr = max(evaluated, key=lambda e: e[2])
    assert step < evaluated[-1][0], "the recipe no longer overfits: the test would not tell best from last"
    summary = records(out, "summary")[0]
    assert summary["best"] == {"step": step, "epoch": epoch, "metric": "MRR", "value": mrr}
    assert summary["final_from_step"] == step and not summary["stopped_early"]
    assert f"--checkpoint {step})" in result.stdout  # the summary says whose figures these are
    kept = sorted(int(p.name) for p in (out / "checkpoints").iterdir())
    assert step in kept and summary["step"] in kept  # keep_checkpoints 1 kept the best besides the newest
    again = invoke("eval", out, "--checkpoint", step, "--split", "test", "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["metrics"] == summary["final"]["test"]
    final_records = records(out, "eval")[-2:]
    assert [r["step"] for r in final_records] == [step, step]


def test_patience_stops_after_that_many_evaluations_without_a_better_one(tmp_path):
    out, result = train(tmp_path, "patient", epochs=40, best="false", patience=2)
    assert result.exit_code == 0, result.stderr
    evaluated = during_training(out)
    best, stale, stop = -1.0, 0, None
    for _, epoch, mrr in evaluated:  # counted here from the records
        best, stale = (mrr, 0) if mrr > best else (best, stale + 1)
        if stale == 2:
            stop = epoch
            break
    assert stop is not None and stop < 40
    summary = records(out, "summary")[0]
    assert summary["stopped_early"] and summary["epochs"] == stop == evaluated[-1][1]
    assert summary["final_from_step"] == summary["step"]  # without select_best: the last step's model
    assert "stopping early" in result.stderr


def test_resume_keeps_the_best_and_its_count(tmp_path):
    whole, result = train(tmp_path, "whole", patience=3)
    assert result.exit_code == 0, result.stderr
    with error_at_step(19):
        broken, crashed = train(tmp_path, "broken", patience=3)
        assert crashed.exit_code == 1
    recipe = tmp_path / "broken.yaml"
    resumed = invoke("run", recipe, "--output", broken, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    for kind in ("eval", "summary"):
        ours, theirs = records(broken, kind), records(whole, kind)
        for record in ours + theirs:
            for timing in MetricsLog.MACHINE_FIELDS:
                record.pop(timing, None)
        assert ours == theirs, kind


@pytest.mark.parametrize(
    ("eval_section", "message"),
    [
        ("{select_best: true}", "every_epochs"),
        ("{patience: 3}", "every_epochs"),
        ("{every_epochs: 1, split: test, select_best: true}", "valid"),
    ],
)
def test_a_choice_without_evaluations_to_choose_from_is_refused(eval_section, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(f"name: x\ndataset: {{kind: synthetic}}\nmodel: {{kind: transe}}\neval: {eval_section}\n")
