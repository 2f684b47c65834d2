"""Sizes of edge lists and click logs guessed before their import (what validate and run
--dry-run estimate with), against the files' true counts: exact where the sample is the
whole file, close (edges, impressions) or on the safe side (nodes) where it is not."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.data import size_guess
from dsa_train.recipe import DatasetConfig, EdgeListConfig, parse_recipe
from dsa_train.train.estimate import estimate


def random_graph(path, edges: int, nodes: int, seed: int = 0, prefix: str = "n"):
    rng = np.random.default_rng(seed)
    u, v = rng.integers(0, nodes, edges), rng.integers(0, nodes, edges)
    path.write_text("# a comment\n" + "".join(f"{prefix}{a}\t{prefix}{b}\n" for a, b in zip(u, v)))
    return (
        len(np.union1d(u, v)) if prefix else int(max(u.max(), v.max())) + 1
    )  # names: the distinct ones; integers: 0 .. the largest


@pytest.mark.parametrize("ids,prefix", [("names", "n"), ("integers", "")])
def test_a_small_file_is_counted_whole(tmp_path, ids, prefix):
    path = tmp_path / "g.txt"
    nodes = random_graph(path, 3000, 1000, prefix=prefix)
    guess = size_guess.edge_list_guess(DatasetConfig(kind="edge_list", path=str(path), edges=EdgeListConfig(ids=ids)))
    assert (guess.items, guess.nodes) == (3000, nodes)
    assert guess.how == "counted in the whole file"


def test_a_large_file_is_estimated_from_its_first_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(size_guess, "SAMPLE_BYTES", 8192)
    path = tmp_path / "g.txt"
    nodes = random_graph(path, 50_000, 10_000)
    guess = size_guess.edge_list_guess(DatasetConfig(kind="edge_list", path=str(path)))
    assert abs(guess.items - 50_000) < 2500  # within 5%
    assert nodes <= guess.nodes <= 2 * 50_000  # on the safe side, at most two new nodes an edge
    assert guess.how.startswith("estimated from ") and f"{path.stat().st_size:,} bytes in all" in guess.how


def test_parquet_rows_come_from_its_metadata(tmp_path):
    import pyarrow as pa  # the test extra installs it: its absence fails, never skips
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"s": list(range(0, 5000)), "t": [i // 2 for i in range(5000)]}), tmp_path / "g.parquet")
    guess = size_guess.edge_list_guess(
        DatasetConfig(kind="edge_list", path=str(tmp_path / "g.parquet"), edges=EdgeListConfig(ids="integers"))
    )
    assert (guess.items, guess.nodes) == (5000, 5000)


@pytest.mark.parametrize("compressed", [False, True])
def test_click_log_impressions(tmp_path, monkeypatch, compressed):
    rng = np.random.default_rng(1)
    text = "label\tI1\tC1\n" + "".join(
        f"{rng.integers(0, 2)}\t{rng.integers(0, 999)}\t{rng.integers(0, 10**9):x}\n" for _ in range(20_000)
    )
    path = tmp_path / ("clicks.tsv.gz" if compressed else "clicks.tsv")
    path.write_bytes(gzip.compress(text.encode()) if compressed else text.encode())
    assert size_guess.click_log_guess(path).items == 20_001  # the whole file: its lines, the header's too
    monkeypatch.setattr(size_guess, "SAMPLE_BYTES", 4096)
    guess = size_guess.click_log_guess(path)
    assert abs(guess.items - 20_001) < 2000 and guess.how.startswith("estimated from its first")


def test_validate_estimates_an_edge_list_before_its_import(tmp_path):
    path = tmp_path / "g.txt"
    nodes = random_graph(path, 3000, 1000)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"dataset: {{kind: edge_list, path: {path}}}\nmodel: {{kind: node2vec, dim: 16}}\n")
    found = estimate(parse_recipe(recipe.read_text()))
    assert found.rows == nodes and found.parts[0][0].startswith("the imported graph (about 3,000 edges")
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 0, result.output
    assert f"({nodes:,} table rows, about: counted in the whole file)" in result.stdout
    missing = estimate(
        parse_recipe(f"dataset: {{kind: edge_list, path: {tmp_path / 'nothing.txt'}}}\nmodel: {{kind: node2vec}}\n")
    )
    assert missing.rows is None and "could not be sampled: edge list" in missing.lines()[0]
