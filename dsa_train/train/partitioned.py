"""What partition-ordered tasks share (``train.order: partitioned``): a disk table laid out by
slot, looked up by id, and the buffer that moves its partitions.

The table's rows are laid out by :class:`~dsa_train.data.buckets.EntityPartitions`: partition
``p`` is one contiguous range of its records. A task trains the states of a
:class:`~dsa_train.data.partition_order.PartitionedOrder` (a bucket's items join two
partitions; a state's buckets have both in the buffer), holds a batch's partitions before its
step and prepares the next batch's while this one trains. :class:`~dsa_train.storage.buffer.PartitionBuffer`
reads a partition whole and writes back the one no batch needs. The update rule is
DiskSparseAdam's as in random order: only the order of the batches (and where uniform
negatives come from) differs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..data.buckets import EntityPartitions
from ..memory import require_memory
from ..storage.buffer import PartitionBuffer
from ..recipe import Recipe
from .tables import TableSite, WholeTable


class SlotTable(nn.Module):
    """A table laid out by slot, looked up by id: ``forward(ids)`` reads rows ``slots(ids)``
    of ``table`` (a DiskEmbedding, or a checkpoint's version of one)."""

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


class PartitionLayout(WholeTable):
    """Where a table's rows are in partition order: by slot (:class:`SlotTable`), each
    partition one contiguous range of records."""

    def __init__(self, num_rows: int, partitions: int, seed: int) -> None:
        super().__init__(num_rows)
        self.partitions = EntityPartitions(num_rows, partitions, seed)

    def make_table(self, recipe: Recipe, tables: TableSite | None, name: str, *, std: float) -> SlotTable:
        return SlotTable(super().make_table(recipe, tables, name, std=std), self.partitions)


class HeldPartitions:
    """The buffer of a :class:`SlotTable` (none for a table that is not trained: a
    checkpoint's), and the partitions the current and the next batch need."""

    def __init__(self, table: SlotTable, capacity: int) -> None:
        self.partitions, self.capacity = table.partitions, capacity
        disk = table.table
        trained = hasattr(disk, "table") and disk.weight.requires_grad
        self.row_bytes = disk.table.rows.spec.row_bytes if trained else 0
        spans = [self.partitions.span(p) for p in range(self.partitions.partitions)]
        partition_bytes = self.partitions.block * self.row_bytes
        #: the memory the buffer takes at most: C partitions, and the next while it is read
        self.bytes = min(capacity + 1, self.partitions.partitions) * partition_bytes
        if trained and capacity < self.partitions.partitions:
            require_memory(
                f"the partition buffer ({capacity} + 1 partitions of {partition_bytes / 2**20:,.0f} MiB: the buffer, and the "
                "next partition while it is read)",
                self.bytes,
                key=f"train.buffer={capacity}, train.partitions={self.partitions.partitions}",
                hint="lower train.buffer (at least 2) or raise train.partitions (smaller partitions)",
            )
        self.buffer = PartitionBuffer(disk.table.rows, spans) if trained else None
        self.current: tuple[int, ...] = ()  # the partitions of this step's batch
        self.upcoming: tuple[int, ...] = ()  # and of the next one's

    def prepare(self, partitions: tuple[int, ...]) -> None:
        """The next batch needs these: start reading them (called before this batch's step,
        once the step before it is done). What neither batch needs is released first, so its
        write-back comes before the reads on the buffer's one thread; and the next batch's
        partitions are read ahead only if the two batches need C + 1 partitions or fewer (as
        they do when a buffer state holds more than a batch), else when the next batch is held.
        So memory holds at most C + 1 partitions, or one batch's where a batch spans more
        than two states."""
        following, self.upcoming = self.upcoming, partitions
        if self.buffer is not None:
            self.buffer.release(self.buffer.held - set(following) - set(partitions))
            if len(set(following) | set(partitions)) <= self.capacity + 1:
                self.buffer.prepare(partitions)

    def hold(self, partitions: tuple[int, ...]) -> None:
        """This batch needs these: release what neither it nor the next needs, then wait for them."""
        self.current = partitions
        if self.buffer is not None:
            self.buffer.release(self.buffer.held - set(partitions) - set(self.upcoming))
            self.buffer.hold(partitions)

    def draw(self, count: int, device: torch.device) -> Tensor:
        """``count`` ids drawn uniformly from the rows of the current batch's partitions."""
        held = torch.tensor(self.current)
        drawn = torch.randint(0, self.partitions.count(held), (count,), device=device).cpu()
        return self.partitions.ids(self.partitions.spread(held, drawn)).to(device)

    def summary(self) -> dict:
        """What the run summary says of the buffer: its size and its traffic."""
        partition_mib = self.partitions.block * self.row_bytes / 2**20
        out = {
            "partitions": self.partitions.partitions,
            "buffer": self.capacity,
            "partition_mib": round(partition_mib, 1),
        }
        if self.buffer is not None:
            out.update({k: round(v, 3) if isinstance(v, float) else v for k, v in self.buffer.stats.items()})
        return out

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
