"""``dsa-train import``: import a dataset into the on-disk format once, ahead of training."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from ..errors import DsaError
from ..recipe import DatasetConfig, load_recipe
from ._errors import handle_errors
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


def import_recipe_data(recipe) -> None:
    """Import what a recipe trains on (its dataset, and its partition buckets in partition
    order) unless current, with a progress display: done once before processes that would each
    import it start (a second importer is refused while the first holds the folder)."""
    with command_output(ProgressReporter()):
        imported_summary(recipe.dataset)
        if recipe.is_kge and recipe.train.order == "partitioned":
            import_buckets(recipe)


def import_buckets(recipe) -> str:
    """The training split in the recipe's partition buckets (written unless current): where."""
    from ..data import load_knowledge_graph
    from ..data.buckets import EntityPartitions, load_buckets

    kg = load_knowledge_graph(recipe.dataset)
    buckets = load_buckets(kg, EntityPartitions(kg.num_entities, recipe.train.partitions, recipe.train.seed))
    return str(buckets.folder)


def imported_summary(config: DatasetConfig) -> dict:
    """Import the dataset a config names (unless current) and describe it."""
    from ..recipe import CLICK_DATASETS, KG_DATASETS
    from ..train.cleanup import allocated_bytes

    if config.kind in KG_DATASETS:
        from ..data import load_knowledge_graph

        data = load_knowledge_graph(config)
    elif config.kind in CLICK_DATASETS:
        from ..data import load_click_log

        data = load_click_log(config)
    else:
        from ..data import load_graph

        data = load_graph(config)
    dataset = getattr(data, "dataset", None)
    folder = dataset.folder if dataset is not None else None
    return {
        "description": str(data),
        "folder": str(folder) if folder else None,
        "imported": bool(getattr(dataset, "fresh", False)),
        "bytes": allocated_bytes(folder) if folder else 0,
        "meta": dataset.meta if dataset is not None else {},
    }
