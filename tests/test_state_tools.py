"""inspect-state, clean, recipes and validate, through the CLI, with every refusal."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsa_train import DiskSparseAdam
from dsa_train.cli.app import app

from .test_train_kge import TINY

REPO = Path(__file__).resolve().parent.parent


def invoke(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


@pytest.fixture
def state(tmp_path):
    """A closed state directory: 1,000 x 4 rows of which 5 were touched, 3 steps."""
    emb = torch.nn.Embedding(1000, 4, sparse=True)
    path = tmp_path / "opt_state_cache"
    with DiskSparseAdam(emb.named_parameters(), lr=0.01, state_dir=path) as opt:
        for _ in range(3):
            opt.zero_grad()
            emb(torch.tensor([1, 2, 3, 500, 999])).pow(2).sum().backward()
            opt.step()
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny training run (checkpoints at steps 20, 25, 30), made once."""
    root = tmp_path_factory.mktemp("made")
    recipe = root / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    assert invoke("run", recipe, "--output", root / "run").exit_code == 0
    return root / "run"


@pytest.fixture
def runs(tmp_path, finished_run):
    """./runs holding a copy of the finished run; the working directory is tmp_path."""
    shutil.copytree(finished_run, tmp_path / "runs" / "tiny-1")
    return tmp_path / "runs"


# -- inspect-state ---------------------------------------------------------------------------
def test_inspect_state_json(state):
    result = invoke("inspect-state", state, "--json", "--rows", "0:3,500", "--stats")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["version"] == 1 and doc["clean"] is True and doc["held_by"] is None
    p = doc["params"]["weight"]
    assert (p["shape"], p["dtype"], p["step"], p["layout"]) == ([1000, 4], "float32", 3, "m|v")
    assert p["apparent_bytes"] == 4096 + 1000 * 32 and p["allocated_bytes"] < p["apparent_bytes"]
    assert p["touched_rows_fraction"] == pytest.approx(5 / 1000) and p["sampled_rows"] == 1000
    raw = np.fromfile(state / "weight.rows", dtype=np.float32, offset=4096).reshape(1000, 2, 4)
    for row in (0, 1, 2, 500):
        assert p["rows"][str(row)]["m"] == raw[row, 0].tolist() and p["rows"][str(row)]["v"] == raw[row, 1].tolist()
    assert p["stats"]["sampled_touched_rows"] == 5 and p["stats"]["v"]["min"] > 0
    assert p["stats"]["effective_lr"]["mean"] > 0


def test_inspect_state_of_a_live_run_does_not_take_the_lock(state):
    emb = torch.nn.Embedding(1000, 4, sparse=True)
    with DiskSparseAdam(emb.named_parameters(), state_dir=state):  # a "training" holds it
        result = invoke("inspect-state", state)
        assert result.exit_code == 0
        assert f"held by a live training, pid {os.getpid()}" in result.stderr
        assert "weight" in result.stdout and "1,000 x 4" in result.stdout


def test_inspect_state_of_a_run_folder(finished_run):
    doc = json.loads(invoke("inspect-state", finished_run, "--json").stdout)
    assert doc["path"].endswith("optimizer_state") and doc["params"]["node_emb.weight"]["step"] == 30


@pytest.mark.parametrize(
    "args,expected",
    [
        (["{tmp}"], "is not a DiskSparseAdam state directory"),
        (["{state}", "--rows", "a:b"], "is not a row list"),
        (["{state}", "--rows", "0,5000"], "rows \\[5000\\] are out of range"),
        (["{state}", "--param", "nope"], "has no parameter 'nope'"),
    ],
)
def test_inspect_state_refusals(state, tmp_path, args, expected):
    result = invoke("inspect-state", *[a.format(tmp=tmp_path, state=state) for a in args])
    assert result.exit_code == 1
    import re

    assert re.search(expected, result.stderr), result.stderr


# -- clean --------------------------------------------------------------------------------------
def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_clean_dry_run_plans_and_removes_nothing(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    result = invoke("clean", "--dry-run")
    assert result.exit_code == 0
    assert "3 to remove" in result.stdout and "Dry run: nothing removed." in result.stdout
    assert "0000000020" in result.stdout and "0000000025" in result.stdout and "optimizer_state" in result.stdout
    assert "0000000030: one of the newest 1 checkpoints" in result.stderr
    assert listing(tmp_path) == before


def test_clean_removes_exactly_the_plan(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (runs / "tiny-1" / "checkpoints" / ".partial-0000000031").mkdir()  # a save killed half-way
    result = invoke("clean", "--yes")
    assert result.exit_code == 0 and "Removed 4 items" in result.stdout
    run = runs / "tiny-1"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["0000000030"]
    assert (
        (run / "config.yaml").exists() and (run / "metrics.jsonl").exists() and not (run / "optimizer_state").exists()
    )
    # the run can still be evaluated, and resumed from its kept checkpoint
    assert invoke("eval", run, "--json").exit_code == 0


def test_clean_keep_last_zero_and_older_than(runs, tmp_path):
    young = invoke("clean", runs, "--older-than", "1d", "--yes")
    assert young.exit_code == 0 and "Nothing to clean." in young.stdout
    result = invoke("clean", runs, "--keep-last", "0", "--yes")
    assert result.exit_code == 0 and "Removed 4 items" in result.stdout
    assert list((runs / "tiny-1" / "checkpoints").iterdir()) == []


def test_clean_asks_first(runs, tmp_path, monkeypatch):
    from dsa_train.cli import clean

    monkeypatch.setattr(clean, "can_ask", lambda: True)  # as on a terminal
    result = invoke("clean", runs, input="n\n")
    assert result.exit_code == 0 and "Cancelled: nothing removed." in result.stdout
    assert len(list((runs / "tiny-1" / "checkpoints").iterdir())) == 3


def test_clean_without_a_terminal_asks_for_yes_and_removes_nothing(runs):
    result = invoke("clean", runs)  # the test's stdin is no terminal, as in a script
    assert result.exit_code == 1 and "no terminal to confirm it on" in result.stderr and "pass --yes" in result.stderr
    assert len(list((runs / "tiny-1" / "checkpoints").iterdir())) == 3


def test_clean_never_touches_a_directory_in_use(state, tmp_path):
    emb = torch.nn.Embedding(1000, 4, sparse=True)
    with DiskSparseAdam(emb.named_parameters(), state_dir=state):
        result = invoke("clean", state, "--yes")
    assert result.exit_code == 0 and "Nothing to clean." in result.stdout
    assert f"in use by pid {os.getpid()}" in result.stderr and (state / "manifest.json").exists()


def test_clean_removes_a_free_state_directory(state):
    result = invoke("clean", state, "--yes")
    assert result.exit_code == 0 and "Removed 1 items" in result.stdout and not state.exists()


def test_clean_refuses_what_it_does_not_recognise(tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_text("precious")
    result = invoke("clean", mine, "--yes")
    assert result.exit_code == 1 and "is not a run folder or a DiskSparseAdam state directory" in result.stderr
    assert (mine / "cat.jpg").read_text() == "precious"
    (tmp_path / "file.txt").write_text("x")
    assert "is not a directory" in invoke("clean", tmp_path / "file.txt").stderr
    assert "is not an age" in invoke("clean", mine, "--older-than", "soon").stderr


def test_clean_does_not_follow_symlinks(state, runs, tmp_path):
    (runs / "elsewhere").symlink_to(state)  # a link inside runs/ to a state directory outside it
    link = tmp_path / "link"
    link.symlink_to(runs)
    assert "is a symbolic link" in invoke("clean", link, "--yes").stderr
    result = invoke("clean", runs, "--yes")
    assert result.exit_code == 0 and "opt_state_cache" not in result.stdout
    assert (state / "manifest.json").exists() and (runs / "elsewhere").is_symlink()


# -- recipes and validate --------------------------------------------------------------------------
def test_recipes_lists_the_shipped_ones(monkeypatch):
    monkeypatch.chdir(REPO)
    result = invoke("recipes")
    assert result.exit_code == 0
    for name in (
        "quickstart",
        "fb15k237-transe",
        "wn18rr-distmult",
        "synthetic-10m",
        "umls-transe",
        "nations-distmult",
    ):
        assert f"recipes/{name}.yaml" in result.stdout


def test_validate(tmp_path):
    good = invoke("validate", REPO / "recipes" / "quickstart.yaml", "--set", "train.epochs=3")
    assert good.exit_code == 0 and "valid (transe on synthetic, 3 epochs)" in good.stdout
    shown = invoke("validate", REPO / "recipes" / "quickstart.yaml", "--show")
    assert shown.stdout.startswith("name: quickstart\n") and "batch_negatives: true" in shown.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset: {kind: tsv}\nmodel: {kind: transe, dimm: 3}\ntrain: {epochs: x}\n")
    result = invoke("validate", bad)
    assert result.exit_code == 1 and "3 problems" in result.stderr
    assert "model.dimm (line 2): unknown key; did you mean 'dim'?" in result.stderr
