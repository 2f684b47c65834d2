"""What ``dsa-train import`` and ``dsa-train tune`` share: importing a recipe's data ahead of
training, with a progress display, and describing what was imported."""

from __future__ import annotations

from ..recipe import DatasetConfig
from ._output import ProgressReporter, command_output


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
    from ..fsutil import allocated_bytes

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
