"""One step's row traffic on a process group: ids to their owners, rows back, gradient rows
to their owners, all with ``all_to_all_single`` (variable splits, zero-length ones included;
gloo's list-form ``all_to_all`` refuses unequal sizes).

Exactness: lookups travel one per occurrence, each with its position in the global batch, and
an owner sums a row's gradient rows in global-batch order (:func:`sum_in_batch_order`) before
its optimizer sees them. A single process summing the whole batch that way gets the same sums
whatever the number of ranks, so the shards stay bit-equal to its table and moments
(``tests/test_distributed_exchange.py``). torch's ``coalesce`` sums duplicates in the order of
an unstable sort instead, so against ``torch.optim.SparseAdam`` a row looked up more than once
in a step agrees to the last bit or two, not bit for bit. Sending each distinct row once per
rank (fewer bytes, another summation order) would be the fast mode; it is not built yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.functional import sum_duplicate_rows
from .sharding import RowSharding


@dataclass
class Request:
    """This rank's lookups, grouped by owner, and what the other ranks asked of this one."""

    order: Tensor  # this rank's lookups sorted by owner (stable: lookup order within an owner)
    send_counts: list[int]  # lookups this rank sends to each owner
    recv_counts: list[int]  # lookups each rank sends to this one
    asked: Tensor  # the local rows the other ranks asked for, rank by rank


class RowExchange:
    """The exchanges of a table laid out by ``sharding`` over the ranks of ``group``."""

    def __init__(self, sharding: RowSharding, group: dist.ProcessGroup | None = None) -> None:
        self.sharding, self.group = sharding, group
        self.rank = dist.get_rank(group)
        self.sent = self.received = 0  # bytes of ids, rows and gradients, to and from other ranks
        self.counting = True  # off: traffic not added to sent and received (an evaluation's)
        if dist.get_world_size(group) != sharding.world_size:
            raise ValueError(
                f"the table is laid out over {sharding.world_size} ranks, the process group has {dist.get_world_size(group)}"
            )

    def request(self, ids: Tensor) -> Request:
        """Tell every owner which of its rows this rank's lookups ``ids`` (1-D) need."""
        owners, local = self.sharding.locate(ids.reshape(-1))
        order = torch.argsort(owners, stable=True)
        send_counts = torch.bincount(owners, minlength=self.sharding.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        asked = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(asked, local[order], recv, send, group=self.group)
        self._count(send, recv, 8)
        return Request(order, send, recv, asked)

    def _count(self, send: list[int], recv: list[int], row_bytes: int) -> None:
        """Add what crossed to other ranks (a rank's share to itself stays in its memory)."""
        if not self.counting:
            return
        self.sent += (sum(send) - send[self.rank]) * row_bytes
        self.received += (sum(recv) - recv[self.rank]) * row_bytes

    def fetch(self, request: Request, shard: Tensor | Callable[[Tensor], Tensor]) -> Tensor:
        """The rows of the lookups, in their order, from the owners' ``shard``: a tensor of
        local rows, or a function from local rows to their values (a DiskEmbedding)."""
        served = (
            shard.index_select(0, request.asked) if isinstance(shard, Tensor) else shard(request.asked)
        ).contiguous()
        back = served.new_empty((sum(request.send_counts), *served.shape[1:]))
        dist.all_to_all_single(back, served, request.send_counts, request.recv_counts, group=self.group)
        self._count(
            request.recv_counts, request.send_counts, served[0].numel() * served.element_size() if len(served) else 0
        )
        rows = torch.empty_like(back)
        rows[request.order] = back
        return rows

    def push(self, request: Request, grad_rows: Tensor, positions: Tensor, shard_shape: tuple[int, ...]) -> Tensor:
        """Send each lookup's gradient row (``grad_rows``, in lookup order) and its position in
        the global batch to the row's owner; return this rank's sparse gradient of shape
        ``shard_shape``, its lookups in global-batch order."""
        values = grad_rows.index_select(0, request.order).contiguous()
        received = values.new_empty((len(request.asked), *values.shape[1:]))
        dist.all_to_all_single(received, values, request.recv_counts, request.send_counts, group=self.group)
        where = torch.empty(len(request.asked), dtype=torch.int64)
        dist.all_to_all_single(
            where,
            positions.reshape(-1)[request.order].contiguous(),
            request.recv_counts,
            request.send_counts,
            group=self.group,
        )
        self._count(
            request.send_counts,
            request.recv_counts,
            values[0].numel() * values.element_size() + 8 if len(values) else 8,
        )
        in_batch_order = torch.argsort(where)
        return sum_in_batch_order(request.asked[in_batch_order], received[in_batch_order], shard_shape)


def gather_everywhere(
    rows: Tensor,
    values: Tensor,
    positions: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    counter: RowExchange | None = None,
) -> tuple[Tensor, Tensor]:
    """Every rank's ``(rows, values)`` lookups on every rank, in global-batch order (by their
    ``positions``, unique over ranks): how a replicated table's gradient reaches all copies.
    ``counter``: an exchange whose byte counts include this traffic."""
    world = dist.get_world_size(group)
    count = torch.tensor([len(rows)])
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c) for c in counts)
    width = values.shape[1:].numel()
    packed = torch.zeros((longest, width), dtype=values.dtype)
    packed[: len(rows)] = values.reshape(len(rows), width)
    keys = torch.full((longest, 2), -1, dtype=torch.int64)
    keys[: len(rows), 0], keys[: len(rows), 1] = positions, rows
    all_values = [torch.empty_like(packed) for _ in range(world)]
    all_keys = [torch.empty_like(keys) for _ in range(world)]
    dist.all_gather(all_values, packed, group=group)
    dist.all_gather(all_keys, keys, group=group)
    if counter is not None:  # this rank's padded block to every other, theirs to it
        block = packed.numel() * packed.element_size() + keys.numel() * keys.element_size()
        counter.sent += (world - 1) * block
        counter.received += (world - 1) * block
    keys = torch.cat([k[: int(c)] for k, c in zip(all_keys, counts)])
    values = torch.cat([v[: int(c)] for v, c in zip(all_values, counts)]).view(-1, *values.shape[1:])
    order = torch.argsort(keys[:, 0])
    return keys[order, 1], values[order]


def sum_in_batch_order(rows: Tensor, values: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A coalesced sparse gradient of ``shape`` from per-lookup ``rows`` and ``values`` given in
    global-batch order: each row's values added first to last, ``((a + b) + c)``."""
    unique, summed = sum_duplicate_rows(rows, values, stable=True)
    return torch.sparse_coo_tensor(unique[None], summed, shape, is_coalesced=True, check_invariants=False)
