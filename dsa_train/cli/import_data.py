"""``dsa-train import``: import a dataset into the on-disk format once, ahead of training."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from ..errors import DsaError
from ..recipe import DatasetConfig, load_recipe
from ._errors import handle_errors
from ._imports import import_buckets, imported_summary
from ._output import ProgressReporter, command_output, stdout


@handle_errors
def import_(
    source: Path = typer.Argument(
        ...,
        help="A recipe (its dataset is imported) or a folder of train.txt, valid.txt, test.txt.",
        show_default=False,
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="Override a recipe key, e.g. --set dataset.root=/data (repeatable).",
        show_default=False,
    ),
    root: Path | None = typer.Option(
        None,
        "--root",
        help="The data root to import under. Default: dataset.root, else $DSA_DATA_ROOT, else ./datasets.",
        show_default=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a summary."),
) -> None:
    """Import a dataset once, into memory-mapped id arrays and a filter index under <data root>/imported/.

    TSV text is parsed in bounded memory, PyG files processed, a click log read and its values hashed, or a synthetic graph or click log generated. Every later `run`, `run --resume` and `eval` maps that folder instead; a changed source file (size or modification time) or changed generator settings make the next command import again. `run` imports on its own when needed: this command does it ahead of time, with progress and a summary.

    Examples:

      dsa-train import recipes/synthetic-10m.yaml

      dsa-train import ~/data/my-kg --root /big/disk/datasets
    """
    recipe = None
    if source.is_dir():
        config = DatasetConfig(kind="tsv", path=str(source.resolve()))
    elif source.is_file():
        recipe = load_recipe(source, list(set_))
        config = recipe.dataset
    else:
        raise DsaError(
            f"'{source}' is neither a recipe file nor a dataset folder",
            hint="pass a recipe YAML or a folder holding train.txt, valid.txt, test.txt",
        )
    if root is not None:
        config.root = str(root)
    started = time.perf_counter()
    with command_output(ProgressReporter()):
        summary = imported_summary(config)
        if recipe is not None and recipe.is_kge and recipe.train.order == "partitioned":
            summary["buckets"] = import_buckets(recipe)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    verb = "imported" if summary["imported"] else "already imported (sources unchanged)"
    stdout.print(
        f"{summary['description']}\n{verb}: {summary['folder']} ({summary['bytes'] / 2**20:,.1f} MiB on disk, {summary['seconds']} s)",
        highlight=False,
    )
    if "buckets" in summary:
        stdout.print(f"training triples in buckets for train.order: partitioned: {summary['buckets']}", highlight=False)
