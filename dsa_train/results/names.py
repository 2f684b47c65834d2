"""The names of a task's table rows, and the rows of names: entities and relations by the
dataset's names (a reciprocal model's inverse relation ``r + R`` is ``inverse:<name>``), nodes
by their names where the graph has them (an edge list), else by their ids written as text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from ..train.partitioned import SlotTable
from .text_blobs import decimal, encoded

INVERSE = "inverse:"  # the name of relation r's inverse, row r + R of a reciprocal model's table


def task_tables(task, recipe) -> dict[str, nn.Module]:
    """A task's embedding tables by name: entities and relations, nodes, or a click model's
    features (hash buckets, named by their row)."""
    if recipe.is_kge:
        return {"entities": task.model.node_emb, "relations": task.model.rel_emb}
    if recipe.is_recsys:
        return {"features": task.model.table}
    return {"nodes": task.model.embedding}


def table_shape(module: nn.Module) -> tuple[int, int]:
    """``(rows, dim)`` of a table module (a partition-ordered run's slot table: its table's)."""
    module = module.table if isinstance(module, SlotTable) else module
    return module.num_embeddings, module.embedding_dim


class TableNames:
    """Names for the rows of ``tables`` (see :func:`task_tables`) of ``task``."""

    def __init__(self, task, recipe, tables: dict[str, nn.Module]) -> None:
        self.graph = task.kg if recipe.is_kge else None
        nodes = None if recipe.is_kge or recipe.is_recsys else getattr(task, "graph", None)
        self.nodes = nodes if nodes is not None and nodes.named else None  # else a node's id is its name
        self.rows = {name: table_shape(module)[0] for name, module in tables.items()}

    def names(self, table: str, ids: Sequence[int]) -> list[str]:
        ids = [int(i) for i in ids]
        if self.nodes is not None:
            return self.nodes.node_names(ids)
        if self.graph is None:
            return [str(i) for i in ids]
        if table == "entities":
            return self.graph.entity_names(ids)
        base = self.graph.num_relations  # rows past it: the inverse relations of a reciprocal model
        names = self.graph.relation_names([i % base for i in ids])
        return [INVERSE + name if i >= base else name for i, name in zip(ids, names)]

    def name_bytes(self, table: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """The names of rows ``[start, stop)`` as one UTF-8 ``(blob, offsets)``
        (:mod:`.text_blobs`): sliced from the dataset's stored names, or the ids written in
        decimal, without a Python string per row (relations, a small table, go by :meth:`names`)."""
        dataset, space = None, None
        if self.nodes is not None:
            dataset, space = self.nodes.dataset, "nodes"
        elif self.graph is not None and table == "entities":
            dataset, space = self.graph.dataset, "entities"
        elif self.graph is not None:
            return encoded(self.names(table, range(start, stop)))
        if dataset is not None and dataset.has(f"{space}.names"):
            offsets = np.asarray(dataset.array(f"{space}.offsets")[start : stop + 1], dtype=np.int64)
            return np.asarray(dataset.array(f"{space}.names")[offsets[0] : offsets[-1]]), offsets - offsets[0]
        return decimal(np.arange(start, stop))

    def lookup(self, table: str, names: Sequence[str]) -> list[int | None]:
        """The rows of ``names`` (``None`` for a name this table does not have)."""
        if self.nodes is not None:
            return self.nodes.node_ids([str(n) for n in names])
        if self.graph is None:
            return _numbered(names, self.rows[table])
        if table == "entities":
            return (
                self.graph.entity_ids([str(n) for n in names])
                if self._named(table)
                else _numbered(names, self.rows[table])
            )
        base = self.graph.num_relations
        inverse = [str(n).startswith(INVERSE) and self.rows[table] > base for n in names]
        bare = [str(n)[len(INVERSE) :] if flip else str(n) for n, flip in zip(names, inverse)]
        rows = self.graph.relation_ids(bare) if self._named(table) else _numbered(bare, base)
        return [None if row is None else row + base * flip for row, flip in zip(rows, inverse)]

    def _named(self, space: str) -> bool:
        """Whether the dataset holds names for ``space`` (a generated graph's ids are its names)."""
        dataset = self.graph.dataset
        return dataset is not None and dataset.has(f"{space}.fingerprints")


def _numbered(names: Sequence[str], rows: int) -> list[int | None]:
    """Rows named by their ids written as text."""
    return [int(n) if str(n).isdigit() and int(n) < rows else None for n in names]
