"""The learning-rate schedule: torch's own schedulers as the reference, the rates a run's
optimizers step with, and an exact resume mid-decay."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.errors import ConfigError
from dsa_train.recipe import parse_recipe
from dsa_train.train import loop
from dsa_train.runs.run_folder import MetricsLog
from dsa_train.train.schedule import lr_factor, plateau_update

from .helpers import error_at_step

RECIPE = """\
name: scheduled
dataset:
  kind: synthetic_clicks
  clicks: {samples: 6000, valid: 1000, test: 1000, features: 4, ids: 500, dense: 3, max_hot: 3, seed: 3}
model: {kind: dlrm, dim: 8, init_std: 0.01, recsys: {rows: 400, bottom: [16], top: [16]}}
train: {epochs: 2, batch_size: 256, log_every: 4, checkpoint_every: 10, keep_checkpoints: 2}
optimizer: {kind: dsa, lr: 0.01, dense_lr: 0.003, schedule: cosine, final_lr_ratio: 0.1}
eval: {every_epochs: 1, final_splits: [test]}
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def records(run, kind):
    timings = MetricsLog.MACHINE_FIELDS
    return [
        {k: v for k, v in r.items() if k not in timings}
        for r in MetricsLog.read(run / "metrics.jsonl")
        if r["kind"] == kind
    ]


@pytest.mark.parametrize("final_ratio", [0.0, 0.1])
@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_factors_are_torchs_schedulers(schedule, final_ratio):
    """CosineAnnealingLR(T_max=S, eta_min=r lr) and LinearLR(1 -> r over S steps) give the
    rates of steps 0..S; ours is their closed form."""
    lr, total = 0.01, 37
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    if schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=final_ratio * lr)
    else:
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=final_ratio, total_iters=total
        )
    for step in range(total + 1):
        assert lr * lr_factor(schedule, step, total, final_ratio) == pytest.approx(
            optimizer.param_groups[0]["lr"], rel=1e-9, abs=1e-15
        )
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("milestone", [1, 10, 36, 40])
def test_step_factors_are_torchs_multisteplr(milestone):
    """MultiStepLR with the one milestone M and gamma r gives the rates of steps 0..S-1 (a
    milestone at or past S: never lowered)."""
    lr, total, ratio = 0.01, 37, 0.1
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[milestone], gamma=ratio)
    for step in range(total):
        assert lr * lr_factor("step", step, total, ratio, milestone) == pytest.approx(
            optimizer.param_groups[0]["lr"], rel=1e-12
        )
        optimizer.step()
        scheduler.step()


def test_hand_computed_points():
    assert lr_factor("cosine", 50, 100, 0.2) == pytest.approx(0.6)  # halfway: the mean of 1 and r
    assert lr_factor("linear", 25, 100, 0.2) == pytest.approx(0.8)
    assert lr_factor("constant", 99, 100, 0.0) == 1.0
    assert lr_factor("cosine", 0, 100, 0.0) == 1.0
    assert lr_factor("step", 89, 100, 0.1, 90) == 1.0 and lr_factor("step", 90, 100, 0.1, 90) == 0.1


def test_a_scheduled_run_steps_at_the_scheduled_rates_and_resumes_exactly(tmp_path, monkeypatch):
    """Both optimizers (the sparse table's DiskSparseAdam, the MLPs' Adam) step at the rate of
    their step on the curve, and a run killed mid-decay and resumed from the checkpoint of
    step 10 ends as the uninterrupted one: the rate is a function of the step alone."""
    path = tmp_path / "scheduled.yaml"
    path.write_text(RECIPE)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    real_step = loop.Training.step
    rates = []

    def recording(self, picked):
        loss = real_step(self, picked)
        rates.append((self.optimizer.param_groups[0]["lr"], self.dense_optimizer.param_groups[0]["lr"]))
        return loss

    monkeypatch.setattr(loop.Training, "step", recording)
    result = invoke("run", path, "--output", whole)
    assert result.exit_code == 0, result.output
    total = records(whole, "summary")[0]["step"]
    assert len(rates) == total == 2 * math.ceil(len(rates) / 2)  # two whole epochs
    for step, (sparse, dense) in enumerate(rates):
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total))
        assert sparse == pytest.approx(0.01 * expected, rel=1e-12) and dense == pytest.approx(
            0.003 * expected, rel=1e-12
        )
    assert rates[-1][0] < 0.0011  # near the end, near lr * final_lr_ratio

    monkeypatch.setattr(loop.Training, "step", real_step)
    with error_at_step(15):
        assert invoke("run", path, "--output", broken).exit_code == 1
    result = invoke("run", path, "--output", broken, "--resume")
    assert result.exit_code == 0, result.output
    for kind in ("train", "eval", "summary"):
        got, want = records(broken, kind), records(whole, kind)
        for r in got + want:
            r.pop("tables_on_disk_mib", None), r.pop("optimizer_state_on_disk_mib", None)
        assert got == want, kind


def test_a_final_ratio_without_a_decay_is_refused():
    with pytest.raises(ConfigError) as e:
        parse_recipe("dataset: {kind: karate}\nmodel: {kind: node2vec}\noptimizer: {final_lr_ratio: 0.1}\n")
    assert "optimizer.final_lr_ratio (line 3): has no effect with schedule 'constant'" in str(e.value)


@pytest.mark.parametrize("epochs, milestone", [(2, 1), (3, 1), (2, 5)])
def test_a_step_scheduled_run_lowers_both_rates_after_its_milestone(tmp_path, monkeypatch, epochs, milestone):
    """With schedule 'step', every step of the first decay_after_epochs epochs runs at the base
    rates and every later one at final_lr_ratio times them, however many epochs follow; a
    milestone past the run (a recipe run with fewer epochs) lowers nothing."""
    path = tmp_path / "step.yaml"
    step = f"schedule: step, final_lr_ratio: 0.1, decay_after_epochs: {milestone}"
    path.write_text(
        RECIPE.replace("schedule: cosine, final_lr_ratio: 0.1", step)
        .replace("epochs: 2,", f"epochs: {epochs},")
        .replace("checkpoint_every: 10,", "checkpoint_every: 1000,")  # no resume here: one checkpoint at the end
    )
    real_step = loop.Training.step
    rates = []

    def recording(self, picked):
        loss = real_step(self, picked)
        rates.append((self.epoch, self.optimizer.param_groups[0]["lr"], self.dense_optimizer.param_groups[0]["lr"]))
        return loss

    monkeypatch.setattr(loop.Training, "step", recording)
    result = invoke("run", path, "--output", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert {epoch for epoch, _, _ in rates} == set(range(epochs))
    for epoch, sparse, dense in rates:
        factor = 0.1 if epoch >= milestone else 1.0
        assert sparse == pytest.approx(0.01 * factor, rel=1e-12) and dense == pytest.approx(0.003 * factor, rel=1e-12)


@pytest.mark.parametrize(
    "optimizer, key, says",
    [
        ("{schedule: step, final_lr_ratio: 0.1}", "optimizer.decay_after_epochs", "set it to 1 or more"),
        ("{schedule: step, decay_after_epochs: 2}", "optimizer.final_lr_ratio", "must be above 0 and below 1, got 0"),
        (
            "{schedule: cosine, decay_after_epochs: 2}",
            "optimizer.decay_after_epochs",
            "has no effect with schedule 'cosine'",
        ),
    ],
)
def test_a_step_schedule_that_cannot_mean_anything_is_refused(optimizer, key, says):
    with pytest.raises(ConfigError) as e:
        parse_recipe(
            f"dataset: {{kind: karate}}\nmodel: {{kind: node2vec}}\ntrain: {{epochs: 5}}\noptimizer: {optimizer}\n"
        )
    assert key in str(e.value) and says in str(e.value)


def test_dry_run_says_the_schedule(tmp_path):
    path = tmp_path / "step.yaml"
    path.write_text(
        RECIPE.replace(
            "schedule: cosine, final_lr_ratio: 0.1", "schedule: step, final_lr_ratio: 0.1, decay_after_epochs: 1"
        )
    )
    assert "(lr 0.01, 0.001 after epoch 1)" in invoke("run", path, "--dry-run").output
    path.write_text(RECIPE)
    assert "(lr 0.01, cosine to 0.001)" in invoke("run", path, "--dry-run").output


PLATEAU = {"plateau_factor": 0.5, "plateau_patience": 1, "final_lr_ratio": 0.1}


def torchs_plateau_rates(values: list[float], lr: float = 1.0) -> list[float]:
    """The rate after each evaluation, by torch's ReduceLROnPlateau (mode max, no threshold, no
    cooldown, min_lr = lr x final_lr_ratio)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt,
        mode="max",
        factor=PLATEAU["plateau_factor"],
        patience=PLATEAU["plateau_patience"],
        threshold=0.0,
        min_lr=lr * PLATEAU["final_lr_ratio"],
    )
    rates = []
    for value in values:
        scheduler.step(value)
        rates.append(opt.param_groups[0]["lr"])
    return rates


def test_plateau_factors_are_torchs_reduce_lr_on_plateau():
    cfg = type("Optimizer", (), PLATEAU)
    values = [0.1, 0.2, 0.2, 0.15, 0.3, 0.25, 0.25, 0.24, 0.31, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
    state, ours = None, []
    for value in values:
        state = plateau_update(state, value, cfg)
        ours.append(state["factor"])
    theirs = torchs_plateau_rates(values)
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert len(set(ours)) > 3 and min(ours) == 0.1  # it lowered the rate several times, down to the floor


def test_a_plateau_run_lowers_its_rate_after_its_evaluations_and_resumes_exactly(tmp_path):
    """The rate each step ran at (the train records' lr) is torch's ReduceLROnPlateau fed the
    run's own evaluations; a run killed after a reduction resumes with the reduced rate."""
    path = tmp_path / "plateau.yaml"
    path.write_text(
        RECIPE.replace(
            "schedule: cosine, final_lr_ratio: 0.1", "schedule: plateau, plateau_patience: 1, final_lr_ratio: 0.1"
        )
        .replace("epochs: 2,", "epochs: 8,")
        .replace("checkpoint_every: 10,", "checkpoint_every: 50,")  # the resume below starts at 150
        .replace("lr: 0.01,", "lr: 0.3,")  # too high: the evaluations stop improving
    )
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert invoke("run", path, "--output", whole).exit_code == 0
    evals = [r for r in records(whole, "eval") if r["split"] == "valid"]
    rate_after = dict(zip([r["step"] for r in evals], torchs_plateau_rates([r["clicks"]["auc"] for r in evals], 0.3)))
    expected, rate = {}, 0.3
    for r in records(whole, "train"):  # a step runs at the rate set by the evaluations before it
        rate = next((v for s, v in sorted(rate_after.items(), reverse=True) if s < r["step"]), 0.3)
        expected[r["step"]] = rate
    got = {r["step"]: r["lr"] for r in records(whole, "train")}
    assert got == pytest.approx(expected, rel=1e-12)
    assert min(got.values()) < 0.3  # it did lower the rate
    with error_at_step(155):  # resumes from step 150, after the reduction at the evaluation of step 120
        assert invoke("run", path, "--output", broken).exit_code == 1
    assert invoke("run", path, "--output", broken, "--resume").exit_code == 0
    for kind in ("train", "eval", "summary"):
        ours, theirs = records(broken, kind), records(whole, kind)
        for r in ours + theirs:
            r.pop("tables_on_disk_mib", None), r.pop("optimizer_state_on_disk_mib", None)
        assert ours == theirs, kind


def test_a_plateau_without_evaluations_is_refused():
    with pytest.raises(ConfigError, match="every_epochs"):
        parse_recipe(
            "name: x\ndataset: {kind: synthetic}\nmodel: {kind: transe}\noptimizer: {schedule: plateau, final_lr_ratio: 0.1}\n"
        )
