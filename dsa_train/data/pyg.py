"""FB15k-237 and WN18RR through PyTorch Geometric's dataset classes.

The raw files are downloaded (where missing) into ``<root>/<folder>/raw`` and checked against
their digests by :mod:`.remote` (the files PyG's classes download, from the same address); PyG
processes them into ``<root>/<folder>/processed``; the result is imported into the dataset format like any other
knowledge graph (see :mod:`.store`). Before PyG reads them, the raw files are checked line by line
(PyG's readers split on whitespace or tabs without looking, so a CRLF or a stray column would
silently become a different entity). Offline, a missing file is a ``DatasetError`` that says
which files to place where, and from which address.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ..errors import DatasetError
from . import remote
from .store import SPLITS, DatasetWriter
from .tsv import check_tsv_file

# kind -> (folder under the data root, PyG class name)
DATASETS = {"fb15k237": ("FB15k-237", "FB15k_237"), "wn18rr": ("WN18RR", "WordNet18RR")}


def pyg_source(kind: str, root: Path) -> tuple[str, list[Path], Callable[[DatasetWriter], None]]:
    """The dataset's name, its raw files (downloaded if missing) and the function that
    imports it: the raw files are checked line by line, then PyG processes them."""
    import torch_geometric.datasets as pyg_datasets

    folder_name, class_name = DATASETS[kind]
    dataset_class = getattr(pyg_datasets, class_name)
    folder = root / folder_name
    raw = folder / "raw"
    files = [f"{split}.txt" for split in SPLITS]
    remote.fetch(kind, root)  # downloads what is missing, checks every file's digest
    for f in files:  # the check only: PyG assigns the ids
        check_tsv_file(raw / f, final_newline=True)
    return folder_name, [raw / f for f in files], partial(_write, kind=kind, folder=folder, dataset_class=dataset_class)


def _write(writer: DatasetWriter, *, kind: str, folder: Path, dataset_class) -> None:
    try:
        if kind == "fb15k237":
            parts = [dataset_class(str(folder), split=split)[0] for split in ("train", "val", "test")]
            splits = [_triples(d.edge_index, d.edge_type) for d in parts]
            num_entities = int(parts[0].num_nodes)
        else:
            data = dataset_class(str(folder))[0]
            splits = [
                _triples(data.edge_index[:, mask], data.edge_type[mask])
                for mask in (data.train_mask, data.val_mask, data.test_mask)
            ]
            num_entities = int(data.num_nodes)
    except OSError as e:
        raise DatasetError(
            f"PyG could not process '{folder}': {e}",
            hint=f"PyG writes '{folder / 'processed'}': the data root must be writable (set DSA_DATA_ROOT)",
        ) from e
    num_relations = int(max(int(s[:, 1].max()) for s in splits if len(s)) + 1)
    for split, triples in zip(SPLITS, splits):
        writer.put(split, triples.to(torch.int32))
    writer.meta.update(num_entities=num_entities, num_relations=num_relations, names=False)


def _triples(edge_index: torch.Tensor, edge_type: torch.Tensor) -> torch.Tensor:
    return torch.stack([edge_index[0], edge_type, edge_index[1]], dim=1).long()
