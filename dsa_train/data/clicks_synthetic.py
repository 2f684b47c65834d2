r"""A seeded synthetic click log with a planted signal, that scales to :math:`10^8` ids per
feature (ids are drawn, never stored per id: every per-id quantity is a hash of the id).

Impression :math:`s` has, for each categorical feature :math:`f`, a bag of :math:`1` to
``max_hot`` ids drawn from a power law over that feature's ``ids`` (popularity rank
:math:`\propto (k + 1)^{-\text{zipf}}`, hot ids scattered; see
:func:`~dsa_train.data.synthetic.power_law_ids`), with weights :math:`w \in (0, 1]` if
``weighted``, and ``dense`` features :math:`x \sim \mathcal N(0, 1)`. Each id has a hidden
effect :math:`a_f(i)` and a hidden 4-vector :math:`\mathbf u_f(i)`, each coordinate uniform
with unit variance, computed from a hash of :math:`(f, i)`; a bag's are its ids'
weighted means :math:`\bar a_f, \bar{\mathbf u}_f`. The click logit is

.. math::
    \ell_s = \operatorname{logit}(\text{click\_rate}) + \text{signal} \cdot \frac{1}{\sqrt 3}\Big(
    \frac{1}{\sqrt F} \sum_f \bar a_f + \frac{1}{\sqrt P} \sum_{p} \frac{\bar{\mathbf u}_{2p}^\top \bar{\mathbf u}_{2p+1}}{2}
    + \frac{1}{\sqrt D} \mathbf c^\top \mathbf x \Big)

(:math:`P = \lfloor F / 2 \rfloor` feature pairs, :math:`\mathbf c` hidden dense weights; a
term with nothing to sum is left out and the :math:`\sqrt 3` becomes the root of the terms
there are), and the impression is clicked with probability :math:`\sigma(\ell_s)`. The
split's true logits are kept (``<split>_logits``): their AUC is the best a model can reach.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..progress import work
from ..recipe import ClicksSyntheticConfig
from .clicks import ClickWriter
from .fingerprint import mix64
from .store import SPLITS, DatasetWriter
from .synthetic import power_law_ids

#: 1: the first version.
GENERATOR_VERSION = 1
CHUNK = 1 << 16  # impressions generated at once
LATENT = 4  # coordinates of the hidden id vectors of the pairwise interactions


def _uniform(keys: np.ndarray, salt: int) -> np.ndarray:
    """A value in ``[-sqrt 3, sqrt 3)`` (unit variance) per key, from a seeded hash."""
    with np.errstate(over="ignore"):
        h = mix64(keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt % 2**64))
    return ((h >> np.uint64(11)).astype(np.float64) / 2.0**53 * 2 - 1) * math.sqrt(3)


def _bag_means(values: np.ndarray, weights: np.ndarray, bag_of: np.ndarray, bags: int) -> np.ndarray:
    """The weighted mean of ``values`` (one column, or rows of columns) per bag."""
    if len(bag_of) == bags:  # one id per bag: its own value
        return values
    mass = np.bincount(bag_of, weights=weights, minlength=bags)
    columns = values.reshape(len(values), -1).T
    means = np.stack([np.bincount(bag_of, weights=column * weights, minlength=bags) / mass for column in columns], 1)
    return means.reshape(bags, *values.shape[1:])


def write_synthetic_clicks(writer: DatasetWriter, *, config: ClicksSyntheticConfig) -> None:
    """Generate the click log into ``writer`` (see the module docstring)."""
    c = config
    f, d = c.features, c.dense
    out = ClickWriter(
        writer,
        features=[f"C{i + 1}" for i in range(f)],
        dense_features=[f"I{i + 1}" for i in range(d)],
        weighted=c.weighted,
    )
    counts = {"train": c.samples, "valid": c.valid, "test": c.test}
    total, done = sum(counts.values()), 0
    dense_weights = _uniform(np.arange(d), c.seed ^ 0xD)
    for split_number, split in enumerate(SPLITS):
        for chunk_number, start in enumerate(range(0, counts[split], CHUNK)):
            n = min(CHUNK, counts[split] - start)
            generator = torch.Generator().manual_seed(hash_seed(c.seed, split_number, chunk_number))
            labels, dense, lengths, ids, weights, logits = _chunk(c, n, generator, dense_weights)
            out.append(split, labels, dense, lengths, ids, weights if c.weighted else None, logits)
            done += n
            work("generating impressions", done, total)
    out.finish()


def hash_seed(*parts: int) -> int:
    """A 63-bit seed for one chunk of one split, from the recipe's seed and the chunk's place."""
    key = np.uint64(0)
    with np.errstate(over="ignore"):
        for part in parts:
            key = mix64(np.asarray([key ^ np.uint64(part % 2**64)]))[0] + np.uint64(0x632BE59BD9B4E019)
    return int(key >> np.uint64(1))


def _chunk(c: ClicksSyntheticConfig, n: int, generator: torch.Generator, dense_weights: np.ndarray):
    """``n`` impressions: labels, dense features, bag lengths, ids, weights and true logits."""
    f, d = c.features, c.dense
    if c.max_hot == 1:
        lengths = np.ones((n, f), dtype=np.int64)
    else:
        lengths = torch.randint(1, c.max_hot + 1, (n, f), generator=generator).numpy()
    nnz = int(lengths.sum())
    feature = np.repeat(np.tile(np.arange(f), n), lengths.reshape(-1))
    ids = power_law_ids(c.ids, nnz, generator, c.zipf).numpy()
    weights = (1 - torch.rand(nnz, generator=generator)).numpy() if c.weighted else np.ones(nnz, np.float32)
    dense = torch.randn(n, d, generator=generator).numpy() if d else np.zeros((n, 0), np.float32)
    bag_of = np.repeat(np.arange(n * f), lengths.reshape(-1))
    key = ids.astype(np.uint64) * np.uint64(f) + feature.astype(np.uint64)  # (feature, id), one key
    terms = []
    effect = _bag_means(_uniform(key, c.seed), weights, bag_of, n * f).reshape(n, f)
    terms.append(effect.sum(1) / math.sqrt(f))
    pairs = f // 2
    if pairs:
        latent = np.stack([_uniform(key, c.seed + 1 + j) for j in range(LATENT)], 1)
        bags = _bag_means(latent, weights, bag_of, n * f).reshape(n, f, LATENT)
        products = (bags[:, 0 : 2 * pairs : 2] * bags[:, 1 : 2 * pairs : 2]).sum(2) / math.sqrt(LATENT)
        terms.append(products.sum(1) / math.sqrt(pairs))
    if d:
        terms.append(dense.astype(np.float64) @ dense_weights / math.sqrt(d))
    logits = math.log(c.click_rate / (1 - c.click_rate)) + c.signal * sum(terms) / math.sqrt(len(terms))
    clicked = torch.rand(n, generator=generator, dtype=torch.float64).numpy() < 1 / (1 + np.exp(-logits))
    return clicked, dense.astype(np.float32), lengths, ids, weights.astype(np.float32), logits.astype(np.float32)
