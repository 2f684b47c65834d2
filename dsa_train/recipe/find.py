"""Recipes by name: ./recipes, then the recipes shipped with dsa-train."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import DsaError


def shipped_dir() -> Path | None:
    """The recipes shipped with dsa-train: the package ``dsa_train.recipes`` of an installed
    dsa-train (pyproject.toml maps the checkout's recipes/ onto it), else the checkout's."""
    spec = importlib.util.find_spec("dsa_train.recipes")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if Path(location).is_dir():
            return Path(location)
    checkout = Path(__file__).resolve().parents[2] / "recipes"
    return checkout if checkout.is_dir() else None


def recipe_dirs() -> list[Path]:
    """./recipes, then the shipped recipes (once, if they are the same folder)."""
    seen, found = set(), []
    for path in (Path.cwd() / "recipes", shipped_dir()):
        if path is not None and path.is_dir() and path.resolve() not in seen:
            seen.add(path.resolve())
            found.append(path)
    return found


def find_recipe(given: Path) -> Path:
    """A recipe file: ``given`` itself, or a recipe named ``given`` (``quickstart`` or
    ``quickstart.yaml``) in ./recipes or among the shipped ones."""
    if given.exists() or len(given.parts) != 1:
        return given  # a path: load_recipe says what is wrong with it
    name = given.name if given.suffix == ".yaml" else f"{given.name}.yaml"
    for folder in recipe_dirs():
        if (folder / name).is_file():
            return folder / name
    raise DsaError(
        f"recipe '{given}' is neither a file nor the name of a recipe in ./recipes or among the shipped ones",
        hint="dsa-train recipes lists them by name; or pass the path of a YAML file",
    )
