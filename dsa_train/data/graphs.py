r"""Graphs for node embeddings: PyG's Planetoid and KarateClub, and a synthetic generator.

Every graph becomes a :class:`Graph`: an undirected adjacency in CSR form (each edge in both
directions, neighbours sorted), optional community/class labels with a node split, and
optionally held-out edges for link prediction (removed from the adjacency before training).

The synthetic generator is a degree-corrected stochastic block model: node :math:`u` has a
power-law weight (popularity rank drawn :math:`\propto (k + 1)^{-s}`, scattered over the ids),
belongs to community :math:`u \bmod K`, and each edge joins a popular node to a popular node
of the same community with probability ``homophily`` (else of any community). It builds the
CSR in chunks from index tensors only, so 10^7 nodes fit in a few GB.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import DatasetError
from ..recipe import DatasetConfig, GraphSyntheticConfig
from .kg import data_root
from .synthetic import CHUNK, power_law_ids

PLANETOID = ("Cora", "CiteSeer", "PubMed")


@dataclass
class Graph:
    name: str
    num_nodes: int
    rowptr: Tensor  # (N + 1,) int64: node u's neighbours are col[rowptr[u]:rowptr[u + 1]]
    col: Tensor  # (2E,) int64, sorted within each row
    labels: Tensor | None = None  # (N,) int64 class or community of each node
    train_mask: Tensor | None = None  # (N,) bool: the nodes a classifier may learn from
    val_mask: Tensor | None = None
    test_mask: Tensor | None = None
    valid_edges: Tensor | None = None  # (M, 2): held-out edges for link prediction
    test_edges: Tensor | None = None

    @property
    def num_edges(self) -> int:
        return len(self.col) // 2

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1 if self.labels is not None else 0

    def degree(self) -> Tensor:
        return self.rowptr[1:] - self.rowptr[:-1]

    def edge_keys(self) -> Tensor:
        """``u * N + v`` for every directed adjacency entry, ascending (rows and columns sorted)."""
        rows = torch.repeat_interleave(torch.arange(self.num_nodes), self.degree())
        return rows * self.num_nodes + self.col

    def __str__(self) -> str:
        parts = [f"{self.name}: {self.num_nodes:,} nodes, {self.num_edges:,} training edges"]
        if self.labels is not None:
            parts.append(f"{self.num_classes} classes")
        if self.test_edges is not None and len(self.test_edges):
            parts.append(f"{len(self.valid_edges):,} / {len(self.test_edges):,} held-out valid / test edges")
        return ", ".join(parts)


def csr_from_edges(edges: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """CSR of the undirected graph with these ``(E, 2)`` edges (self-loops and duplicates dropped)."""
    return csr_from_keys(directed_keys(edges, num_nodes), num_nodes)


def directed_keys(edges: Tensor, num_nodes: int) -> Tensor:
    """``u * N + v`` for both directions of each ``(u, v)`` edge, self-loops dropped."""
    u, v = edges[:, 0], edges[:, 1]
    keep = u != v
    u, v = u[keep], v[keep]
    return torch.cat([u * num_nodes + v, v * num_nodes + u])


def csr_from_keys(keys: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """CSR from directed edge keys ``u * N + v`` (any order, duplicates allowed).

    Made to hold a 10^8-node graph: the sorted unique keys become the column array in place,
    and the row pointers are a binary search for each row's first key."""
    keys = torch.unique(keys)  # sorted
    rowptr = torch.searchsorted(keys, torch.arange(num_nodes + 1) * num_nodes)
    return rowptr, keys.remainder_(num_nodes)


def split_edges(graph: Graph, valid: float, test: float, seed: int) -> Graph:
    """Hold out fractions of the undirected edges for link prediction (removed from the CSR)."""
    if valid == 0 and test == 0:
        return graph
    keys = graph.edge_keys()
    u, v = keys // graph.num_nodes, keys % graph.num_nodes
    once = u < v
    edges = torch.stack([u[once], v[once]], 1)
    order = torch.randperm(len(edges), generator=torch.Generator().manual_seed(seed))
    n_valid, n_test = int(valid * len(edges)), int(test * len(edges))
    graph.valid_edges = edges[order[:n_valid]]
    graph.test_edges = edges[order[n_valid : n_valid + n_test]]
    graph.rowptr, graph.col = csr_from_edges(edges[order[n_valid + n_test :]], graph.num_nodes)
    return graph


def load_graph(config: DatasetConfig) -> Graph:
    if config.kind == "karate":
        from torch_geometric.datasets import KarateClub

        data = KarateClub()[0]  # built into PyG: no download
        graph = _from_pyg("KarateClub", data)
        graph.test_mask = ~graph.train_mask
    elif config.kind == "planetoid":
        graph = _planetoid(config.name, data_root(config))
    else:
        graph = generate_graph(config.graph)
    return split_edges(graph, *config.link_split, seed=config.graph.seed)


def _from_pyg(name: str, data) -> Graph:
    rowptr, col = csr_from_edges(data.edge_index.t(), data.num_nodes)
    masks = {m: getattr(data, m, None) for m in ("train_mask", "val_mask", "test_mask")}
    return Graph(name, int(data.num_nodes), rowptr, col, data.y, **masks)


def _planetoid(name: str, root: Path) -> Graph:
    from torch_geometric.datasets import Planetoid

    raw = root / name / "raw"
    files = [f"ind.{name.lower()}.{part}" for part in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")]
    missing = [f for f in files if not (raw / f).is_file()]
    try:
        data = Planetoid(str(root), name)[0]
    except Exception as e:  # offline download, unreadable or truncated files
        what = f"{', '.join(missing)} missing" if missing else f"unreadable ({type(e).__name__}: {e})"
        raise DatasetError(
            f"Planetoid {name} files in '{raw}' are {what}",
            hint=f"place {', '.join(files)} in '{raw}' (from {Planetoid.url}/), or set DSA_DATA_ROOT",
        ) from None
    return _from_pyg(name, data)


def generate_graph(config: GraphSyntheticConfig) -> Graph:
    generator = torch.Generator().manual_seed(config.seed)
    n, k = config.nodes, min(config.communities, config.nodes)
    target = n * config.average_degree // 2
    keys = []  # each chunk's edges as directed keys, deduplicated early: memory for 10^8 nodes
    for start in range(0, target, CHUNK):
        count = min(CHUNK, target - start)
        u = power_law_ids(n, count, generator, config.zipf)
        same = torch.rand(count, generator=generator) < config.homophily
        community = torch.where(same, u % k, torch.randint(0, k, (count,), generator=generator))
        v = power_law_ids(n, count, generator, config.zipf)
        v = v - v % k + community
        v = torch.where(v >= n, v - k, v)
        keys.append(torch.unique(directed_keys(torch.stack([u, v], 1), n)))
    joined = torch.cat(keys)
    del keys
    rowptr, col = csr_from_keys(joined, n)
    del joined
    labels = torch.arange(n) % k
    split = torch.rand(n, generator=generator)
    return Graph(
        f"sbm-{n}", n, rowptr, col, labels, train_mask=split < 0.1, val_mask=(split >= 0.1) & (split < 0.2), test_mask=split >= 0.2
    )
