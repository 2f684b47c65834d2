"""``dsa-train recipes`` and ``dsa-train validate``: what recipes there are, and checking one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer
from rich.table import Table

from ..errors import ConfigError, DsaError
from ..recipe import load_recipe, recipe_to_yaml
from ._errors import handle_errors
from ._output import stdout


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


@handle_errors
def recipes(
    directory: Path | None = typer.Option(
        None, "--dir", help="Where to look. Default: ./recipes and the shipped ones.", show_default=False
    ),
    show: str | None = typer.Option(
        None, "--show", help="Print the recipe of this name (or path) as it is, to copy and edit.", show_default=False
    ),
) -> None:
    """List recipes with a one-line description each, or print one.

    A recipe listed here runs by its name from anywhere: dsa-train run quickstart.

    Examples:

      dsa-train recipes

      dsa-train recipes --show quickstart > my.yaml
    """
    if show is not None:
        typer.echo(find_recipe(Path(show)).read_text(), nl=False)
        return
    folders = [directory] if directory else recipe_dirs()
    if not folders or not any(f.is_dir() for f in folders):
        raise DsaError(
            "no recipes found: no ./recipes here and no shipped ones", hint="pass --dir with a folder of recipes"
        )
    table = Table()
    for column in ("recipe", "where", "description"):
        table.add_column(column)
    for folder in folders:
        for path in sorted(folder.glob("*.yaml")):
            try:
                description = load_recipe(path).description
            except ConfigError as e:
                description = f"(invalid: {len(e.problems)} problems; see dsa-train validate {path})"
            where = str(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)
            table.add_row(path.stem, where, description)
    stdout.print(table)


@handle_errors
def validate(
    recipe: Path = typer.Argument(
        ..., help="The recipe: a YAML file, or a recipe's name (dsa-train recipes lists them).", show_default=False
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="Override a recipe key, e.g. --set train.epochs=5 (repeatable).",
        show_default=False,
    ),
    show: bool = typer.Option(False, "--show", help="Print the resolved recipe (every key, defaults filled in)."),
) -> None:
    """Check a recipe completely without training: every problem at once, with its dotted path.

    Examples:

      dsa-train validate recipes/fb15k237-transe.yaml

      dsa-train validate my.yaml --set train.epochs=5 --show
    """
    config = load_recipe(find_recipe(recipe), list(set_))
    from ..train.estimate import estimate

    lines = estimate(config).lines(output=Path(config.output.dir))
    if show:
        typer.echo(recipe_to_yaml(config), nl=False)
        for line in lines:  # the YAML alone on stdout, to copy
            typer.echo(line, err=True)
    else:
        stdout.print(
            f"{recipe}: valid ({config.model.kind} on {config.dataset.kind}, {config.train.epochs} epochs)",
            highlight=False,
        )
        for line in lines:
            stdout.print(line, highlight=False, soft_wrap=True)
