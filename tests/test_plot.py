"""`dsa-train plot` and `output.tensorboard`: the figure's lines read back against the run's
metrics.jsonl, the image file's size, a run without evaluations drawn as its loss alone, a
tune folder's trials, and TensorBoard's events read back with tensorboard's own reader."""

from __future__ import annotations

import itertools
import json
import sys
import time
import types

import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.errors import DsaError
from dsa_train.plot import figure, save
from dsa_train.recipe import parse_recipe
from dsa_train.train import loop
from dsa_train.runs.run_folder import MetricsLog, RunFolder

RECIPE = """
name: tiny
dataset:
  kind: synthetic
  synthetic: {{entities: 200, relations: 3, triples: 2000, valid: 100, test: 100, clusters: 8, seed: 0}}
model: {{kind: transe, dim: 8}}
train: {{epochs: 3, batch_size: 256, negatives: 32, log_every: 2, device: cpu}}
optimizer: {{lr: 0.05, schedule: cosine}}
eval: {{every_epochs: 1}}
output: {{tensorboard: {tensorboard}}}
"""


def _train(tmp_path, name="run", tensorboard=False):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE.format(tensorboard=str(tensorboard).lower()))
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp_path / name)])
    assert result.exit_code == 0, result.output
    return tmp_path / name


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


@pytest.mark.slow
def test_plot_draws_loss_rate_and_metrics_of_each_run(tmp_path):
    a, b = _train(tmp_path, "a"), _train(tmp_path, "b")
    fig = figure([a, b])
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == ["training loss", "learning rate", "MRR", "Hits@10"]
    records = MetricsLog.read(a / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    assert _lines(axes["training loss"])["a"] == ([r["step"] for r in train], [r["loss"] for r in train])
    steps, rates = _lines(axes["learning rate"])["a"]
    assert rates == [r["lr"] for r in train] and rates[0] > rates[-1]  # the cosine schedule, falling
    evals = [r for r in records if r.get("kind") == "eval"]
    mrr = _lines(axes["MRR"])
    assert mrr["a (valid)"] == (
        [r["step"] for r in evals if r["split"] == "valid"],
        [r["both"]["mrr"] for r in evals if r["split"] == "valid"],
    )
    assert (
        mrr["a (test)"][1] == [r["both"]["mrr"] for r in evals if r["split"] == "test"] and len(mrr["a (test)"][1]) == 1
    )
    assert set(mrr) == {"a (valid)", "a (test)", "b (valid)", "b (test)"}  # both runs overlaid
    save(fig, tmp_path / "out.png")
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "out.png").shape[:2] == (720, 1280)  # 2 x 2 panels of 640 x 360 pixels


def test_a_run_without_evaluations_plots_its_loss_alone(tmp_path):
    run = RunFolder.create(parse_recipe(RECIPE.format(tensorboard="false")), tmp_path / "run")
    run.release()
    records = [
        {"kind": "train", "step": 10 * i, "epoch": 1, "loss": 1 / i} for i in range(1, 4)
    ]  # an older run: no lr either
    (run.metrics_path).write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = figure([run.path])
    assert [ax.get_title() for ax in fig.axes] == ["training loss"]
    assert _lines(fig.axes[0])["run"] == ([10, 20, 30], [1.0, 0.5, 1 / 3])
    result = CliRunner().invoke(app, ["plot", str(run.path), "-o", str(tmp_path / "loss.svg")])
    assert result.exit_code == 0, result.output
    assert "<svg" in (tmp_path / "loss.svg").read_text()[:2000]


def test_a_tune_folder_plots_its_trials(tmp_path):
    tune = tmp_path / "tune"
    (tune / "trials").mkdir(parents=True)
    (tune / "tune.json").write_text(json.dumps({"format": "dsa-train/tune", "version": 1}))
    rows = [("0", "COMPLETE", "0.3"), ("1", "PRUNED", "0.1"), ("2", "COMPLETE", "0.5"), ("3", "COMPLETE", "0.4")]
    (tune / "trials.tsv").write_text(
        "trial\tstate\tvalid MRR\tepoch\tseconds\trun\n" + "".join(f"{n}\t{s}\t{v}\t1\t1.0\t\n" for n, s, v in rows)
    )
    fig = figure([tune])
    trials = fig.axes[0]
    points = {c.get_label(): c.get_offsets().tolist() for c in trials.collections}
    assert points == {"complete": [[0, 0.3], [2, 0.5], [3, 0.4]], "pruned": [[1, 0.1]]}
    assert _lines(trials)["best so far"] == ([0, 1, 2, 3], [0.3, 0.3, 0.5, 0.5])


def test_plot_errors(tmp_path, monkeypatch):
    run = RunFolder.create(parse_recipe(RECIPE.format(tensorboard="false")), tmp_path / "run")
    run.release()
    with pytest.raises(DsaError, match=r"\.png, \.svg or \.pdf"):
        save(figure([run.path]), tmp_path / "out.jpeg")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    result = CliRunner().invoke(app, ["plot", str(run.path)])
    assert (
        result.exit_code == 1 and "pip install 'dsa-train[plot]'" in result.output and "Traceback" not in result.output
    )


def test_tensorboard_events_hold_the_metrics_records(tmp_path):
    # the test extra installs tensorboard: its absence fails, never skips
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _train(tmp_path, tensorboard=True)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    records = MetricsLog.read(run / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in train]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([r["lr"] for r in train], rel=1e-6)
    pace = events.Scalars("train/items_per_s")
    assert [e.value for e in pace] == pytest.approx([r["items_per_s"] for r in train], rel=1e-6)
    assert all(r["items_per_s"] > 0 for r in train)
    valid = [r for r in records if r.get("kind") == "eval" and r["split"] == "valid"]
    assert [e.value for e in events.Scalars("valid/both/mrr")] == pytest.approx(
        [r["both"]["mrr"] for r in valid], rel=1e-6
    )
    assert "test/both/hits_at_10" in events.Tags()["scalars"]


def test_a_train_records_items_per_s_is_its_windows_items_over_its_steps_seconds(tmp_path, monkeypatch):
    """With a clock that moves one second per reading, every step lasts exactly one second, so a
    train record's items_per_s is the mean batch size of the steps since the record before."""
    ticks = itertools.count()
    fake = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(**{**fake, "perf_counter": lambda: float(next(ticks))}))
    sizes, real_step = [], loop.Training.step

    def recording(self, picked):
        sizes.append(len(picked))
        return real_step(self, picked)

    monkeypatch.setattr(loop.Training, "step", recording)
    run = _train(tmp_path)
    train = [r for r in MetricsLog.read(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert len(set(sizes)) == 2  # full batches and each epoch's shorter last one
    before = 0
    for r in train:
        window = sizes[before : r["step"]]
        assert r["items_per_s"] == pytest.approx(sum(window) / len(window), abs=0.05), r
        before = r["step"]
