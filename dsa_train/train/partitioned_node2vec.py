"""node2vec in partition order (``train.order: partitioned``), from pools of walk pairs.

Walks wander over the whole graph, so a batch of walks cannot stay inside a buffer. The
pairs they make can (GraphVite's way, Zhu et al. 2019): the epoch's start nodes (the random
order's shuffle) are cut into pools of ``train.pool_pairs`` positive pairs; a pool's walks
are drawn (seeded by the epoch and the pool, so any pool can be drawn again on resume), each
window gives its first node paired with each of the others, and the pairs are sorted into
``P x P`` buckets by the partitions of their two nodes. A pool is then trained in the order
of :class:`~dsa_train.data.partition_order.PartitionedOrder`, and pools alternate the
schedule's direction, so each starts with the buffer the previous one ended with. Each
positive pair ``(u, v)`` gets ``negatives`` pairs ``(u, n)``, ``n`` uniform over the
buffer's partitions (``train.negatives_from: buffer``) or the table.

The walks and pairs are the random order's distribution (pairs of the same walks, reordered);
what changes is their order and the negatives' pool. An epoch reads the table
``(C + swaps) / P`` times per pool, so pools should be as large as memory allows (8 bytes a
pair; 40 while the next pool is drawn). With ``train.partitions: 1`` the task is random
order's (:class:`Node2VecTask`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..data.buckets import EntityPartitions, bucket_of, sorted_into_buckets
from ..data.order import Shuffle
from ..data.partition_order import PartitionedOrder
from ..memory import require_memory
from ..recipe import Recipe
from .node2vec import Node2VecTask, evaluate_node_embeddings
from .partitioned import HeldPartitions, PartitionLayout, SlotTable
from .sizes import keys_of
from .tables import TableSite


BLOCK_PAIRS = 1 << 22
#: Bytes of memory per pair of a pool: 8 for the pool in training, 32 for the next one while
#: it is drawn (its pairs twice, their buckets, the sort's output).
POOL_BYTES_PER_PAIR = 40


class PairPool:
    """One pool's positive pairs in buckets, and their order."""

    def __init__(
        self, pairs: Tensor, partitions: EntityPartitions, capacity: int, seed: int, epoch_seed: int, *, reverse: bool
    ) -> None:
        bucket = torch.empty(len(pairs), dtype=torch.int32)
        for begin in range(0, len(pairs), BLOCK_PAIRS):  # the layout's arithmetic in int64, a block at a time
            bucket[begin : begin + BLOCK_PAIRS] = bucket_of(partitions, pairs[begin : begin + BLOCK_PAIRS])
        self.buckets = sorted_into_buckets(partitions, pairs, bucket)  # rows (u, v) where a KG's are (h, r, t)
        self.order = PartitionedOrder(self.buckets, capacity, seed, epoch_seed, reverse=reverse)

    def take(self, start: int, stop: int) -> tuple[Tensor, tuple[int, ...]]:
        """The pairs at positions ``start .. stop - 1`` of the pool's order, and the partitions
        of the buffers they are trained in."""
        positions = torch.arange(start, stop)
        states = np.unique(self.order.state_of(positions).numpy())
        return self.buckets.triples[self.order.slice(start, stop)].long(), self.order.buffers_of(states)


class PartitionedNode2VecTask(Node2VecTask):
    def __init__(
        self,
        recipe: Recipe,
        device: torch.device,
        tables: TableSite | None = None,
    ) -> None:
        cfg = recipe.train
        layout = lambda rows: PartitionLayout(rows, cfg.partitions, cfg.seed)  # noqa: E731
        super().__init__(recipe, device, tables, layout=layout)
        c = self.config
        #: positive pairs per start node: its walks' windows, each first node with the others
        self.pairs_per_start = c.walks_per_node * (c.walk_length - c.context_size + 2) * (c.context_size - 1)
        self.pool_starts = max(cfg.batch_size, cfg.pool_pairs // self.pairs_per_start)
        self.held = HeldPartitions(self.model.embedding, min(cfg.buffer, cfg.partitions))
        pool_pairs = min(self.pool_starts, self.graph.num_nodes) * self.pairs_per_start
        require_memory(
            f"a pool of {pool_pairs:,} walk pairs ({POOL_BYTES_PER_PAIR} bytes each: the pool in training, and the next while "
            "it is drawn and sorted)",
            pool_pairs * POOL_BYTES_PER_PAIR,
            key=keys_of(train__pool_pairs=cfg.pool_pairs, train__batch_size=cfg.batch_size),
            hint="lower train.pool_pairs (each pool then reads the table as often, for fewer pairs)",
            reserved=self.held.bytes,
            reserved_for="the partition buffer",
        )
        self._epoch_seed = 0
        self._pools: dict[int, PairPool] = {}
        self._taken: dict[tuple[int, int], tuple[Tensor, tuple[int, ...]]] = {}  # the last two batches asked for

    @property
    def partitions(self) -> EntityPartitions:
        return self.layout.partitions

    def epoch_order(self, epoch_seed: int, items: int) -> _Positions:
        """The epoch's start nodes in random order's shuffle; a batch's positions name which
        start nodes' worth of pairs it trains (see :meth:`_batch`)."""
        self._epoch_seed, self._pools, self._taken = epoch_seed, {}, {}
        return _Positions(self.graph.num_nodes)

    def _pool(self, k: int) -> PairPool:
        """Pool ``k`` of the epoch, drawn on first use (and the pools before it let go)."""
        if k not in self._pools:
            c, cfg = self.config, self.recipe.train
            n = self.graph.num_nodes
            starts = Shuffle(n, self._epoch_seed).slice(k * self.pool_starts, min(n, (k + 1) * self.pool_starts))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((self._epoch_seed * 1_000_003 + k) % 2**62)
                walks = self.sampler.walks(starts.repeat(c.walks_per_node), c.walk_length)
            pairs = walk_pairs(walks.to(torch.int32 if n < 2**31 else torch.int64), c.context_size)
            del walks
            self._pools = {j: pool for j, pool in self._pools.items() if j >= k - 1}
            self._pools[k] = PairPool(
                pairs, self.partitions, self.held.capacity, cfg.seed, self._epoch_seed, reverse=k % 2 == 1
            )
        return self._pools[k]

    def _batch(self, picked: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """The positive pairs of the batch at start positions ``picked`` (consecutive), and the
        partitions they need (the next batch's are asked for twice: to prefetch, then to train)."""
        if not len(picked):
            return torch.empty(0, 2, dtype=torch.long), ()
        per_pool = self.pool_starts * self.pairs_per_start
        start, stop = int(picked[0]) * self.pairs_per_start, (int(picked[-1]) + 1) * self.pairs_per_start
        if (start, stop) in self._taken:
            return self._taken[(start, stop)]
        pairs, needed = [], set()
        for k in range(start // per_pool, (stop - 1) // per_pool + 1):
            got, parts = self._pool(k).take(
                max(start, k * per_pool) - k * per_pool, min(stop, (k + 1) * per_pool) - k * per_pool
            )
            pairs.append(got)
            needed.update(parts)
        self._taken[(start, stop)] = got = torch.cat(pairs), tuple(sorted(needed))
        if len(self._taken) > 2:
            del self._taken[next(iter(self._taken))]  # the oldest
        return got

    def prefetch(self, picked: Tensor) -> None:
        self.held.prepare(self._batch(picked)[1])

    def windows(self, picked: Tensor) -> tuple[Tensor, Tensor]:
        """The batch's positive pairs, and ``negatives`` pairs ``(u, n)`` for each ``(u, v)``."""
        positive, needed = self._batch(picked)
        self.held.hold(needed)
        count = len(positive) * self.config.negatives
        if self.recipe.train.negatives_from == "table":
            drawn = torch.randint(0, self.graph.num_nodes, (count,))
        else:
            drawn = self.held.draw(count, torch.device("cpu"))
        return positive, torch.stack([positive[:, 0].repeat(self.config.negatives), drawn], 1)

    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        return evaluate_node_embeddings(
            self.graph, _ById(self.model.embedding), split, self.recipe
        )  # the table is laid out by slot

    def buffer_summary(self) -> dict:
        return {**self.held.summary(), "pool_pairs": self.pool_starts * self.pairs_per_start}

    def close(self) -> None:
        self.held.close()


def walk_pairs(walks: Tensor, context_size: int) -> Tensor:
    """``(u, v)`` rows: in each ``context_size``-node window of each walk, its first node with
    each of the others (the pairs :func:`~dsa_train.models.node.windows` scores), in the
    walks' dtype."""
    width = walks.shape[1]
    offsets = [(j, i) for j in range(width - context_size + 1) for i in range(1, context_size)]
    return torch.stack(
        [torch.cat([walks[:, j] for j, _ in offsets]), torch.cat([walks[:, j + i] for j, i in offsets])], 1
    )


class _Positions:
    """An epoch's order as the loop asks for it: batch ``i`` is positions ``i x B .. (i + 1) x B - 1``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def slice(self, start: int, stop: int) -> Tensor:
        return torch.arange(start, max(start, min(stop, self.n)))


class _ById:
    """``table[ids]``: the rows of a :class:`SlotTable` by id, without gradient."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table

    def __getitem__(self, ids: Tensor) -> Tensor:
        with torch.no_grad():
            return self.table(ids.reshape(-1)).reshape(*ids.shape, -1).detach().cpu()
