"""What `dsa-train run` leaves and says around the edges of a run: a new run that fails before
its first step leaves no folder behind; `--resume` of a finished run says so and trains
nothing (until asked for more epochs). References: the file system and the metrics log."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from dsa_train.cli.app import app

RECIPE = """
name: small
dataset:
  kind: synthetic
  synthetic: {entities: 200, relations: 3, triples: 1500, valid: 20, test: 20, seed: 4}
model: {kind: distmult, dim: 8}
train: {epochs: 1, batch_size: 64, negatives: 16, device: cpu}
eval: {final_splits: []}
"""


def _run(*args: str):
    return CliRunner().invoke(app, ["run", *args], terminal_width=300)


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_DATA_ROOT", str(tmp_path / "no-data"))
    recipe = tmp_path / "umls.yaml"
    recipe.write_text("name: u\ndataset: {kind: tsv, path: umls}\nmodel: {kind: transe, dim: 8}\n")
    result = _run(str(recipe), "-o", str(tmp_path / "runs" / "u"))
    assert result.exit_code == 1 and "lacks train.txt" in result.output
    assert "set dataset.fetch: umls" in result.output and "set DSA_DATA_ROOT" in result.output  # how to get the files
    assert not (tmp_path / "runs" / "u").exists() and "removed" in result.output
    again = _run(str(recipe), "-o", str(tmp_path / "runs" / "u"), "--resume")  # nothing to pick up
    assert again.exit_code == 1 and "does not exist" in again.output


def test_resuming_a_finished_run_says_so_and_trains_nothing(tmp_path):
    recipe, run = tmp_path / "small.yaml", tmp_path / "run"
    recipe.write_text(RECIPE)
    assert _run(str(recipe), "-o", str(run)).exit_code == 0
    before = (run / "metrics.jsonl").read_text()
    steps = json.loads(before.splitlines()[-1])["step"]
    finished = _run(str(recipe), "-o", str(run), "--resume")
    assert finished.exit_code == 0 and f"is finished: {steps} steps, 1 epoch; nothing to resume" in finished.output
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained, evaluated or logged
    longer = _run(str(recipe), "-o", str(run), "--resume", "--set", "train.epochs=2")
    assert longer.exit_code == 0 and f"{2 * steps} steps, 2 epochs" in longer.output
    records = [json.loads(line) for line in Path(run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epochs"] for r in records if r["kind"] == "summary"] == [
        2
    ]  # cut back to the checkpoint, then one summary


def test_help_shows_no_type_placeholders_for_flags_or_lists():
    runner = CliRunner()
    for command in ("run", "eval", "import", "inspect-state", "clean", "recipes", "validate"):
        shown = runner.invoke(app, [command, "--help"], terminal_width=200).output
        assert "<bool>" not in shown and "list[" not in shown, (command, shown)
    assert "KEY=VALUE" in runner.invoke(app, ["run", "--help"], terminal_width=200).output


def test_eval_of_a_missing_folder_says_it_does_not_exist(tmp_path):
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "nothing")])
    assert result.exit_code == 1 and f"run folder '{tmp_path / 'nothing'}' does not exist" in result.output
    assert "Hint:" in result.output


def test_a_run_stores_its_data_root_so_eval_needs_no_environment(tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("DSA_DATA_ROOT", str(data))
    recipe, run = tmp_path / "small.yaml", tmp_path / "run"
    recipe.write_text(RECIPE.replace("final_splits: []", "final_splits: [test]"))
    assert _run(str(recipe), "-o", str(run)).exit_code == 0
    assert f"root: {data.resolve()}" in (run / "config.yaml").read_text()
    monkeypatch.delenv("DSA_DATA_ROOT")
    monkeypatch.chdir(tmp_path / "run")  # no ./datasets here: only the stored root finds the data
    scored = CliRunner().invoke(app, ["eval", str(run), "--json"])
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["warnings"] == []
    moved = tmp_path / "moved"
    data.rename(moved)
    monkeypatch.setenv("DSA_DATA_ROOT", str(moved))
    scored = CliRunner().invoke(app, ["eval", str(run), "--json"])
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["warnings"] == [
        f"data root: $DSA_DATA_ROOT ({moved.resolve()}) instead of the run's {data.resolve()}"
    ]


def test_the_summary_line_is_never_broken_inside_a_value(tmp_path, monkeypatch):
    """On a narrow console (or a log that is no terminal) the summary stays one line per fact:
    rich must not insert line breaks between a number and its unit."""
    from dsa_train.cli._output import stdout

    monkeypatch.setattr(stdout, "width", 40)  # narrower than the line
    recipe, run = tmp_path / "small.yaml", tmp_path / "run"
    recipe.write_text(RECIPE)
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(run)])
    assert result.exit_code == 0, result.output
    summary = next(line for line in result.stdout.splitlines() if " steps, " in line)
    assert re.search(r"optimizer state on disk [\d.,]+ MiB \(memory budget [\d,]+ MiB\)$", summary.rstrip()), summary
    assert f"run folder: {run}" in result.stdout.splitlines()
