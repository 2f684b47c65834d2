"""A ``torchrun`` job's checkpoint, brought together in one process for reading.

A job's run folder holds one rank folder per process (``ranks/<r>-of-<w>/``), each with its
own checkpoints of its shard of the entity (node) table, and ``checkpoints.json`` with the steps
every rank checkpointed. Row ``id`` of the whole table lives on rank ``slot // B`` at local row
``slot % B``, ``slot`` being the id's place in the job's seeded permutation
(:class:`~dsa_train.distributed.sharding.RowSharding`); :class:`ShardedTable` reads rows by
global id from the ranks' checkpoint shards (memory shards from their ``model.pt``, disk shards
through their delta chains). The relation table is replicated: rank 0's copy is read.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from ..data import load_graph, load_knowledge_graph
from ..distributed.sharding import RowSharding
from ..errors import DsaError
from ..models import build_kge_model
from ..models.node import SkipGram
from ..recipe import Recipe
from ..runs.checkpoint_store import CheckpointStore
from ..runs.optimizer_state import load_tensors
from ..runs.run_folder import RANKS, RunFolder, job_checkpoints, rank_folder_name
from ..train.tables import TableSite, disk_table


class ShardedTable(nn.Module):
    """A table of ``sharding.num_rows`` rows whose rank ``r`` rows are ``shards[r]``: looked up
    by global id, read-only."""

    def __init__(self, sharding: RowSharding, shards: list[nn.Module], dim: int) -> None:
        super().__init__()
        self.sharding, self.shards = sharding, nn.ModuleList(shards)
        self.num_embeddings, self.embedding_dim = sharding.num_rows, dim

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.cpu().long()
        owner, local = self.sharding.locate(ids.reshape(-1))
        out = torch.empty((len(owner), self.embedding_dim))
        for rank, shard in enumerate(self.shards):
            here = owner == rank
            if bool(here.any()):
                out[here] = shard(local[here]).detach().cpu().float()
        return out.view(*ids.shape, self.embedding_dim)


def open_job(run: RunFolder, recipe: Recipe, checkpoint: int | None) -> tuple[list[Path], int, SimpleNamespace]:
    """The ranks' checkpoint folders of one complete step (the newest by default), the step,
    and a task-like object (``kg`` or ``graph``, ``model``) whose entity or node table is a
    :class:`ShardedTable` over them."""
    listed = job_checkpoints(run.path)
    if listed is None or not listed[1]:
        raise DsaError(
            f"'{run.path}' is a run over several processes without a complete checkpoint (its checkpoints.json lists none)",
            hint="train it to its first checkpoint (train.checkpoint_every) or to its end",
        )
    world, steps = listed
    step = steps[-1] if checkpoint is None else checkpoint
    if step not in steps:
        raise DsaError(
            f"step {step} is not a checkpoint every rank of '{run.path}' completed",
            hint=f"its complete steps: {', '.join(map(str, steps))}",
        )
    paths = []
    for rank in range(world):
        rank_run = RunFolder.find(run.path / RANKS / rank_folder_name(rank, world))
        path, _, _ = CheckpointStore(rank_run.checkpoints).find(step)  # a step asked for is never substituted
        paths.append(path)
    if recipe.is_kge:
        kg = load_knowledge_graph(recipe.dataset)
        table = _sharded(recipe, paths, "entities", "node_emb.weight", kg.num_entities)
        model = build_kge_model(recipe.model, kg.num_entities, kg.num_relations, table)
        rank_zero = load_tensors(CheckpointStore.get_model_file(paths[0]))
        with torch.no_grad():
            for name in model.replicated:  # the same on every rank
                getattr(model, name).weight.copy_(rank_zero[f"{name}.weight"])
        return paths, step, SimpleNamespace(kg=kg, model=model)
    if recipe.model.kind != "node2vec":
        raise DsaError(
            f"'{run.path}' trained {recipe.model.kind!r} over several processes, which open_run cannot read",
            hint="dsa-train eval scores it",
        )
    graph = load_graph(recipe.dataset)
    table = _sharded(recipe, paths, "nodes", "embedding.weight", graph.num_nodes)
    return paths, step, SimpleNamespace(graph=graph, model=SkipGram(graph.num_nodes, recipe.model.dim, embedding=table))


def _sharded(recipe: Recipe, paths: list[Path], name: str, key: str, num_rows: int) -> ShardedTable:
    sharding = RowSharding(num_rows, len(paths), recipe.train.seed)
    shards = []
    for rank, path in enumerate(paths):
        if recipe.model.embedding_storage == "disk":  # the rank's version: whole, or a chain of deltas
            site = TableSite(
                CheckpointStore.get_tables_dir(path), writable=False, versions=CheckpointStore.table_versions(path)
            )
            std = recipe.model.init_std if recipe.is_kge else recipe.model.node2vec.init_std
            shards.append(
                disk_table(
                    recipe,
                    site,
                    name,
                    sharding.rows_of(rank),
                    std=std,
                    first_row=rank * sharding.block,
                    total_rows=num_rows,
                )
            )
        else:
            shards.append(
                nn.Embedding.from_pretrained(load_tensors(CheckpointStore.get_model_file(path))[key], freeze=True)
            )
    return ShardedTable(sharding, shards, recipe.model.dim)
