r"""What every sharded task does with its sharded table (see docs/distributed.md).

A step's batch is cut into ``distributed.slices`` slices; slice :math:`m` is computed whole by
rank :math:`m \bmod W` (:meth:`ShardedRows.my_slices`). A task asks the owners for the rows
its slices need (:meth:`ShardedRows.fetch`), computes each slice's loss on leaf copies of
them, and sends every gradient row back with its position in the global batch
(:meth:`ShardedRows.push`), where the owner sums a row's gradients in that order. Every rank
calls every collective of a step, with nothing to send if it has no slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed.exchange import RowExchange
from ..distributed.group import World
from ..distributed.sharding import RowSharding
from ..recipe import Recipe
from .tables import TableSite, disk_table


class ShardedRows:
    """One table of ``num_rows`` rows laid out over the ranks of ``world``; ``table`` is this
    rank's shard (an ``nn.Embedding`` or a DiskEmbedding of its rows), set once it exists."""

    def __init__(self, world: World, num_rows: int, seed: int, slices: int, *, exact: bool = True) -> None:
        self.world, self.slices, self.exact = world, slices, exact
        self.sharding = RowSharding(num_rows, world.world_size, seed)
        self.exchange = RowExchange(self.sharding)
        self.table: nn.Module | None = None
        self.name = ""  # the table's name in the task (its file: <name>.table)

    def make_table(self, recipe: Recipe, tables: TableSite | None, name: str, *, std: float) -> nn.Module:
        """This rank's shard of the task's ``name`` table, drawn as the rows of the whole table
        that every layout draws alike (slot order, the seed's chunks): a DiskEmbedding with
        ``embedding_storage: disk``, else an ``nn.Embedding`` in memory."""
        rank, sharding = self.world.rank, self.sharding
        self.name = name
        if recipe.model.embedding_storage == "disk":
            table = disk_table(
                recipe,
                tables,
                name,
                self.rows_here,
                std=std,
                first_row=rank * sharding.block,
                total_rows=sharding.num_rows,
            )
        else:
            rows = sharding.initial_rows(rank, recipe.model.dim, std=std, seed=recipe.train.seed)
            table = nn.Embedding(len(rows), recipe.model.dim, sparse=True, _weight=rows)
        self.table = table
        return table

    @property
    def rows_here(self) -> int:
        return self.sharding.rows_of(self.world.rank)

    def my_slices(self, n: int) -> list[tuple[int, int, int]]:
        """``(m, start, stop)`` of the non-empty slices of ``n`` batch items this rank computes."""
        bounds = [n * m // self.slices for m in range(self.slices + 1)]
        rank, world = self.world.rank, self.world.world_size
        return [
            (m, bounds[m], bounds[m + 1]) for m in range(self.slices) if m % world == rank and bounds[m] < bounds[m + 1]
        ]

    def read_local(self, local: Tensor) -> Tensor:
        """Rows of this rank's shard, on the host."""
        return self.table(local.to(self.table.weight.device)).detach().cpu()

    def fetch(self, ids: Tensor, doing: str, *, counted: bool = True) -> Tensor:
        """The rows of ``ids`` (global, 1-D, on the host) from their owners, in order;
        ``counted=False``: not training traffic (an evaluation's), left out of the byte counts.
        Exact mode asks per occurrence (what docs/distributed.md's traffic model counts); fast
        mode asks each distinct row once (the same rows: fetching is exact either way)."""
        self.exchange.counting = counted
        asked, where = (
            (ids, None) if self.exact else torch.unique(ids, return_inverse=True)
        )  # fast: each row asked once
        try:
            with self.world.guard(doing), torch.no_grad():
                rows = self.exchange.fetch(self.exchange.request(asked), self.read_local)
        finally:
            self.exchange.counting = True
        return rows if where is None else rows[where]

    def push(self, ids: Tensor, grads: Tensor, positions: Tensor) -> None:
        """Send each lookup's gradient row to its owner; leave this rank's summed sparse
        gradient (rows in global-batch order of ``positions``) in the shard's ``.grad``.

        Not exact (``distributed.exact: false``): this rank first sums its rows of each id
        (in its own lookup order) and sends one row per distinct id; owners add those in rank
        order. Fewer bytes, but the sums are associated by rank, so the result depends on the
        number of ranks by float rounding (docs/distributed.md says how much)."""
        weight = self.table.weight
        if not self.exact and len(ids):
            ids, where = torch.unique(ids, return_inverse=True)
            grads = torch.zeros((len(ids), *grads.shape[1:]), dtype=grads.dtype).index_add_(0, where, grads)
            positions = self.world.rank * (1 << 40) + torch.arange(len(ids))  # owners add ranks' sums in rank order
        with self.world.guard("sending the step's gradient rows to their owners"):
            request = self.exchange.request(ids)
            weight.grad = self.exchange.push(request, grads, positions, tuple(weight.shape)).to(weight.device)

    def total(self, losses: Tensor) -> float:
        """The batch's loss from each slice's (zero where another rank computed it)."""
        with self.world.guard("adding up the step's loss"):
            dist.all_reduce(losses)
        return float(losses.sum())


class ShardedTask:
    """What a sharded task (listed before the one-process task it extends) shares with the
    others: its table's layout, no read-ahead and no plain loss. ``world`` and ``recipe`` are
    the task's."""

    world: World
    recipe: Recipe
    layout: ShardedRows

    @property
    def shards(self) -> ShardedRows:
        """The sharded table's layout over the ranks."""
        return self.layout

    def prefetch(self, picked: Tensor) -> None:
        pass  # the owners learn which rows a step needs only during the step

    def loss(self, picked: Tensor) -> Tensor:
        raise TypeError("a sharded task computes its gradients with gradients(), not a loss to backward")


def sharded_layout(world: World, recipe: Recipe):
    """The task's ``layout``: ``num_rows -> ShardedRows``, this rank's shard of them."""
    d = recipe.distributed
    return lambda num_rows: ShardedRows(world, num_rows, recipe.train.seed, d.slices, exact=d.exact)


def wait_for_import(world: World, load) -> None:
    """Let one rank per machine (local rank 0) run ``load()`` (a dataset import) first; the
    others wait, then reuse what it imported."""
    if world.local_rank == 0:
        load()
    with world.guard("waiting for the dataset import"):
        dist.barrier()
