"""One rank of a ``torchrun`` job: its place in the run folder, its training, and the
checkpoints all ranks commit together.

::

    runs/<name>/                       on every machine (no shared file system needed)
      run.json, config.yaml            rank 0's machine: the run as a whole
      checkpoints.json                 rank 0's: the steps every rank has checkpointed
      ranks/<rank>-of-<world>/         one run folder per rank, on that rank's machine:
        run.json, config.yaml, metrics.jsonl, optimizer_state/, checkpoints/<step>/

A rank's folder is an ordinary run folder holding its shard (:mod:`~dsa_train.runs.run_folder`,
:mod:`~dsa_train.runs.checkpoint_store`). A checkpoint of the job is complete when ``checkpoints.json`` lists its
step: rank 0 adds it only after every rank has committed its own checkpoint of that step (a
barrier), by an atomic rewrite, so a job killed while checkpointing resumes from the step
before. ``--resume`` reads the newest listed step on rank 0 and every rank restores its own
checkpoint of exactly that step; at another number of ranks, the new ranks' folders are made
and filled from the old ranks' checkpoints (:mod:`.reshard`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.group import World, broadcast_bytes, broadcast_int
from ..errors import DsaError, StateError
from ..fsutil import atomic_write_bytes
from ..recipe import Recipe, parse_recipe, recipe_to_yaml
from .lifecycle import warn_differences
from .loop import Training, evaluate_run, resolve_device
from .reshard import reshard
from ..runs.run_folder import JOB_FORMAT, JOB_MANIFEST, RANKS, RunFolder, job_checkpoints, rank_folder_name

logger = logging.getLogger(__name__)
EVAL_TIMEOUT = 300.0  # seconds; an evaluation has no recipe until its rank folder is found


def train_rank(
    recipe: Recipe, world: World, *, output: Path | None, resume: bool, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[Training, RunFolder, dict]:
    """Join the job, train this rank's shard to the end, leave; returns the training, the
    job's run folder (on rank 0; elsewhere its path) and the summary. A resumed job trains
    the recipe its run folder saved (with ``overrides``), which rank 0 reads and sends to all."""
    device = resolve_device(recipe.train.device)
    world.join(recipe.distributed.backend, recipe.distributed.timeout, device)
    top: RunFolder | None = None
    try:
        refused: DsaError | None = None
        if world.is_leader:
            try:
                top = (
                    (RunFolder.find(output) if output else RunFolder.newest(recipe))
                    if resume
                    else RunFolder.create(recipe, output)
                )
                if resume:
                    top.lock()
            except DsaError as e:  # told to the others, so they stop with it instead of losing rank 0
                refused = e
        with world.guard("agreeing on the run folder"):
            path = Path(broadcast_bytes(str(top.path).encode() if top else b"").decode())
        if refused is not None:
            raise refused
        if not str(path) or str(path) == ".":
            raise DsaError(
                "rank 0 could not open the run folder (its error says why)",
                hint="fix what rank 0 reports and run again",
            )
        with world.guard("agreeing on the checkpoint to resume from"):
            step, saved_world = _newest_complete_step(path) if world.is_leader and resume else (-1, world.world_size)
            step, saved_world = broadcast_int(step), broadcast_int(saved_world)
            if resume:
                recipe = _saved_recipe(top, recipe, overrides) if world.is_leader else None
                recipe = parse_recipe(
                    broadcast_bytes(recipe_to_yaml(recipe).encode() if recipe else b"").decode(),
                    source=f"'{path}'s config.yaml",
                )
        resharding = step >= 0 and saved_world != world.world_size
        top = top or RunFolder(path)
        folder = path / RANKS / rank_folder_name(world.rank, world.world_size)
        if resume and step >= 0 and not resharding:
            rank_run = RunFolder.find(folder)
            rank_run.lock()
            rank_run.write_config(recipe)
        else:  # created locked
            rank_run = _fresh_rank_folder(recipe, folder, step) if resume else RunFolder.create(recipe, folder)
        try:
            if world.is_leader and world.world_size > recipe.distributed.slices:
                logger.warning(
                    f"warning: distributed.slices is {recipe.distributed.slices}, so ranks {recipe.distributed.slices}-{world.world_size - 1} "
                    f"compute nothing (they hold rows only); set distributed.slices to {world.world_size} or more for all "
                    "to compute (a new run: slices is part of what a run computes)"
                )
            training = Training(
                recipe,
                rank_run,
                world=world,
                commit=lambda step: _commit(world, path, step, recipe.train.keep_checkpoints),
            )
            try:
                if resharding:  # a fresh shard, filled from the old ranks' checkpoint
                    training.setup(resume=False)
                    old = [path / RANKS / rank_folder_name(k, saved_world) for k in range(saved_world)]
                    reshard(training, world, old, step)
                else:
                    training.setup(resume=resume and step >= 0, at_step=step if step >= 0 else None)
                summary = training.train()
                exchange = training.task.shards.exchange
                training.log(
                    {
                        "kind": "exchange",
                        "rank": world.rank,
                        "steps": training.step_count,
                        "sent_bytes": exchange.sent,
                        "received_bytes": exchange.received,
                    }
                )
                # (training traffic only, since this process started: evaluations are not counted)
            except BaseException:
                training.close(after_error=True)
                raise
            training.close()
        finally:
            rank_run.release()
    finally:
        if top is not None and world.is_leader:
            top.release()
        world.leave()
    return training, top, summary


def _saved_recipe(top: RunFolder, given: Recipe, overrides) -> Recipe:
    """The job's saved recipe with ``overrides``, as a resumed one-process run takes it; a
    note names what the given recipe would have changed."""
    saved = top.read_config(overrides)
    warn_differences(given, saved)
    top.write_config(saved)
    return saved


def _fresh_rank_folder(recipe: Recipe, folder: Path, step: int) -> RunFolder:
    """A rank folder made for a resumed job: one with no complete checkpoint starts afresh, and
    one resumed at another number of ranks fills it from the old ranks' checkpoint."""
    if folder.exists() and step >= 0 and (folder / RunFolder.MARKER).is_file() and not folder.is_symlink():
        # a rank folder of an earlier layout with this rank count: the checkpoint it holds is older
        # than the job's; kept, under another name, never removed
        earlier = RunFolder(folder)
        earlier.lock()  # a process still holding it stops us here, named
        try:
            folder.rename(
                folder.with_name(f"{folder.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
            )
        finally:
            earlier.release()
        return RunFolder.create(recipe, folder)
    if folder.exists():
        why = (
            "the job has no complete checkpoint to resume from"
            if step < 0
            else f"the job's checkpoint of step {step} was written by another number of ranks, so this one was left by an earlier attempt to resume"
        )
        raise StateError(
            f"'{folder}' already holds a rank's state, but {why}",
            hint="remove that folder (it holds no complete checkpoint of the job) and resume again"
            if step >= 0
            else "start the run again without --resume (into a new folder)",
        )
    return RunFolder.create(recipe, folder)


def _commit(world: World, top: Path, step: int, keep: int) -> None:
    """Every rank has written its checkpoint of ``step``: rank 0 lists it as complete (with
    the ``keep - 1`` before it, which every rank still holds)."""
    with world.guard(f"waiting for every rank's checkpoint of step {step}"):
        dist.barrier()
    if world.is_leader:
        listed = job_checkpoints(top)
        steps = sorted({*listed[1], step}) if listed is not None and listed[0] == world.world_size else [step]
        steps = steps[-keep:]
        record = {"format": JOB_FORMAT, "world_size": world.world_size, "complete": steps}
        atomic_write_bytes(top / JOB_MANIFEST, json.dumps(record, indent=2).encode())


def _newest_complete_step(top: Path) -> tuple[int, int]:
    """The newest step every rank has checkpointed (-1: none) and how many ranks there were."""
    listed = job_checkpoints(top)
    if listed is None:
        return -1, 0
    world, steps = listed
    return (steps[-1] if steps else -1), world


def evaluate_rank(top: Path, world: World, split: str, *, checkpoint: int | None, device: str | None):
    """This rank's part of scoring a job's checkpoint (every rank gets the same metrics)."""
    world.join("gloo", EVAL_TIMEOUT, torch.device("cpu"))  # rows travel on the host whatever scores them
    try:
        with world.guard("agreeing on the checkpoint to evaluate"):
            newest, saved_world = _newest_complete_step(top) if world.is_leader else (-1, 0)
            newest, saved_world = broadcast_int(newest), broadcast_int(saved_world)
        if saved_world != world.world_size:
            raise StateError(
                f"job '{top}' was checkpointed by {saved_world} ranks; this evaluation has {world.world_size}",
                hint=f"evaluate it with {saved_world} processes (dsa-train eval starts them when the job's folders are on this machine)",
            )
        step = checkpoint if checkpoint is not None else newest
        return evaluate_run(
            RunFolder.find(top / RANKS / rank_folder_name(world.rank, world.world_size)),
            split,
            checkpoint=step,
            device=device,
            world=world,
        )
    finally:
        world.leave()
