"""The knowledge-graph container: a graph's triples, names and filter index, mapped from its
imported dataset.

Every knowledge graph (a TSV folder, a PyG dataset, a generated one) is imported once into
the on-disk dataset format (:mod:`.store`) under ``<data root>/imported/``
(:func:`~dsa_train.data.load.load_knowledge_graph`) and mapped from there by every later run,
``--resume`` or ``eval``, as a :class:`KnowledgeGraph`: its triples are never held in RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import DatasetError
from .fingerprint import fingerprint_of
from .store import SPLITS, Dataset
from .triple_index import TripleIndex

FILTER_INDEX = "filter"  # the imported dataset's subfolder holding its TripleIndex
LAYOUT = "kg-1"  # what an imported knowledge graph holds (arrays, names, filter index): bump it when that changes


@dataclass
class KnowledgeGraph:
    """Triples as ``(M, 3)`` id tensors of (head, relation, tail) per split: int32 where the
    ids fit, else int64, mapped read-only from the imported dataset (index them to read rows;
    :meth:`rows` gives int64)."""

    name: str
    num_entities: int
    num_relations: int
    train: Tensor
    valid: Tensor
    test: Tensor
    dataset: Dataset | None = None  # where the triples (and names, filter index) live

    def split(self, name: str) -> Tensor:
        return {"train": self.train, "valid": self.valid, "test": self.test}[name]

    def rows(self, split: str, picked: Tensor) -> Tensor:
        """The ``picked`` triples of a split, read from disk, as int64."""
        return self.split(split)[picked].long()

    def fixed_negatives(self, split: str) -> tuple[np.ndarray, np.ndarray] | None:
        """OGB's fixed negatives of a split, ``(head_neg, tail_neg)``, each ``(M, K)`` global
        entity ids mapped read-only from the dataset (``None`` where the dataset has none)."""
        if self.dataset is None or not self.dataset.has(f"{split}.head_neg"):
            return None
        return self.dataset.array(f"{split}.head_neg"), self.dataset.array(f"{split}.tail_neg")

    def filter_index(self) -> TripleIndex:
        """Every true triple of every split, on disk: what filtered ranking filters out."""
        if self.dataset is None:
            return TripleIndex.from_triples(
                torch.cat([self.train, self.valid, self.test]).long(), self.num_entities, self.num_relations
            )
        return TripleIndex.open(self.dataset.subfolder(FILTER_INDEX))

    def entity_names(self, ids) -> list[str]:
        """The names of these entity ids (their ids as text when the graph has no names)."""
        return names_in(self.dataset, "entities", ids)

    def relation_names(self, ids) -> list[str]:
        return names_in(self.dataset, "relations", ids)

    def entity_ids(self, names) -> list[int | None]:
        """The ids of these entity names (``None`` for a name the graph does not have), looked up
        on disk: a binary search of the name's fingerprint in the sorted fingerprints, then the
        stored name compared, so a lookup is exact."""
        return ids_in(self.dataset, "entities", names)

    def relation_ids(self, names) -> list[int | None]:
        return ids_in(self.dataset, "relations", names)

    @classmethod
    def of(cls, dataset: Dataset) -> KnowledgeGraph:
        meta = dataset.meta
        splits = [dataset.tensor(split) for split in SPLITS]
        return cls(dataset.name, meta["num_entities"], meta["num_relations"], *splits, dataset=dataset)

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.num_entities:,} entities, {self.num_relations:,} relations, "
            f"{len(self.train):,} / {len(self.valid):,} / {len(self.test):,} train / valid / test triples"
        )


def names_in(dataset: Dataset | None, space: str, ids) -> list[str]:
    """The names of these ids of a name space (``entities``, ``relations``, ``nodes``); their ids as text where the dataset has none."""
    ids = [int(i) for i in ids]
    if dataset is None or not dataset.has(f"{space}.names"):
        return [str(i) for i in ids]
    names, offsets = dataset.array(f"{space}.names"), dataset.array(f"{space}.offsets")
    return [bytes(names[offsets[i] : offsets[i + 1]]).decode("utf-8") for i in ids]


def ids_in(dataset: Dataset | None, space: str, names) -> list[int | None]:
    """The ids of these names of a name space (``None`` for a name it does not have), by the sorted fingerprints."""
    if dataset is None or not dataset.has(f"{space}.fingerprints"):
        raise DatasetError(
            f"this graph has no names for its {space} (their ids are their names)",
            hint="look names up in a graph imported from TSV files",
        )
    prints = dataset.array(f"{space}.fingerprints")
    found = []
    for name in names:
        h1, h2 = fingerprint_of(name.encode("utf-8"))
        i = int(np.searchsorted(prints[:, 0], np.uint64(h1)))
        while i < len(prints) and int(prints[i, 0]) == h1 and int(prints[i, 1]) != h2:
            i += 1
        hit = i < len(prints) and int(prints[i, 0]) == h1 and names_in(dataset, space, [i])[0] == name
        found.append(i if hit else None)
    return found
