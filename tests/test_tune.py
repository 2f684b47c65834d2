"""`dsa-train tune`: a tiny search end to end, pruning checked against the median rule
recomputed from the trials' own metrics.jsonl, best.yaml retrained to the best trial's valid
metric, a search killed with SIGKILL and resumed, bad search spaces, and two searches on one
folder."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.cli.tune import parse_duration
from dsa_train.errors import ConfigError, DsaError, StateError
from dsa_train.recipe import parse_recipe
from dsa_train.runs.run_folder import MetricsLog
from dsa_train.tune.space import apply, default_space, parse_space
from dsa_train.tune.study import PRUNER_STARTUP_TRIALS, TuneFolder, rows

RECIPE = """
name: tiny
dataset:
  kind: synthetic
  root: {root}
  synthetic: {{entities: 300, relations: 4, triples: 4000, valid: 200, test: 200, clusters: 10, noise: 0.05, seed: 0}}
model: {{kind: transe, dim: 16, init_std: 0.1}}
train: {{epochs: {epochs}, batch_size: 256, negatives: 64, log_every: 5, device: cpu}}
optimizer: {{lr: 0.02}}
eval: {{every_epochs: 1}}
"""
# A rate of 1e-5 cannot learn in 3 epochs: after the first trials those get pruned.
SPACE = {"optimizer.lr": [0.05, 0.00001], "model.dim": [16, 32], "model.p_norm": [1, 2]}


def _recipe(folder: Path, epochs: int = 3) -> Path:
    path = folder / "tiny.yaml"
    path.write_text(RECIPE.format(root=folder / "data", epochs=epochs))
    return path


def _invoke(*args: str):
    return CliRunner().invoke(app, ["tune", *map(str, args)])


def _valid_evals(run: Path) -> dict[int, float]:
    """epoch -> valid MRR of the evaluations during training (the values the pruner saw)."""
    return {
        r["epoch"]: r["both"]["mrr"]
        for r in MetricsLog.read(run / "metrics.jsonl")
        if r.get("kind") == "eval" and r["split"] == "valid"
    }


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One tiny search of 6 trials, shared by the tests that read it."""
    folder = tmp_path_factory.mktemp("tune")
    space = folder / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    result = _invoke(_recipe(folder), "-o", folder / "t", "--trials", 6, "--space", space)
    assert result.exit_code == 0, result.output
    return folder / "t", result.output


@pytest.mark.slow
def test_tiny_search_end_to_end(searched):
    tune, output = searched
    found = rows(TuneFolder(tune))
    assert [r.number for r in found] == list(range(6))
    assert {r.state for r in found} <= {"COMPLETE", "PRUNED"}
    table = (tune / "trials.tsv").read_text().splitlines()
    assert table[0].split("\t")[:6] == ["trial", "state", "valid MRR", "epoch", "seconds", "run"] and len(table) == 7
    for r in found:  # each trial is an ordinary run folder, scored on valid only
        run = tune / "trials" / r.run
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["eval"]["final_splits"] == ["valid"] and config["optimizer"]["lr"] == r.params["optimizer.lr"]
        records = MetricsLog.read(run / "metrics.jsonl")
        assert all(rec["split"] == "valid" for rec in records if rec.get("kind") == "eval")  # the search never saw test
        if r.state == "COMPLETE":
            final = [rec for rec in records if rec.get("kind") == "eval"][-1]
            assert final["both"]["mrr"] == pytest.approx(r.value, rel=1e-9)
    best = max((r for r in found if r.state == "COMPLETE"), key=lambda r: r.value)
    test = json.loads((tune / "best-test.json").read_text())
    assert test["trial"] == best.number and 0 < test["test"]["both"]["mrr"] <= 1
    assert f"best: trial {best.number}" in output


@pytest.mark.slow
def test_pruning_follows_the_median_rule(searched):
    """A trial is pruned exactly when its best valid MRR so far is below the median of the
    finished trials' at the same epoch (Optuna's MedianPruner), recomputed from metrics.jsonl."""
    tune, _ = searched
    found = rows(TuneFolder(tune))
    pruned = [r for r in found if r.state == "PRUNED"]
    assert pruned, "no trial was pruned: the 1e-5 rate should have been stopped early"
    for r in found:
        seen = _valid_evals(tune / "trials" / r.run)
        finished = [q for q in found if q.state == "COMPLETE" and q.number < r.number]
        for epoch in sorted(seen):
            others = [_valid_evals(tune / "trials" / q.run)[epoch] for q in finished]
            stop = len(finished) >= PRUNER_STARTUP_TRIALS and max(
                v for e, v in seen.items() if e <= epoch
            ) < statistics.median(others)
            if stop:
                assert r.state == "PRUNED" and r.epoch == epoch and max(seen) == epoch, (r, epoch)
                break
        else:
            assert r.state == "COMPLETE", r
    for r in pruned:  # stopped early: no summary, fewer evaluations than the 2 of a full run
        assert r.params["optimizer.lr"] == 0.00001
        records = MetricsLog.read(tune / "trials" / r.run / "metrics.jsonl")
        assert not any(rec.get("kind") == "summary" for rec in records)


@pytest.mark.slow
def test_best_yaml_reproduces_the_best_trial(searched, tmp_path):
    tune, _ = searched
    best = max((r for r in rows(TuneFolder(tune)) if r.state == "COMPLETE"), key=lambda r: r.value)
    result = CliRunner().invoke(app, ["run", str(tune / "best.yaml"), "-o", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    final = {
        rec["split"]: rec
        for rec in MetricsLog.read(tmp_path / "again" / "metrics.jsonl")
        if rec.get("kind") == "eval" and rec["epoch"] == 3
    }
    assert final["valid"]["both"]["mrr"] == pytest.approx(best.value, rel=1e-6)
    test = json.loads((tune / "best-test.json").read_text())["test"]
    assert final["test"]["both"]["mrr"] == pytest.approx(test["both"]["mrr"], rel=1e-6)  # the same model scored on test


@pytest.mark.slow
def test_resume_of_a_finished_search_keeps_it(searched):
    tune, _ = searched
    before = [(r.number, r.state, r.value) for r in rows(TuneFolder(tune))]
    result = _invoke(_recipe(tune.parent), "-o", tune, "--trials", 6, "--resume")
    assert result.exit_code == 0, result.output
    assert [(r.number, r.state, r.value) for r in rows(TuneFolder(tune))] == before


@pytest.mark.slow
def test_sigkill_mid_trial_then_resume_keeps_finished_trials(tmp_path):
    recipe = _recipe(tmp_path, epochs=12)
    tune = tmp_path / "t"
    command = [sys.executable, "-m", "dsa_train", "tune", str(recipe), "-o", str(tune), "--trials", "3"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.monotonic() + 300
    while True:  # one trial finished, the next one training
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        done = rows(TuneFolder(tune)) if (tune / "tune.json").exists() else []
        running = [r for r in done if r.state == "RUNNING"]
        if (
            any(r.state in ("COMPLETE", "PRUNED") for r in done)
            and running
            and (tune / "trials" / f"trial-{running[0].number:04d}" / "metrics.jsonl").exists()
        ):
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    before = {
        r.number: (r.state, r.value, r.params) for r in rows(TuneFolder(tune)) if r.state in ("COMPLETE", "PRUNED")
    }
    killed = next(r for r in rows(TuneFolder(tune)) if r.state == "RUNNING")
    result = _invoke(recipe, "-o", tune, "--trials", 3, "--resume")
    assert result.exit_code == 0, result.output
    after = rows(TuneFolder(tune))
    assert {
        r.number: (r.state, r.value, r.params) for r in after if r.number in before
    } == before  # nothing finished was lost
    assert next(r for r in after if r.number == killed.number).state == "KILLED"
    again = [t for t in TuneFolder(tune).study().trials if t.user_attrs.get("requeued_from") == killed.number]
    assert (
        len(again) == 1 and again[0].params == killed.params and again[0].state.name in ("COMPLETE", "PRUNED")
    )  # its settings ran again
    assert sum(r.state in ("COMPLETE", "PRUNED") for r in after) == 3


def test_the_data_is_imported_once_before_the_workers_start(tmp_path, monkeypatch):
    """Workers that each imported the dataset raced for the import folder, and all but the
    first were refused: the parent imports it before it starts them."""
    from dsa_train.cli import tune as tune_cli
    from dsa_train.data.store import PARTIAL

    seen = []

    def spawn(path, trials, deadline, share, jobs):
        imported = tmp_path / "data" / "imported"
        seen.append(
            [p.name.startswith(PARTIAL) for p in imported.iterdir() if p.is_dir()] if imported.is_dir() else None
        )
        raise DsaError("stopped by the test")

    monkeypatch.setattr(tune_cli, "_spawn", spawn)
    result = _invoke(_recipe(tmp_path, epochs=1), "-o", tmp_path / "t", "--trials", 2, "--jobs", 2)
    assert "stopped by the test" in result.output and seen == [
        [False]
    ]  # one dataset folder, complete, before any worker


@pytest.mark.slow
def test_jobs_share_one_study(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    result = _invoke(_recipe(tmp_path, epochs=2), "-o", tmp_path / "t", "--trials", 4, "--jobs", 2, "--space", space)
    assert result.exit_code == 0, result.output
    found = rows(TuneFolder(tmp_path / "t"))
    assert (
        sorted(r.number for r in found) == list(range(len(found))) and 4 <= len(found) <= 5
    )  # a worker may start one as the other ends
    assert all(r.state in ("COMPLETE", "PRUNED") for r in found)
    assert len({r.run for r in found}) == len(found)


def test_a_second_search_on_a_folder_is_refused(tmp_path):
    recipe = _recipe(tmp_path)
    base = parse_recipe(recipe.read_text())
    folder = TuneFolder.create(
        base, parse_space({"optimizer.lr": [0.01, 0.02]}, base), tmp_path / "t"
    )  # holds the lock
    try:
        result = _invoke(recipe, "-o", tmp_path / "t", "--trials", 1, "--resume")
        assert result.exit_code == 1 and "tune folder" in result.output and "is locked by" in result.output
        result = _invoke(recipe, "-o", tmp_path / "t", "--trials", 1)
        assert result.exit_code == 1 and "already exists and is not empty" in result.output
    finally:
        folder.release()
    with pytest.raises(StateError, match="not a tune folder"):
        TuneFolder.find(tmp_path)


BASE = RECIPE.format(root="/nonexistent", epochs=3)


@pytest.mark.parametrize(
    "space, message",
    [
        ({"model.dimm": [8]}, r"model\.dimm: not a recipe key; did you mean model\.dim\?"),
        ({"model.loss": ["margin"]}, r"model\.loss: not a recipe key; did you mean train\.loss\?"),
        ({"model": [1]}, r"model: is a section of the recipe, not a value"),
        ({"optimizer.lr": {"low": 0.1, "high": 0.01}}, r"optimizer\.lr: empty range: low 0\.1 is not below high 0\.01"),
        ({"optimizer.lr": {"low": 0.1, "high": 0.1}}, r"empty range: .*one value: set it with --set"),
        ({"model.dim": []}, r"model\.dim: empty list of choices"),
        ({"model.dim": {"low": 8.5, "high": 64}}, r"model\.dim: low 8\.5 is not a whole number"),
        ({"model.dim": {"low": "big", "high": 64}}, r"model\.dim: low must be a number, got 'big'"),
        (
            {"model.p_norm": {"low": 1, "high": 2}},
            r"model\.p_norm: takes one of 1, 2, which has no range; list the choices",
        ),
        ({"model.p_norm": [1, 3]}, r"model\.p_norm: the value 3 does not fit: model\.p_norm: .*1, 2"),
        (
            {"model.dropout": {"low": 0.0, "high": 1.5}},
            r"model\.dropout: the value 1\.5 does not fit: model\.dropout: must be in \[0, 1\)",
        ),
        ({"train.loss": ["hinge"]}, r"train\.loss: the value 'hinge' does not fit"),
        ({"optimizer.lr": {"low": 0, "high": 0.1, "log": True}}, r"a log range needs low > 0"),
        ({"optimizer.lr": {"lo": 0.001, "high": 0.1}}, r"unknown field 'lo' in the range"),
        ({"model.dim": 64}, r"model\.dim: expected a range .* or a list of choices, got 64"),
    ],
)
def test_bad_spaces_are_named(space, message):
    with pytest.raises(ConfigError, match=message):
        parse_space(space, parse_recipe(BASE))


def test_bad_space_file_ends_the_cli_cleanly(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("model.dimm: [8]\noptimizer.lr: {low: 1, high: 0.5}\n")
    result = _invoke(_recipe(tmp_path), "-o", tmp_path / "t", "--trials", 1, "--space", space)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        "search space" in result.output and "2 problems" in result.output and "did you mean model.dim" in result.output
    )
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_default_space_fits_every_shipped_kind():
    """The default space of each model kind is valid for its recipe, and each of its choices
    and bounds makes a recipe that loads."""
    shipped = Path(__file__).parent.parent / "recipes"
    for name in ("quickstart", "umls-transe", "umls-complex", "karate-node2vec", "cora-sage", "recsys-quickstart"):
        base = parse_recipe((shipped / f"{name}.yaml").read_text())
        space = default_space(base)
        assert "optimizer.lr" in space and "model.dim" in space, name
        assert ("model.p_norm" in space) == (base.model.kind == "transe")
        for param in space.values():
            for value in param.choices or (param.low, param.high):
                apply(base, {param.key: value})


def test_schedule_choices_get_their_companions():
    base = parse_recipe(BASE.replace("lr: 0.02}", "lr: 0.02, schedule: cosine, final_lr_ratio: 0.1}"))
    assert apply(base, {"optimizer.schedule": "constant"}).optimizer.final_lr_ratio == 0
    step = apply(base, {"optimizer.schedule": "step"}).optimizer
    assert step.decay_after_epochs == 2 and step.final_lr_ratio == 0.1


def test_kge_default_space_searches_what_the_best_published_configs_turn():
    base = parse_recipe(BASE.replace("kind: transe", "kind: complex"))
    space = default_space(base)
    for key in ("model.relation_dropout", "train.labels", "train.label_smoothing", "train.regularization"):
        assert key in space, key
    assert "margin" not in space["train.loss"].choices  # k-vs-all has several answers
    kvsall = apply(base, {"train.labels": "all"}).train
    assert kvsall.candidates == "all" and kvsall.query_chunk is None
    assert apply(base, {"train.loss": "softplus", "train.label_smoothing": 0.1}).train.label_smoothing == 0.0
    assert apply(base, {"train.loss": "cross_entropy", "train.label_smoothing": 0.1}).train.label_smoothing == 0.1
    rotate = default_space(parse_recipe(BASE.replace("kind: transe", "kind: rotate")))
    assert "model.relation_dropout" not in rotate  # its relations are angles


def test_trial_share_by_hand():
    from dsa_train.tune.budget import TRIALS_IN_BUDGET, trial_share

    assert trial_share(None, 5, 1) is None
    assert trial_share(1800, None, 1) == 1800 / TRIALS_IN_BUDGET
    assert trial_share(1800, 6, 2) == 600  # 6 trials, 2 at a time: 3 rounds of 10 minutes


@pytest.mark.slow  # 12 s: a search of one trial
def test_a_trial_ends_at_the_last_epoch_within_its_share(tmp_path, monkeypatch):
    """A trial whose next epoch would pass its share of --timeout ends after the epoch under way,
    then scores valid and completes: here a share too short for any second epoch."""
    from dsa_train.cli import tune as tune_cli

    monkeypatch.setattr(tune_cli, "trial_share", lambda seconds, trials, jobs: 1e-6)
    result = _invoke(_recipe(tmp_path, epochs=3), "-o", tmp_path / "t", "--trials", 1, "--timeout", "1h")
    assert result.exit_code == 0, result.output
    assert "each trial trains at most" in result.output
    (run,) = (tmp_path / "t" / "trials").iterdir()
    records = MetricsLog.read(run / "metrics.jsonl")
    summary = next(r for r in records if r["kind"] == "summary")
    assert summary["epochs"] == 1 and [r["epoch"] for r in records if r["kind"] == "epoch"] == [1]
    assert "valid" in summary["final"]  # a whole trial's ending: valid scored, the trial counted
    (row,) = rows(TuneFolder(tmp_path / "t"))
    assert row.state == "COMPLETE" and row.value == summary["final"]["valid"]["both"]["mrr"]


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("1.5h", 5400), (" 8m ", 480)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "30 minutes", "m"])
def test_bad_durations(text):
    with pytest.raises(DsaError, match="is not a duration"):
        parse_duration(text)


def test_a_dataset_without_a_valid_split_stops_the_search_at_once(tmp_path):
    """Karate's probe has test labels only: every trial would fail alike, so the first one ends
    the search with the dataset named as the cause, instead of N failed trials."""
    result = _invoke("karate-node2vec", "-o", tmp_path / "t", "--trials", 3, "--set", "train.epochs=2")
    assert result.exit_code == 1
    assert "no valid split to search on" in result.output and "dataset.link_split" in result.output
    assert len(rows(TuneFolder(tmp_path / "t"))) == 1  # the first trial, queued again for --resume


TASKS = {
    "node2vec": (
        """
name: tiny-n2v
dataset: {{kind: synthetic_graph, root: {root}, graph: {{nodes: 400, communities: 4, average_degree: 6, homophily: 0.9, seed: 0}}}}
model: {{kind: node2vec, dim: 8, node2vec: {{walk_length: 8, context_size: 4, walks_per_node: 2}}}}
train: {{epochs: 2, batch_size: 128}}
""",
        "probe accuracy",
    ),
    "dlrm": (
        """
name: tiny-dlrm
dataset: {{kind: synthetic_clicks, root: {root}, clicks: {{samples: 6000, valid: 1000, test: 1000, features: 3, ids: 200, dense: 2}}}}
model: {{kind: dlrm, dim: 8, recsys: {{rows: 200, top: [8]}}}}
train: {{epochs: 2, batch_size: 256}}
""",
        "AUC",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(TASKS))
def test_node2vec_and_dlrm_searches_score_their_own_metric(task, tmp_path):
    """tune is not KGE's alone: a node2vec search maximises the probe's valid accuracy and a
    DLRM search the valid AUC; best-test.json holds the best trial's test metrics."""
    text, label = TASKS[task]
    recipe = tmp_path / f"{task}.yaml"
    recipe.write_text(text.format(root=tmp_path / "data"))
    result = _invoke(recipe, "-o", tmp_path / "t", "--trials", 2)
    assert result.exit_code == 0, result.output
    found = rows(TuneFolder(tmp_path / "t"))
    assert [r.state for r in found] == ["COMPLETE", "COMPLETE"] and all(r.metric == f"valid {label}" for r in found)
    best = max(found, key=lambda r: r.value)
    valid = [
        r
        for r in MetricsLog.read(tmp_path / "t" / "trials" / f"trial-{best.number:04d}" / "metrics.jsonl")
        if r.get("kind") == "eval"
    ]
    assert valid and valid[-1]["split"] == "valid"
    assert json.loads((tmp_path / "t" / "best-test.json").read_text())
