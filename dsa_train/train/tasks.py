"""What a training task gives the loop (see :mod:`.loop`), and the task a recipe asks for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from ..errors import DsaError
from ..memory import require_disk, require_memory
from ..recipe import Recipe

FLOAT_BYTES = 4  # tables, activations and scores are float32


@dataclass(frozen=True)
class TableSite:
    """Where a task's disk tables live (``model.embedding_storage: disk``), and whether it may
    write them (training) or only read them (evaluating a checkpoint)."""

    directory: Path
    writable: bool = True
    progress: Callable[[int, int], None] | None = None  # called while a new table is written
    # tables read another way, by file name (a checkpoint's version read through its deltas)
    versions: Mapping[str, Callable[[], nn.Module]] = field(default_factory=dict)


def disk_table(
    recipe: Recipe, site: TableSite | None, name: str, num_rows: int, *, std: float, first_row: int = 0, total_rows: int | None = None
) -> nn.Module | None:
    """The task's ``name`` table as a DiskEmbedding (created, seeded, if missing), or ``None``
    for ``embedding_storage: memory``. With ``total_rows``: a shard, rows ``[first_row, ...)``
    of a ``total_rows``-row table drawn from the seed."""
    if recipe.model.embedding_storage != "disk":
        return None
    if site is None:
        raise DsaError(
            f"recipe '{recipe.name}' keeps its tables on disk, but no folder for them was given",
            hint="train it with dsa-train run, which keeps them in the run folder's tables/",
        )
    from ..nn import DiskEmbedding

    if f"{name}.table" in site.versions:
        table = site.versions[f"{name}.table"]()
        if (table.num_embeddings, table.embedding_dim) != (num_rows, recipe.model.dim):
            raise DsaError(
                f"table '{name}' of '{site.directory}' is {table.num_embeddings:,} x {table.embedding_dim}, the recipe needs {num_rows:,} x {recipe.model.dim}",
                hint="evaluate a checkpoint with the recipe of the run that wrote it",
            )
        return table
    path = site.directory / f"{name}.table"
    if not site.writable and not path.exists():
        raise DsaError(f"table '{path}' is missing", hint="evaluate a checkpoint written by a run with these tables")
    return DiskEmbedding(
        num_rows, recipe.model.dim, path=path, std=std, seed=recipe.train.seed, writable=site.writable, progress=site.progress,
        first_row=first_row, total_rows=total_rows,
    )  # fmt: skip


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
    recipe: Recipe, device: torch.device, site: TableSite | None, *, table: str, rows: int, other: int,
    working: list[Working], other_what: str = "the other parameters", other_keys: str = "",
) -> None:  # fmt: skip
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
    hint = "lower " + " or ".join(lower) + (", or use optimizer.kind: dsa (its moments stay on disk)" if moments else "")
    shape = f"{rows:,} x {dim:,} float32"
    parts = [f"the {table} table ({shape})"] if not on_disk else []
    parts += ["SparseAdam's moments"] if moments else []
    parts += [other_what] if other else []
    if on_disk:
        buffers = 0
        if site is not None and site.writable and not (site.directory / f"{table}.table").exists():
            from ..optim.format import TABLE_LAYOUT, RowSpec

            file_bytes = RowSpec(table, (rows, dim), "float32", "", TABLE_LAYOUT).file_bytes
            require_disk(
                f"the {table} table file ({shape}, weights and Adam moments)", file_bytes, site.directory,
                key=keys_of(model__dim=dim), hint="lower model.dim, free space on that disk, or write the run (-o) to a bigger one",
            )  # fmt: skip
            buffers = (min(1 << 16, rows) + 3 * min(1 << 12, rows)) * dim * FLOAT_BYTES  # Table.create's chunks
        # The file's pages are the page cache's; the host holds the chunks a new file is written
        # from, then SparseAdam's moments (host tensors, as the weight is) and the other parameters.
        if buffers > moments:
            parts.insert(0, f"writing the {table} table file ({shape})")
        require_memory(" and ".join(parts) or "the parameters", max(buffers, moments) + other, key=", ".join(keys), hint=hint)
        resident = other if cuda else other + moments
    else:
        # nn.Embedding is built on the host, then moved to the device: the host holds it once.
        hint += ", or keep the table on disk with `model.embedding_storage: disk` (a memory-mapped file: only the rows a step touches take RAM)"
        host_parts = parts if not cuda else [p for p in parts if p != "SparseAdam's moments"]
        require_memory(" and ".join(host_parts), table_bytes + other + (0 if cuda else moments), key=", ".join(keys), hint=hint)
        resident = table_bytes + other + moments
        if cuda:
            require_memory(" and ".join(parts), resident, key=", ".join(keys), hint=hint, device=device)
    largest = max(working, key=lambda w: w.bytes, default=None)
    if largest is not None:
        require_memory(
            largest.what, largest.bytes, key=largest.keys, hint=largest.hint, device=device,
            reserved=resident, reserved_for="the tables and parameters",
        )  # fmt: skip


class Task(Protocol):
    """Data, model, batches, loss and metrics of one kind of training.

    An epoch is a shuffled pass over ``epoch_items()`` items (triples, nodes or edges,
    counted in ``unit``); ``loss(picked)`` turns a batch of item numbers into a loss, drawing
    any randomness from torch's global generator (which the loop seeds per step).
    ``prefetch(picked)`` is told the next batch before this one's step, to start reading the
    rows of its disk table that it will touch (called only with ``embedding_storage: disk``).
    A task that computes its gradients itself (a sharded one, whose backward involves other
    processes) has ``gradients(picked) -> float`` instead of ``loss``.
    """

    unit: str
    description: str
    model: nn.Module

    def sparse_parameters(self) -> list[tuple[str, Tensor]]: ...
    def prefetch(self, picked: Tensor) -> None: ...
    def dense_parameters(self) -> list[Tensor]: ...
    def epoch_items(self) -> int: ...
    def loss(self, picked: Tensor) -> Tensor: ...
    def evaluate(self, split: str, *, final: bool, reporter) -> dict[str, dict]: ...
    def headline(self, metrics: dict[str, dict]) -> str: ...


def make_task(
    recipe: Recipe, device: torch.device, tables: TableSite | None = None, *,
    progress: Callable[..., None] | None = None, note: Callable[[str], None] | None = None, world=None,
) -> Task:  # fmt: skip
    """The task for the recipe's model; builds its data and model (seed torch first).

    ``tables``: where disk tables live (needed with ``model.embedding_storage: disk``);
    ``progress(what, done, total)`` and ``note(text)`` hear how a dataset import goes;
    ``world``: this rank's place in a ``torchrun`` job (``None``: one process)."""
    if world is not None:
        if recipe.is_kge:
            from .sharded_kge import ShardedKGETask

            return ShardedKGETask(recipe, device, world, tables, progress=progress, note=note)
        if recipe.model.kind == "node2vec":
            from .sharded_node2vec import ShardedNode2VecTask

            return ShardedNode2VecTask(recipe, device, world, tables, progress=progress, note=note)
        raise DsaError(
            f"model.kind {recipe.model.kind!r} does not train over several processes yet; knowledge-graph models and node2vec do",
            hint="run it in one process (without torchrun)",
        )
    if recipe.is_kge:
        from .kge import KGETask

        return KGETask(recipe, device, tables, progress=progress, note=note)
    if recipe.model.kind == "node2vec":
        from .node2vec import Node2VecTask

        return Node2VecTask(recipe, device, tables, progress=progress, note=note)
    from .sage import SageTask

    return SageTask(recipe, device, tables, progress=progress, note=note)
