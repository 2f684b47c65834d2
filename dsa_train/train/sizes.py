"""Sizes checked before a task allocates anything: its table, its other parameters and the
largest working set of a step, against the memory (and disk) there is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import require_disk, require_memory
from ..storage.format import TABLE_LAYOUT, RowSpec
from ..recipe import Recipe
from .tables import TableSite

FLOAT_BYTES = 4  # tables, activations and scores are float32


@dataclass(frozen=True)
class Working:
    """Memory that one step (or one evaluation batch) holds at once besides the tables: a
    conservative estimate from the recipe's sizes, made once when the task is set up."""

    what: str  # e.g. "one training step (1,024 queries x 2,304 candidates)"
    bytes: int
    keys: str  # the recipe settings that size it, as "key=value, key=value"
    hint: str  # how to make it smaller


def keys_of(**settings) -> str:
    """``keys_of(train__batch_size=512)`` -> ``"train.batch_size=512"``."""
    return ", ".join(f"{key.replace('__', '.')}={value}" for key, value in settings.items())


def check_sizes(
    recipe: Recipe,
    device: torch.device,
    site: TableSite | None,
    *,
    table: str,
    rows: int,
    other: int,
    working: list[Working],
    other_what: str = "the other parameters",
    other_keys: str = "",
) -> None:
    """Refuse, before anything big is allocated, sizes that cannot fit: the ``table`` of
    ``rows x model.dim`` floats (in memory, or its file on disk), ``other`` bytes of further
    parameters with their gradients and optimizer state (``other_what``, sized by
    ``model.dim`` and ``other_keys``), and the largest ``working`` set on top of what stays
    resident. Each refusal is a DsaError naming the keys, the bytes needed and the bytes
    available (see :func:`dsa_train.memory.require_memory`)."""
    dim, on_disk, cuda = recipe.model.dim, recipe.model.embedding_storage == "disk", device.type == "cuda"
    table_bytes = rows * dim * FLOAT_BYTES
    moments = 2 * table_bytes if recipe.optimizer.kind == "sparse_adam" else 0  # torch's SparseAdam: dense m and v
    keys, lower = [keys_of(model__dim=dim)], ["model.dim"]
    if other and other_keys:
        keys.append(other_keys)
        lower.append(other_keys.split("=")[0])
    if moments:
        keys.append("optimizer.kind=sparse_adam")
    hint = (
        "lower " + " or ".join(lower) + (", or use optimizer.kind: dsa (its moments stay on disk)" if moments else "")
    )
    shape = f"{rows:,} x {dim:,} float32"
    parts = [f"the {table} table ({shape})"] if not on_disk else []
    parts += ["SparseAdam's moments"] if moments else []
    parts += [other_what] if other else []
    if on_disk:
        buffers = 0
        if site is not None and site.writable and not (site.directory / f"{table}.table").exists():
            file_bytes = RowSpec(table, (rows, dim), "float32", "", TABLE_LAYOUT).file_bytes
            require_disk(
                f"the {table} table file ({shape}, weights and Adam moments)",
                file_bytes,
                site.directory,
                key=keys_of(model__dim=dim),
                hint="lower model.dim, free space on that disk, or write the run (-o) to a bigger one",
            )
            buffers = (min(1 << 16, rows) + 3 * min(1 << 12, rows)) * dim * FLOAT_BYTES  # Table.create's chunks
        # The file's pages are the page cache's; the host holds the chunks a new file is written
        # from and the other parameters (a recipe never pairs a disk table with SparseAdam's
        # moments: Recipe.problems refuses it).
        if buffers:
            parts.insert(0, f"writing the {table} table file ({shape})")
        require_memory(" and ".join(parts) or "the parameters", buffers + other, key=", ".join(keys), hint=hint)
        resident = other
    else:
        # nn.Embedding is built on the host, then moved to the device: the host holds it once.
        hint += ", or keep the table on disk with `model.embedding_storage: disk` (a memory-mapped file: only the rows a step touches take RAM)"
        host_parts = parts if not cuda else [p for p in parts if p != "SparseAdam's moments"]
        require_memory(
            " and ".join(host_parts), table_bytes + other + (0 if cuda else moments), key=", ".join(keys), hint=hint
        )
        resident = table_bytes + other + moments
        if cuda:
            require_memory(" and ".join(parts), resident, key=", ".join(keys), hint=hint, device=device)
    largest = max(working, key=lambda w: w.bytes, default=None)
    if largest is not None:
        require_memory(
            largest.what,
            largest.bytes,
            key=largest.keys,
            hint=largest.hint,
            device=device,
            reserved=resident,
            reserved_for="the tables and parameters",
        )
