"""``dsa-train``: the Typer application; each command lives in a module of its own."""

from __future__ import annotations

import warnings

import typer
from typer.core import TyperArgument, TyperOption

from .. import __version__
from ..errors import DsaError
from ..fsutil import require_linux
from ..threads import prefer_sleeping_threads
from .clean import clean
from .eval import eval_
from .export import export
from .import_data import import_
from .inspect_state import inspect_state
from .predict import neighbors, predict
from .recipes import recipes, validate
from .plot import plot
from .run import run
from .tune import tune


def _no_type_placeholders() -> None:
    """Typer's help writes ``<bool>`` in the type column of every on/off flag (``--help``
    included), which reads as if the flag took a value, and ``<list[Path]>`` beside an
    argument that its name already says repeats: flags show no type, and an argument with a
    metavar shows only that (options with one show it in the type column, as before)."""
    option_type, argument_type = TyperOption.display_type_rich, TyperArgument.display_type_rich
    TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else option_type(self, ctx)
    TyperArgument.display_type_rich = lambda self, ctx: None if self.metavar else argument_type(self, ctx)


_no_type_placeholders()

app = typer.Typer(
    name="dsa-train",
    help="Train huge sparse embedding tables on one machine, with Adam's moments on disk.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run)
app.command("tune")(tune)
app.command("eval")(eval_)
app.command("plot")(plot)
app.command("export")(export)
app.command("predict")(predict)
app.command("neighbors")(neighbors)
app.command("import")(import_)
app.command("inspect-state")(inspect_state)
app.command("clean")(clean)
app.command("recipes")(recipes)
app.command("validate")(validate)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dsa-train {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Train huge sparse embedding tables on one machine, with Adam's moments on disk."""


#: Warnings from dependencies that a user can do nothing about (PyG calls torch.jit.script at
#: import; torch notes once that sparse invariant checks are off): not printed on every command.
THIRD_PARTY_WARNINGS = (r"`torch\.jit\.script` is deprecated", r"Sparse invariant checks are implicitly disabled")


def main() -> None:
    try:
        require_linux("dsa-train")
    except DsaError as e:
        typer.echo(f"Error: {e.message}\nHint: {e.hint}", err=True)
        raise SystemExit(1) from None
    for message in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    prefer_sleeping_threads()  # before any command imports torch
    app()
