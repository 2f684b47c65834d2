"""Callbacks a recipe names (output.callbacks) and callbacks dsa_train.run is handed: a metric
logger sees every record metrics.jsonl gets, in order, and an unknown name is refused before a
run folder exists."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

import dsa_train
from dsa_train.cli.app import app
from dsa_train.errors import ConfigError
from dsa_train.runs.run_folder import MetricsLog
from dsa_train.train.callbacks import CALLBACKS, Callback

# 12 steps of quickstart, a window of steps logged every 4, one evaluation on valid after the
# (shortened) epoch and the final one on test
QUICK = {
    "train.max_steps": 12,
    "train.log_every": 4,
    "train.checkpoint_every": 100,
    "eval.final_splits": ["test"],
    "eval.max_queries": 50,
}


class Recorder(Callback):
    """Keeps what its hooks were told."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.summaries: list[dict] = []

    def logged(self, training, record: dict) -> None:
        self.records.append(json.loads(json.dumps(record)))  # as metrics.jsonl holds it

    def train_done(self, training, summary: dict) -> None:
        self.summaries.append(summary)


def written(folder) -> list[dict]:
    return MetricsLog.read(folder / "metrics.jsonl")


def test_a_callback_handed_to_run_sees_every_record_of_metrics_jsonl_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recorder = Recorder()
    dsa_train.run("quickstart", overrides=QUICK, output=tmp_path / "run", callbacks=[recorder])
    on_disk = written(tmp_path / "run")
    assert [r["kind"] for r in on_disk] == ["train"] * 3 + ["eval", "summary"]
    assert recorder.records == on_disk
    assert recorder.summaries == [on_disk[-1]]


@CALLBACKS.register_as("test_recorder")
class NamedRecorder(Recorder):
    made: list[NamedRecorder] = []

    def __init__(self) -> None:
        super().__init__()
        NamedRecorder.made.append(self)


def test_a_registered_callback_is_named_in_the_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    NamedRecorder.made.clear()
    dsa_train.run("quickstart", overrides={**QUICK, "output.callbacks": ["test_recorder"]}, output=tmp_path / "run")
    (made,) = NamedRecorder.made
    assert made.records == written(tmp_path / "run")
    assert "test_recorder" in (tmp_path / "run" / "config.yaml").read_text()  # a resume makes it again


def test_log_metrics_logs_each_record_as_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="dsa_train"):
        dsa_train.run("quickstart", overrides={**QUICK, "output.callbacks": ["log_metrics"]}, output=tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.name == "dsa_train.train.callbacks"]
    on_disk = written(tmp_path / "run")
    assert [line.split()[0] for line in lines] == [r["kind"] for r in on_disk]
    evaluation = next(r for r in on_disk if r["kind"] == "eval")
    line = next(line for line in lines if line.startswith("eval "))
    assert f"both.mrr={evaluation['both']['mrr']:.6g}" in line.split()
    assert f"split={evaluation['split']}" in line.split()


def test_an_unknown_callback_is_refused_before_a_run_folder_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        dsa_train.run("quickstart", overrides={**QUICK, "output.callbacks": ["log_metric"]}, output=tmp_path / "run")
    message = str(caught.value)
    assert "output.callbacks: 'log_metric' is not a known callback" in message
    assert "did you mean 'log_metrics'" in message
    assert not (tmp_path / "run").exists()
    for command in (["validate", "quickstart"], ["run", "quickstart", "-o", str(tmp_path / "cli")]):
        result = CliRunner().invoke(app, [*command, "--set", "output.callbacks=[log_metric]"])
        assert result.exit_code != 0 and "'log_metric' is not a known callback" in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "cli").exists()


def test_a_callback_named_twice_is_a_recipe_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="output.callbacks.*names a callback twice"):
        dsa_train.run(
            "quickstart", overrides={**QUICK, "output.callbacks": ["log_metrics", "log_metrics"]}, output=tmp_path / "r"
        )
