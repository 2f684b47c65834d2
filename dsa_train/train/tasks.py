"""What a training task gives the loop (see :mod:`.loop`), and the task a recipe asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from ..errors import DsaError
from ..recipe import Recipe
from .kge import KGETask
from .node2vec import Node2VecTask
from .partitioned_kge import PartitionedKGETask
from .partitioned_node2vec import PartitionedNode2VecTask
from .recsys import RecsysTask
from .sage import SageTask
from .sharded_kge import ShardedKGETask
from .sharded_node2vec import ShardedNode2VecTask
from .tables import TableSite


class Task(Protocol):
    """Data, model, batches, loss and metrics of one kind of training.

    An epoch is a shuffled pass over ``epoch_items()`` items (triples, nodes or edges,
    counted in ``unit``); ``loss(picked)`` turns a batch of item numbers into a loss, drawing
    any randomness from torch's global generator (which the loop seeds per step).
    ``prefetch(picked)`` is told the next batch before this one's step, to start reading the
    rows of its disk table that it will touch (called only with ``embedding_storage: disk``).
    A task that computes its gradients itself (a sharded one, whose backward involves other
    processes) has ``gradients(picked) -> float`` instead of ``loss``. A task with its own
    epoch order (partition order) has ``epoch_order(seed)``, giving what ``slice(start, stop)``
    of the epoch's batches are, and ``buffer_summary()`` and ``close()``.
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


def make_task(
    recipe: Recipe, device: torch.device, tables: TableSite | None = None, *,
    progress: Callable[..., None] | None = None, note: Callable[[str], None] | None = None, world=None,
) -> Task:  # fmt: skip
    """The task for the recipe's model; builds its data and model (seed torch first).

    ``tables``: where disk tables live (needed with ``model.embedding_storage: disk``);
    ``progress(what, done, total)`` and ``note(text)`` hear how a dataset import goes;
    ``world``: this rank's place in a ``torchrun`` job (``None``: one process)."""
    if world is not None:
        if recipe.train.order == "partitioned":
            raise DsaError(
                "train.order 'partitioned' runs in one process; over several processes each rank holds its shard of the table",
                hint="set train.order: random for a torchrun job, or run without torchrun",
            )
        if recipe.is_kge and recipe.train.candidates == "all":
            raise DsaError(
                "train.candidates 'all' runs in one process so far: each rank would fetch every entity row every step",
                hint="set train.candidates: sampled for a torchrun job, or run without torchrun",
            )
        if recipe.is_kge:
            return ShardedKGETask(recipe, device, world, tables, progress=progress, note=note)
        if recipe.model.kind == "node2vec":
            return ShardedNode2VecTask(recipe, device, world, tables, progress=progress, note=note)
        raise DsaError(
            f"model.kind {recipe.model.kind!r} does not train over several processes yet; knowledge-graph models and node2vec do",
            hint="run it in one process (without torchrun)",
        )
    if recipe.is_recsys:
        return RecsysTask(recipe, device, tables, progress=progress, note=note)
    if recipe.is_kge and recipe.train.order == "partitioned":
        return PartitionedKGETask(recipe, device, tables, progress=progress, note=note)
    if recipe.is_kge:
        return KGETask(recipe, device, tables, progress=progress, note=note)
    if recipe.model.kind == "node2vec" and recipe.train.order == "partitioned" and recipe.train.partitions > 1:
        return PartitionedNode2VecTask(recipe, device, tables, progress=progress, note=note)
    if recipe.model.kind == "node2vec":  # (one partition: the random order itself)
        return Node2VecTask(recipe, device, tables, progress=progress, note=note)
    return SageTask(recipe, device, tables, progress=progress, note=note)
