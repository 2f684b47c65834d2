r"""A seeded shuffle of ``[0, n)`` computed on demand: the epoch order of any number of items
without an ``n``-long permutation in memory.

:class:`Shuffle` is a Feistel network on :math:`2b`-bit integers (:math:`2^{2b} \ge n`, the
smallest even bit count): split :math:`x` into halves :math:`(L, R)` of :math:`b` bits and
apply :data:`ROUNDS` rounds

.. math::
    (L, R) \leftarrow \big(R,\; L \oplus (F(R \oplus k_i) \bmod 2^b)\big)

with :math:`F` MurmurHash3's 64-bit finaliser and round keys :math:`k_i` drawn from the seed.
Each round is a bijection, so the network permutes :math:`[0, 2^{2b})`; values that land at
or beyond :math:`n` are sent through it again ("cycle walking") until they fall below
:math:`n`, which restricts it to a permutation of :math:`[0, n)` (fewer than 4 passes on
average, as :math:`2^{2b} < 4n`). ``shuffle(positions)`` gives the items at those positions of
the epoch's order, so a batch costs its own size, and any batch of any epoch can be
recomputed after a resume. :meth:`Shuffle.slice` computes :data:`BLOCK` positions at a time
and serves consecutive batches from them: one cycle-walking pass over a block instead of a dozen
small ones per batch (the loop asks for each batch twice, once to prefetch it).
"""

from __future__ import annotations

import numpy as np
import torch

from .fingerprint import mix64

ROUNDS = 6
BLOCK = 1 << 16  # positions computed at once by ``slice``: 512 KiB of int64


class Shuffle:
    """The permutation of ``range(n)`` for ``seed``; ``shuffle(positions)`` maps positions to items."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        bits = max(2, (max(n, 2) - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        keys = np.random.default_rng(seed % 2**63).integers(0, 2**63, ROUNDS, dtype=np.int64)
        self.keys = keys.astype(np.uint64)
        self._block_start, self._block = 0, torch.empty(0, dtype=torch.int64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.mask)
        return (left << half) | right

    def _inverse_network(self, y: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = y >> half, y & self.mask
        for key in self.keys[::-1]:
            left, right = right ^ (mix64(left ^ key) & self.mask), left
        return (left << half) | right

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        x = self._network(positions.numpy().astype(np.uint64))
        outside = np.flatnonzero(x >= self.n)
        while len(outside):  # cycle walking: at most a few passes
            x[outside] = self._network(x[outside])
            outside = outside[x[outside] >= self.n]
        return torch.from_numpy(x.astype(np.int64))

    def position_of(self, items: torch.Tensor) -> torch.Tensor:
        """Where ``items`` stand in the order: the inverse of ``shuffle(positions)`` (the network
        run backwards, cycle-walking back until the value falls below ``n``)."""
        y = self._inverse_network(items.numpy().astype(np.uint64))
        outside = np.flatnonzero(y >= self.n)
        while len(outside):
            y[outside] = self._inverse_network(y[outside])
            outside = outside[y[outside] >= self.n]
        return torch.from_numpy(y.astype(np.int64))

    def slice(self, start: int, stop: int) -> torch.Tensor:
        """The items at positions ``start .. stop - 1`` of the order."""
        stop = min(stop, self.n)
        if stop <= start:
            return torch.empty(0, dtype=torch.int64)
        offset = start - self._block_start
        if not (0 <= offset and stop - self._block_start <= len(self._block)):
            end = min(self.n, max(stop, start + BLOCK))
            self._block_start, self._block, offset = start, self(torch.arange(start, end)), 0
        return self._block[offset : offset + stop - start].clone()  # the caller's own, never the cache
