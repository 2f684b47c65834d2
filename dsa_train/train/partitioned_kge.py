"""Knowledge-graph embedding in partition order (``train.order: partitioned``).

The entity table is a :class:`~.partitioned.SlotTable`. An epoch visits the states of
:class:`~dsa_train.data.partition_order.PartitionedOrder` over the training triples in
buckets; a state's batches come from the buckets whose two partitions are both in the buffer,
and its uniform negatives from the buffer's partitions (``train.negatives_from: buffer``), so
a step touches only rows in memory. With ``train.partitions: 1`` the run is the random
order's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..data.buckets import Buckets, EntityPartitions, load_buckets
from ..data.partition_order import PartitionedOrder
from ..recipe import Recipe
from .kge import KGETask
from .partitioned import HeldPartitions, PartitionLayout
from .tables import TableSite


class PartitionedKGETask(KGETask):
    def __init__(
        self,
        recipe: Recipe,
        device: torch.device,
        tables: TableSite | None = None,
    ) -> None:
        cfg = recipe.train
        layout = lambda rows: PartitionLayout(rows, cfg.partitions, cfg.seed)  # noqa: E731
        super().__init__(recipe, device, tables, layout=layout)
        self.buckets: Buckets = load_buckets(self.kg, self.partitions)
        self.held = HeldPartitions(self.model.node_emb, min(cfg.buffer, cfg.partitions))
        self.order: PartitionedOrder | None = None
        self._bucket_state: np.ndarray | None = None

    @property
    def partitions(self) -> EntityPartitions:
        return self.layout.partitions

    def epoch_order(self, epoch_seed: int, items: int) -> PartitionedOrder:
        """The epoch's order (the loop's ``Shuffle`` for random order; same seed)."""
        self.order = PartitionedOrder(self.buckets, self.held.capacity, self.recipe.train.seed, epoch_seed)
        self._bucket_state = self.order.bucket_states(self.buckets.offsets)
        return self.order

    def _buffers_of(self, picked: Tensor) -> tuple[int, ...]:
        """The partitions of the buffer states the rows ``picked`` are trained in."""
        buckets = torch.searchsorted(self.buckets.offsets, picked, right=True) - 1
        return self.order.buffers_of(np.unique(self._bucket_state[buckets.numpy()]))

    def train_rows(self, picked: Tensor) -> Tensor:
        return self.buckets.triples[picked].long()

    def draw_negatives(self, count: int) -> Tensor:
        if self.recipe.train.negatives_from == "table" or self.partitions.partitions == 1:
            return super().draw_negatives(count)  # P = 1: the buffer is the table, drawn as random order draws
        return self.held.draw(count, self.device)

    def prefetch(self, picked: Tensor) -> None:
        """The next batch's partitions start loading (called before this batch's step)."""
        self.held.prepare(self._buffers_of(picked))

    def loss(self, picked: Tensor) -> Tensor:
        self.held.hold(self._buffers_of(picked))
        return super().loss(picked)

    def buffer_summary(self) -> dict:
        return self.held.summary()

    def close(self) -> None:
        self.held.close()
