"""Resuming a ``torchrun`` job at another number of ranks: the rows of a checkpoint written by
``W0`` ranks, moved to their owners among ``W`` ranks, in chunks, over the process group.

Each old rank's checkpoint of the step is read by one new rank that sees it on its own disk
(the lowest such rank; on one machine, or with the old folders copied to the machines that
read them): it verifies the checkpoint (every file's digest), then streams its entity rows,
``CHUNK_ROWS`` at a time, as ``(new local row, weights, m, v)`` to their new owners with
``all_to_all_single`` (every rank joins every round, sending nothing once it is done). No rank
holds more than its old shards' weights and one chunk of moments at once, and the moments are
never gathered anywhere. The relation table, the same on every old rank, and the trainer state
(step, epoch, position in the epoch, the loss windows) come from old rank 0's checkpoint,
broadcast by its reader. Old rank 0's metrics log, up to the checkpoint, becomes new rank 0's.

Weights and moments are copied as they are (float32 and back, never rounded), and the
steps after the resume depend on the step number alone, so a job resumed at any number of
ranks ends bit-equal to one that never stopped. Then every rank checkpoints the step at once,
so the job's ``checkpoints.json`` names the new number of ranks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.group import World, broadcast_bytes
from ..distributed.sharding import RowSharding
from ..errors import StateError
from ..optim import DiskSparseAdam
from ..storage.inspect import StateInspector
from ..nn import DiskEmbedding
from ..runs.checkpoint_store import CheckpointStore
from ..runs.optimizer_state import STATE_COPY, load_tensors
from ..runs.run_folder import MetricsLog, RunFolder

logger = logging.getLogger(__name__)

CHUNK_ROWS = 1 << 16


def reshard(training, world: World, old_folders: list[Path], step: int) -> None:
    """Fill ``training`` (set up afresh: this rank's new shard and optimizer) with the job's
    checkpoint of ``step`` written by ``len(old_folders)`` ranks; then checkpoint it."""
    optimizer = training.optimizer
    if not isinstance(optimizer, DiskSparseAdam):
        raise StateError(
            "resuming at another number of ranks moves DiskSparseAdam's state; this run trains with torch's SparseAdam",
            hint=f"resume it with the {len(old_folders)} ranks it was checkpointed by",
        )
    stores = [CheckpointStore.of_run(folder) for folder in old_folders]
    checkpoints = [store.get_checkpoint_dir(step) for store in stores]
    readers = _readers(world, checkpoints)
    shards = training.task.shards
    named = dict(training.task.model.named_parameters())
    sharded = next(name for name, p in named.items() if p is shards.table.weight)
    replicated = {name: p for name, p in named.items() if name != sharded}  # the same on every rank
    old = RowSharding(shards.sharding.num_rows, len(old_folders), training.recipe.train.seed)
    mine = [k for k, reader in enumerate(readers) if reader == world.rank]
    for k in mine:
        stores[k].verify(checkpoints[k])
    trainer_text = CheckpointStore.get_trainer_file(checkpoints[0]).read_text() if readers[0] == world.rank else ""
    with world.guard(f"resharding the checkpoint of step {step}"):
        trainer = json.loads(broadcast_bytes(trainer_text.encode(), readers[0]).decode())
        steps = _broadcast_steps(checkpoints[0], readers[0], world, list(named))
        for name, param in replicated.items():
            _copy_replicated(checkpoints[0], readers[0], world, name, param, optimizer, steps[name])
        _copy_shard(checkpoints, mine, old, shards, sharded, optimizer, steps[sharded])
    training.step_count, training.epoch, training.batch = trainer["step"], trainer["epoch"], trainer["batch"]
    training.window, training.epoch_loss, training.optimizer_ram = (
        trainer["window"],
        trainer["epoch_loss"],
        trainer["optimizer_ram"],
    )
    if world.is_leader:
        _copy_metrics(old_folders[0], training, trainer["metrics_records"])
    logger.info(f"resharded step {step} from {len(old_folders)} ranks to {world.world_size}")
    training.save_checkpoint()


def _readers(world: World, checkpoints: list[Path]) -> list[int]:
    """For each old rank's checkpoint, the lowest new rank that has it on its disk."""
    seen = torch.tensor([CheckpointStore.get_trainer_file(c).is_file() for c in checkpoints], dtype=torch.uint8)
    everyone = [torch.empty_like(seen) for _ in range(world.world_size)]
    with world.guard("finding the old ranks' checkpoints"):
        dist.all_gather(everyone, seen)
    readers = []
    for k, checkpoint in enumerate(checkpoints):
        having = [r for r, s in enumerate(everyone) if s[k]]
        if not having:
            raise StateError(
                f"no rank of this job sees '{checkpoint}', old rank {k}'s checkpoint",
                hint="resume on the machines that hold the old ranks' folders, or copy the folder to one of them",
            )
        readers.append(having[0])
    return readers


def _broadcast_steps(checkpoint: Path, source: int, world: World, names: list[str]) -> dict[str, int]:
    """The optimizer's step counter of each table at the checkpoint (every old rank's are equal)."""
    text = b""
    if world.rank == source:
        params = StateInspector(checkpoint / STATE_COPY, checkpoint=checkpoint).params
        text = json.dumps({name: params[name]["step"] for name in names}).encode()
    return json.loads(broadcast_bytes(text, source).decode())


def _moments(checkpoint: Path, name: str, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """``m`` and ``v`` of rows ``[start, stop)`` of ``name`` in a checkpoint's optimizer state,
    read through its chain of deltas, as float32 (the values as stored: float32, or bfloat16
    and a row-wise v, which float32 holds exactly)."""
    if stop <= start:
        return torch.empty(0), torch.empty(0)
    parts = list(StateInspector(checkpoint / STATE_COPY, checkpoint=checkpoint).iter_rows(name, [(start, stop)]))
    as_tensor = lambda arrays: torch.from_numpy(np.ascontiguousarray(np.concatenate(arrays), dtype=np.float32))  # noqa: E731
    return as_tensor([m for _, m, _ in parts]), as_tensor([v for _, _, v in parts])


def _copy_replicated(
    checkpoint: Path, source: int, world: World, name: str, weight: Tensor, optimizer: DiskSparseAdam, step: int
) -> None:
    """A replicated table (relations) and its moments, from old rank 0's checkpoint to every rank."""
    rows = len(weight)
    if world.rank == source:
        values = load_tensors(CheckpointStore.get_model_file(checkpoint))[name].to(torch.float32)
        m, v = _moments(checkpoint, name, 0, rows)
        packed = torch.cat([values, m, v], dim=1).contiguous()
    else:
        packed = torch.empty((rows, 3 * weight.shape[1]))
    dist.broadcast(packed, source)
    values, m, v = packed.chunk(3, dim=1)
    with torch.no_grad():
        weight.copy_(values.to(weight.device))
    optimizer.load_rows(weight, torch.arange(rows), m, v, step=step)


def _copy_shard(
    checkpoints: list[Path], mine: list[int], old: RowSharding, shards, name: str, optimizer: DiskSparseAdam, step: int
) -> None:
    """Stream the old shards this rank reads to the rows' new owners, one chunk a round."""
    weight = shards.table.weight
    dim = weight.shape[1]
    chunks = [(k, a, min(a + CHUNK_ROWS, old.rows_of(k))) for k in mine for a in range(0, old.rows_of(k), CHUNK_ROWS)]
    rounds = torch.tensor([len(chunks)])
    dist.all_reduce(rounds, dist.ReduceOp.MAX)
    reading: OldShard | None = None
    optimizer.load_rows(
        weight, torch.empty(0, dtype=torch.int64), torch.empty((0, dim)), torch.empty((0, dim)), step=step
    )
    for i in range(int(rounds)):
        if i < len(chunks):
            k, a, b = chunks[i]
            if reading is None or reading.checkpoint != checkpoints[k]:  # one old shard at a time
                if reading is not None:
                    reading.close()
                reading = OldShard(checkpoints[k], name, f"{shards.name}.table", old.rows_of(k), dim)
            ids = old.ids_of(k, torch.arange(a, b))
            m, v = _moments(checkpoints[k], name, a, b)
            payload = torch.cat([reading.weights(a, b), m, v], dim=1)
            if i == len(chunks) - 1:
                reading.close()
        else:
            ids, payload = torch.empty(0, dtype=torch.int64), torch.empty((0, 3 * dim))
        owners, local = shards.sharding.locate(ids)
        local, payload = _to_owners(owners, local, payload, shards.sharding.world_size)
        values, m, v = payload.chunk(3, dim=1)
        with torch.no_grad():
            weight[local.to(weight.device)] = values.to(weight.device)
        optimizer.load_rows(weight, local, m, v, step=step)


class OldShard:
    """The entity weights of an old rank's checkpoint, read a range of rows at a time: a memory
    table's from ``model.pt`` (loaded once: it was that rank's memory), a disk table's through
    the checkpoint's version of its file (a copy, or a chain of deltas on its base)."""

    def __init__(self, checkpoint: Path, name: str, file: str, rows: int, dim: int) -> None:
        self.checkpoint = checkpoint
        saved = load_tensors(CheckpointStore.get_model_file(checkpoint)).get(name)
        self.table = None
        if isinstance(saved, Tensor) and saved.shape == (rows, dim):
            self.rows = saved
            return
        versions = CheckpointStore.table_versions(checkpoint)  # a DiskEmbedding's entry is a reference to its file
        tables = CheckpointStore.get_tables_dir(checkpoint)
        self.table = (
            versions[file]() if file in versions else DiskEmbedding(rows, dim, path=tables / file, writable=False)
        )
        self.rows = self.table.weight

    def weights(self, start: int, stop: int) -> Tensor:
        values = self.rows.range(start, stop) if hasattr(self.rows, "range") else self.rows[start:stop]
        return values.to(torch.float32).clone()

    def close(self) -> None:
        if self.table is not None:
            (self.table.table if isinstance(self.table, DiskEmbedding) else self.table).close()
            self.table = None


def _to_owners(owners: Tensor, local: Tensor, payload: Tensor, world_size: int) -> tuple[Tensor, Tensor]:
    """Send each row (its new local index and its payload) to its owner; returns what came here."""
    order = torch.argsort(owners, stable=True)
    send = torch.bincount(owners, minlength=world_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    got_local = torch.empty(sum(recv_counts), dtype=torch.int64)
    dist.all_to_all_single(got_local, local[order].contiguous(), recv_counts, send_counts)
    got = payload.new_empty((sum(recv_counts), payload.shape[1]))
    dist.all_to_all_single(got, payload[order].contiguous(), recv_counts, send_counts)
    return got_local, got


def _copy_metrics(old_rank0: Path, training, records: int) -> None:
    """Old rank 0's metrics records up to the checkpoint open new rank 0's log."""
    path = RunFolder(old_rank0).metrics_path
    if not path.is_file():
        logger.warning(f"warning: '{path}' is not on this machine: the new metrics log starts at the checkpoint")
        return
    for record in MetricsLog.read(path)[:records]:
        training.metrics.log(record)
