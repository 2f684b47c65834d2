"""Where a relative dataset.path is read: from the current folder where it exists there (and
a run stores it absolute), else under the data root; a missing one names both places."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsa_train.data import load_click_log, load_graph, load_knowledge_graph
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, parse_recipe, with_data_root


def test_relative_path_from_the_current_folder_first_then_the_data_root(tmp_path, monkeypatch):
    root = Path(os.environ["DSA_DATA_ROOT"])
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    (root / "g.txt").write_text("a b\n")
    assert load_graph(DatasetConfig(kind="edge_list", path="g.txt")).num_nodes == 2  # under the data root
    (here / "g.txt").write_text("a b\nb c\n")
    assert load_graph(DatasetConfig(kind="edge_list", path="g.txt")).num_nodes == 3  # the current folder's wins
    recipe = with_data_root(
        parse_recipe("dataset: {kind: edge_list, path: g.txt}\nmodel: {kind: node2vec}\n", source="r")
    )
    assert recipe.dataset.path == str(here / "g.txt")  # what a run stores
    elsewhere = with_data_root(
        parse_recipe("dataset: {kind: edge_list, path: other.txt}\nmodel: {kind: node2vec}\n", source="r")
    )
    assert elsewhere.dataset.path == "other.txt"  # not here: left to the data root


@pytest.mark.parametrize(
    "config",
    [
        DatasetConfig(kind="edge_list", path="missing/edges.txt"),
        DatasetConfig(kind="tsv", path="missing"),
        DatasetConfig(kind="click_log", path="missing/clicks.tsv"),
    ],
    ids=["edge_list", "tsv", "click_log"],
)
def test_a_missing_path_names_both_places(tmp_path, monkeypatch, config):
    monkeypatch.chdir(tmp_path)
    root = Path(os.environ["DSA_DATA_ROOT"]).resolve()
    load = {"edge_list": load_graph, "tsv": load_knowledge_graph, "click_log": load_click_log}[config.kind]
    with pytest.raises(DatasetError) as caught:
        load(config)
    message = str(caught.value)
    assert (
        f"'{tmp_path / config.path}' (from the current folder)" in message
        and f"'{root / config.path}' (under the data root)" in message
    )
