r"""Graphs for node embeddings: PyG's Planetoid and KarateClub, and a synthetic generator.

Every graph is imported once into the on-disk dataset format (:mod:`.store`, kind
``"graph"``; the arrays in :mod:`.graph_import`) under ``<data root>/imported/`` and mapped
from there by every later run, ``--resume`` or ``eval``, as a :class:`Graph`: an undirected
adjacency in CSR form (each edge in both directions, neighbours sorted), class or community
labels with a node split, and the edges held out for link prediction (removed from the
adjacency). Nothing of size N or E is held in RAM: consumers index the memory-mapped
arrays with the nodes a batch needs (``graph.degree(nodes)``, ``graph.col[...]``).

The synthetic generator is a degree-corrected stochastic block model: node :math:`u` has a
power-law weight (popularity rank drawn :math:`\propto (k + 1)^{-s}`, scattered over the ids),
belongs to community :math:`u \bmod K`, and each edge joins a popular node to a popular node
of the same community with probability ``homophily`` (else of any community). It writes the
CSR out of core (:func:`~dsa_train.data.graph_import.write_csr`), so 10^8 nodes generate
in a few hundred MB of RAM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from ..errors import DatasetError
from ..recipe import DatasetConfig
from .graph_import import GENERATOR_VERSION, IMPORTER_VERSION, write_pyg_graph, write_synthetic_graph
from .kg import data_root, import_target
from .store import SPLITS, Dataset, DatasetWriter, Progress, file_sources, import_folder

PLANETOID = ("Cora", "CiteSeer", "PubMed")


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

    @property
    def num_edges(self) -> int:
        return len(self.col) // 2

    def degree(self, nodes: Tensor) -> Tensor:
        """The degrees of these nodes (int64), read from ``rowptr``."""
        return self.rowptr[nodes + 1] - self.rowptr[nodes]

    def nodes(self, split: str) -> Tensor:
        """The ascending ids of a split's nodes (``train``, ``valid``, ``test``; empty if none)."""
        return self.splits.get(split, torch.empty(0, dtype=torch.long))

    def upper_edges(self, rows: int = 1 << 20) -> Tensor:
        """Every training edge once, as ``(E, 2)`` pairs ``u < v`` in CSR order (col's dtype),
        gathered ``rows`` nodes at a time: the only O(E) array this class makes."""
        out = torch.empty(self.num_edges, 2, dtype=self.col.dtype)
        filled = 0
        for low in range(0, self.num_nodes, rows):
            high = min(self.num_nodes, low + rows)
            begin, end = int(self.rowptr[low]), int(self.rowptr[high])
            source = torch.repeat_interleave(torch.arange(low, high), self.rowptr[low + 1 : high + 1] - self.rowptr[low:high])
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
            dataset.name, meta["num_nodes"], dataset.tensor("rowptr"), dataset.tensor("col"), meta["max_degree"],
            labels=dataset.tensor("labels") if dataset.has("labels") else None, num_classes=meta["num_classes"],
            splits={split: dataset.tensor(f"{split}_nodes") for split in SPLITS},
            valid_edges=dataset.tensor("valid_edges"), test_edges=dataset.tensor("test_edges"), dataset=dataset,
        )  # fmt: skip

    def __str__(self) -> str:
        parts = [f"{self.name}: {self.num_nodes:,} nodes, {self.num_edges:,} training edges"]
        if self.labels is not None:
            parts.append(f"{self.num_classes} classes")
        if self.test_edges is not None and len(self.test_edges):
            parts.append(f"{len(self.valid_edges):,} / {len(self.test_edges):,} held-out valid / test edges")
        return ", ".join(parts)


def load_graph(config: DatasetConfig, *, progress: Progress | None = None, note=None) -> Graph:
    """Load the graph a recipe names, importing (or generating) it first if it has not been,
    or if its sources changed (other generator settings, files or ``link_split``). Raises
    ``DatasetError``."""
    name, target, sources, write = _source(config, progress)
    return Graph.of(import_folder(target, kind="graph", name=name, sources=sources, build=write, note=note))


def _source(config: DatasetConfig, progress: Progress | None):
    """The graph's name, import folder, sources, and the function that writes it. The held-out
    edges depend on ``link_split`` and the seed: they are sources too (a new split re-imports
    into the same folder)."""
    split = {"link_split": [float(f) for f in config.link_split], "split_seed": config.graph.seed, "importer": f"graph-{IMPORTER_VERSION}"}
    link = {"link_split": tuple(config.link_split), "seed": config.graph.seed, "progress": progress}
    if config.kind == "synthetic_graph":
        identity = {"generator": f"synthetic_graph-{GENERATOR_VERSION}", "settings": asdict(config.graph)}
        write = partial(write_synthetic_graph, config=config.graph, link_split=link["link_split"], progress=progress)
        return f"sbm-{config.graph.nodes}", import_target(config, "synthetic-graph", identity), {**identity, **split}, write
    if config.kind == "karate":
        import torch_geometric

        def write_karate(writer: DatasetWriter) -> None:
            from torch_geometric.datasets import KarateClub

            data = KarateClub()[0]  # built into PyG: no download
            write_pyg_graph(writer, data, {"train": data.train_mask, "test": ~data.train_mask}, **link)

        sources = {"dataset": "KarateClub", "torch_geometric": torch_geometric.__version__, **split}
        return "KarateClub", import_target(config, "karate", "karate"), sources, write_karate
    root = data_root(config)
    files = _planetoid_files(config.name, root)

    def write_planetoid(writer: DatasetWriter) -> None:
        data = _planetoid(config.name, root, files)
        masks = {"train": data.train_mask, "valid": data.val_mask, "test": data.test_mask}
        write_pyg_graph(writer, data, masks, **link)

    target = import_target(config, f"planetoid-{config.name}", str((root / config.name).resolve()))
    return config.name, target, file_sources(files, **split), write_planetoid


def _planetoid_files(name: str, root: Path) -> list[Path]:
    """The raw files of a Planetoid dataset, downloaded (by PyG) if any is missing."""
    raw = root / name / "raw"
    files = [raw / f"ind.{name.lower()}.{part}" for part in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")]
    if any(not f.is_file() for f in files):
        _planetoid(name, root, files)
    return files


def _planetoid(name: str, root: Path, files: list[Path]):
    """PyG's processed ``Data`` of the dataset; a ``DatasetError`` says which files to place
    where when they are missing (offline) or unreadable."""
    from torch_geometric.datasets import Planetoid

    missing = [f.name for f in files if not f.is_file()]
    try:
        return Planetoid(str(root), name)[0]
    except Exception as e:  # offline download, unreadable or truncated files
        problem = (
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing from '{files[0].parent}' and could not be downloaded"
            if missing
            else f"its files in '{files[0].parent}' are unreadable ({type(e).__name__}: {e})"
        )
        raise DatasetError(
            f"Planetoid {name}: {problem}",
            hint=f"place {', '.join(f.name for f in files)} in '{files[0].parent}' (from {Planetoid.url}/), "
            f"or set DSA_DATA_ROOT (or dataset.root) to the folder that holds '{name}/raw/'",
        ) from None
