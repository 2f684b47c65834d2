"""A search space: which recipe keys a tune varies, over which values.

A space maps the recipe's dotted keys to a range or a list of choices. In YAML::

    optimizer.lr: {low: 0.0003, high: 0.03, log: true}   # a float range, searched on a log scale
    train.negatives: {low: 32, high: 512, log: true}      # an int key: an int range
    train.batch_size: {low: 128, high: 1024, step: 128}
    model.dim: [64, 128, 256]                             # choices (any type the key takes)
    model.p_norm: {choices: [1, 2]}

:func:`load_space` checks every entry against the recipe and reports all problems at once in a
``ConfigError``: a key the recipe does not have (with the closest one), a section instead of a
value, an empty range or list, a bound or choice whose type the key does not take, or a value
the recipe's own checks refuse (a dropout of 1.5). :func:`default_space` gives the space
``dsa-train tune`` searches when the user brings none, per model kind, around the recipe's own
values. :func:`apply` makes a trial's recipe from the base recipe and the sampled values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..recipe import Recipe, parse_recipe, recipe_to_yaml
from ..recipe.loader import MAX_RECIPE_BYTES, decode, parse_yaml
from ..recipe.schema import scoring_functions

RANGE_FIELDS = ("low", "high", "log", "step")


@dataclass(frozen=True)
class Param:
    """One searched key: a range (``low``..``high``, on a log scale with ``log``, in multiples
    of ``step`` from ``low``) of an int or float key, or a list of ``choices``."""

    key: str
    kind: str  # "int", "float" or "choice"
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        """The value an Optuna trial draws for this key."""
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)
        plain = [choice_text(c) for c in self.choices]
        picked = trial.suggest_categorical(self.key, plain)
        return self.choices[plain.index(picked)]

    def as_yaml(self) -> Any:
        if self.kind == "choice":
            return [list(c) if isinstance(c, tuple) else c for c in self.choices]
        spec = {"low": self.low, "high": self.high}
        if self.log:
            spec["log"] = True
        if self.step is not None:
            spec["step"] = self.step
        return spec


Space = dict[str, Param]


# -- the recipe's keys and their types ---------------------------------------------------------
def _field_type(key: str):
    """The annotation of a dotted recipe key, or ``None`` if there is no such key; a
    dataclass (a section) is returned as such."""
    cls: Any = Recipe
    hint = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        hint = cls = hints[part]
    return hint


def _all_keys(cls=Recipe, prefix: str = "") -> list[str]:
    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            keys += _all_keys(hint, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _number_kind(hint) -> str | None:
    """``"int"`` or ``"float"`` for a key that takes a number (``int | None`` too), else ``None``."""
    args = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, _UnionType)
        else [hint]
    )
    if args == [int]:
        return "int"
    if args == [float]:
        return "float"
    return None


_UnionType = type(int | None)


# -- a trial's recipe ----------------------------------------------------------------------------
def apply(base: Recipe, values: dict[str, Any], *, source: str = "trial") -> Recipe:
    """``base`` with each dotted key set to its value, validated as a recipe file is. A
    schedule picked without its companions gets what it needs: ``constant`` drops
    ``final_lr_ratio`` and ``decay_after_epochs``, ``cosine``/``linear`` drop
    ``decay_after_epochs``, ``step`` decays by 10x after three quarters of the epochs (each
    unless the space sets that key itself). ``train.labels: all`` (k-vs-all) brings
    ``train.candidates: all`` and drops ``train.query_chunk``; a label smoothing drawn beside a
    loss other than cross_entropy is 0 (the trial's recipe says so)."""
    data = yaml.safe_load(recipe_to_yaml(base))
    for key, value in values.items():
        _set(data, key, value)
    train = data["train"]
    if values.get("train.labels") == "all" and "train.candidates" not in values:  # k-vs-all scores every entity
        train["candidates"] = "all"
    if train.get("candidates") == "all" and "train.query_chunk" not in values:
        train.pop("query_chunk", None)
    if train.get("loss", "cross_entropy") != "cross_entropy" and "train.label_smoothing" in values:
        train["label_smoothing"] = 0.0  # it spreads the cross-entropy's target: drawn beside another loss, none
    schedule = values.get("optimizer.schedule")
    if schedule is not None:
        optimizer, fixed = data["optimizer"], {}
        if schedule != "step":
            fixed["decay_after_epochs"] = 0
        if schedule == "constant":
            fixed["final_lr_ratio"] = 0.0
        if schedule == "step":
            if not optimizer.get("decay_after_epochs"):
                fixed["decay_after_epochs"] = max(1, base.train.epochs * 3 // 4)
            if not 0 < optimizer.get("final_lr_ratio", 0) < 1:
                fixed["final_lr_ratio"] = 0.1
        for name, value in fixed.items():
            if f"optimizer.{name}" not in values:
                optimizer[name] = value
    return parse_recipe(yaml.safe_dump(data, sort_keys=False), source=source, default_name=base.name)


def _set(data: dict, key: str, value: Any) -> None:
    *sections, last = key.split(".")
    for part in sections:
        data = data.setdefault(part, {})
    data[last] = list(value) if isinstance(value, tuple) else value


# -- reading and checking a space -------------------------------------------------------------------
def load_space(path: Path, base: Recipe) -> Space:
    """Read a space from a YAML file and check it against ``base`` (see the module's docstring)."""
    path = Path(path)
    source = f"search space '{path}'"
    try:
        raw = path.read_bytes()[: MAX_RECIPE_BYTES + 1]
    except OSError as e:
        raise ConfigError(
            [f"cannot read '{path}': {e.strerror}"], source=source, hint="check the path of --space"
        ) from None
    data, _, problems = parse_yaml(decode(raw, source), source)
    if problems:
        raise ConfigError(problems, source=source)
    return parse_space(data, base, source=source)


def parse_space(data: dict, base: Recipe, *, source: str = "search space") -> Space:
    """A space from its YAML data (dotted key -> range mapping or list of choices)."""
    problems: list[str] = []
    space: Space = {}
    if not data:
        raise ConfigError(
            ["it names no key to search"],
            source=source,
            hint="map recipe keys to ranges, e.g. optimizer.lr: {low: 0.001, high: 0.1, log: true}",
        )
    for key, spec in data.items():
        param = _parse_param(str(key), spec, base, problems)
        if param is not None:
            space[param.key] = param
    if problems:
        raise ConfigError(
            problems,
            source=source,
            hint="each key is a recipe key (dotted) mapped to {low, high[, log][, step]} or a list of choices",
        )
    return space


def _parse_param(key: str, spec: Any, base: Recipe, problems: list[str]) -> Param | None:
    hint = _field_type(key)
    if hint is None:
        keys = _all_keys()
        same_name = [k for k in keys if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]  # model.loss -> train.loss
        close = same_name[:1] or difflib.get_close_matches(key, keys, n=1)
        problems.append(
            f"{key}: not a recipe key"
            + (f"; did you mean {close[0]}?" if close else " (dsa-train validate --help lists them)")
        )
        return None
    if dataclasses.is_dataclass(hint):
        problems.append(
            f"{key}: is a section of the recipe, not a value; name one of its keys, e.g. {key}.{dataclasses.fields(hint)[0].name}"
        )
        return None
    if isinstance(spec, dict) and set(spec) == {"choices"}:
        spec = spec["choices"]
    if isinstance(spec, list):
        return _parse_choices(key, spec, base, problems)
    if not isinstance(spec, dict):
        problems.append(f"{key}: expected a range {{low: ..., high: ...}} or a list of choices, got {spec!r}")
        return None
    unknown = [k for k in spec if k not in RANGE_FIELDS]
    if unknown:
        problems.append(
            f"{key}: unknown field {unknown[0]!r} in the range; a range has low, high, log, step (or give a list of choices)"
        )
        return None
    kind = _number_kind(hint)
    if kind is None:
        problems.append(
            f"{key}: takes {_describe(hint)}, which has no range; list the choices instead, e.g. {key}: [{_example(key, base)}]"
        )
        return None
    return _parse_range(key, kind, spec, base, problems)


def _parse_range(key: str, kind: str, spec: dict, base: Recipe, problems: list[str]) -> Param | None:
    found = len(problems)
    bounds = {}
    for name in ("low", "high"):
        value = spec.get(name)
        if value is None:
            problems.append(f"{key}: the range needs {name}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{key}: {name} must be a number, got {value!r}")
        elif kind == "int" and not isinstance(value, int):
            problems.append(f"{key}: {name} {value!r} is not a whole number, and {key} takes whole numbers")
        else:
            bounds[name] = float(value) if kind == "float" else value
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        problems.append(f"{key}: log must be true or false, got {log!r}")
    if step is not None and (
        isinstance(step, bool)
        or not isinstance(step, (int, float))
        or step <= 0
        or (kind == "int" and not isinstance(step, int))
    ):
        problems.append(f"{key}: step must be a positive {'whole ' if kind == 'int' else ''}number, got {step!r}")
    if len(problems) > found:
        return None
    low, high = bounds["low"], bounds["high"]
    if not low < high:
        problems.append(
            f"{key}: empty range: low {low!r} is not below high {high!r}"
            + (" (one value: set it with --set instead)" if low == high else "")
        )
        return None
    if log and low <= 0:
        problems.append(f"{key}: a log range needs low > 0, got {low!r}")
        return None
    if log and step is not None:
        problems.append(f"{key}: a range is either log or stepped, not both")
        return None
    for value in (low, high):
        if not _fits(key, value, base, problems):
            return None
    return Param(key, kind, low=low, high=high, log=log, step=step)


def _parse_choices(key: str, choices: list, base: Recipe, problems: list[str]) -> Param | None:
    if not choices:
        problems.append(f"{key}: empty list of choices; list at least one value")
        return None
    plain = [choice_text(c) for c in choices]
    if len(set(plain)) != len(plain):
        problems.append(f"{key}: a choice is listed twice in {choices!r}")
        return None
    if all(_fits(key, c, base, problems) for c in choices):
        return Param(key, "choice", choices=tuple(tuple(c) if isinstance(c, list) else c for c in choices))
    return None


def _fits(key: str, value: Any, base: Recipe, problems: list[str]) -> bool:
    """Whether the recipe takes ``value`` at ``key`` (its type and its own checks)."""
    try:
        apply(base, {key: value})
    except ConfigError as e:
        own = [p for p in e.problems if p.startswith(key)] or e.problems
        problems.append(f"{key}: the value {value!r} does not fit: {re.sub(r' [(]line [0-9]+[)]', '', own[0])}")
        return False
    return True


def choice_text(value: Any) -> Any:
    """A choice as Optuna stores it: None, bool, int, float or str as they are, a list as YAML text."""
    if isinstance(value, (type(None), bool, int, float, str)):
        return value
    return yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True).strip()


def _describe(hint) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    return getattr(hint, "__name__", str(hint))


def _example(key: str, base: Recipe) -> str:
    value: Any = base
    for part in key.split("."):
        value = getattr(value, part)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def space_to_yaml(space: Space) -> str:
    return yaml.safe_dump({key: p.as_yaml() for key, p in space.items()}, sort_keys=False, default_flow_style=None)


# -- the default space -------------------------------------------------------------------------------
def default_space(base: Recipe) -> Space:
    """What ``dsa-train tune`` searches when no ``--space`` is given, around the recipe's own
    values: the learning rate (10x either way, log scale), the dimension, batch size and
    negatives (halved and doubled), dropout, loss and schedule; for knowledge graphs also what
    the best published configs turn (LibKGE's, the ComplEx-N3 paper's): relation dropout,
    k-vs-all against sampled negatives, label smoothing and the N3 weight; TransE's norm and
    entity normalisation; node2vec's p, q and window; SAGE's and DLRM's dense rate and widths."""
    m, t, o = base.model, base.train, base.optimizer
    entries: dict[str, Any] = {
        "optimizer.lr": {"low": o.lr / 10, "high": min(o.lr * 10, 1.0), "log": True},
        "model.dim": _around(
            m.dim, (0.5, 1, 2), even=bool(scoring_functions().get(m.kind, {}).get("halves"))
        ),  # rows of two halves
        "train.batch_size": _around(t.batch_size, (0.5, 1, 2)),
        "optimizer.schedule": list(dict.fromkeys([o.schedule, "constant", "cosine"])),
    }
    if base.is_kge:
        scoring = scoring_functions().get(m.kind, {})
        entries["model.dropout"] = {"low": 0.0, "high": 0.4}
        if not scoring.get("relation_dropout_unsupported"):
            entries["model.relation_dropout"] = {"low": 0.0, "high": 0.4}
        if t.candidates == "sampled":
            entries["train.negatives"] = _around(t.negatives, (0.25, 0.5, 1, 2))
        if t.order == "random" and base.model.embedding_storage == "memory":  # what the best published configs train
            entries["train.labels"] = list(dict.fromkeys([t.labels, "one", "all"]))  # all: k-vs-all
            entries["train.loss"] = ["cross_entropy", "softplus"]  # margin takes one answer
        else:
            entries["train.loss"] = ["cross_entropy", "softplus"] + (["margin"] if t.labels == "one" else [])
        entries["train.label_smoothing"] = list(dict.fromkeys([t.label_smoothing, 0.0, 0.1]))
        entries["train.regularization"] = list(dict.fromkeys([t.regularization, 0.0, 0.001, 0.01]))  # N3
        if m.kind == "transe":
            entries["model.p_norm"] = [1, 2]
            entries["model.normalize_entities"] = [True, False]
    elif m.kind == "node2vec":
        entries["model.node2vec.p"] = {"low": 0.25, "high": 4.0, "log": True}
        entries["model.node2vec.q"] = {"low": 0.25, "high": 4.0, "log": True}
        entries["model.node2vec.negatives"] = {"low": 1, "high": 5}
    elif m.kind == "sage":
        entries["optimizer.dense_lr"] = {"low": o.dense_lr / 10, "high": min(o.dense_lr * 10, 1.0), "log": True}
        entries["model.sage.dropout"] = {"low": 0.0, "high": 0.5}
    elif base.is_recsys:
        entries["optimizer.dense_lr"] = {"low": o.dense_lr / 10, "high": min(o.dense_lr * 10, 1.0), "log": True}
        entries["model.recsys.interaction"] = ["dot", "cat"]
    return parse_space(entries, base, source="the default search space")


def _around(value: int, factors: tuple[float, ...], *, even: bool = False) -> list[int]:
    picked = []
    for f in factors:
        v = max(1, int(round(value * f)))
        if even:
            v = max(2, v + v % 2)
        picked.append(v)
    return list(dict.fromkeys(picked))
