r"""node2vec / DeepWalk with the node table sharded by rows over the ranks of a ``torchrun`` job
(see :mod:`.sharded_kge` for the scheme and docs/distributed.md).

Every rank knows the step's start nodes (the epoch's seeded order); the batch is cut into
``distributed.slices`` slices of start nodes, slice :math:`m` computed whole by rank
:math:`m \bmod W`: its walks and negative windows are drawn from a generator seeded by the step
and :math:`m` alone, its distinct nodes' rows fetched from their owners, and its share of the
loss (each part summed over the *global* number of positive or negative pairs) run backward
on a leaf copy of those rows. Each row's gradient goes to its owner with its position (slice,
then the row among the slice's sorted distinct nodes), where the rows are summed in that
order. So the table, its moments and the losses are bit-equal for every number of ranks.

Evaluation reads only the rows it samples (the probe's nodes, the held-out edges' ends and
their rivals), fetched from their owners: every rank computes the same metrics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..data import load_graph
from ..distributed.group import World
from ..models.node import SkipGram, distinct_nodes
from ..recipe import Recipe
from .node2vec import Node2VecTask, evaluate_node_embeddings
from .seeding import seed_step
from .shards import ShardedRows, ShardedTask, sharded_layout, wait_for_import
from .tables import TableSite


class ShardedNode2VecTask(ShardedTask, Node2VecTask):
    """A :class:`Node2VecTask` whose node table is this rank's shard."""

    def __init__(self, recipe: Recipe, device: torch.device, world: World, tables: TableSite | None = None) -> None:
        wait_for_import(world, lambda: load_graph(recipe.dataset))
        super().__init__(recipe, device, tables, layout=sharded_layout(world, recipe))
        self.world = world
        self.description += (
            f"; nodes sharded over {world.world_size} ranks (this rank holds {self.shards.rows_here:,} rows)"
        )

    def gradients(self, picked: Tensor) -> float:
        """Forward and backward of this rank's slices of the start nodes ``picked``; leaves the
        shard's summed sparse gradient in its ``.grad`` and returns the batch's loss."""
        c, shards = self.config, self.shards
        n = len(picked)
        pairs = n * c.walks_per_node * (c.walk_length - c.context_size + 2) * (c.context_size - 1)
        totals = (pairs, pairs * c.negatives)  # the batch's positive and negative pairs
        seed = int(torch.randint(0, 1 << 62, (1,)))  # the step's: the same on every rank
        sliced = []
        for m, a, b in shards.my_slices(n):
            seed_step(seed + m)  # the slice's walks depend on the step and the slice alone
            nodes, positive, negative = distinct_nodes(*self.windows(picked[a:b]), self.graph.num_nodes)
            sliced.append((m, nodes, positive, negative))
        ids = torch.cat([nodes for _, nodes, _, _ in sliced]) if sliced else torch.empty(0, dtype=torch.int64)
        rows = shards.fetch(ids, "fetching the step's node rows")
        span = (n // shards.slices + 1) * c.walks_per_node * (1 + c.negatives) * (c.walk_length + 1)
        grads, positions = [], []
        losses = torch.zeros(shards.slices, dtype=torch.float64)
        start = 0
        for m, nodes, positive, negative in sliced:
            leaf = rows[start : start + len(nodes)].to(self.device).requires_grad_()
            start += len(nodes)
            loss = SkipGram.rows_loss(leaf, positive.to(self.device), negative.to(self.device), totals)
            loss.backward()
            losses[m] = loss.item()
            grads.append(leaf.grad.cpu())
            positions.append(m * span + torch.arange(len(nodes)))
        no_rows, no_ids = torch.empty((0, rows.shape[1])), torch.empty(0, dtype=torch.int64)
        shards.push(ids, torch.cat(grads) if grads else no_rows, torch.cat(positions) if positions else no_ids)
        return shards.total(losses)

    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        return evaluate_node_embeddings(self.graph, FetchedRows(self.shards), split, self.recipe)


class FetchedRows:
    """The node table indexed by node ids, each lookup fetched from the rows' owners (a
    collective: every rank must index it the same way, as the seeded evaluation does)."""

    def __init__(self, shards: ShardedRows) -> None:
        self.shards = shards

    def __getitem__(self, ids: Tensor) -> Tensor:
        ids = torch.as_tensor(ids)
        rows = self.shards.fetch(ids.reshape(-1).long().cpu(), "fetching rows to evaluate", counted=False)
        return rows.view(*ids.shape, rows.shape[-1])
