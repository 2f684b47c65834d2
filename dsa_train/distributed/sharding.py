r"""Which rank owns which rows of a table sharded by rows, and where a row sits on its owner.

A table of :math:`N` rows is split over :math:`W` ranks in contiguous blocks of
:math:`B = \lceil N / W \rceil` *slots*, after a seeded permutation of the ids (so the hot rows
of a power-law workload, often the low ids, spread over every rank, as PyTorch-BigGraph's
importer shuffles for the same reason). Row ``id`` has slot :math:`s = \pi(\mathrm{id})` and
lives on rank :math:`\lfloor s / B \rfloor` at local row :math:`s \bmod B`. The permutation is
:class:`~dsa_train.data.order.Shuffle`'s, computed on demand in both directions, so no
:math:`N`-long array exists on any rank, and every rank computes the same layout from
``(N, W, seed)`` alone.

Initial weights are drawn in slot order, in the chunks and from the seeds a
:class:`~dsa_train.DiskEmbedding` of :math:`N` rows draws its rows (:meth:`initial_rows`):
every rank draws only the chunks its block overlaps, and the table the ranks hold together is
the same for every :math:`W`.
"""

from __future__ import annotations

import torch

from ..data.buckets import EntityPartitions
from ..storage.table import INIT_CHUNK_ROWS, initial_weights


class RowSharding(EntityPartitions):
    """The layout of an ``num_rows``-row table over ``world_size`` ranks for ``seed``: the
    partitions of :class:`~dsa_train.data.buckets.EntityPartitions`, one per rank, with the
    ids permuted for one rank too."""

    def __init__(self, num_rows: int, world_size: int, seed: int) -> None:
        if num_rows <= 0 or world_size <= 0:
            raise ValueError(f"a sharded table needs rows and ranks, got {num_rows} rows over {world_size} ranks")
        super().__init__(num_rows, world_size, seed, permute_one=True)
        self.num_rows, self.world_size = num_rows, world_size

    def rows_of(self, rank: int) -> int:
        """How many rows rank ``rank`` holds (the last ranks may hold fewer, or none)."""
        first, stop = self.span(rank)
        return stop - first

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The owner rank and the local row of each id (int64 tensors shaped like ``ids``, on the host)."""
        slots = self.slots(ids.cpu())
        return torch.div(slots, self.block, rounding_mode="floor"), slots % self.block

    def ids_of(self, rank: int, local_rows: torch.Tensor) -> torch.Tensor:
        """The global ids of rank ``rank``'s ``local_rows``."""
        return self.ids(local_rows.cpu() + rank * self.block)

    def initial_rows(self, rank: int, dim: int, *, std: float, seed: int) -> torch.Tensor:
        """Rank ``rank``'s rows (``rows_of(rank) x dim``) before training: slots
        ``[rank * block, ...)`` of a DiskEmbedding-style table drawn ``N(0, std^2)`` from ``seed``."""
        first, count = rank * self.block, self.rows_of(rank)
        creation = {"init": "normal", "std": std, "bound": 0.0, "seed": seed, "chunk_rows": INIT_CHUNK_ROWS}
        out = torch.empty((count, dim))
        done = 0
        while done < count:
            slot = first + done
            chunk, offset = divmod(slot, INIT_CHUNK_ROWS)
            rows = initial_weights(creation, (self.num_rows, dim), torch.float32, chunk)
            take = min(len(rows) - offset, count - done)
            out[done : done + take] = rows[offset : offset + take]
            done += take
        return out
