"""Knowledge-graph embedding in partition order (``train.order: partitioned``).

The entity table is a disk table laid out by slot (:class:`~dsa_train.data.buckets.EntityPartitions`):
partition ``p`` is one contiguous range of its records. An epoch visits the states of
:class:`~dsa_train.data.partition_order.PartitionedOrder`; a state's batches come from the
buckets whose two partitions are both in the buffer, and its uniform negatives from the
buffer's partitions (``train.negatives_from: buffer``), so a step touches only rows in
memory. :class:`~dsa_train.optim.buffer.PartitionBuffer` reads the next state's new partition
while the current one trains and writes back the one it replaces. The update rule is
DiskSparseAdam's as in random order: only the order of the batches (and where the negatives
come from) differs. With ``train.partitions: 1`` the run is the random order's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ..data.buckets import Buckets, EntityPartitions, load_buckets
from ..data.partition_order import PartitionedOrder
from ..optim.buffer import PartitionBuffer
from ..recipe import Recipe
from .kge import KGETask
from .tables import TableSite


class SlotTable(nn.Module):
    """An entity table laid out by slot, looked up by entity id: ``forward(ids)`` reads rows
    ``slots(ids)`` of ``table`` (a DiskEmbedding, or a checkpoint's version of one)."""

    def __init__(self, table: nn.Module, partitions: EntityPartitions) -> None:
        super().__init__()
        self.table, self.partitions = table, partitions

    @property
    def weight(self) -> Tensor:
        return self.table.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.table(self.partitions.slots(ids))

    def prefetch(self, ids: Tensor) -> None:
        self.table.prefetch(self.partitions.slots(ids))


class PartitionedKGETask(KGETask):
    def __init__(self, recipe: Recipe, device: torch.device, tables: TableSite | None = None, *, progress=None, note=None) -> None:
        super().__init__(recipe, device, tables, progress=progress, note=note)
        cfg = recipe.train
        self.buckets: Buckets = load_buckets(self.kg, self.partitions, progress=progress, note=note)
        self.capacity = min(cfg.buffer, cfg.partitions)
        spans = [self.partitions.span(p) for p in range(cfg.partitions)]
        table = self.model.node_emb.table
        self.buffer = PartitionBuffer(table.table.rows, spans) if hasattr(table, "table") and table.weight.requires_grad else None
        self.order: PartitionedOrder | None = None
        self._bucket_state: np.ndarray | None = None
        self._current: tuple[int, ...] = ()  # the partitions of this step's batch
        self._upcoming: tuple[int, ...] = ()  # and of the next one's

    @property
    def partitions(self) -> EntityPartitions:
        if not hasattr(self, "_partitions"):
            self._partitions = EntityPartitions(self.kg.num_entities, self.recipe.train.partitions, self.recipe.train.seed)
        return self._partitions

    def entity_table(self, tables: TableSite | None) -> nn.Module:
        return SlotTable(super().entity_table(tables), self.partitions)

    def epoch_order(self, epoch_seed: int) -> PartitionedOrder:
        """The epoch's order (the loop's ``Shuffle`` for random order; same seed)."""
        self.order = PartitionedOrder(self.buckets, self.capacity, self.recipe.train.seed, epoch_seed)
        parts = self.partitions.partitions
        owner = np.full(parts * parts, -1, np.int64)
        for k, (firsts, _) in enumerate(self.order._ranges):
            owner[np.searchsorted(self.buckets.offsets.numpy(), firsts, side="right") - 1] = k
        self._bucket_state = owner
        return self.order

    def _buffers_of(self, picked: Tensor) -> tuple[int, ...]:
        """The partitions of the buffer states the rows ``picked`` are trained in."""
        buckets = torch.searchsorted(self.buckets.offsets, picked, right=True) - 1
        states = np.unique(self._bucket_state[buckets.numpy()])
        return tuple(sorted({p for k in states for p in self.order.states[k]}))

    def train_rows(self, picked: Tensor) -> Tensor:
        return self.buckets.triples[picked].long()

    def draw_negatives(self, count: int) -> Tensor:
        if self.recipe.train.negatives_from == "table" or self.partitions.partitions == 1:
            return super().draw_negatives(count)  # P = 1: the buffer is the table, drawn as random order draws
        held = torch.tensor(self._current)
        drawn = torch.randint(0, self.partitions.count(held), (count,), device=self.device).cpu()
        return self.partitions.ids(self.partitions.spread(held, drawn)).to(self.device)

    def prefetch(self, picked: Tensor) -> None:
        """The next batch's partitions start loading (called before this batch's step)."""
        self._upcoming = self._buffers_of(picked)
        if self.buffer is not None:
            self.buffer.prepare(self._upcoming)

    def loss(self, picked: Tensor) -> Tensor:
        self._current = self._buffers_of(picked)
        if self.buffer is not None:
            self.buffer.hold(self._current)  # and the partitions neither this batch nor the next needs go back
            self.buffer.release(self.buffer.held - set(self._current) - set(self._upcoming))
        return super().loss(picked)

    def buffer_summary(self) -> dict:
        """What the run summary says of the buffer: its size and its traffic."""
        row_bytes = self.model.node_emb.table.table.rows.spec.row_bytes if self.buffer is not None else 0
        partition_mib = self.partitions.block * row_bytes / 2**20
        out = {"partitions": self.partitions.partitions, "buffer": self.capacity, "partition_mib": round(partition_mib, 1)}
        if self.buffer is not None:
            out.update({k: round(v, 3) if isinstance(v, float) else v for k, v in self.buffer.stats.items()})
        return out

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
