r"""A seeded synthetic graph for node embeddings: a degree-corrected stochastic block model
that scales to 10^8 nodes.

Node :math:`u` has a power-law weight (popularity rank drawn :math:`\propto (k + 1)^{-s}`,
scattered over the ids), belongs to community :math:`u \bmod K`, and each edge joins a popular
node to a popular node of the same community with probability ``homophily`` (else of any
community). It writes the CSR out of core (:func:`~dsa_train.data.graph_import.write_csr`),
so 10^8 nodes generate in a few hundred MB of RAM.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..recipe import GraphSyntheticConfig
from .fingerprint import mix64
from .graph_import import BLOCK_NODES, fraction_bound, write_csr, write_nodes
from .store import DatasetWriter
from .synthetic import CHUNK, power_law_ids

#: 2: written out of core into the dataset format; the node split by a hash of each node.
GENERATOR_VERSION = 2
#: The synthetic graph's node split: a node whose hash falls in the first 10% of the range
#: is a training node, in the next 10% a validation node, else a test node.
NODE_SPLIT = (0.1, 0.2)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SECOND = np.uint64(0xC2B2AE3D27D4EB4F)


def node_priority(nodes: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit hash of each node id (uniform: what the synthetic node split uses)."""
    with np.errstate(over="ignore"):
        return mix64(mix64(nodes.astype(np.uint64) * _SECOND + np.uint64(seed % 2**64)) ^ _GOLDEN)


def write_synthetic_graph(
    writer: DatasetWriter,
    *,
    config: GraphSyntheticConfig,
    link_split: tuple[float, float],
    memory_bytes: int = 256 << 20,
) -> None:
    r"""Generate the graph into ``writer`` (see the module docstring).

    Edge :math:`i` joins :math:`u_i` (power-law popular, see
    :func:`~dsa_train.data.synthetic.power_law_ids`) to :math:`v_i`, a popular node moved
    into :math:`u_i`'s community :math:`u_i \bmod K` with probability ``homophily``, else into
    a uniform community; ``N x average_degree / 2`` edges are drawn in chunks from one seeded
    generator (repeats and self-loops then dropped). Node :math:`u`'s label is
    :math:`u \bmod K`; its split is a seeded hash of :math:`u` (see :data:`NODE_SPLIT`)."""
    n, k = config.nodes, min(config.communities, config.nodes)
    draws = n * config.average_degree // 2
    write_csr(
        writer,
        _synthetic_edges(config),
        n,
        edges_bound=draws,
        link_split=link_split,
        seed=config.seed,
        memory_bytes=memory_bytes,
        what="generating edges",
    )
    write_nodes(writer, n, k, _synthetic_nodes(n, k, config.seed))


def _synthetic_edges(config: GraphSyntheticConfig) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    generator = torch.Generator().manual_seed(config.seed)
    n, k = config.nodes, min(config.communities, config.nodes)
    draws = n * config.average_degree // 2
    for start in range(0, draws, CHUNK):
        count = min(CHUNK, draws - start)
        u = power_law_ids(n, count, generator, config.zipf)
        same = torch.rand(count, generator=generator) < config.homophily
        community = torch.where(same, u % k, torch.randint(0, k, (count,), generator=generator))
        v = power_law_ids(n, count, generator, config.zipf)
        v = v - v % k + community
        v = torch.where(v >= n, v - k, v)
        yield u.numpy(), v.numpy()


def _synthetic_nodes(n: int, k: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    train, valid = fraction_bound(NODE_SPLIT[0]), fraction_bound(NODE_SPLIT[1])
    for start in range(0, n, BLOCK_NODES):
        nodes = np.arange(start, min(n, start + BLOCK_NODES), dtype=np.int64)
        draw = node_priority(nodes, seed)
        yield nodes, nodes % k, np.where(draw < train, 0, np.where(draw < valid, 1, 2)).astype(np.int8)
