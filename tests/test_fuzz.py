"""Hostile recipes and overrides: every outcome is a valid recipe or a ConfigError, never a crash."""

from __future__ import annotations

import dataclasses
import re
import typing

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.errors import ConfigError
from dsa_train.recipe import Recipe, parse_recipe


def dotted_keys(cls=Recipe, prefix=""):
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            keys += dotted_keys(tp, f"{prefix}{f.name}.")
    return keys


KEYS = dotted_keys()
NAMES = sorted({k.split(".")[-1] for k in KEYS})
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["tsv", "synthetic", "fb15k237", "transe", "distmult", "dsa", "sparse_adam", "1e-3", "../..", "/"]),
)  # fmt: skip
keys = st.one_of(st.sampled_from(NAMES), st.text(max_size=8))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)), max_leaves=25)
overrides = st.lists(
    st.one_of(
        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), st.text(max_size=10)),
        st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}", st.sampled_from(KEYS), scalars),
        st.text(max_size=15),
    ),
    max_size=4,
)
texts = st.one_of(documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)), st.text(max_size=200))

PART = r"(?:\w+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+|None|True|False|-?[\d.e+-]+|nan|inf|-inf)"
PROBLEM = re.compile(rf"^({PART}(?:\.{PART})*|--set .*|\(top level\)|not valid YAML.*|the top level must be .*|cannot read .*)(\s|:)", re.S)


def check(text, sets):
    try:
        recipe = parse_recipe(text, overrides=sets)
    except ConfigError as e:
        assert e.problems and all(PROBLEM.match(p) for p in e.problems), e.problems
        return None
    assert isinstance(recipe, Recipe)
    name = recipe.output.run_name  # paths from a recipe never reach outside the runs folder
    assert name is None or ("/" not in name and not name.startswith("."))
    return recipe


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, overrides)
def test_parse_never_crashes(text, sets):
    check(text, sets)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(texts, overrides, st.sampled_from([["validate"], ["run", "--dry-run"]]))
def test_cli_never_shows_a_traceback(tmp_path, text, sets, command):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    args = [*command, str(path)] + [a for s in sets for a in ("--set", s)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), (result.exit_code, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stderr + result.stdout
    if result.exit_code == 1:
        assert result.stderr.startswith("Error: recipe"), result.stderr


def test_a_valid_recipe_survives_hostile_overrides_to_paths():
    base = "dataset: {kind: synthetic}\nmodel: {kind: transe}\n"
    for bad in ("../escape", "/etc", ".hidden", ""):
        try:
            parse_recipe(base, overrides=[f"output.run_name={bad}"])
        except ConfigError as e:
            assert e.problems[0].startswith("output.run_name")
        else:
            raise AssertionError(f"run_name {bad!r} was accepted")
