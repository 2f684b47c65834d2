"""The training loop and the CLI around it: run folders, checkpoints, exact resume, eval."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.train import loop
from dsa_train.runs.run_folder import MetricsLog

from .helpers import assert_same_tensors, error_at_step

TINY = """\
name: tiny
description: a few seconds of training for the tests
dataset:
  kind: synthetic
  synthetic: {entities: 300, relations: 6, triples: 4000, valid: 100, test: 100, clusters: 10, seed: 1}
model: {kind: %(model)s, dim: 16, init_std: 0.05, dropout: 0.1, embedding_storage: %(storage)s}
train: {epochs: 3, batch_size: 256, negatives: 64, log_every: 4, checkpoint_every: 5, keep_checkpoints: 3, regularization: 0.001}
optimizer: {kind: %(optimizer)s, lr: 0.01}
eval: {every_epochs: 2, final_splits: [valid, test]}
"""


@pytest.fixture
def recipe(tmp_path):
    def write(model="transe", optimizer="dsa", storage="memory"):
        path = tmp_path / f"tiny-{model}-{optimizer}-{storage}.yaml"
        path.write_text(TINY % {"model": model, "optimizer": optimizer, "storage": storage})
        return path

    return write


def invoke(*args, env=None):
    return CliRunner(env=env).invoke(app, [str(a) for a in args])


def records(run, kind):
    return [r for r in MetricsLog.read(run / "metrics.jsonl") if r["kind"] == kind]


def test_run_writes_a_complete_run_folder(recipe, tmp_path):
    out = tmp_path / "run"
    result = invoke("run", recipe(), "--output", out)
    assert result.exit_code == 0, result.stderr
    assert "tiny: test" in result.stdout and "Hits@10" in result.stdout and "run folder" in result.stdout
    assert "epoch 3: loss" in result.stderr  # progress goes to stderr
    assert (out / "config.yaml").read_text().startswith("name: tiny\n")
    summary = records(out, "summary")[0]
    total = summary["step"]
    assert total == 30  # 3 epochs of 10 batches of 256 (the generator dedups to ~2,500 train triples)
    steps = [int(p.name) for p in sorted((out / "checkpoints").iterdir())]
    assert steps == [20, 25, 30]  # every 5 steps, the newest 3 kept
    assert (out / "checkpoints" / "0000000030" / "optimizer_state" / "manifest.json").exists()
    assert [r["epoch"] for r in records(out, "epoch")] == [1, 2, 3]
    assert [r["step"] for r in records(out, "train")] == list(range(4, 31, 4))
    assert [(r["split"], r["epoch"]) for r in records(out, "eval")] == [("valid", 2), ("valid", 3), ("test", 3)]
    assert summary["final"]["test"]["both"]["mrr"] > 0.05  # far above chance (~0.02)
    manifest = json.loads((out / "optimizer_state" / "manifest.json").read_text())
    assert manifest["clean"] and manifest["params"]["node_emb.weight"]["step"] == 30


@pytest.mark.parametrize(("optimizer", "storage"), [("dsa", "memory"), ("sparse_adam", "memory"), ("dsa", "disk")])
def test_resume_after_a_failed_step_matches_an_uninterrupted_run(recipe, tmp_path, optimizer, storage):
    """Also with the entity table on disk: the table file (weights and moments) comes back
    from the checkpoint's copy, and ends equal to the uninterrupted run's."""
    path = recipe("distmult", optimizer, storage)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert invoke("run", path, "--output", whole).exit_code == 0

    with error_at_step(12):  # after the checkpoint of step 10; steps 11-12 are lost
        crashed = invoke("run", path, "--output", broken)
        assert crashed.exit_code == 1 and "injected error at step" in crashed.stderr
    resumed = invoke("run", path, "--output", broken, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "step 10" in resumed.stderr

    for kind in ("train", "epoch", "eval", "summary"):
        ours, theirs = records(broken, kind), records(whole, kind)
        for record in ours + theirs:
            for timing in MetricsLog.MACHINE_FIELDS:
                record.pop(timing, None)
        assert ours == theirs, kind
    final = "checkpoints/0000000030"
    a = torch.load(whole / final / "model.pt")
    b = torch.load(broken / final / "model.pt")
    assert_same_tensors(a, b, final)
    files = {"memory": ["optimizer_state/node_emb.weight.rows"], "disk": ["tables/entities.table"]}[storage]
    if optimizer == "dsa":
        for rows in [*files, "optimizer_state/rel_emb.weight.rows"]:
            x = np.fromfile(whole / rows, dtype=np.float32, offset=4096)  # past the header,
            y = np.fromfile(broken / rows, dtype=np.float32, offset=4096)  # which names the run
            assert np.array_equal(x, y), rows


@pytest.mark.parametrize("optimizer", ["dsa", "sparse_adam"])
def test_a_learning_rate_set_on_resume_applies_from_the_checkpoint_on(recipe, tmp_path, monkeypatch, optimizer):
    """``--resume --set optimizer.lr=...`` trains on at the new rate, as config.yaml then says:
    the run ends as an uninterrupted one whose rate changed after the checkpoint it resumed
    from (the checkpoint's own rate must not come back with its step counters)."""
    path = recipe("distmult", optimizer)
    switched, resumed = tmp_path / "switched", tmp_path / "resumed"
    real_step = loop.Training.step

    def switch_after_10(self, picked):
        if self.step_count == 10:
            for group in self.optimizer.param_groups:
                group["lr"] = 0.05
        return real_step(self, picked)

    monkeypatch.setattr(loop.Training, "step", switch_after_10)
    assert invoke("run", path, "--output", switched).exit_code == 0
    monkeypatch.setattr(loop.Training, "step", real_step)
    with error_at_step(12):  # after the checkpoint of step 10
        assert invoke("run", path, "--output", resumed).exit_code == 1
    result = invoke("run", path, "--output", resumed, "--resume", "--set", "optimizer.lr=0.05")
    assert result.exit_code == 0, result.stderr
    assert "lr: 0.05" in (resumed / "config.yaml").read_text()
    final = "checkpoints/0000000030"
    a, b = torch.load(switched / final / "model.pt"), torch.load(resumed / final / "model.pt")
    assert_same_tensors(a, b, final)
    groups = torch.load(resumed / final / "optimizer.pt")["param_groups"]
    assert [g["lr"] for g in groups] == [0.05] * len(groups)


@pytest.mark.parametrize(("model", "storage"), [("complex", "memory"), ("rotate", "disk")])
def test_complex_models_train_and_evaluate(recipe, tmp_path, model, storage):
    """ComplEx and RotatE through the whole CLI (memory and disk tables, N3 and dropout on):
    they learn far above chance, and `eval` of the run gives the metrics it ended with."""
    out = tmp_path / model
    result = invoke("run", recipe(model=model, storage=storage), "--output", out, "--set", "train.epochs=6")
    assert result.exit_code == 0, result.stderr
    final = records(out, "summary")[0]["final"]["test"]
    assert final["both"]["mrr"] > 0.05, final  # chance is ~0.02
    scored = invoke("eval", out, "--json")
    assert scored.exit_code == 0, scored.stderr
    assert json.loads(scored.stdout)["metrics"] == final


def test_an_odd_dim_for_a_complex_model_is_refused(recipe, tmp_path):
    result = invoke("run", recipe(model="complex"), "--output", tmp_path / "odd", "--set", "model.dim=15")
    assert result.exit_code != 0 and "model.dim" in result.stderr and "must be even for 'complex'" in result.stderr


def test_eval_saves_each_querys_rank(recipe, tmp_path):
    """--save-ranks: one line per query (tail queries, then head queries, in the split's
    order) whose ranks give back the metrics eval prints, and whose triples are the split's."""
    from dsa_train.data import load_knowledge_graph
    from dsa_train.recipe import load_recipe

    out, ranks = tmp_path / "run", tmp_path / "ranks.tsv"
    assert invoke("run", recipe(), "--output", out).exit_code == 0
    scored = invoke("eval", out, "--json", "--save-ranks", ranks)
    assert scored.exit_code == 0, scored.stderr
    metrics = json.loads(scored.stdout)["metrics"]
    lines = ranks.read_text().splitlines()
    assert lines[0] == "side\thead\trelation\ttail\trank"
    rows = [line.split("\t") for line in lines[1:]]
    test = load_knowledge_graph(load_recipe(out / "config.yaml").dataset).test.tolist()
    assert [r[0] for r in rows] == ["tail"] * len(test) + ["head"] * len(test)
    assert [[int(x) for x in r[1:4]] for r in rows] == test + test
    for side, chosen in (("tail", rows[: len(test)]), ("head", rows[len(test) :]), ("both", rows)):
        values = [float(r[4]) for r in chosen]
        assert min(values) >= 1
        assert sum(1 / v for v in values) / len(values) == pytest.approx(metrics[side]["mrr"], rel=1e-12)
        assert sum(v <= 10 for v in values) / len(values) == pytest.approx(metrics[side]["hits_at_10"], rel=1e-12)
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith(".ranks.tsv.tmp-")
    ]  # written through a temporary, renamed
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    linked = tmp_path / "linked.tsv"
    linked.symlink_to(victim)
    assert invoke("eval", out, "--save-ranks", linked).exit_code == 0
    assert victim.read_text() == "keep me" and not linked.is_symlink()  # the link is replaced, never written through
    refused = invoke("eval", out, "--save-ranks", tmp_path / "no" / "such" / "ranks.tsv")
    assert refused.exit_code != 0 and "does not exist" in refused.stderr and "Traceback" not in refused.stderr


def test_eval_command(recipe, tmp_path):
    out = tmp_path / "run"
    assert invoke("run", recipe(), "--output", out).exit_code == 0
    result = invoke("eval", out, "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["checkpoint"] == 30 and document["split"] == "test"
    assert document["metrics"] == records(out, "summary")[0]["final"]["test"]
    older = invoke("eval", out, "--split", "valid", "--checkpoint", "25")
    assert older.exit_code == 0 and "checkpoint 25: valid" in older.stdout
    missing = invoke("eval", out, "--checkpoint", "999")
    assert missing.exit_code == 1
    assert "Error: no checkpoint of step 999" in missing.stderr and "available steps: 20, 25, 30" in missing.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["run", "{bad}"], "Error: recipe '.*' has 2 problems"),
        (
            ["run", "{good}", "--set", "train.epochz=2"],
            "train.epochz \\(from --set\\): unknown key; did you mean 'epochs'",
        ),
        (["run", "{good}", "--resume"], "Error: no run of recipe 'tiny' to resume"),
        (["eval", "{tmp}"], "is not a run folder"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(recipe, tmp_path, monkeypatch, args, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: {kind: tsvv}\nmodel: {kind: transe, dim: -1}\n")
    monkeypatch.chdir(tmp_path)
    args = [a.format(bad=bad, good=recipe(), tmp=tmp_path) for a in args]
    result = invoke(*args)
    assert result.exit_code == 1
    assert "Traceback" not in result.stderr + result.stdout
    import re

    assert re.search(expected, result.stderr), result.stderr


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: {kind: tsvv}\n")
    result = invoke("run", bad, env={"DSA_DEBUG": "1"})
    assert result.exit_code == 1 and type(result.exception).__name__ == "ConfigError"


def test_existing_run_folder_is_not_overwritten(recipe, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    result = invoke("run", recipe(), "--output", out)
    assert result.exit_code == 1 and "already exists" in result.stderr and "--resume" in result.stderr
    assert (out / "notes.txt").read_text() == "precious"


def test_usage_errors_exit_2_and_help_shows_examples():
    assert invoke("run", "--bogus").exit_code == 2
    for command in ("run", "eval"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "Example" in result.stdout


def test_second_process_on_a_run_folder_is_refused_and_a_dead_holder_is_not(recipe, tmp_path):
    import signal
    import subprocess
    import sys
    import textwrap

    out = tmp_path / "run"
    assert invoke("run", recipe(), "--output", out).exit_code == 0
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys
            from dsa_train.runs.run_folder import RunFolder
            lock = RunFolder({str(out)!r}).lock()
            print("ready", flush=True)
            sys.stdin.read()
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        second = invoke("run", recipe(), "--output", out, "--resume")
        assert second.exit_code == 1 and f"run folder '{out}' is locked by pid {holder.pid}" in second.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    again = invoke("run", recipe(), "--output", out, "--resume")  # the kernel freed the dead holder's lock
    assert again.exit_code == 0, again.stderr


def test_a_long_full_ranking_says_how_long_after_its_first_batch(notes):
    from dsa_train import progress
    from dsa_train.train.kge import RankingForecast

    class Reporter(progress.SilentReporter):
        advanced = 0

        def eval_advance(self, done):
            self.advanced += done

    said = {}
    for name, is_sampled, elapsed in (("full", False, 10.0), ("sampled", True, 10.0), ("quick", False, 0.0)):
        notes.clear()
        with progress.reporting(Reporter()) as reporter:
            forecast = RankingForecast(10_000, 10**8, sampled=is_sampled)
            forecast.started -= elapsed  # the first 100 queries took this long
            forecast(100)
            forecast(100)
        assert reporter.advanced == 200
        said[name] = list(notes)
    assert len(said["full"]) == 1 and "about 17 minutes" in said["full"][0] and "sampled_negatives" in said["full"][0]
    assert not said["sampled"] and not said["quick"]


def test_one_vs_all_is_a_softmax_over_every_entity(tmp_path):
    """train.candidates: all: each query's loss is -log softmax over every entity of its
    answer's score, written out triple by triple here; every entity row gets a gradient."""
    from dsa_train.recipe import parse_recipe
    from dsa_train.train.tasks import make_task

    text = TINY % {"model": "complex", "optimizer": "dsa", "storage": "memory"}
    recipe = parse_recipe(
        text, overrides=["train.candidates=all", "model.dropout=0", "train.regularization=0", "model.reciprocal=false"]
    )
    torch.manual_seed(0)
    task = make_task(recipe, torch.device("cpu"))
    model, n = task.model.double(), task.kg.num_entities
    picked = torch.tensor([0, 7, 42])
    loss = task.loss(picked)
    expected = []
    with torch.no_grad():
        for h, r, t in task.kg.rows("train", picked).tolist():
            every = torch.arange(n)
            tails = model(torch.full((n,), h), torch.full((n,), r), every)  # (h, r, e) for every e
            heads = model(every, torch.full((n,), r), torch.full((n,), t))
            expected += [-torch.log_softmax(tails, 0)[t], -torch.log_softmax(heads, 0)[h]]
    assert loss.item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-9)
    loss.backward()
    touched = model.node_emb.weight.grad.coalesce()._indices()[0]
    assert torch.equal(torch.unique(touched), torch.arange(n))  # every row: DiskSparseAdam's sparsity is gone


def test_one_vs_all_trains_and_is_refused_where_it_cannot_run(recipe, tmp_path):
    out = tmp_path / "all"
    result = invoke("run", recipe(model="distmult", storage="disk"), "--output", out, "--set", "train.candidates=all")
    assert result.exit_code == 0, result.stderr
    assert records(out, "summary")[0]["final"]["test"]["both"]["mrr"] > 0.05
    refused = invoke(
        "run",
        recipe(model="distmult", storage="disk"),
        "--output",
        tmp_path / "p",
        "--set",
        "train.candidates=all",
        "--set",
        "train.order=partitioned",
    )
    assert (
        refused.exit_code != 0
        and "train.candidates" in refused.stderr
        and "partition order keeps out of memory" in refused.stderr
    )
    from dsa_train.errors import DsaError
    from dsa_train.recipe import parse_recipe
    from dsa_train.train.tasks import make_task

    with pytest.raises(DsaError, match="train.candidates 'all' runs in one process so far"):
        make_task(
            parse_recipe(
                TINY % {"model": "distmult", "optimizer": "dsa", "storage": "memory"},
                overrides=["train.candidates=all"],
            ),
            torch.device("cpu"),
            world=object(),
        )
