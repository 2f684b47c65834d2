r"""An epoch of partition-ordered training: which partitions the buffer holds when, and the
batches drawn from the edge buckets it can train.

With :math:`P` partitions and a buffer of :math:`C` of them, :func:`buffer_schedule` lists
buffer states: each holds :math:`C` partitions and trains every bucket :math:`(i, j)` with
both :math:`i` and :math:`j` in the buffer that no earlier state trained; the next state
swaps one partition out for one in, so the disk reads (and writes back) one partition at a
time. The swap is chosen greedily, the one that makes the most untrained buckets trainable
(ties: the lowest numbers), which visits all :math:`P^2` buckets in close to the fewest swaps
(Marius's BETA ordering, Mohoney et al., OSDI '21, reaches the same bound of about
:math:`P^2 / (2 (C - 1))` swaps for large :math:`P` with a fixed construction).

:class:`PartitionedOrder` is an epoch's order of the bucketed triples (see :mod:`.buckets`):
partitions are relabelled by a seeded permutation each epoch (so no pair of partitions is
always trained first), the states follow one another, and within a state its buckets'
triples are shuffled together (:class:`~.order.Shuffle`). Like ``Shuffle`` it is computed per
batch and can give any batch of any epoch again after a resume. With :math:`P = 1` it is the
random order itself: one state, one bucket, the training split shuffled with the same seed.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .buckets import Buckets
from .order import Shuffle


def buffer_schedule(partitions: int, capacity: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """``[(buffer, buckets), ...]``: the partitions held (in load order) and the buckets
    ``i * partitions + j`` first trainable in each state; every bucket appears exactly once."""
    if capacity >= partitions:
        everything = tuple(range(partitions))
        return [(everything, [i * partitions + j for i in everything for j in everything])]
    done = np.zeros((partitions, partitions), bool)
    buffer = list(range(capacity))
    states = []
    while True:
        held = np.array(buffer)
        fresh = ~done[np.ix_(held, held)]
        buckets = sorted(int(held[a] * partitions + held[b]) for a, b in zip(*np.nonzero(fresh)))
        done[np.ix_(held, held)] = True
        states.append((tuple(buffer), buckets))
        if done.all():
            return states
        best, best_gain = None, -1
        outside = [p for p in range(partitions) if p not in buffer]
        for out in buffer:
            kept = np.array([p for p in buffer if p != out])
            for new in outside:
                # buckets the swap makes trainable: (new, kept), (kept, new), (new, new)
                gain = int((~done[new, kept]).sum() + (~done[kept, new]).sum() + (not done[new, new]))
                if gain > best_gain:
                    best, best_gain = (out, new), gain
        out, new = best
        buffer[buffer.index(out)] = new


class PartitionedOrder:
    """Epoch ``epoch``'s order of ``buckets.triples``: ``slice(start, stop)`` gives the
    positions (rows of the bucketed triples) of batches ``start .. stop - 1``;
    :meth:`state_of` says which buffer state a position of the epoch belongs to.
    ``reverse``: the schedule's states from the last to the first, so that an order that
    follows a forward one starts with the buffer that one ended with."""

    def __init__(self, buckets: Buckets, capacity: int, seed: int, epoch_seed: int, *, reverse: bool = False) -> None:
        parts = buckets.partitions.partitions
        relabel = (
            np.arange(parts)
            if parts == 1
            else np.random.default_rng([seed % 2**63, epoch_seed % 2**63]).permutation(parts)
        )
        offsets = buckets.offsets.numpy()
        self.states: list[tuple[int, ...]] = []  # the buffer of each state, as partitions
        self._starts: list[int] = []  # each state's first position in the epoch
        self._ranges: list[
            tuple[np.ndarray, np.ndarray]
        ] = []  # per state: its buckets' first rows and cumulative sizes
        self._shuffles: list[Shuffle] = []
        position = 0
        schedule = buffer_schedule(parts, capacity)
        for k, (buffer, labelled) in enumerate(schedule[::-1] if reverse else schedule):
            ids = [int(relabel[b // parts]) * parts + int(relabel[b % parts]) for b in labelled]
            firsts = offsets[ids]
            sizes = offsets[np.array(ids) + 1] - firsts
            if sizes.sum() == 0:
                continue  # nothing to train here (an empty bucket set): the buffer moves on
            self.states.append(tuple(int(relabel[p]) for p in buffer))
            self._starts.append(position)
            self._ranges.append((firsts, np.cumsum(sizes)))
            # P = 1: the random order's own shuffle of the whole split (same n, same seed)
            self._shuffles.append(Shuffle(int(sizes.sum()), epoch_seed if k == 0 else epoch_seed + k))
            position += int(sizes.sum())
        self.n = position
        self._bounds = np.array(self._starts[1:] + [position], np.int64)

    def bucket_states(self, offsets: Tensor) -> np.ndarray:
        """The state each bucket (of the buckets with these ``offsets``) is trained in; -1
        for an empty bucket."""
        owner = np.full(len(offsets) - 1, -1, np.int64)
        for k, (firsts, _) in enumerate(self._ranges):
            owner[np.searchsorted(offsets.numpy(), firsts, side="right") - 1] = k
        return owner

    def buffers_of(self, states) -> tuple[int, ...]:
        """The partitions of the buffers of these states, sorted."""
        return tuple(sorted({p for k in states for p in self.states[int(k)]}))

    def state_of(self, positions: Tensor) -> Tensor:
        """The state (index into :attr:`states`) of each epoch position."""
        return torch.from_numpy(np.searchsorted(self._bounds, positions.numpy(), side="right"))

    def slice(self, start: int, stop: int) -> Tensor:
        """The bucketed rows at epoch positions ``start .. stop - 1``."""
        stop = min(stop, self.n)
        positions = torch.arange(start, max(start, stop))
        if not len(positions):
            return positions
        states = self.state_of(positions)
        out = torch.empty_like(positions)
        for k in torch.unique(states).tolist():
            mine = states == k
            local = self._shuffles[k](positions[mine] - self._starts[k]).numpy()
            firsts, ends = self._ranges[k]
            which = np.searchsorted(ends, local, side="right")
            before = np.where(which > 0, ends[np.maximum(which - 1, 0)], 0)
            out[mine] = torch.from_numpy(firsts[which] + local - before)
        return out
