"""The training loop, for every task: a recipe in, a run folder out.

Read it top to bottom: :meth:`Training.setup` builds the task (data and model) and the
optimizers, or restores them from the newest intact checkpoint; :meth:`Training.train` runs
the epochs; :meth:`Training.step` is one optimizer step; :meth:`Training.evaluate` scores a
split; :meth:`Training.save_checkpoint` commits a checkpoint; :meth:`Training.close` releases
everything. What is particular to knowledge graphs, node2vec or GraphSAGE lives in a task
object (see :mod:`.tasks`): its data, model, batches, loss and metrics. The loop is one, with
no subclasses.

Determinism: the item order of epoch ``e`` is a shuffle seeded with ``(seed, e)`` and computed
batch by batch (:class:`~dsa_train.data.order.Shuffle`: no permutation of all items in RAM),
and each step reseeds torch from ``(seed, step)`` before the task draws its negatives, walks
or dropout masks. A resumed run therefore replays exactly what an uninterrupted one does,
without storing any random state.

Optimizers: the task's sparse embedding tables train with the recipe's optimizer
(DiskSparseAdam or torch's SparseAdam); its dense weights, if any (GraphSAGE's layers), with
torch's Adam at ``optimizer.dense_lr``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import progress
from ..errors import DsaError
from ..fsutil import allocated_bytes
from ..memory import peak_rss_bytes
from ..recipe import Recipe, with_data_root
from ..runs.checkpoint_store import CheckpointStore
from ..runs.optimizer_state import (
    build_optimizer,
    close_optimizer,
    flush_optimizer,
    load_optimizer_state,
    load_tensors,
    restore_state_dir,
)
from ..runs.run_folder import MetricsLog, RunFolder
from .callbacks import Callback, default_callbacks, named_callbacks
from .seeding import seed_step, step_seed
from .tables import TableSite
from .task import Task
from .tasks import make_task

if TYPE_CHECKING:
    from .tensorboard import TensorBoardLog

MiB = 1 << 20
DENSE_STATE = "dense_optimizer.pt"
TENSORBOARD = "tensorboard"  # output.tensorboard: the event files, beside metrics.jsonl
logger = logging.getLogger(__name__)


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise DsaError(
            "device 'cuda' was asked for, but torch sees no CUDA device",
            hint="use --device cpu (or auto), or install a CUDA build of torch",
        )
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


class Training:
    def __init__(
        self,
        recipe: Recipe,
        run: RunFolder,
        *,
        world=None,
        warm_start=None,
        callbacks: list[Callback] | None = None,
        commit: Callable[[int], None] | None = None,
    ) -> None:
        self.recipe = recipe
        #: the extras around the loop, their hooks called in order (:mod:`.callbacks`)
        self.callbacks = (default_callbacks() if callbacks is None else list(callbacks)) + named_callbacks(
            recipe.output.callbacks
        )
        #: ``warm_start(task, recipe) -> {table: {"carried", "new"}}``: a fresh run's rows
        #: from a finished run's (``model.init_from``; results.warm_start.carry_over)
        self.warm_start = warm_start
        self.warm_started: dict | None = None
        self.world = world  # this rank's place in a torchrun job (distributed.group.World), or None
        #: called with the step after each checkpoint (a torchrun job lists it in its manifest)
        self.commit = commit
        self.interrupted = (
            False  # Ctrl-C during train(): stop after the step, with a checkpoint (callbacks.CheckpointOnInterrupt)
        )
        self.run = run
        self.store = CheckpointStore(run.checkpoints)  # its checkpoints: saved, found, verified, restored, pruned
        self.device = resolve_device(recipe.train.device)
        self.step_count = 0  # optimizer steps done
        self._froze = False  # setup() froze the objects alive then (see there)
        self.epoch = 0  # epochs fully done
        self.batch = 0  # batches done in the current epoch
        self.window = [0.0, 0]  # loss sum and steps since the last train log record
        self.window_pace = [0.0, 0]  # step seconds and items since then: a machine figure, never checkpointed
        self.epoch_loss = [0.0, 0]  # loss sum and steps of the current epoch
        self.optimizer_ram = 0  # largest RssAnon growth across one sparse optimizer step
        self.dense_optimizer: torch.optim.Optimizer | None = None
        self.task: Task | None = None  # setup() builds it
        self.optimizer: torch.optim.Optimizer | None = None  # setup() builds it (the sparse tables')
        self.metrics: MetricsLog | TensorBoardLog | None = None  # setup() opens it
        self.last_eval: dict | None = None  # the record of the newest evaluation (callbacks read it)
        #: the best evaluation during training so far, ``{"step", "epoch", "metric", "value"}``
        #: (eval.select_best, eval.patience; callbacks.BestEvaluation keeps it), and the
        #: evaluations since it that were no better
        self.best: dict | None = None
        self.stale = 0
        #: optimizer.schedule plateau: the rate's factor, the best evaluation and the count since
        #: it (schedule.plateau_update)
        self.plateau: dict = {"factor": 1.0, "best": None, "bad": 0}
        #: set by a callback to end training after this epoch (why, in words)
        self.stop_reason: str | None = None

    # -- setup ----------------------------------------------------------------------------
    def setup(self, *, resume: bool, at_step: int | None = None) -> None:
        """Build the task and optimizers, or restore them from the newest intact checkpoint
        (``at_step``: from that step's, as every rank of a torchrun job does)."""
        recipe = self.recipe
        state_dir, tables = self.run.state_dir(recipe), self.run.tables_dir
        checkpoint, trainer = None, {}
        if resume and self.store.complete():
            checkpoint, trainer, damaged = self.store.find(at_step)
            for warning in damaged:
                logger.warning(f"warning: {warning}")
        if not resume:
            for folder, what in ((state_dir, "optimizer state directory"), (tables, "table folder")):
                if folder.exists() and any(folder.iterdir()):
                    raise DsaError(
                        f"{what} '{folder}' already holds state",
                        hint="pass --resume to continue that run, or point optimizer.state_dir elsewhere",
                    )
        else:  # what is there came after the checkpoint: back to the checkpoint's copies
            if checkpoint is not None:
                _check_trainer_state(checkpoint, trainer, self.run.run_id)
            self.store.restore_tables(checkpoint, tables)
            restore_state_dir(checkpoint, state_dir, owned={self.run.marker.get("state_id")})
        if self.world is not None and (
            recipe.eval.select_best or recipe.eval.patience or recipe.optimizer.schedule == "plateau"
        ):
            raise DsaError(
                "eval.select_best, eval.patience and optimizer.schedule plateau follow a run's evaluations in one "
                "process; a torchrun job cannot yet",
                hint="leave them out of a torchrun job's recipe",
            )
        torch.manual_seed(recipe.train.seed)
        site = TableSite(tables)
        self.task = make_task(recipe, self.device, site, world=self.world)
        logger.info(self.task.description)
        if checkpoint is None and recipe.model.init_from:
            if self.warm_start is None or self.world is not None:
                raise DsaError(
                    "model.init_from starts a run in one process from `dsa-train run`; a torchrun job cannot yet",
                    hint="train the first run's successor in one process, or leave out model.init_from",
                )
            self.warm_started = self.warm_start(self.task, recipe)
        if checkpoint is not None:
            self.store.load_model(checkpoint, self.task.model)
            self.step_count, self.epoch, self.batch = trainer["step"], trainer["epoch"], trainer["batch"]
            self.window, self.epoch_loss = trainer["window"], trainer["epoch_loss"]
            self.optimizer_ram = trainer["optimizer_ram"]
            self.best, self.stale = trainer.get("best"), trainer.get("stale", 0)
            self.plateau = trainer.get("plateau", self.plateau)
            MetricsLog.truncate(self.run.metrics_path, trainer["metrics_records"])
            logger.info(f"resuming from {checkpoint} (step {self.step_count}, epoch {self.epoch + 1})")
        elif resume:
            MetricsLog.truncate(self.run.metrics_path, 0)
            logger.info(f"{self.run.path} has no checkpoint yet: starting it from the beginning")
        self.optimizer = build_optimizer(recipe.optimizer, self.task.sparse_parameters(), state_dir)
        self.run.record_state_id(getattr(self.optimizer, "state_id", None), state_dir)
        logger.info(f"checkpoints: {self.store.mode(self.optimizer)}")
        dense = self.task.dense_parameters()
        if dense:
            self.dense_optimizer = torch.optim.Adam(dense, lr=recipe.optimizer.dense_lr)
        if checkpoint is None:
            if self.warm_started is None:  # its tables and row files as made: checkpoints start as deltas on them
                self.store.count_from_creation(
                    self.optimizer
                )  # (a warm start wrote rows no delta would hold: bases first)
        else:
            load_optimizer_state(self.optimizer, checkpoint, recipe.optimizer)
            self.store.count_from_checkpoint(self.optimizer, checkpoint, trainer)
            if hasattr(self.optimizer, "skipped_steps"):
                self.optimizer.skipped_steps = trainer["skipped_steps"]
            if self.dense_optimizer is not None:
                self.dense_optimizer.load_state_dict(load_tensors(checkpoint / DENSE_STATE))
                for group in self.dense_optimizer.param_groups:  # the recipe's, as for the sparse optimizer
                    group["lr"] = recipe.optimizer.dense_lr
        self.items_per_epoch = self.task.epoch_items()
        self.steps_per_epoch = math.ceil(self.items_per_epoch / recipe.train.batch_size)
        self.metrics = MetricsLog(self.run.metrics_path)
        if recipe.output.tensorboard:  # a copy of each record for TensorBoard; metrics.jsonl stays the record
            from .tensorboard import TensorBoardLog

            self.metrics = TensorBoardLog(
                self.metrics, self.run.path / TENSORBOARD, purge_step=self.step_count if checkpoint else None
            )
        # torch's import alone leaves ~300,000 objects for Python's cycle collector, and a
        # full collection walks them all (~130 ms here), every few dozen steps: measured at
        # 13-18% of a small recipe's training time. What exists now lives as long as the run,
        # so the collector leaves it alone until close().
        gc.collect()
        gc.freeze()
        self._froze = True

    def log(self, record: dict) -> None:
        """Add ``record`` to metrics.jsonl and tell the callbacks (their ``logged`` hook)."""
        self.metrics.log(record)
        for callback in self.callbacks:
            callback.logged(self, record)

    # -- training -------------------------------------------------------------------------
    def train(self) -> dict:
        """Run the remaining epochs, the final checkpoint and evaluation; returns the summary.

        Ctrl-C (SIGINT) ends the step under way, writes a checkpoint and raises
        ``KeyboardInterrupt`` (:class:`~.callbacks.CheckpointOnInterrupt`)."""
        with contextlib.ExitStack() as running:
            for callback in self.callbacks:
                running.enter_context(callback.running(self))
            summary = self._train()
        for callback in self.callbacks:
            callback.train_done(self, summary)
        self.log(summary)
        return summary

    def _train(self) -> dict:
        cfg = self.recipe.train
        items, steps_per_epoch = self.items_per_epoch, self.steps_per_epoch
        prefetch = self.recipe.model.embedding_storage == "disk"
        started = time.perf_counter()
        while self.epoch < cfg.epochs and not self._step_limit_reached() and not self.stopped_early:
            seed = step_seed(cfg.seed, -1 - self.epoch)
            # computed per batch: no O(items) permutation; a partitioned task orders its buckets
            order = self.task.epoch_order(seed, items)
            for callback in self.callbacks:
                callback.epoch_start(self, steps_per_epoch)
            epoch_started, epoch_items, upcoming = time.perf_counter(), 0, None
            while self.batch < steps_per_epoch and not self._step_limit_reached():
                picked = (
                    upcoming
                    if upcoming is not None
                    else order.slice(self.batch * cfg.batch_size, (self.batch + 1) * cfg.batch_size)
                )
                upcoming = order.slice((self.batch + 1) * cfg.batch_size, (self.batch + 2) * cfg.batch_size)
                if prefetch and len(upcoming):  # its rows are read in the background while this step computes
                    self.task.prefetch(upcoming)
                step_started = time.perf_counter()
                loss = self.step(picked)
                self.batch += 1
                epoch_items += len(picked)
                step_seconds = time.perf_counter() - step_started
                rate = len(picked) / max(step_seconds, 1e-9)
                self._account(loss, len(picked), step_seconds)
                for callback in self.callbacks:
                    callback.step_done(self, loss, rate)
            if self.batch < steps_per_epoch:  # stopped by max_steps inside the epoch
                break
            seconds = time.perf_counter() - epoch_started
            record = {
                "kind": "epoch",
                "epoch": self.epoch + 1,
                "step": self.step_count,
                "loss": self.epoch_loss[0] / max(self.epoch_loss[1], 1),
                "seconds": round(seconds, 3),
                "items_per_s": round(epoch_items / max(seconds, 1e-9), 1),
                "unit": self.task.unit,
            }
            self.log(record)
            self.epoch, self.batch, self.epoch_loss = self.epoch + 1, 0, [0.0, 0]
            for callback in self.callbacks:
                callback.epoch_done(self, record)
            if self.stopped_early:
                logger.info(
                    f"stopping early: {self.stale} evaluations without a better {self.best['metric']} than "
                    f"{self.best['value']:.4f} (epoch {self.best['epoch']}; eval.patience {self.recipe.eval.patience})"
                )
                break
            if self.stop_reason:
                logger.info(f"stopping after epoch {self.epoch}: {self.stop_reason}")
                break
        if cfg.final_checkpoint:
            self.checkpoint_unless_saved()
        chosen = self.best["step"] if self.recipe.eval.select_best and self.best is not None else self.step_count
        if chosen == self.step_count:
            final = {split: self.evaluate(split, final=True) for split in self.recipe.eval.final_splits}
        else:
            final = self.evaluate_checkpoint(self.recipe.eval.final_splits, chosen)
        self.final_metrics = final
        flush_optimizer(self.optimizer)  # the live files as the run leaves them, for their sizes below
        summary = {
            "kind": "summary",
            "step": self.step_count,
            "epochs": self.epoch,
            "seconds": round(time.perf_counter() - started, 1),
            "peak_rss_mib": round(peak_rss_bytes() / MiB, 1),
            "optimizer_ram_mib": round(self.optimizer_ram / MiB, 1),
            "optimizer_state_on_disk_mib": round(allocated_bytes(self.run.state_dir(self.recipe)) / MiB, 1),
            "tables_on_disk_mib": round(allocated_bytes(self.run.tables_dir) / MiB, 1),
            "skipped_steps": getattr(self.optimizer, "skipped_steps", 0),
            "optimizer_memory_budget_mib": _mib_or_none(getattr(self.optimizer, "memory_budget", None)),
            "warm_start": self.warm_started,
            "final": final,
        }
        if self.recipe.eval.select_best or self.recipe.eval.patience:
            summary.update(best=self.best, final_from_step=chosen, stopped_early=self.stopped_early)
        buffer = self.task.buffer_summary()
        if buffer is not None:
            summary["buffer"] = buffer
        return summary

    def checkpoint_unless_saved(self) -> None:
        """A checkpoint of this step, unless the newest one is of it already."""
        if self.store.newest_step() != self.step_count:
            self.save_checkpoint()

    @property
    def stopped_early(self) -> bool:
        """``eval.patience`` evaluations in a row were no better than the best one."""
        patience = self.recipe.eval.patience
        return bool(patience) and self.stale >= patience

    def _step_limit_reached(self) -> bool:
        limit = self.recipe.train.max_steps
        return limit is not None and self.step_count >= limit

    def step(self, picked: torch.Tensor) -> float:
        """One optimizer step on the epoch items ``picked``; returns its loss."""
        seed_step(step_seed(self.recipe.train.seed, self.step_count))
        self.task.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.dense_optimizer is not None:
            self.dense_optimizer.zero_grad(set_to_none=True)
        if self.world is not None:
            self.world.step = self.step_count + 1
        loss = self.task.gradients(picked)
        for callback in self.callbacks:
            callback.before_optimizer_step(self)
        self.optimizer.step()
        for callback in self.callbacks:
            callback.after_optimizer_step(self)
        if self.dense_optimizer is not None:
            self.dense_optimizer.step()
        self.step_count += 1
        return loss

    def _account(self, loss: float, items: int, seconds: float) -> None:
        self.window[0] += loss
        self.window[1] += 1
        self.window_pace[0] += seconds
        self.window_pace[1] += items
        self.epoch_loss[0] += loss
        self.epoch_loss[1] += 1
        if self.step_count % self.recipe.train.log_every == 0:
            self.log(
                {
                    "kind": "train",
                    "step": self.step_count,
                    "epoch": self.epoch + 1,
                    "loss": self.window[0] / self.window[1],
                    "lr": self.optimizer.param_groups[0]["lr"],  # the rate of the step just taken
                    # the window's items over its steps' own seconds (evaluations and checkpoints left out)
                    "items_per_s": round(self.window_pace[1] / max(self.window_pace[0], 1e-9), 1),
                }
            )
            self.window, self.window_pace = [0.0, 0], [0.0, 0]

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        """Score a split; during training (``final=False``) the task may sample it, and the
        callbacks' ``evaluated`` hooks are told the record, in their order."""
        started = time.perf_counter()
        self.task.model.eval()
        metrics = self.task.evaluate(split, final=final)
        progress.current().eval_done(split, self.task.headline(metrics))
        record = {
            "kind": "eval",
            "split": split,
            "step": self.step_count,
            "epoch": self.epoch,
            "seconds": round(time.perf_counter() - started, 2),
            **metrics,
        }
        self.log(record)
        self.last_eval = record
        if not final:
            for callback in self.callbacks:
                callback.evaluated(self, record)
        return metrics

    def evaluate_checkpoint(self, splits: list[str], step: int) -> dict[str, dict]:
        """Score ``splits`` with the model of this run's checkpoint of ``step`` (the best
        evaluation's, ``eval.select_best``), read as ``dsa-train eval`` reads it, beside the live
        model; each record names the checkpoint's step."""
        path, task = _checkpoint_task(self.store, self.recipe, step, world=self.world)
        final = {}
        try:
            for split in splits:
                started = time.perf_counter()
                final[split] = metrics = task.evaluate(split, final=True)
                progress.current().eval_done(split, task.headline(metrics))
                record = {
                    "kind": "eval",
                    "split": split,
                    "step": int(path.name),
                    "epoch": self.best["epoch"] if self.best else self.epoch,
                    "seconds": round(time.perf_counter() - started, 2),
                    **metrics,
                }
                self.log(record)
                self.last_eval = record
        finally:
            task.close()
        return final

    # -- checkpoints and cleanup -------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        trainer = {
            "run_id": self.run.run_id,
            "step": self.step_count,
            "epoch": self.epoch,
            "batch": self.batch,
            "window": self.window,
            "epoch_loss": self.epoch_loss,
            "optimizer_ram": self.optimizer_ram,
            "metrics_records": self.metrics.records,
            "skipped_steps": getattr(self.optimizer, "skipped_steps", 0),
            "best": self.best,
            "stale": self.stale,
            "plateau": self.plateau,
            # a checkpoint pruning keeps (CheckpointStore.retained): the best evaluation's
            "best_checkpoint": self.best["step"] if self.best and self.recipe.eval.select_best else None,
        }
        extra = {DENSE_STATE: self.dense_optimizer.state_dict()} if self.dense_optimizer is not None else {}
        saved = self.store.save(
            self.step_count,
            self.task.model,
            self.optimizer,
            trainer,
            # a torchrun job keeps one more: the newest may be one the other ranks never finished
            keep=self.recipe.train.keep_checkpoints + (self.commit is not None),
            extra=extra,
        )
        if self.commit is not None:  # a torchrun job: the checkpoint counts once every rank has its own
            self.commit(self.step_count)
        return saved

    def close(self, *, after_error: bool = False) -> None:
        """Release the metrics log and the optimizer. ``after_error``: an error is already on
        its way to the user, and a second one while closing (a full disk failing the flush,
        say) must not hide it: it is logged as a warning instead."""
        if self._froze:
            gc.unfreeze()  # what setup() froze is the collector's again
            self._froze = False
        try:
            if self.metrics is not None:
                self.metrics.close()
            if self.task is not None:
                self.task.close()  # its background reads and write-backs end before the optimizer's flush
            if self.optimizer is not None:
                close_optimizer(self.optimizer)
        except Exception as e:
            if not after_error:
                raise
            logger.warning(f"warning: while stopping after the error below, closing also failed: {e}")


TRAINER_FIELDS = {
    "step": int,
    "epoch": int,
    "batch": int,
    "optimizer_ram": int,
    "metrics_records": int,
    "skipped_steps": int,
}


def _check_trainer_state(checkpoint: Path, trainer: dict, run_id: str) -> None:
    """A checkpoint of this run with every field the loop reads, of the right type."""
    if trainer.get("run_id") != run_id:
        raise DsaError(
            f"checkpoint '{checkpoint}' belongs to run {trainer.get('run_id')!r}, not to this run ({run_id})",
            hint="resume the run folder the checkpoint was written in",
        )
    bad = [k for k, kind in TRAINER_FIELDS.items() if not isinstance(trainer.get(k), kind) or trainer[k] < 0]
    bad += [k for k in ("window", "epoch_loss") if not (isinstance(trainer.get(k), list) and len(trainer[k]) == 2)]
    best = trainer.get("best")  # absent from checkpoints older than eval.select_best
    if best is not None and not (
        isinstance(best, dict)
        and all(isinstance(best.get(k), int) for k in ("step", "epoch"))
        and isinstance(best.get("value"), float)
        and isinstance(best.get("metric"), str)
    ):
        bad.append("best")
    if not isinstance(trainer.get("stale", 0), int) or trainer.get("stale", 0) < 0:
        bad.append("stale")
    plateau = trainer.get("plateau", {"factor": 1.0, "best": None, "bad": 0})
    if not (
        isinstance(plateau, dict)
        and isinstance(plateau.get("factor"), float)
        and (plateau.get("best") is None or isinstance(plateau.get("best"), float))
        and isinstance(plateau.get("bad"), int)
    ):
        bad.append("plateau")
    if bad:
        raise DsaError(
            f"checkpoint '{checkpoint}' has missing or invalid trainer fields: {', '.join(bad)}",
            hint="resume from an older checkpoint",
        )


def _mib_or_none(size: int | None) -> float | None:
    return None if size is None else round(size / MiB, 1)


def _checkpoint_task(store: CheckpointStore, recipe: Recipe, step: int | None, *, world=None) -> tuple[Path, Task]:
    """The checkpoint of ``step`` (the newest intact one for ``None``) and a task with its
    model, read-only, in evaluation mode."""
    path, _, damaged = store.find(step)
    for warning in damaged:
        logger.warning(f"warning: {warning}")
    torch.manual_seed(recipe.train.seed)
    site = TableSite(
        store.get_tables_dir(path), writable=False, versions=store.table_versions(path)
    )  # deltas read through their chains
    task = make_task(recipe, resolve_device(recipe.train.device), site, world=world)
    store.load_model(path, task.model)
    task.model.eval()
    return path, task


def evaluate_run(
    run: RunFolder,
    split: str,
    *,
    checkpoint: int | None = None,
    device: str | None = None,
    world=None,
    save_ranks: Path | None = None,
) -> tuple[Path, dict[str, dict], str]:
    """Score ``split`` with the model of a run's checkpoint (the newest intact one by default);
    returns the checkpoint, the metrics and their one-line headline. ``world``: this process
    is one rank of a torchrun job, ``run`` its rank folder (every rank scores its share).
    ``save_ranks``: write each query's rank there (knowledge graphs, one process)."""
    recipe = with_data_root(run.read_config([f"train.device={device}"] if device else []), stored=True)
    path, task = _checkpoint_task(CheckpointStore(run.checkpoints), recipe, checkpoint, world=world)
    if save_ranks is not None and not task.saves_ranks:
        raise DsaError(
            f"--save-ranks writes the ranks of knowledge-graph queries; model.kind {recipe.model.kind!r} has none",
            hint="leave out --save-ranks for this run",
        )
    metrics = task.evaluate(split, final=True)
    progress.current().eval_done(split, task.headline(metrics))
    if save_ranks is not None:
        lines = task.write_ranks(save_ranks)
        logger.info(f"{lines:,} ranks written to {save_ranks}")
    return path, metrics, task.headline(metrics)
