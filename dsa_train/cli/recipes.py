"""``dsa-train recipes`` and ``dsa-train validate``: what recipes there are, and checking one."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..errors import ConfigError, DsaError
from ..recipe import load_recipe, recipe_to_yaml
from ..recipe.find import find_recipe, recipe_dirs
from ._errors import handle_errors
from ._output import stdout


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
    from ..train.callbacks import check_callback_names
    from ..train.estimate import estimate

    check_callback_names(config.output.callbacks)

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
