"""YAML into typed, validated dataclasses, with the line of every problem.

Generic: it knows dataclasses and YAML, not recipes (their schema is :mod:`.schema`; only the
word "recipe" in its messages names them). :func:`parse_yaml` reads text through a bounded
PyYAML loader (at most ``MAX_RECIPE_BYTES``; no alias inside its own anchor, nesting deeper than
``MAX_DEPTH`` or more than ``MAX_VALUES`` values once aliases are expanded, refused while
composing) and records the line of every key; :func:`apply_override` applies a ``key=value``;
:func:`build` makes a dataclass from the data, converting each value to its field's type and
running the field's check. Every problem is collected, with its dotted path, its line and, for
a misspelt key or choice, the closest valid one ("did you mean").

Hand-written rather than pydantic v2 or OmegaConf structured configs: neither gives the YAML
line of a problem, pydantic does not bound alias expansion and OmegaConf stops at the first
problem; pydantic kept behind our bounds, lines and overrides would save 78 of 953 lines
(docs/recipes.md compares them, with their messages side by side).
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import yaml

from ..errors import ConfigError

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few dozen lines: this refuses a wrong file or a generated one
MAX_DEPTH = 32  # nesting of sections and lists; a recipe needs 4 (model.sage.fanout.0)
MAX_VALUES = 10_000  # values once aliases are expanded; a 400-byte "billion laughs" expands to 9**9


# -- reading: bounded YAML and the line of every key -----------------------------------------
def decode(raw: bytes, source: str) -> str:
    """The file's text: UTF-8 (a byte-order mark is fine), else a ConfigError saying where it is not."""
    hint = "save it as UTF-8 (in most editors: File > Save with Encoding > UTF-8)"
    for bom, name in (
        (codecs.BOM_UTF32_LE, "UTF-32"),
        (codecs.BOM_UTF32_BE, "UTF-32"),
        (codecs.BOM_UTF16_LE, "UTF-16"),
        (codecs.BOM_UTF16_BE, "UTF-16"),
    ):
        if raw.startswith(bom):
            problem = f"the file is {name} (it starts with a {name} byte-order mark), not UTF-8; save it as UTF-8"
            raise ConfigError([problem], source=source, hint=hint)
    nul = raw.find(b"\0")
    if nul >= 0:  # valid UTF-8, but YAML refuses it: a binary file, or UTF-16 without a byte-order mark
        line = raw.count(b"\n", 0, nul) + 1
        problem = (
            f"NUL byte at offset {nul} (line {line}): the file is binary or UTF-16, not UTF-8 text; save it as UTF-8"
        )
        raise ConfigError([problem], source=source, hint=hint)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        offset = e.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)
        line = raw.count(b"\n", 0, offset) + 1
        problem = (
            f"not UTF-8: byte 0x{raw[offset]:02x} at offset {offset} (line {line}) cannot be decoded; save it as UTF-8"
        )
        raise ConfigError([problem], source=source, hint=hint) from None


def _size_problem(text: str, what: str) -> str | None:
    size = len(text) if len(text) > MAX_RECIPE_BYTES else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_RECIPE_BYTES:
        return f"{what} is {size:,} bytes, over the limit of {MAX_RECIPE_BYTES:,} bytes ({MAX_RECIPE_BYTES >> 20} MiB)"
    return None


def parse_yaml(text: str, source: str) -> tuple[dict, dict[tuple, Any], list[str]]:
    """The data, the line of every key, and the problems of the YAML itself (duplicate keys)."""
    too_big = _size_problem(text, "the recipe")
    if too_big:
        raise ConfigError(
            [too_big], source=source, hint="a recipe is a short YAML file; check that this is the right one"
        )
    try:
        data, lines, duplicates = _load_bounded(text)
    except _Refused as e:
        raise ConfigError([f"{_dotted(e.path)} (line {e.line}): {e.problem}"], source=source) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML{_yaml_where(e, text)}: {_yaml_problem(e)}"], source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {_kind(data)}"], source=source)
    problems = [
        f"{_dotted(key)} (line {line}): duplicate key, first at line {first}; keep one"
        for key, line, first in duplicates
    ]
    return data, lines, problems


def _yaml_where(e: yaml.YAMLError, text: str) -> str:
    mark = getattr(e, "problem_mark", None)
    if mark:
        return f" (line {mark.line + 1})"
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.position, int):
        return f" (line {text.count(chr(10), 0, e.position) + 1})"
    return ""


def _yaml_problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.character, int):
        reason = f"character #x{e.character:04x} is not allowed in YAML ({e.reason})"
        return f"{reason}; remove it, or write it as an escape inside double quotes"
    return str(getattr(e, "problem", None) or e)


class _Refused(Exception):
    """YAML the loader will not build: ``problem`` at ``path`` (line ``line``)."""

    def __init__(self, path: tuple, line: int, problem: str) -> None:
        super().__init__(problem)
        self.path, self.line, self.problem = path, line, problem


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _guarded(construct):
    """A constructor whose ValueError & co. (``2020-13-45``, 5000 digits, ``!!bool maybe``) is a YAML error."""

    def guarded(loader, node):
        try:
            return construct(loader, node)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, KeyError, OverflowError) as e:
            kind = node.tag.rpartition(":")[2] or "a value"
            article = "an" if kind[:1] in "aeiou" else "a"
            value = repr(_short(node.value)) if isinstance(node.value, str) else "this value"
            reason = str(e).partition("; use sys.set_int_max_str_digits")[0]
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {value} as {article} {kind} ({reason})", node.start_mark
            ) from None

    return guarded


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing while it composes what would blow up whatever walks the
    result: an alias inside its own anchor (a cycle), nesting deeper than ``MAX_DEPTH`` (also
    through aliases) and more than ``MAX_VALUES`` values once aliases are expanded (a bomb;
    merge keys ``<<`` count the same, PyYAML copies the pairs they merge). Composing stays
    linear in the text: an alias adds its anchor's precomputed size and depth."""

    yaml_constructors = {tag: _guarded(f) for tag, f in yaml.SafeLoader.yaml_constructors.items()}

    def __init__(self, stream, what: str) -> None:
        super().__init__(stream)
        self._what = what  # "the recipe", "the value" (of --set)
        self._path: list = []  # where the composer is, for messages
        self._level = 0  # collections open around it
        self._shape: dict[int, tuple[int, int]] = {}  # id(complete node) -> (values, depth) it expands to
        self._values = 0  # values composed so far, aliases expanded

    def _refuse(self, problem: str, event) -> None:
        raise _Refused(tuple(self._path), event.start_mark.line + 1, problem)

    def _count(self, values: int, event) -> None:
        self._values += values
        if self._values > MAX_VALUES:
            self._refuse(
                f"{self._what} has more than {MAX_VALUES} values once aliases are expanded (each use of an alias "
                "counts its anchor's values again); a recipe needs a few dozen: write fewer values or aliases",
                event,
            )

    def compose_node(self, parent, index):
        if parent is not None:  # a mapping's key (index None) or value (index: the key), or a list item
            part = index if isinstance(index, int) else index.value if isinstance(index, yaml.ScalarNode) else "?"
            self._path.append(part)
        try:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                target = self.anchors.get(event.anchor)
                if target is not None and id(target) not in self._shape:
                    self._refuse(
                        f"an alias refers to itself: *{event.anchor} is inside &{event.anchor}; write the values out",
                        event,
                    )
                node = super().compose_node(parent, index)  # the anchored node (or PyYAML's error)
                values, depth = self._shape[id(node)]
                if self._level + depth > MAX_DEPTH:
                    self._refuse(
                        f"nested deeper than {MAX_DEPTH} levels (counting what aliases bring in); a recipe needs 4",
                        event,
                    )
                self._count(values, event)
                return node
            collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
            if collection:
                if self._level >= MAX_DEPTH:
                    self._refuse(f"nested deeper than {MAX_DEPTH} levels; a recipe needs 4", event)
                self._level += 1
            self._count(1, event)
            try:
                node = super().compose_node(parent, index)
            finally:
                self._level -= collection
            if isinstance(node, yaml.MappingNode):
                children = [self._shape[id(n)] for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = [self._shape[id(n)] for n in node.value]
            else:
                children = []
            self._shape[id(node)] = (
                1 + sum(v for v, _ in children),
                collection + max((d for _, d in children), default=0),
            )
            return node
        finally:
            if parent is not None:
                self._path.pop()


def _load_bounded(text: str, what: str = "the recipe") -> tuple[Any, dict[tuple, Any], list[tuple[tuple, int, int]]]:
    """``text``'s data, the line of each key and the duplicate keys (path, line, first line);
    raises ``yaml.YAMLError`` for invalid YAML and ``_Refused`` past the loader's bounds."""
    loader = _BoundedLoader(text, what)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}, []
        lines: dict[tuple, Any] = {}
        duplicates = _collect_lines(node, lines)  # before constructing: that rewrites merge keys
        return loader.construct_document(node), lines, duplicates
    except RecursionError:  # cannot happen within MAX_DEPTH; kept so it can never be a crash
        raise _Refused((), 1, f"nested too deeply to read (more than {MAX_DEPTH} levels)") from None
    finally:
        loader.dispose()


class _Alias(int):
    """The line of a key whose value is an alias: also where the aliased values were first seen."""

    target: tuple

    def __new__(cls, line: int, target: tuple):
        obj = super().__new__(cls, line)
        obj.target = target
        return obj


_MERGE = "tag:yaml.org,2002:merge"


def _collect_lines(root, lines: dict[tuple, Any]) -> list[tuple[tuple, int, int]]:
    """Record the line of every key and list item; return the duplicate keys (path, line, first line).

    Walks each node once (an alias is the same node object as its anchor: under the alias's
    path it is recorded as an :class:`_Alias` to where it was first seen), without recursion."""
    duplicates = []
    first_path: dict[int, tuple] = {id(root): ()}
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        children = []
        if isinstance(node, yaml.MappingNode):
            first_line: dict[tuple, int] = {}
            for key_node, value_node in node.value:
                scalar = isinstance(key_node, yaml.ScalarNode)
                key, line = (*path, key_node.value if scalar else "?"), key_node.start_mark.line + 1
                if scalar and key_node.tag != _MERGE:
                    name = (key_node.tag, key_node.value)
                    if name in first_line:
                        duplicates.append((key, line, first_line[name]))
                    else:
                        first_line[name] = line
                children.append((key, line, value_node))
        elif isinstance(node, yaml.SequenceNode):
            children = [((*path, i), item.start_mark.line + 1, item) for i, item in enumerate(node.value)]
        walk = []
        for key, line, child in children:
            if not isinstance(child, yaml.CollectionNode):
                lines[key] = line
            elif id(child) in first_path:  # met before: an alias
                lines[key] = _Alias(line, first_path[id(child)])
            else:
                lines[key], first_path[id(child)] = line, key
                walk.append((child, key))
        stack.extend(reversed(walk))
    return duplicates


# -- overrides -------------------------------------------------------------------------------
def apply_override(data: dict, lines: dict, override: str, problems: list[str]) -> None:
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        problems.append(f"--set {_short(override)!r}: expected key=value, for example train.epochs=5")
        return
    too_big = _size_problem(override, "the override")
    if too_big:
        problems.append(f"--set {_short(key)}: {too_big}")
        return
    parts = key.split(".")
    if len(parts) > MAX_DEPTH:
        problems.append(
            f"--set {_short(key)}: a key of {len(parts)} parts is deeper than any recipe key (at most {MAX_DEPTH})"
        )
        return
    try:
        value, _, duplicates = _load_bounded(raw, "the value") if raw.strip() else ("", {}, [])
    except _Refused as e:
        problems.append(f"--set {key}: {e.problem}")
        return
    except yaml.YAMLError:
        value, duplicates = raw, []
    for path, _, _ in duplicates:
        problems.append(f"--set {key}: duplicate key '{_dotted(path)}' in the value; keep one")
    target = data
    for i, part in enumerate(parts[:-1]):
        existing = target.get(part)
        if existing is None:
            existing = target[part] = {}
        if not isinstance(existing, dict):
            problems.append(f"--set {key}: '{'.'.join(parts[: i + 1])}' is not a section")
            return
        target = existing
    target[parts[-1]] = value
    lines[tuple(parts)] = "--set"


# -- building a dataclass: typed conversion, checks, problems with their lines ----------------
_MISSING = object()  # a value that could not be converted (its problem is recorded)


def _part(part) -> str:
    """A path part as written in a message: plain names bare, anything else quoted."""
    return part if isinstance(part, str) and part.isidentifier() else repr(part)


def _dotted(path: tuple) -> str:
    return (
        ".".join(_part(p) if not isinstance(p, int) or isinstance(p, bool) else str(p) for p in path) or "(top level)"
    )


def _line(path: tuple, lines: dict):
    """The line of ``path``; inside an alias, the line where the aliased values are written."""
    for _ in range(MAX_DEPTH):  # each round follows one alias
        line = lines.get(path)
        if line is not None:
            return line
        for depth in range(len(path) - 1, 0, -1):
            ref = lines.get(path[:depth])
            if isinstance(ref, _Alias):
                path = ref.target + path[depth:]
                break
        else:
            return None
    return None


def _where(path: tuple, lines: dict) -> str:
    dotted = _dotted(path)
    line = _line(path, lines)
    if isinstance(line, str):  # "--set", "the file name"
        return f"{dotted} (from {line})"
    if line:
        return f"{dotted} (line {line})"
    for depth in range(len(path) - 1, 0, -1):  # a missing key: point at its section
        if isinstance(lines.get(path[:depth]), int):
            return f"{dotted} (in the section at line {lines[path[:depth]]})"
    return dotted


def build(cls, data, path: tuple, lines: dict, problems: list[str]):
    """Instantiate dataclass ``cls`` from ``data``, appending every problem found."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{_where(path, lines)}: expected a section (key: value lines), got {_kind(data)}")
        data = {}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            problems.append(f"{_where((*path, key), lines)}: unknown key{hint}")
    kwargs = {}
    found_before = len(problems)  # cross-field checks only make sense when every field is valid
    for name, f in fields.items():
        here, tp = (*path, name), hints[name]
        if f.metadata.get("choices"):  # names known only once their registry is loaded
            tp = Literal[tuple(f.metadata["choices"]())]
        if name in data:
            value = _convert(tp, data[name], here, lines, problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            choices = f" (required; one of {_show(_choices(tp))})" if _choices(tp) else " (required)"
            problems.append(f"{_where(here, lines)}: missing{choices}")
            value = _MISSING
        else:
            continue
        if value is _MISSING:
            kwargs[name] = _placeholder(tp)
            continue
        check = f.metadata.get("check")
        message = check(value) if check is not None and value is not None else None
        if message:
            problems.append(f"{_where(here, lines)}: {message}, got {data[name]!r}")
        kwargs[name] = value
    obj = cls(**kwargs)
    if len(problems) == found_before and hasattr(obj, "problems"):
        for name, message in obj.problems():
            problems.append(f"{_where((*path, *name.split('.')), lines)}: {message}")
    return obj


def _placeholder(tp):
    """A stand-in for an invalid or missing value, so validation can go on to the next one."""
    if not dataclasses.is_dataclass(tp):
        return None
    required = [
        f
        for f in dataclasses.fields(tp)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    hints = typing.get_type_hints(tp)
    return tp(**{f.name: _placeholder(hints[f.name]) for f in required})


def _choices(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _show(choices) -> str:
    return ", ".join(repr(c) for c in choices)


def _kind(value) -> str:
    if value is None:
        return "nothing (an empty value or null)"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"text ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a section"
    return type(value).__name__


_TYPE_WORDS = {int: "a whole number", str: "text", float: "a number"}


def _convert(tp, value, path: tuple, lines: dict, problems: list[str]) -> Any:
    """``value`` as type ``tp``, or ``_MISSING`` after recording why it cannot be."""
    where = _where(path, lines)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, path, lines, problems)
        for a in inner:  # int | str: the first type the value has as it is
            if isinstance(value, a) and not isinstance(value, bool):
                return value
        problems.append(
            f"{where}: expected {' or '.join(_TYPE_WORDS.get(a, a.__name__) for a in inner)}, got {_kind(value)}"
        )
        return _MISSING
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, lines, problems)
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"{where}: must be one of {_show(args)}, got {value!r}{hint}")
        return _MISSING
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{where}: expected true or false, got {_kind(value)}")
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.append(f"{where}: expected a whole number, got {_kind(value)}")
        return _MISSING
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{where}: expected a number, got {_kind(value)}")
        return _MISSING
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{where}: expected text, got {_kind(value)}")
        return _MISSING
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {_kind(value)}")
            return _MISSING
        items = [_convert(args[0], item, (*path, i), lines, problems) for i, item in enumerate(value)]
        return _MISSING if any(item is _MISSING for item in items) else items
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            problems.append(f"{where}: expected a list of {len(args)} numbers, got {_kind(value)}")
            return _MISSING
        items = [_convert(a, item, (*path, i), lines, problems) for i, (a, item) in enumerate(zip(args, value))]
        return _MISSING if any(item is _MISSING for item in items) else tuple(items)
    raise TypeError(f"recipe field type {tp} is not supported")  # a bug in the schema, not user input
