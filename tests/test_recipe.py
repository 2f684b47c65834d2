"""Recipes: every problem reported at once, with its dotted path, line and a suggestion."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dsa_train.errors import ConfigError
from dsa_train.recipe import load_recipe, parse_recipe, recipe_differences, recipe_to_yaml

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))

BROKEN = """\
dataset:
  kind: tsvv
  pth: umls
model:
  kind: transe
  dimm: 12
  dim: ten
train:
  epochs: -1
  batch_size: 1.5
optimizer:
  lr: 1e-3
  betas: [0.9, 1.2]
"""


def problems_of(text, overrides=()):
    with pytest.raises(ConfigError) as err:
        parse_recipe(text, overrides=overrides)
    return err.value.problems


def test_every_problem_at_once_with_path_line_and_suggestion():
    problems = problems_of(BROKEN, ["train.negatives=0", "nokey"])
    assert problems == [
        "--set 'nokey': expected key=value, for example train.epochs=5",
        "dataset.pth (line 3): unknown key; did you mean 'path'?",
        "dataset.kind (line 2): must be one of 'tsv', 'fb15k237', 'wn18rr', 'ogbl', 'synthetic', 'planetoid', 'karate', "
        "'synthetic_graph', 'edge_list', 'click_log', 'synthetic_clicks', got 'tsvv'; did you mean 'tsv'?",
        "model.dimm (line 6): unknown key; did you mean 'dim'?",
        "model.dim (line 7): expected a whole number, got text ('ten')",
        "train.epochs (line 9): must be >= 0, got -1",
        "train.batch_size (line 10): expected a whole number, got a number (1.5)",
        "train.negatives (from --set): must be > 0, got 0",
        "optimizer.betas (line 13): each beta must be in [0, 1), got [0.9, 1.2]",
    ]


@pytest.mark.parametrize(
    "text,expected",
    [
        (
            "dataset: {kind: tsv}\nmodel: {kind: distmult}\n",
            "dataset.path (in the section at line 1): is required for kind 'tsv'",
        ),
        (
            "dataset: [1]\nmodel: {kind: distmult}\n",
            "dataset (line 1): expected a section (key: value lines), got a list",
        ),
        ("model: {kind: distmult}\n", "dataset: missing (required)"),
        (
            "dataset: {kind: fb15k237}\nmodel: {}\n",
            "model.kind (in the section at line 2): missing (required; one of 'transe', 'distmult', 'complex', 'rotate', ",
        ),  # then any other registered
        (
            "dataset: {kind: fb15k237}\nmodel: {kind: transe, p_norm: 3}\n",
            "model.p_norm (line 2): must be one of 1, 2, got 3",
        ),
        (
            "dataset: {kind: fb15k237}\nmodel: {kind: transe, reciprocal: yes please}\n",
            "model.reciprocal (line 2): expected true or false",
        ),
        ("dataset: {kind: tsv\n", "not valid YAML (line 2)"),
        ("- a\n- b\n", "the top level must be a mapping of sections, got a list"),
        (
            "dataset: {kind: synthetic, synthetic: {triples: 10, valid: 5, test: 5}}\nmodel: {kind: transe}\n",
            "dataset.synthetic.triples",
        ),
        (
            "dataset: {kind: karate}\nmodel: {kind: transe}\n",
            "model.kind (line 2): 'transe' trains on a knowledge graph",
        ),
        ("dataset: {kind: fb15k237}\nmodel: {kind: node2vec}\n", "model.kind (line 2): 'node2vec' trains on a graph"),
        (
            "dataset: {kind: planetoid, name: cora}\nmodel: {kind: node2vec}\n",
            "dataset.name (line 1): must be Cora, CiteSeer or PubMed",
        ),
        ("dataset: {kind: karate}\nmodel: {kind: sage}\n", "dataset.link_split"),
        (
            "dataset: {kind: karate}\nmodel: {kind: sage, sage: {layers: 2, fanout: [5]}}\n",
            "model.sage.fanout (line 2): must list 2",
        ),
        (
            "dataset: {kind: karate}\nmodel: {kind: node2vec, node2vec: {walk_length: 3, context_size: 9}}\n",
            "model.node2vec.context_size",
        ),
    ],
)
def test_single_problems(text, expected):
    assert any(p.startswith(expected) for p in problems_of(text)), problems_of(text)


def test_values_overrides_and_round_trip(tmp_path):
    text = "dataset: {kind: tsv, path: umls}\nmodel: {kind: distmult}\noptimizer: {lr: 1e-2}\n"
    recipe = parse_recipe(text, overrides=["train.epochs=3", "model.dim=32", "eval.final_splits=[test]"])
    assert (recipe.optimizer.lr, recipe.train.epochs, recipe.model.dim, recipe.eval.final_splits) == (
        0.01,
        3,
        32,
        ["test"],
    )
    saved = tmp_path / "config.yaml"
    saved.write_text(recipe_to_yaml(recipe))
    again = load_recipe(saved)
    assert again == recipe
    other = dataclasses.replace(again, train=dataclasses.replace(again.train, epochs=4))
    assert recipe_differences(recipe, other) == [("train.epochs", 3, 4)]


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="cannot read .*nope.yaml'"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_are_valid(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem and recipe.description


def test_an_empty_value_is_named_in_plain_words():
    with pytest.raises(ConfigError) as err:
        parse_recipe("dataset: {kind: synthetic}\nmodel: {kind: transe, dim:}\n")
    assert "model.dim (line 2): expected a whole number, got nothing (an empty value or null)" in err.value.problems
