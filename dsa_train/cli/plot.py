"""``dsa-train plot``: training loss, learning rate and evaluation metrics against steps, as a PNG or SVG."""

from __future__ import annotations

from pathlib import Path

import typer

from ._errors import handle_errors
from ._output import stdout


@handle_errors
def plot(
    runs: list[Path] = typer.Argument(
        ..., metavar="RUN...", help="Run folders (overlaid) or tune folders (their trials).", show_default=False
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="The image: .png, .svg or .pdf. Default: <first folder's name>.png here.",
        show_default=False,
    ),
) -> None:
    """Draw runs' curves from their metrics.jsonl: loss, learning rate and each evaluation's metrics against steps.

    Examples:

      dsa-train plot runs/umls-transe-20261206-010000

      dsa-train plot runs/a runs/b -o compare.svg

      dsa-train plot tunes/umls -o trials.png
    """
    from ..plot import figure, save

    target = output or Path(f"{runs[0].resolve().name}.png")
    save(figure(runs), target)
    stdout.print(f"plot written to {target}", highlight=False)
