"""Recipes: YAML files parsed into typed, validated configuration.

A recipe has the sections ``dataset``, ``model``, ``train``, ``optimizer``, ``eval``,
``output`` and ``distributed`` (all optional but ``dataset`` and ``model``); each maps onto a
dataclass of :mod:`.schema`, whose fields carry their help text and checks, and :mod:`.loader`
builds them from the YAML. :func:`load_recipe` reports every problem at once in one
:class:`~dsa_train.errors.ConfigError`, each with its dotted path, the YAML line and, for a
misspelt key, the closest valid one. ``key=value`` overrides (``--set``) are applied before
validation, so they are checked the same way.

Hostile or careless input ends in a ``ConfigError`` too, never a crash, a hang or a blown-up
process: the file must be UTF-8 and at most ``MAX_RECIPE_BYTES``; YAML is composed by a
loader that refuses an alias inside its own anchor, nesting deeper than ``MAX_DEPTH`` and
more than ``MAX_VALUES`` values once aliases are expanded (a "billion laughs" bomb), before
anything walks the values; duplicate keys are reported; seeds, names and paths are checked
against what torch and the file system accept.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .loader import MAX_DEPTH, MAX_RECIPE_BYTES, MAX_VALUES, apply_override, build, decode, parse_yaml
from .schema import (
    CLICK_DATASETS,
    GRAPH_DATASETS,
    KG_DATASETS,
    GRAPH_MODELS,
    RECSYS_MODELS,
    ClickColumnsConfig,
    ClicksSyntheticConfig,
    MAX_NAME_BYTES,
    SEED_MAX,
    DatasetConfig,
    DistributedConfig,
    EdgeListConfig,
    EvalConfig,
    GraphSyntheticConfig,
    ModelConfig,
    Node2VecConfig,
    OptimizerConfig,
    OutputConfig,
    Recipe,
    RecsysConfig,
    SageConfig,
    SyntheticConfig,
    TrainConfig,
    TriplesConfig,
)

__all__ = [
    "CLICK_DATASETS",
    "GRAPH_DATASETS",
    "GRAPH_MODELS",
    "KG_DATASETS",
    "MAX_DEPTH",
    "MAX_NAME_BYTES",
    "MAX_RECIPE_BYTES",
    "MAX_VALUES",
    "RECSYS_MODELS",
    "SEED_MAX",
    "ClickColumnsConfig",
    "ClicksSyntheticConfig",
    "DatasetConfig",
    "DistributedConfig",
    "EdgeListConfig",
    "EvalConfig",
    "GraphSyntheticConfig",
    "ModelConfig",
    "Node2VecConfig",
    "OptimizerConfig",
    "OutputConfig",
    "Recipe",
    "RecsysConfig",
    "SageConfig",
    "SyntheticConfig",
    "TrainConfig",
    "TriplesConfig",
    "load_recipe",
    "parse_recipe",
    "recipe_differences",
    "recipe_to_yaml",
    "with_data_root",
]

logger = logging.getLogger(__name__)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe file; a :class:`ConfigError` lists every problem."""
    path = Path(path)
    source = f"recipe '{path}'"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)  # never more: the path may be /dev/zero or a huge file
            if len(raw) > MAX_RECIPE_BYTES:
                st = os.fstat(f.fileno())
                size = f"{st.st_size:,} bytes, over the limit of" if stat.S_ISREG(st.st_mode) else "more than"
                raise ConfigError(
                    [f"the file is {size} {MAX_RECIPE_BYTES:,} bytes ({MAX_RECIPE_BYTES >> 20} MiB)"],
                    source=source,
                    hint="a recipe is a short YAML file; check that this is the right one",
                )
    except OSError as e:
        raise ConfigError(
            [f"cannot read '{path}': {e.strerror}"],
            source=source,
            hint="check the path; the shipped recipes are in recipes/, for example recipes/quickstart.yaml",
        ) from None
    return parse_recipe(decode(raw, source), source=source, overrides=overrides, default_name=path.stem)


def parse_recipe(
    text: str, *, source: str = "recipe", overrides: list[str] | tuple[str, ...] = (), default_name: str = "recipe"
) -> Recipe:
    """Parse YAML text into a :class:`Recipe` (see :func:`load_recipe`)."""
    data, lines, problems = parse_yaml(text, source)
    for override in overrides:
        apply_override(data, lines, override, problems)
    if "name" not in data:
        data["name"] = default_name
        lines[("name",)] = "the file name"
    recipe = build(Recipe, data, (), lines, problems)
    if problems:
        raise ConfigError(problems, source=source)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what a run folder's config.yaml holds)."""
    data = _plain(dataclasses.asdict(recipe))
    ordered = {"name": data.pop("name"), "description": data.pop("description"), **data}
    return yaml.safe_dump(ordered, sort_keys=False)


def recipe_differences(a: Recipe, b: Recipe) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every key where two recipes differ."""
    flat_a, flat_b = _flatten(dataclasses.asdict(a)), _flatten(dataclasses.asdict(b))
    return [(key, flat_a[key], flat_b[key]) for key in flat_a if flat_a[key] != flat_b[key]]


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def with_data_root(recipe: Recipe, *, stored: bool = False) -> Recipe:
    """``recipe`` with ``dataset.root`` resolved to the absolute data root it reads (its own,
    else ``$DSA_DATA_ROOT``, else ``./datasets``), as a new run stores it, so that ``eval``
    and ``--resume`` find the data without the environment the run was started in.
    A relative ``dataset.path`` (or ``labels``) that exists from the current folder is stored
    absolute (else it is read under the data root).
    ``stored``: the recipe is a run's; a set ``$DSA_DATA_ROOT`` other than its root wins (the
    data moved), with a warning saying so."""
    root, env = recipe.dataset.root, os.environ.get("DSA_DATA_ROOT")
    if stored and root and env and Path(env).resolve() != Path(root).resolve():
        logger.warning(f"data root: $DSA_DATA_ROOT ({Path(env).resolve()}) instead of the run's {root}")
        root = env
    resolved = Path(root or env or "datasets").resolve()
    found = {}
    for key in ("path", "labels"):  # a relative file that exists from the current folder is that one
        value = getattr(recipe.dataset, key)
        if value and not os.path.isabs(value) and Path(value).exists():
            found[key] = str(Path(value).resolve())
    return dataclasses.replace(recipe, dataset=dataclasses.replace(recipe.dataset, root=str(resolved), **found))
