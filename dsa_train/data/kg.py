"""The knowledge-graph container and the one entry point that loads any recipe's dataset.

Every knowledge graph (a TSV folder, a PyG dataset, a generated one) is imported once into
the on-disk dataset format (:mod:`.store`) under ``<data root>/imported/`` and mapped from
there by every later run, ``--resume`` or ``eval``: its triples are never held in RAM.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import DatasetError
from ..recipe import DatasetConfig
from .fingerprint import fingerprint_of
from .store import SPLITS, Dataset, DatasetWriter, Progress, file_sources, import_folder, imports_root
from .triple_index import TripleIndex, write_triple_index

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

    def filter_index(self) -> TripleIndex:
        """Every true triple of every split, on disk: what filtered ranking filters out."""
        if self.dataset is None:
            return TripleIndex.from_triples(torch.cat([self.train, self.valid, self.test]).long(), self.num_entities, self.num_relations)
        return TripleIndex.open(self.dataset.subfolder(FILTER_INDEX))

    def entity_names(self, ids) -> list[str]:
        """The names of these entity ids (their ids as text when the graph has no names)."""
        return _names(self.dataset, "entities", ids)

    def relation_names(self, ids) -> list[str]:
        return _names(self.dataset, "relations", ids)

    def entity_ids(self, names) -> list[int | None]:
        """The ids of these entity names (``None`` for a name the graph does not have), looked up
        on disk: a binary search of the name's fingerprint in the sorted fingerprints, then the
        stored name compared, so a lookup is exact."""
        return _ids(self.dataset, "entities", names)

    def relation_ids(self, names) -> list[int | None]:
        return _ids(self.dataset, "relations", names)

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


def _names(dataset: Dataset | None, space: str, ids) -> list[str]:
    ids = [int(i) for i in ids]
    if dataset is None or not dataset.has(f"{space}.names"):
        return [str(i) for i in ids]
    names, offsets = dataset.array(f"{space}.names"), dataset.array(f"{space}.offsets")
    return [bytes(names[offsets[i] : offsets[i + 1]]).decode("utf-8") for i in ids]


def _ids(dataset: Dataset | None, space: str, names) -> list[int | None]:
    if dataset is None or not dataset.has(f"{space}.fingerprints"):
        raise DatasetError(f"this {space[:-1]} table has no names (its ids are its names)", hint="look names up in a graph imported from TSV files")
    prints = dataset.array(f"{space}.fingerprints")
    found = []
    for name in names:
        h1, h2 = fingerprint_of(name.encode("utf-8"))
        i = int(np.searchsorted(prints[:, 0], np.uint64(h1)))
        while i < len(prints) and int(prints[i, 0]) == h1 and int(prints[i, 1]) != h2:
            i += 1
        hit = i < len(prints) and int(prints[i, 0]) == h1 and _names(dataset, space, [i])[0] == name
        found.append(i if hit else None)
    return found


def data_root(config: DatasetConfig) -> Path:
    """The recipe's ``dataset.root``, else ``$DSA_DATA_ROOT``, else ``./datasets``."""
    return Path(config.root or os.environ.get("DSA_DATA_ROOT") or "datasets")


def import_target(config: DatasetConfig, slug: str, key: object) -> Path:
    """The folder a dataset is imported into: ``<data root>/imported/<slug>-<digest of key>``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return imports_root(data_root(config)) / f"{slug}-{digest}"


def load_knowledge_graph(config: DatasetConfig, *, progress: Progress | None = None, note=None) -> KnowledgeGraph:
    """Load the knowledge graph a recipe names, importing (or generating) it first if it has
    not been, or if its sources changed. Raises ``DatasetError``."""
    name, target, sources, write = _source(config, progress)
    sources = {**sources, "layout": LAYOUT}

    def build(writer: DatasetWriter) -> None:
        write(writer)

        def chunks():
            for split in SPLITS:
                yield from writer.blocks(split)

        if progress is not None:
            progress("building the filter index", 0, 1)
        write_triple_index(writer.path(FILTER_INDEX), chunks, writer.meta["num_entities"], writer.meta["num_relations"])
        if progress is not None:
            progress("building the filter index", 1, 1)

    dataset = import_folder(target, kind="kg", name=name, sources=sources, build=build, note=note)
    return KnowledgeGraph.of(dataset)


def _source(config: DatasetConfig, progress: Progress | None):
    """The dataset's name, import folder, sources, and the function that writes it."""
    if config.kind == "synthetic":
        from .synthetic import GENERATOR_VERSION, write_synthetic_knowledge_graph

        settings = asdict(config.synthetic)
        sources = {"generator": f"synthetic-{GENERATOR_VERSION}", "settings": settings}
        write = partial(write_synthetic_knowledge_graph, config=config.synthetic, progress=progress)
        return f"synthetic-{config.synthetic.entities}", import_target(config, "synthetic", sources), sources, write
    if config.kind == "tsv":
        from .tsv import tsv_files
        from .tsv_import import IMPORTER_VERSION, write_knowledge_graph

        folder = Path(config.path)
        folder = folder if folder.is_absolute() else data_root(config) / folder
        files = tsv_files(folder)
        sources = file_sources(files, importer=f"tsv-{IMPORTER_VERSION}")
        write = partial(write_knowledge_graph, files=files, progress=progress)
        return folder.name, import_target(config, f"tsv-{folder.name}", str(folder.resolve())), sources, write
    from .pyg import pyg_source

    name, files, write = pyg_source(config.kind, data_root(config))
    sources = file_sources(files, importer="pyg-1")
    return name, import_target(config, config.kind, config.kind), sources, write
