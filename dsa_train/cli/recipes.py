"""``dsa-train recipes`` and ``dsa-train validate``: what recipes there are, and checking one."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..errors import ConfigError, DsaError
from ..recipe import load_recipe, recipe_to_yaml
from ._errors import handle_errors
from ._output import stdout


def recipe_dirs() -> list[Path]:
    """./recipes, then the recipes/ folder of the dsa-train checkout this package runs from."""
    candidates = [Path.cwd() / "recipes", Path(__file__).resolve().parents[2] / "recipes"]
    seen, found = set(), []
    for path in candidates:
        if path.is_dir() and path.resolve() not in seen:
            seen.add(path.resolve())
            found.append(path)
    return found


@handle_errors
def recipes(
    directory: Path | None = typer.Option(None, "--dir", help="Where to look. Default: ./recipes and the shipped ones.", show_default=False),
) -> None:
    """List recipes with a one-line description each.

    Example:

      dsa-train recipes
    """
    folders = [directory] if directory else recipe_dirs()
    if not folders or not any(f.is_dir() for f in folders):
        raise DsaError("no recipes/ folder here", hint="run from the dsa-train checkout, or pass --dir")
    table = Table()
    for column in ("recipe", "description"):
        table.add_column(column)
    for folder in folders:
        for path in sorted(folder.glob("*.yaml")):
            try:
                description = load_recipe(path).description
            except ConfigError as e:
                description = f"(invalid: {len(e.problems)} problems; see dsa-train validate {path})"
            table.add_row(str(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path), description)
    stdout.print(table)


@handle_errors
def validate(
    recipe: Path = typer.Argument(..., help="The recipe, a YAML file.", show_default=False),
    set_: list[str] = typer.Option([], "--set", help="Override a recipe key, e.g. --set train.epochs=5 (repeatable).", show_default=False),
    show: bool = typer.Option(False, "--show", help="Print the resolved recipe (every key, defaults filled in)."),
) -> None:
    """Check a recipe completely without training: every problem at once, with its dotted path.

    Examples:

      dsa-train validate recipes/fb15k237-transe.yaml

      dsa-train validate my.yaml --set train.epochs=5 --show
    """
    config = load_recipe(recipe, list(set_))
    if show:
        typer.echo(recipe_to_yaml(config), nl=False)
    else:
        stdout.print(f"{recipe}: valid ({config.model.kind} on {config.dataset.kind}, {config.train.epochs} epochs)", highlight=False)
