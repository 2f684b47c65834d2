"""The graph container for node embeddings: a graph's CSR adjacency, labels, node split and
held-out edges, mapped from its imported dataset.

Every graph (PyG's Planetoid or KarateClub, a generated one) is imported once into the
on-disk dataset format (:mod:`.store`, kind ``"graph"``; the arrays in :mod:`.graph_import`)
under ``<data root>/imported/`` (:func:`~dsa_train.data.load.load_graph`) and mapped from
there by every later run, ``--resume`` or ``eval``, as a :class:`Graph`: an undirected
adjacency in CSR form (each edge in both directions, neighbours sorted; an edge list read with
``directed: true`` keeps each edge in its source's row only), class or community
labels with a node split, and the edges held out for link prediction (removed from the
adjacency). Nothing of size N or E is held in RAM: consumers index the memory-mapped
arrays with the nodes a batch needs (``graph.degree(nodes)``, ``graph.col[...]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .store import SPLITS, Dataset


@dataclass
class Graph:
    """A graph over memory-mapped, read-only tensors (copy one before writing into it)."""

    name: str
    num_nodes: int
    rowptr: Tensor  # (N + 1,) int64: node u's neighbours are col[rowptr[u]:rowptr[u + 1]]
    col: Tensor  # (2E,) int32 (int64 past 2^31 nodes), sorted within each row
    max_degree: int = 0
    labels: Tensor | None = None  # (N,) int8/int16/int32 class or community of each node
    num_classes: int = 0
    splits: dict[str, Tensor] = field(default_factory=dict)  # train/valid/test -> ascending node ids
    valid_edges: Tensor | None = None  # (M, 2), u < v: held-out edges for link prediction
    test_edges: Tensor | None = None
    dataset: Dataset | None = None  # where the arrays live
    directed: bool = False  # col holds each edge u -> v once, in row u (an edge list read with directed: true)

    @property
    def num_edges(self) -> int:
        return len(self.col) if self.directed else len(self.col) // 2

    def degree(self, nodes: Tensor) -> Tensor:
        """The degrees of these nodes (int64), read from ``rowptr``."""
        return self.rowptr[nodes + 1] - self.rowptr[nodes]

    def nodes(self, split: str) -> Tensor:
        """The ascending ids of a split's nodes (``train``, ``valid``, ``test``; empty if none)."""
        return self.splits.get(split, torch.empty(0, dtype=torch.long))

    @property
    def named(self) -> bool:
        """Whether the nodes have names (an edge list read with ``ids: names``); else a node's id is its name."""
        return self.dataset is not None and self.dataset.has("nodes.fingerprints")

    def node_names(self, ids) -> list[str]:
        """The names of these node ids (their ids as text where the graph has no names)."""
        from .kg import names_in

        return names_in(self.dataset, "nodes", ids)

    def node_ids(self, names) -> list[int | None]:
        """The ids of these node names (``None`` for a name the graph does not have)."""
        from .kg import ids_in

        return ids_in(self.dataset, "nodes", names)

    def upper_edges(self, rows: int = 1 << 20) -> Tensor:
        """Every training edge once, as ``(E, 2)`` pairs ``u < v`` in CSR order (col's dtype),
        gathered ``rows`` nodes at a time: the only O(E) array this class makes (undirected
        graphs only)."""
        if self.directed:
            raise ValueError(
                "upper_edges reads an undirected graph's edges (each once as u < v); this graph is directed"
            )
        out = torch.empty(self.num_edges, 2, dtype=self.col.dtype)
        filled = 0
        for low in range(0, self.num_nodes, rows):
            high = min(self.num_nodes, low + rows)
            begin, end = int(self.rowptr[low]), int(self.rowptr[high])
            source = torch.repeat_interleave(
                torch.arange(low, high), self.rowptr[low + 1 : high + 1] - self.rowptr[low:high]
            )
            target = self.col[begin:end].long()
            upper = source < target
            count = int(upper.sum())
            out[filled : filled + count, 0], out[filled : filled + count, 1] = source[upper], target[upper]
            filled += count
        return out

    @classmethod
    def of(cls, dataset: Dataset) -> Graph:
        meta = dataset.meta
        return cls(
            dataset.name,
            meta["num_nodes"],
            dataset.tensor("rowptr"),
            dataset.tensor("col"),
            meta["max_degree"],
            labels=dataset.tensor("labels") if dataset.has("labels") else None,
            num_classes=meta["num_classes"],
            splits={split: dataset.tensor(f"{split}_nodes") for split in SPLITS},
            valid_edges=dataset.tensor("valid_edges"),
            test_edges=dataset.tensor("test_edges"),
            dataset=dataset,
            directed=bool(meta.get("directed", False)),
        )

    def __str__(self) -> str:
        parts = [f"{self.name}: {self.num_nodes:,} nodes, {self.num_edges:,} training edges"]
        if self.labels is not None:
            parts.append(f"{self.num_classes} classes")
        if self.test_edges is not None and len(self.test_edges):
            parts.append(f"{len(self.valid_edges):,} / {len(self.test_edges):,} held-out valid / test edges")
        return ", ".join(parts)
