"""Where a task's disk tables live, and opening (or creating) one of them for a recipe."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from torch import nn

from .. import progress
from ..errors import DsaError
from ..nn import DiskEmbedding, DiskEmbeddingBag
from ..recipe import Recipe


NEW_TABLE = "writing the new disk table"  # the progress bar of a table being created


@dataclass(frozen=True)
class TableSite:
    """Where a task's disk tables live (``model.embedding_storage: disk``), and whether it may
    write them (training) or only read them (evaluating a checkpoint)."""

    directory: Path
    writable: bool = True
    # tables read another way, by file name (a checkpoint's version read through its deltas)
    versions: Mapping[str, Callable[[], nn.Module]] = field(default_factory=dict)


class WholeTable:
    """Where a task's table rows are when this process holds all ``num_rows`` of them, in id
    order: a task's default layout. :class:`~.partitioned.PartitionLayout` lays them out by
    partition, :class:`~.shards.ShardedRows` holds one rank's shard; a task is given its layout
    as a factory of the row count (known once the data is loaded)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    @property
    def rows_here(self) -> int:
        """The rows this process holds."""
        return self.num_rows

    def make_table(self, recipe: Recipe, tables: TableSite | None, name: str, *, std: float) -> nn.Module | None:
        """The task's ``name`` table if it is not the model's own ``nn.Embedding`` (a disk table)."""
        return disk_table(recipe, tables, name, self.num_rows, std=std)


def disk_table(
    recipe: Recipe,
    site: TableSite | None,
    name: str,
    num_rows: int,
    *,
    std: float,
    first_row: int = 0,
    total_rows: int | None = None,
    bag_mode: str | None = None,
) -> nn.Module | None:
    """The task's ``name`` table as a DiskEmbedding (a DiskEmbeddingBag pooling by
    ``bag_mode``, if given), created and seeded if missing, or ``None`` for
    ``embedding_storage: memory``. With ``total_rows``: a shard, rows ``[first_row, ...)``
    of a ``total_rows``-row table drawn from the seed."""
    if recipe.model.embedding_storage != "disk":
        return None
    if site is None:
        raise DsaError(
            f"recipe '{recipe.name}' keeps its tables on disk, but no folder for them was given",
            hint="train it with dsa-train run, which keeps them in the run folder's tables/",
        )
    if f"{name}.table" in site.versions:
        table = site.versions[f"{name}.table"]()
        if (table.num_embeddings, table.embedding_dim) != (num_rows, recipe.model.dim):
            raise DsaError(
                f"table '{name}' of '{site.directory}' is {table.num_embeddings:,} x {table.embedding_dim}, the recipe needs {num_rows:,} x {recipe.model.dim}",
                hint="evaluate a checkpoint with the recipe of the run that wrote it",
            )
        return table
    path = site.directory / f"{name}.table"
    if not site.writable and not path.exists():
        raise DsaError(f"table '{path}' is missing", hint="evaluate a checkpoint written by a run with these tables")
    module, options = (DiskEmbedding, {}) if bag_mode is None else (DiskEmbeddingBag, {"mode": bag_mode})
    return module(
        num_rows,
        recipe.model.dim,
        path=path,
        std=std,
        seed=recipe.train.seed,
        writable=site.writable,
        progress=partial(progress.work, NEW_TABLE),
        first_row=first_row,
        total_rows=total_rows,
        **options,
    )
