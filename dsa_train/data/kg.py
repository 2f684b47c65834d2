"""The knowledge-graph container and the one entry point that loads any recipe's dataset."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from ..recipe import DatasetConfig

SPLITS = ("train", "valid", "test")


@dataclass
class KnowledgeGraph:
    """Triples as ``(M, 3)`` int64 tensors of (head, relation, tail) ids, per split."""

    name: str
    num_entities: int
    num_relations: int
    train: Tensor
    valid: Tensor
    test: Tensor

    def split(self, name: str) -> Tensor:
        return {"train": self.train, "valid": self.valid, "test": self.test}[name]

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.num_entities:,} entities, {self.num_relations:,} relations, "
            f"{len(self.train):,} / {len(self.valid):,} / {len(self.test):,} train / valid / test triples"
        )


def data_root(config: DatasetConfig) -> Path:
    """The recipe's ``dataset.root``, else ``$DSA_DATA_ROOT``, else ``./datasets``."""
    return Path(config.root or os.environ.get("DSA_DATA_ROOT") or "datasets")


def load_knowledge_graph(config: DatasetConfig) -> KnowledgeGraph:
    """Load (or generate) the knowledge graph a recipe names. Raises ``DatasetError``."""
    if config.kind == "synthetic":
        from .synthetic import generate_knowledge_graph

        return generate_knowledge_graph(config.synthetic)
    root = data_root(config)
    if config.kind == "tsv":
        from .tsv import load_tsv_folder

        folder = Path(config.path)
        return load_tsv_folder(folder if folder.is_absolute() else root / folder)
    from .pyg import load_pyg_knowledge_graph

    return load_pyg_knowledge_graph(config.kind, root)
