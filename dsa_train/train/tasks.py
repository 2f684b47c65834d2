"""What a training task gives the loop (see :mod:`.loop`), and the task a recipe asks for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from ..errors import DsaError
from ..recipe import Recipe


@dataclass(frozen=True)
class TableSite:
    """Where a task's disk tables live (``model.embedding_storage: disk``), and whether it may
    write them (training) or only read them (evaluating a checkpoint)."""

    directory: Path
    writable: bool = True
    progress: Callable[[int, int], None] | None = None  # called while a new table is written


def disk_table(recipe: Recipe, site: TableSite | None, name: str, num_rows: int, *, std: float) -> nn.Module | None:
    """The task's ``name`` table as a DiskEmbedding (created, seeded, if missing), or ``None``
    for ``embedding_storage: memory``."""
    if recipe.model.embedding_storage != "disk":
        return None
    if site is None:
        raise DsaError(
            f"recipe '{recipe.name}' keeps its tables on disk, but no folder for them was given",
            hint="train it with dsa-train run, which keeps them in the run folder's tables/",
        )
    from ..nn import DiskEmbedding

    path = site.directory / f"{name}.table"
    if not site.writable and not path.exists():
        raise DsaError(f"table '{path}' is missing", hint="evaluate a checkpoint written by a run with these tables")
    return DiskEmbedding(
        num_rows, recipe.model.dim, path=path, std=std, seed=recipe.train.seed, writable=site.writable, progress=site.progress
    )


class Task(Protocol):
    """Data, model, batches, loss and metrics of one kind of training.

    An epoch is a shuffled pass over ``epoch_items()`` items (triples, nodes or edges,
    counted in ``unit``); ``loss(picked)`` turns a batch of item numbers into a loss, drawing
    any randomness from torch's global generator (which the loop seeds per step).
    ``prefetch(picked)`` is told the next batch before this one's step, to start reading the
    rows of its disk table that it will touch (called only with ``embedding_storage: disk``).
    """

    unit: str
    description: str
    model: nn.Module

    def sparse_parameters(self) -> list[tuple[str, Tensor]]: ...
    def prefetch(self, picked: Tensor) -> None: ...
    def dense_parameters(self) -> list[Tensor]: ...
    def epoch_items(self) -> int: ...
    def loss(self, picked: Tensor) -> Tensor: ...
    def evaluate(self, split: str, *, final: bool, reporter) -> dict[str, dict]: ...
    def headline(self, metrics: dict[str, dict]) -> str: ...


def make_task(recipe: Recipe, device: torch.device, tables: TableSite | None = None) -> Task:
    """The task for the recipe's model; builds its data and model (seed torch first).

    ``tables``: where disk tables live (needed with ``model.embedding_storage: disk``)."""
    if recipe.is_kge:
        from .kge import KGETask

        return KGETask(recipe, device, tables)
    if recipe.model.kind == "node2vec":
        from .node2vec import Node2VecTask

        return Node2VecTask(recipe, device, tables)
    from .sage import SageTask

    return SageTask(recipe, device, tables)
