"""Warm start (``model.init_from``): a new run's rows begin as a finished run's, matched by name.

For each table of the new run (entities, relations or nodes) and each of its rows, in storage
order a chunk at a time: the row's name (an entity's or a relation's name; a node's id) is
looked up in the finished run, and a row found there is copied, bit for bit, from that run's
newest intact checkpoint. Rows the finished run did not have keep what the recipe drew for
them. Adam's moments start at zero: a step of the new run is a first step for every row.
A disk table is written through, a chunk at a time, so a table larger than RAM is carried
over in bounded memory.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import DsaError
from ..train.partitioned import SlotTable
from .names import TableNames, table_shape, task_tables
from .reader import CHUNK_ROWS, open_run

logger = logging.getLogger(__name__)


def carry_over(task, recipe) -> dict[str, dict[str, int]]:
    """Copy into ``task``'s tables the rows of the run ``recipe.model.init_from`` that share
    their names; returns ``{table: {"carried": n, "new": m}}``."""
    source = open_run(recipe.model.init_from)  # its warnings are logged as it opens
    if (source.kind, source.recipe.model.dim) != (recipe.model.kind, recipe.model.dim):
        raise DsaError(
            f"model.init_from: '{source.run.path}' trained {source.kind} with dim {source.recipe.model.dim}, "
            f"this recipe asks for {recipe.model.kind} with dim {recipe.model.dim}",
            hint="start from a run of the same model.kind and model.dim, or leave out model.init_from",
        )
    tables = task_tables(task, recipe)
    names = TableNames(task, recipe, tables)
    counts = {}
    for table, module in tables.items():
        rows = table_shape(module)[0]
        carried = 0
        if table in source.tables:
            for start in range(0, rows, CHUNK_ROWS):
                carried += _carry_chunk(source, table, module, names, start, min(start + CHUNK_ROWS, rows))
        counts[table] = {"carried": carried, "new": rows - carried}
    parts = [f"{table} {c['carried']:,} carried over, {c['new']:,} new" for table, c in counts.items()]
    logger.info(
        f"init_from {source.run.path} (checkpoint {source.step}): {'; '.join(parts)}; Adam's moments start at zero"
    )
    return counts


def _carry_chunk(source, table: str, module: nn.Module, names: TableNames, start: int, stop: int) -> int:
    """Rows stored at ``[start, stop)`` of ``module``: those ``source`` has, copied in."""
    positions = torch.arange(start, stop)
    storage = module
    if isinstance(module, SlotTable):  # stored by slot: the ids living at these slots
        ids, storage = module.partitions.ids(positions), module.table
    else:
        ids = positions
    found = source.lookup(table, names.names(table, ids.tolist()))
    hit = torch.tensor([i for i, row in enumerate(found) if row is not None], dtype=torch.long)
    if not len(hit):
        return 0
    old = source.gather(table, torch.tensor([found[i] for i in hit.tolist()]))
    with torch.no_grad():
        weight = storage.weight
        weight[positions[hit].to(weight.device)] = old.to(weight.device, weight.dtype)
    if hasattr(storage, "table"):  # a DiskEmbedding: to its file, so memory holds one chunk
        storage.table.rows.write_out_rows(start, stop)
    return len(hit)
