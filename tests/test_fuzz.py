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
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["tsv", "synthetic", "fb15k237", "transe", "distmult", "dsa", "sparse_adam", "1e-3", "../..", "/"]),
)
keys = st.one_of(st.sampled_from(NAMES), st.text(max_size=8))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=25,
)
overrides = st.lists(
    st.one_of(
        st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), st.text(max_size=10)),
        st.builds(
            lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}", st.sampled_from(KEYS), scalars
        ),
        st.text(max_size=15),
    ),
    max_size=4,
)
texts = st.one_of(documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)), st.text(max_size=200))

SECTIONS = {k.rpartition(".")[0] for k in KEYS}  # "" is the top level

# A problem says where, then what: "model.dim (line 4): must be > 0, got -1", "dataset.'a b'
# (line 2): unknown key; ...", "train.seed (from --set): ...", "--set x: ...", "not valid YAML
# (line 3): ...". A key part is a name (str.isidentifier), a list index, or the repr of any other key.
PART = r"(?:datetime\.\w+\([\d, ]*\)|b?'(?:[^'\\]|\\.)*'|b?\"(?:[^\"\\]|\\.)*\"|[^\s.'\"():\\]+|-?\.\d+(?:e[+-]?\d+)?)"
KEYED = re.compile(
    rf"(?P<path>{PART}(?:\.{PART})*|\(top level\))"
    r"(?: \((?:line (?P<line>\d+)|from (?P<origin>--set|the file name)|in the section at line (?P<section>\d+))\))?: (?P<what>\S.*)",
    re.S,
)
WHOLE = re.compile(
    r"--set \S.*: \S.*|not valid YAML(?: \(line (?P<line>\d+)\))?: \S.*|the top level must be a mapping of sections, got .+",
    re.S,
)
# The composer's refusals (a bomb, a cycle, too deep) and duplicate keys can be at any path.
ANYWHERE = (
    "duplicate key",
    "the recipe has more than",
    "an alias refers to itself",
    "nested deeper than",
    "nested too deeply",
)


def where_problem(problem: str, text: str, sets: list[str]) -> str | None:
    """What is wrong with a problem's message (None: nothing): it must name a place that
    exists, a recipe key (or the section of an unknown one) at a line of the text, or an
    override that was given."""
    lines = text.count("\n") + 2  # PyYAML may point one line past the last one
    whole = WHOLE.fullmatch(problem)
    if whole:
        if problem.startswith("--set") and not sets:
            return "names an override, none was given"
        line = whole.group("line")
        return None if line is None or 1 <= int(line) <= lines else f"line {line} of a text of {lines - 1} lines"
    keyed = KEYED.fullmatch(problem)
    if not keyed:
        return "does not start with where it is"
    for line in (keyed.group("line"), keyed.group("section")):
        if line is not None and not 1 <= int(line) <= lines:
            return f"line {line} of a text of {lines - 1} lines"
    if keyed.group("origin") == "--set" and not sets:
        return "names an override, none was given"
    path = keyed.group("path")
    parts, at = [], 0
    while path != "(top level)" and at < len(path):
        parts.append(re.compile(PART).match(path, at).group())
        at += len(parts[-1]) + 1  # and the dot
    while parts and re.fullmatch(r"-?\d+", parts[-1]):  # a list item: its list is the key
        parts.pop()
    key, section, what = ".".join(parts), ".".join(parts[:-1]), keyed.group("what")
    if what.startswith("unknown key"):
        return None if section in SECTIONS else f"an unknown key in {section!r}, not a section"
    if what.startswith(ANYWHERE) or key in KEYS or key == "":
        return None
    return f"{key!r} is not a recipe key"


def check(text, sets):
    try:
        recipe = parse_recipe(text, overrides=sets)
    except ConfigError as e:
        assert e.problems, "a ConfigError without problems"
        for problem in e.problems:
            assert where_problem(problem, text, sets) is None, (problem, where_problem(problem, text, sets))
        return None
    assert isinstance(recipe, Recipe)
    name = recipe.output.run_name  # paths from a recipe never reach outside the runs folder
    assert name is None or ("/" not in name and not name.startswith("."))
    return recipe


def test_the_check_refuses_problems_that_do_not_say_where():
    text = "model:\n  dim: -1\n"
    for good in (
        "model.dim (line 2): must be > 0, got -1",
        "model.'a.b' (line 2): unknown key; valid keys: kind, dim",
        "eval.final_splits.0 (from --set): must be one of 'valid', 'test', got 3",
        "dataset: missing (required)",
        "not valid YAML (line 3): found character '\\t' that cannot start any token",
    ):
        assert where_problem(good, text, ["eval.final_splits=[3]"]) is None, good
    for bad, sets in (
        ("invalid literal for int() with base 10: 'x'", []),  # a bare exception's text
        ("KeyError: 'kind'", []),
        ("Traceback (most recent call last):", []),
        ("expected a whole number, got text ('x')", []),  # the place lost
        ("modle.dim (line 2): must be > 0, got -1", []),  # not a recipe key
        ("model.dim (line 9): must be > 0, got -1", []),  # past the end of the text
        ("train.seed (from --set): must be a whole number", []),  # no override was given
        ("model.dim.x (line 2): unknown key; valid keys: ", []),  # dim is not a section
    ):
        assert where_problem(bad, text, sets) is not None, bad


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, overrides)
def test_parse_never_crashes(text, sets):
    check(text, sets)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
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
