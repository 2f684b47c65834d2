"""The memory and disk a recipe's run takes, estimated before it starts, against sizes worked
out by hand; a warning when the machine has less; printed by validate and run --dry-run."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.recipe import parse_recipe
from dsa_train.train import estimate as estimate_module
from dsa_train.train.estimate import estimate

DLRM = "dataset: {kind: synthetic_clicks, clicks: {features: 8}}\nmodel: {kind: dlrm, dim: 16, embedding_storage: %s, recsys: {rows: 1000}}\noptimizer: {kind: %s}\n"


@pytest.mark.parametrize(
    "storage,optimizer,ram,disk",
    [
        # 8 features x 1,000 rows x 16 floats x 4 bytes = 512,000 bytes (T); 3 checkpoints (2 kept + 1 being written)
        ("memory", "dsa", 512_000, 2 * 512_000 + 3 * 512_000),  # moments on disk (2T), a checkpoint's weights T each
        ("memory", "sparse_adam", 3 * 512_000, 3 * 512_000),  # torch's dense moments in RAM
        ("disk", "dsa", 0, 3 * 512_000 + 3 * 3 * 512_000),  # one file of weights and moments; checkpoints up to 3T each
    ],
)
def test_dlrm_tables_by_hand(storage, optimizer, ram, disk):
    found = estimate(parse_recipe(DLRM % (storage, optimizer), source="r"))
    assert (found.rows, found.ram, found.disk) == (8000, ram, disk)


def test_criteo_layout_and_graphs_and_unknown_rows():
    criteo = parse_recipe(
        "dataset: {kind: click_log, path: day_0, layout: criteo}\nmodel: {kind: dlrm, recsys: {rows: 100}}\n",
        source="r",
    )
    assert estimate(criteo).rows == 2600
    kg = parse_recipe(
        "dataset: {kind: synthetic, synthetic: {entities: 500, relations: 7}}\nmodel: {kind: transe, dim: 8}\n",
        source="r",
    )
    assert estimate(kg).rows == 500 + 2 * 7  # reciprocal: an inverse per relation
    cora = estimate(parse_recipe("dataset: {kind: planetoid, name: Cora}\nmodel: {kind: node2vec}\n", source="r"))
    assert cora.rows is None and "known once it is imported" in cora.lines()[0]


def test_a_warning_when_the_machine_has_less(monkeypatch, tmp_path):
    found = estimate(parse_recipe(DLRM % ("memory", "dsa"), source="r"))
    monkeypatch.setattr(estimate_module, "host_total_bytes", lambda: 100_000)
    monkeypatch.setattr(estimate_module, "free_disk_bytes", lambda folder: 1000)
    lines = found.lines(output=tmp_path)
    assert any(
        line.startswith("warning: the tables need 500.0 KiB of RAM and this machine has 97.7 KiB") for line in lines
    )
    assert any(line.startswith("warning: the run may write up to") for line in lines)


def test_validate_and_dry_run_print_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(DLRM % ("memory", "dsa"))
    for args in (["validate", str(recipe)], ["run", str(recipe), "--dry-run"]):
        result = CliRunner().invoke(app, args)
        assert (
            result.exit_code == 0
            and "estimate: tables in RAM 500.0 KiB, disk up to 2.4 MiB (8,000 table rows)" in result.stdout
        )
    shown = CliRunner().invoke(app, ["validate", str(recipe), "--show"])
    assert "estimate:" in shown.stderr and "estimate:" not in shown.stdout  # the YAML alone on stdout
