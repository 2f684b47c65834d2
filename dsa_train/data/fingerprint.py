r"""128-bit fingerprints of many byte strings at once, computed by NumPy without a Python loop
over the strings.

A string of :math:`L` bytes is read as :math:`\lceil L/8 \rceil` little-endian 64-bit words
:math:`w_0, w_1, \dots` (the last one zero-padded). Each of two lanes starts from its seed
mixed with :math:`L` and absorbs the words one by one,

.. math::
    h \leftarrow \mathrm{mix}\big(\mathrm{rotl}_{31}(h \oplus w_i) \cdot c\big), \qquad
    \mathrm{mix}(x) = x \oplus (x \gg 29),

with multiplication modulo :math:`2^{64}`, then ends with MurmurHash3's 64-bit finaliser. The
two lanes use different seeds and constants, so a fingerprint is 128 bits: the chance that
two different names among :math:`n` share one is about :math:`n^2 / 2^{129}` (below
:math:`10^{-20}` for :math:`n = 10^9`). The result is the same on every machine and in every
process (unlike Python's salted ``hash``), so fingerprints stored on disk stay valid.

Vectorised over blocks of strings small enough to stay in the CPU's cache, step :math:`i`
touches only the strings longer than :math:`8i` bytes.
No installable library here hashes variable-length strings in bulk (NumPy has no string
hash; PyArrow and pandas are not dependencies), hence this small hand-written one.
"""

from __future__ import annotations

import numpy as np

_SEEDS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))
_MULTIPLIERS = (np.uint64(0x87C37B91114253D5), np.uint64(0x4CF5AD432745937F))
_FMIX = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))


BLOCK = 1 << 14  # strings hashed together: their temporaries stay in the CPU's cache


def fingerprints(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``(n, 2)`` uint64 fingerprints of the byte strings ``buffer[starts[i] : starts[i] + lengths[i]]``."""
    n = len(starts)
    out = np.empty((n, 2), dtype=np.uint64)
    padded = np.concatenate([np.asarray(buffer, dtype=np.uint8).reshape(-1), np.zeros(8, np.uint8)])
    # words[p] is the little-endian 64-bit word of the 8 bytes starting at byte p
    words = np.ndarray((len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    with np.errstate(over="ignore"):
        for begin in range(0, n, BLOCK):
            block = slice(begin, begin + BLOCK)
            _absorb(words, starts[block], lengths[block], out[block])
    return out


def _absorb(words: np.ndarray, start: np.ndarray, length: np.ndarray, out: np.ndarray) -> None:
    counts = (length + 7) // 8
    tail_bits = (length - 8 * (counts - 1)).astype(np.uint64) * np.uint64(8)  # of the last word, the string's own
    last_mask = np.where(tail_bits >= 64, ~np.uint64(0), (np.uint64(1) << (tail_bits & np.uint64(63))) - np.uint64(1))
    lanes = [
        np.full(len(start), seed, dtype=np.uint64) ^ (length.astype(np.uint64) * m)
        for seed, m in zip(_SEEDS, _MULTIPLIERS)
    ]
    for i in range(int(counts.max(initial=0))):
        active = counts > i
        rows = slice(None) if active.all() else np.flatnonzero(active)
        word = words[start[rows] + 8 * i]
        ending = counts[rows] == i + 1
        word[ending] &= last_mask[rows][ending]
        for lane, multiplier in zip(lanes, _MULTIPLIERS):
            h = lane[rows] ^ word
            rotated = (h << np.uint64(31)) | (h >> np.uint64(33))
            rotated *= multiplier
            lane[rows] = rotated ^ (rotated >> np.uint64(29))
    for column, h in enumerate(lanes):
        out[:, column] = mix64(h)


def mix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: a bijection of uint64 whose output bits each depend on
    every input bit (used to hash integer keys)."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, dtype=np.uint64) ^ (np.asarray(x, dtype=np.uint64) >> np.uint64(33))
        x *= _FMIX[0]
        x ^= x >> np.uint64(33)
        x *= _FMIX[1]
        x ^= x >> np.uint64(33)
    return x


#: one odd multiplier per column of :func:`hash_columns`
_COLUMN_MULTIPLIERS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9))


def hash_columns(columns: list[np.ndarray], seed: int) -> np.ndarray:
    r"""A seeded 64-bit hash of each row of up to three integer columns :math:`c_0, c_1, \dots`:
    :math:`k \leftarrow \mathrm{mix}(c_0 m_0 + s)`, then :math:`k \leftarrow \mathrm{mix}(k \oplus c_i m_i)`
    (``mix`` is :func:`mix64`, products modulo :math:`2^{64}`). What picks held-out triples and
    edges, and partitions, by a uniform draw per row."""
    with np.errstate(over="ignore"):
        key = mix64(np.asarray(columns[0]).astype(np.uint64) * _COLUMN_MULTIPLIERS[0] + np.uint64(seed % 2**64))
        for column, multiplier in zip(columns[1:], _COLUMN_MULTIPLIERS[1:], strict=False):
            key = mix64(key ^ (np.asarray(column).astype(np.uint64) * multiplier))
    return key


def fingerprint_of(name: bytes) -> tuple[int, int]:
    """The fingerprint of one string (a lookup by name, see ``KnowledgeGraph.entity_ids``)."""
    buffer = np.frombuffer(name, dtype=np.uint8)
    pair = fingerprints(buffer, np.array([0]), np.array([len(name)]))[0]
    return int(pair[0]), int(pair[1])
