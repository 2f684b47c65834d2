"""The task a recipe asks for: one registration per kind of training, naming its variants."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DsaError
from ..recipe import Recipe
from ..registry import Registry
from .kge import KGETask
from .node2vec import Node2VecTask
from .partitioned_kge import PartitionedKGETask
from .partitioned_node2vec import PartitionedNode2VecTask
from .recsys import RecsysTask
from .sage import SageTask
from .sharded_kge import ShardedKGETask
from .sharded_node2vec import ShardedNode2VecTask
from .tables import TableSite
from .task import Task


@dataclass(frozen=True)
class TaskKind:
    """One kind of training and its variants, each a :class:`~.task.Task` class.

    Args:
        what: what it trains, as an error names it.
        random: one process, batches in random order.
        partitioned: one process, ``train.order: partitioned`` (``None``: the kind has no such order).
        sharded: one rank of a ``torchrun`` job, the table sharded over the ranks (``None``: not yet).
        one_partition_is_random: ``train.partitions: 1`` trains the ``random`` variant.
    """

    what: str
    random: type[Task]
    partitioned: type[Task] | None = None
    sharded: type[Task] | None = None
    one_partition_is_random: bool = False


#: the kinds of training by ``model.kind`` (every knowledge-graph scoring function is ``kge``)
TASKS: Registry[TaskKind] = Registry("kind of training", "model.kind")
TASKS.add("kge", TaskKind("knowledge-graph models", KGETask, partitioned=PartitionedKGETask, sharded=ShardedKGETask))
TASKS.add(
    "node2vec",
    TaskKind(
        "node2vec",
        Node2VecTask,
        partitioned=PartitionedNode2VecTask,
        sharded=ShardedNode2VecTask,
        one_partition_is_random=True,
    ),
)
TASKS.add("sage", TaskKind("sage", SageTask))
TASKS.add("dlrm", TaskKind("dlrm", RecsysTask))


def make_task(
    recipe: Recipe,
    device: torch.device,
    tables: TableSite | None = None,
    *,
    world=None,
) -> Task:
    """The task for the recipe's model; builds its data and model (seed torch first).

    ``tables``: where disk tables live (needed with ``model.embedding_storage: disk``);
    ``world``: this rank's place in a ``torchrun`` job (``None``: one process)."""
    kind = TASKS.get("kge" if recipe.is_kge else recipe.model.kind)
    if world is not None:
        if recipe.train.order == "partitioned":
            raise DsaError(
                "train.order 'partitioned' runs in one process; over several processes each rank holds its shard of the table",
                hint="set train.order: random for a torchrun job, or run without torchrun",
            )
        if kind.sharded is None:
            sharded = " and ".join(k.what for k in TASKS if k.sharded is not None)
            raise DsaError(
                f"model.kind {recipe.model.kind!r} does not train over several processes yet; {sharded} do",
                hint="run it in one process (without torchrun)",
            )
        return kind.sharded(recipe, device, world, tables)
    partitioned = recipe.train.order == "partitioned" and not (
        kind.one_partition_is_random and recipe.train.partitions == 1
    )
    if partitioned and kind.partitioned is not None:
        return kind.partitioned(recipe, device, tables)
    return kind.random(recipe, device, tables)
