"""A run whose recipe puts its optimizer state elsewhere (optimizer.state_dir) is still found
from the run folder alone: inspect-state RUN shows that state, clean RUN says where it is; a
cleaned run points inspect-state to its checkpoints' copies. References: the state directory
the optimizer actually wrote, and the CLI's own words."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dsa_train.cli.app import app

RECIPE = """
name: small
dataset:
  kind: synthetic
  synthetic: {entities: 150, relations: 3, triples: 1200, valid: 20, test: 20, seed: 4}
model: {kind: distmult, dim: 8}
train: {epochs: 1, batch_size: 128, negatives: 16, device: cpu}
eval: {final_splits: []}
optimizer: {kind: dsa, state_dir: %s}
"""


def _cli(*args: str):
    return CliRunner().invoke(app, list(args), terminal_width=300)


def test_a_run_with_its_own_state_dir_is_found_from_the_run_folder(tmp_path):
    state, run, recipe = tmp_path / "fast-disk" / "state", tmp_path / "run", tmp_path / "small.yaml"
    recipe.write_text(RECIPE % state)
    assert _cli("run", str(recipe), "-o", str(run)).exit_code == 0
    assert json.loads((run / "run.json").read_text())["state_dir"] == str(state.resolve())
    shown = _cli("inspect-state", str(run), "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["path"] == str(
        state.resolve()
    )  # the state the optimizer wrote, not <run>/optimizer_state
    planned = _cli("clean", str(run), "--dry-run")
    assert planned.exit_code == 0 and f"dsa-train clean {state.resolve()} removes it" in planned.output


def test_a_cleaned_run_points_to_its_checkpoint_copies(tmp_path):
    run, recipe = tmp_path / "run", tmp_path / "small.yaml"
    recipe.write_text((RECIPE % "null").replace("optimizer: {kind: dsa, state_dir: null}", "optimizer: {kind: dsa}"))
    assert _cli("run", str(recipe), "-o", str(run)).exit_code == 0
    assert _cli("clean", str(run), "--yes").exit_code == 0
    assert not (run / "optimizer_state").exists()
    pointed = _cli("inspect-state", str(run))
    assert pointed.exit_code == 1 and "no live optimizer state any more" in pointed.output
    newest = sorted((run / "checkpoints").iterdir())[-1]
    assert f"Hint: dsa-train inspect-state {newest}" in pointed.output
    assert _cli("inspect-state", str(newest)).exit_code == 0
