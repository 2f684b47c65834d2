"""PyG's graphs for node embeddings (Planetoid's Cora, CiteSeer and PubMed, and KarateClub)
written into the on-disk dataset format as graphs (:mod:`.graph_import`).

PyG downloads a Planetoid dataset's raw files into ``<root>/<name>/raw`` and processes them;
KarateClub is built into PyG (no download). Offline, a missing Planetoid file is a
``DatasetError`` that says which files to place where. ``torch_geometric`` is imported only
when a PyG graph is read or imported: it is slow to import, and no other dataset needs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from .graph_import import write_csr, write_nodes
from .store import DatasetWriter

PLANETOID = ("Cora", "CiteSeer", "PubMed")


def torch_geometric_version() -> str:
    """The installed PyG's version: a source of a graph PyG builds (KarateClub)."""
    import torch_geometric

    return torch_geometric.__version__


def write_karate(writer: DatasetWriter, *, link_split: tuple[float, float], seed: int) -> None:
    """Write KarateClub (its train mask the training nodes, the rest the test nodes)."""
    from torch_geometric.datasets import KarateClub

    data = KarateClub()[0]  # built into PyG: no download
    masks = {"train": data.train_mask, "test": ~data.train_mask}
    write_pyg_graph(writer, data, masks, link_split=link_split, seed=seed)


def planetoid_files(name: str, root: Path) -> list[Path]:
    """The raw files of a Planetoid dataset, downloaded (by PyG) if any is missing."""
    raw = root / name / "raw"
    files = [
        raw / f"ind.{name.lower()}.{part}" for part in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
    ]
    if any(not f.is_file() for f in files):
        _planetoid(name, root, files)
    return files


def write_planetoid(
    writer: DatasetWriter,
    *,
    name: str,
    root: Path,
    files: list[Path],
    link_split: tuple[float, float],
    seed: int,
) -> None:
    """Write a Planetoid dataset (``files``: its :func:`planetoid_files`) with its own node split."""
    data = _planetoid(name, root, files)
    masks = {"train": data.train_mask, "valid": data.val_mask, "test": data.test_mask}
    write_pyg_graph(writer, data, masks, link_split=link_split, seed=seed)


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


def write_pyg_graph(
    writer: DatasetWriter,
    data,
    masks: dict[str, torch.Tensor | None],
    *,
    link_split: tuple[float, float],
    seed: int,
) -> None:
    """Write a (small) PyG ``Data`` graph: its ``edge_index``, its labels ``y`` and the
    nodes of each split's mask (``masks``: ``train``, ``valid``, ``test``; ``None``: none)."""
    n = int(data.num_nodes)
    source, target = data.edge_index.numpy()
    write_csr(writer, [(source, target)], n, edges_bound=len(source), link_split=link_split, seed=seed)
    split = np.full(n, -1, np.int8)
    for which, name in enumerate(("train", "valid", "test")):
        if masks.get(name) is not None:
            split[masks[name].numpy()] = which
    labels = data.y.numpy()
    write_nodes(writer, n, int(labels.max()) + 1, [(np.arange(n), labels, split)])
