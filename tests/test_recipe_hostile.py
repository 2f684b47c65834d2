"""Hostile or careless recipes: each ends in a ConfigError that says what is wrong, never a
crash, a hang or a blown-up process."""

from __future__ import annotations

import codecs
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.errors import ConfigError
from dsa_train.recipe import Recipe, load_recipe, parse_recipe
from dsa_train.recipe.loader import build

BASE = "dataset: {kind: synthetic}\nmodel: {kind: transe}\n"
NAMES = "abcdefghi"


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    """The classic YAML bomb: ``width ** levels`` strings from a few hundred bytes."""
    strings = ", ".join(['"x"'] * width)
    rows = [f"{NAMES[0]}: &{NAMES[0]} [{strings}]"]
    for prev, name in zip(NAMES[: levels - 1], NAMES[1:levels]):
        rows.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * width)}]")
    return "\n".join(rows) + "\n"


def flow_bomb(levels: int = 9, width: int = 9) -> str:
    """The same bomb as one flow value, for ``--set``."""
    strings = ", ".join(["x"] * width)
    items = [f"&{NAMES[0]} [{strings}]"]
    for prev, name in zip(NAMES[: levels - 1], NAMES[1:levels]):
        items.append(f"&{name} [{', '.join([f'*{prev}'] * width)}]")
    return "[" + ", ".join(items) + "]"


def merge_bomb(levels: int = 9, width: int = 9) -> str:
    """A bomb through merge keys (``<<``): PyYAML itself copies the merged pairs."""
    rows = [f"{NAMES[0]}: &{NAMES[0]} {{x0: 1, x1: 2, x2: 3}}"]
    for prev, name in zip(NAMES[: levels - 1], NAMES[1:levels]):
        rows.append(f"{name}: &{name} {{<<: [{', '.join([f'*{prev}'] * width)}]}}")
    return "\n".join(rows) + "\n"


def alias_chain(length: int = 200) -> str:
    """Each line nests the previous one a level deeper: deep only once aliases are expanded."""
    rows = ["l0: &l0 [1]"] + [f"l{i}: &l{i} [*l{i - 1}]" for i in range(1, length)]
    return "\n".join(rows) + "\n"


def problems_of(text, overrides=()):
    with pytest.raises(ConfigError) as err:
        parse_recipe(text, overrides=overrides)
    return err.value.problems


def assert_reported(problems, pattern):
    assert any(re.search(pattern, p) for p in problems), problems


SEED = r"must be a whole number in \[0, 2\*\*63 - 1\]"
MANY = r"has more than 10000 values once aliases are expanded"
PLAIN = r"must be a plain folder name"

# (id, recipe text, regex one of the problems must match)
HOSTILE = [
    # 1. bombs: bounded by the number of values the aliases expand to
    ("bomb-small", billion_laughs(levels=6), r"^[a-z](\.\d+)* \(line \d+\): the recipe " + MANY),
    ("bomb-merge", merge_bomb(levels=6), MANY),
    (
        "too-large",
        "# padding\n" * 120_000,
        r"^the recipe is 1,200,000 bytes, over the limit of 1,048,576 bytes \(1 MiB\)",
    ),
    # 2. recursion: self-referencing aliases, deep nesting, deep alias chains
    ("alias-self-list", "a: &a [*a]\n" + BASE, r"^a\.0 \(line 1\): an alias refers to itself: \*a is inside &a"),
    (
        "alias-self-map",
        BASE + "train: &t {epochs: 1, again: *t}\n",
        r"^train\.again \(line 3\): an alias refers to itself",
    ),
    ("alias-self-merge", "a: &a {<<: *a}\n" + BASE, r"an alias refers to itself"),
    ("deep-list", "a: " + "[" * 5000 + "]" * 5000 + "\n", r"^a(\.0)+ \(line 1\): nested deeper than 32 levels"),
    ("deep-map", "a: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", r"nested deeper than 32 levels"),
    (
        "deep-block",
        "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "v: 1\n",
        r"nested deeper than 32 levels",
    ),
    (
        "deep-alias-chain",
        alias_chain(),
        r"^l\d+\.0 \(line \d+\): nested deeper than 32 levels \(counting what aliases bring in\)",
    ),
    # values PyYAML cannot construct: a clear message instead of ValueError/AttributeError/KeyError
    (
        "huge-int-literal",
        "train: {seed: 1" + "0" * 5000 + "}\n" + BASE,
        r"^not valid YAML \(line 1\): cannot read '1000.*' as an int",
    ),
    (
        "bad-date",
        BASE + "description: 2020-13-45\n",
        r"^not valid YAML \(line 3\): cannot read '2020-13-45' as a timestamp",
    ),
    ("bad-tag", BASE + "description: !!bool maybe\n", r"^not valid YAML \(line 3\): cannot read 'maybe' as a bool"),
    (
        "control-char",
        BASE + "description: a\x01b\n",
        r"^not valid YAML \(line 3\): character #x0001 is not allowed in YAML",
    ),
    # 4. duplicate keys
    (
        "duplicate-section",
        BASE + "train:\n  epochs: 1\ntrain:\n  epochs: 2\n",
        r"^train \(line 5\): duplicate key, first at line 3; keep one$",
    ),
    (
        "duplicate-key",
        BASE + "train:\n  epochs: 1\n  batch_size: 8\n  epochs: 2\n",
        r"^train\.epochs \(line 6\): duplicate key, first at line 4; keep one$",
    ),
    (
        "duplicate-quoted",
        BASE + "train: {epochs: 1, 'epochs': 2}\n",
        r"^train\.epochs \(line 3\): duplicate key, first at line 3",
    ),
    # 5. seeds torch and numpy can take
    ("seed-huge", BASE + "train: {seed: 99999999999999999999999}\n", r"^train\.seed \(line 3\): " + SEED),
    ("seed-negative", BASE + "train: {seed: -1}\n", r"^train\.seed \(line 3\): " + SEED),
    (
        "seed-2**63",
        BASE + f"train: {{seed: {2**63}}}\n",
        r"^train\.seed \(line 3\): " + SEED + r".*got 9223372036854775808",
    ),
    (
        "seed-synthetic",
        "dataset: {kind: synthetic, synthetic: {seed: 1.0e+30}}\nmodel: {kind: transe}\n",
        r"^dataset\.synthetic\.seed \(line 1\): " + SEED,
    ),
    (
        "seed-graph",
        "dataset: {kind: karate, graph: {seed: 18446744073709551616}}\nmodel: {kind: node2vec}\n",
        r"^dataset\.graph\.seed \(line 1\): " + SEED,
    ),
    # 6. names and paths that would leave their root
    (
        "name-parent",
        BASE + "name: ../../escape\n",
        r"^name \(line 3\): must be a plain folder name .*got '\.\./\.\./escape'",
    ),
    ("name-absolute", BASE + "name: /tmp/x\n", r"^name \(line 3\): " + PLAIN),
    ("name-dotdot", BASE + "name: '..'\n", r"^name \(line 3\): " + PLAIN),
    ("name-dot", BASE + "name: '.'\n", r"^name \(line 3\): " + PLAIN),
    ("name-hidden", BASE + "name: .hidden\n", r"^name \(line 3\): " + PLAIN),
    ("name-backslash", BASE + "name: 'a\\b'\n", r"^name \(line 3\): " + PLAIN),
    ("name-nul", BASE + 'name: "a\\0b"\n', r"^name \(line 3\): " + PLAIN),
    (
        "name-long",
        BASE + f"name: {'n' * 201}\n",
        r"^name \(line 3\): is 201 bytes long; at most 200 \(the run folder adds -YYYYmmdd-HHMMSS",
    ),
    ("name-long-utf8", BASE + f"name: {'é' * 101}\n", r"^name \(line 3\): is 202 bytes long; at most 200"),
    (
        "run-name-long",
        BASE + f"output: {{run_name: {'r' * 300}}}\n",
        r"^output\.run_name \(line 3\): is 300 bytes long; at most 200",
    ),
    ("run-name-dotdot", BASE + "output: {run_name: '..'}\n", r"^output\.run_name \(line 3\): " + PLAIN),
    (
        "tsv-path-climbs",
        "dataset: {kind: tsv, path: ../../etc}\nmodel: {kind: transe}\n",
        r"^dataset\.path \(line 1\): climbs out of its folder .*write an absolute path if .* really meant, got '\.\./\.\./etc'",
    ),
    (
        "tsv-path-climbs-late",
        "dataset: {kind: tsv, path: a/../../b}\nmodel: {kind: transe}\n",
        r"^dataset\.path \(line 1\): climbs out of its folder",
    ),
]


@pytest.mark.parametrize("text,pattern", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_recipe_is_a_config_error(text, pattern):
    assert_reported(problems_of(text), pattern)


@pytest.mark.parametrize(
    "text",
    [
        "dataset: {kind: tsv, path: a/../b}\nmodel: {kind: transe}\n",
        "dataset: {kind: tsv, path: /srv/data/umls}\nmodel: {kind: transe}\n",
        BASE + f"name: {'n' * 200}\ntrain: {{seed: {2**63 - 1}}}\n",
        BASE + "output: &o {dir: runs}\n",
        "\ufeff" + BASE,  # a UTF-8 byte-order mark, read as text
        billion_laughs(levels=4) + BASE,  # 9**4 values: below the bound
    ],
    ids=["tsv-path-inside", "tsv-path-absolute", "limits-inclusive", "anchor", "bom", "aliases-below-bound"],
)
def test_near_misses_are_not_refused(text):
    try:
        parse_recipe(text)
    except ConfigError as e:  # only the unknown keys of the alias case may be reported
        assert all(re.match(r"^[a-d] \(line \d\): unknown key", p) for p in e.problems), e.problems


def test_aliases_still_resolve_and_point_at_the_written_value():
    with pytest.raises(ConfigError) as err:  # 'common' is an unknown key; the alias still fills train
        parse_recipe("common: &c {epochs: -1}\n" + BASE + "train: *c\nmodel: *c\n")
    problems = err.value.problems
    assert "train.epochs (line 1): must be >= 0, got -1" in problems  # the line the value is written on
    assert "model (line 5): duplicate key, first at line 3; keep one" in problems
    assert any(p.startswith("model.epochs (line 1): unknown key") for p in problems), problems
    nested = "gen: &g {seed: -1}\nds: &d {kind: synthetic, synthetic: *g}\ndataset: *d\nmodel: {kind: transe}\n"
    assert "dataset.synthetic.seed (line 1)" in problems_of(nested)[-1]  # through two aliases


# 1-2. the same bounds for --set values, and a data walk that cannot recurse forever
@pytest.mark.parametrize(
    "override,pattern",
    [
        ("model.dim=" + flow_bomb(), r"^--set model\.dim: the value " + MANY),
        ("model.sage.fanout=&a [*a]", r"^--set model\.sage\.fanout: an alias refers to itself"),
        ("model.dim=" + "[" * 5000 + "]" * 5000, r"^--set model\.dim: nested deeper than 32 levels"),
        (
            "model.dim=" + "x" * (1 << 20),
            r"^--set model\.dim: the override is 1,048,586 bytes, over the limit of 1,048,576 bytes",
        ),
        ("." * 100 + "=1", r"^--set \.+: a key of 101 parts is deeper than any recipe key"),
        ("train={epochs: 1, epochs: 2}", r"^--set train: duplicate key 'epochs' in the value; keep one"),
        ("train.seed=99999999999999999999999", r"^train\.seed \(from --set\): " + SEED),
        ("name=../up", r"^name \(from --set\): " + PLAIN),
        ("description=2020-13-45", None),  # not a date: read as text, which is valid
    ],
    ids=["bomb", "alias-self", "deep", "too-large", "key-too-deep", "duplicate", "seed", "name", "bad-date-is-text"],
)
def test_hostile_override(override, pattern):
    if pattern is None:
        assert parse_recipe(BASE, overrides=[override]).description == "2020-13-45"
    else:
        assert_reported(problems_of(BASE, [override]), pattern)


def test_data_walk_survives_a_self_referencing_list():
    loop: list = []
    loop.append(loop)
    data = {
        "dataset": {"kind": "synthetic"},
        "model": {"kind": loop, "sage": {"fanout": loop}},
        "train": {"seed": loop},
    }
    problems: list[str] = []
    build(Recipe, data, (), {}, problems)
    assert any(p.startswith("model.kind: must be one of") for p in problems), problems
    assert "model.sage.fanout.0: expected a whole number, got a list" in problems


# 3. encodings
def test_utf16_file_says_utf16(tmp_path):
    path = tmp_path / "utf16.yaml"
    path.write_bytes(BASE.encode("utf-16"))  # with a byte-order mark
    with pytest.raises(ConfigError, match=r"utf16\.yaml' has 1 problem:\n  the file is UTF-16 .*; save it as UTF-8"):
        load_recipe(path)


def test_binary_file_gives_offset_and_line(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(BASE.encode() + b"description: caf\xe9\n")
    offset = len(BASE.encode()) + len(b"description: caf")
    with pytest.raises(ConfigError, match=rf"not UTF-8: byte 0xe9 at offset {offset} \(line 3\)") as err:
        load_recipe(path)
    assert "save it as UTF-8" in str(err.value)


def test_nul_bytes_mean_binary_or_utf16(tmp_path):
    path = tmp_path / "nul.yaml"
    path.write_bytes(BASE.encode("utf-16-le"))  # no byte-order mark
    with pytest.raises(ConfigError, match=r"NUL byte at offset 1 \(line 1\).*UTF-16.*save it as UTF-8"):
        load_recipe(path)


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(codecs.BOM_UTF8 + BASE.encode())
    assert load_recipe(path).name == "bom"


def test_oversized_file_states_size_and_limit(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (3 << 20))
    with pytest.raises(ConfigError, match=r"the file is 3,145,728 bytes, over the limit of 1,048,576 bytes \(1 MiB\)"):
        load_recipe(path)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_endless_file_is_not_read_to_the_end():
    with pytest.raises(ConfigError, match=r"the file is more than 1,048,576 bytes \(1 MiB\)"):
        load_recipe("/dev/zero")


# 6. the default name comes from the file name and is checked too
def test_file_stem_as_name_is_checked(tmp_path):
    path = tmp_path / ("n" * 210 + ".yaml")
    path.write_text(BASE)
    with pytest.raises(ConfigError, match=r"name \(from the file name\): is 210 bytes long; at most 200"):
        load_recipe(path)
    hidden = tmp_path / ".hidden.yaml"
    hidden.write_text(BASE)
    with pytest.raises(ConfigError, match=r"name \(from the file name\): must be a plain folder name"):
        load_recipe(hidden)


# 1. the bomb, through the real CLI, in a process that may use at most 1 GiB
BOMB_RUNNER = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    sys.argv = ["dsa-train", *sys.argv[1:]]
    from dsa_train.cli.app import main
    main()
    """
)


@pytest.mark.parametrize("builder", [billion_laughs, merge_bomb], ids=["aliases", "merge-keys"])
def test_yaml_bomb_is_refused_in_bounded_memory(tmp_path, builder):
    path = tmp_path / "bomb.yaml"
    path.write_text(builder())
    assert path.stat().st_size < 600
    result = subprocess.run(
        [sys.executable, "-c", BOMB_RUNNER, "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stderr.startswith("Error: recipe"), result.stderr[-2000:]
    assert re.search(MANY, result.stderr), result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("builder", [billion_laughs, merge_bomb], ids=["aliases", "merge-keys"])
def test_yaml_bomb_is_refused_after_work_linear_in_its_text(tmp_path, builder, monkeypatch):
    """The work a bomb costs, counted rather than timed: the loader composes each node of the
    text once (an alias adds its anchor's precomputed size) and refuses before it constructs
    a single value, so a bomb of a few hundred bytes is refused after at most that many
    nodes, whatever it would expand to (9**9 strings here)."""
    from dsa_train.recipe.loader import _BoundedLoader

    text = builder()
    composed, real_compose = [0], _BoundedLoader.compose_node

    def counting(self, parent, index):
        composed[0] += 1
        if composed[0] > len(text):
            pytest.fail("composing more nodes than the text has bytes: the aliases are being expanded", pytrace=False)
        return real_compose(self, parent, index)

    def constructing(self, node, deep=False):  # (pytrace=False: a traceback would print the node, the bomb expanded)
        pytest.fail("the bomb reached construction: nothing stopped it while it was composed", pytrace=False)

    monkeypatch.setattr(_BoundedLoader, "compose_node", counting)
    monkeypatch.setattr(_BoundedLoader, "construct_object", constructing)
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=MANY):
        load_recipe(path)
    import yaml

    def size(node) -> int:  # the nodes of a composed tree
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        return 1 + sum(map(size, children))

    plain = re.sub(
        r"[&*]\w+", lambda m: "" if m.group(0)[0] == "&" else "0", text
    )  # each alias a scalar: nothing to expand
    assert 0 < composed[0] <= size(yaml.compose(plain)), (composed[0], size(yaml.compose(plain)))


# every case above, through the CLI: exit code 1, "Error:" first, no traceback
CLI_CASES = [h for h in HOSTILE if not h[0].startswith(("bomb", "too-large"))] + [
    (
        "too-large",
        "# padding\n" * 120_000,
        r"^the file is 1,200,000 bytes, over the limit of 1,048,576 bytes \(1 MiB\)",
    ),
    ("utf16", BASE.encode("utf-16"), r"the file is UTF-16"),
    ("binary", b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe", r"NUL byte at offset 7"),
    ("latin1", "name: café\n".encode("latin-1"), r"not UTF-8: byte 0xe9 at offset 9 \(line 1\)"),
]


@pytest.mark.parametrize("content,pattern", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_validate_reports_hostile_recipe(tmp_path, content, pattern):
    path = tmp_path / "hostile.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    result = CliRunner().invoke(app, ["validate", str(path)])
    output = result.stderr + result.stdout
    assert result.exit_code == 1, (result.exit_code, output[-2000:])
    assert result.stderr.startswith("Error: recipe"), output[-2000:]
    assert "Traceback" not in output
    assert any(re.search(pattern, line.strip()) for line in result.stderr.splitlines()), result.stderr[-2000:]


@pytest.mark.parametrize(
    "override,pattern",
    [("model.dim=" + flow_bomb(), MANY), ("model.sage.fanout=&a [*a]", "an alias refers to itself")],
    ids=["bomb", "alias-self"],
)
def test_cli_validate_reports_hostile_override(tmp_path, override, pattern):
    path = tmp_path / "ok.yaml"
    path.write_text(BASE)
    result = CliRunner().invoke(app, ["validate", str(path), "--set", override])
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith("Error: recipe") and "Traceback" not in result.stderr + result.stdout
    assert re.search(pattern, result.stderr), result.stderr
