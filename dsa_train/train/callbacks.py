"""The training loop's extras, as callbacks with no-op hooks (PyKEEN's ``training/callbacks.py``).

:class:`~.loop.Training` runs the epochs and the steps; what comes around them (the
progress display, the learning-rate schedule, periodic checkpoints and evaluation, the
checkpoint on Ctrl-C, metering the optimizer's memory) is a :class:`Callback` whose hooks it
calls in order. Each hook receives the :class:`~.loop.Training`, whose state (``step_count``,
``epoch``, ``batch``, ``optimizer``...) it may read and, where its job says so, change.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from .. import progress
from ..eval.objective import objective_of
from ..memory import PeakRssAnon, rss_anon_bytes
from ..registry import Registry
from .schedule import lr_factor, plateau_update

MiB = 1 << 20
logger = logging.getLogger(__name__)

#: callbacks a recipe may name in ``output.callbacks``; a Python user adds their own with
#: ``@CALLBACKS.register_as("name")`` on a :class:`Callback` subclass (made with no arguments)
CALLBACKS: Registry[type] = Registry("callback", "output.callbacks")


class Callback:
    """No-op hooks, in the order the loop calls them."""

    def running(self, training) -> contextlib.AbstractContextManager:
        """A context the whole of ``train()`` runs in (nothing by default)."""
        return contextlib.nullcontext()

    def epoch_start(self, training, steps: int) -> None:
        """An epoch of ``steps`` steps starts (or resumes at ``training.batch``)."""

    def before_optimizer_step(self, training) -> None:
        """The step's gradients are in; the optimizers step next."""

    def after_optimizer_step(self, training) -> None:
        """The sparse optimizer has stepped."""

    def step_done(self, training, loss: float, rate: float) -> None:
        """A step is done and accounted: ``loss``, at ``rate`` items per second."""

    def epoch_done(self, training, record: dict) -> None:
        """An epoch is done (``training.epoch`` counts it) and logged as ``record``."""

    def evaluated(self, training, record: dict) -> None:
        """After each evaluation made during training (not the final ones), with its record; it
        may raise to stop the run there (how ``dsa-train tune`` prunes a trial)."""

    def train_done(self, training, summary: dict) -> None:
        """Training is over; ``summary`` is the run's summary, before it is logged."""

    def logged(self, training, record: dict) -> None:
        """``record`` was just added to the run's metrics.jsonl (a window of steps, an epoch, an
        evaluation, the summary): where a metric logger sends it on."""


class Progress(Callback):
    """Tells the reporter (:func:`dsa_train.progress.current`: the CLI's progress display) what
    the loop does."""

    def epoch_start(self, training, steps: int) -> None:
        progress.current().epoch_start(training.epoch + 1, training.recipe.train.epochs, steps, training.batch)

    def step_done(self, training, loss: float, rate: float) -> None:
        progress.current().step_done(1, loss, rate, training.task.unit)

    def epoch_done(self, training, record: dict) -> None:
        progress.current().epoch_done(record)


class LearningRateSchedule(Callback):
    """The recipe's rates scaled by the schedule at this step (see :mod:`.schedule`); nothing
    with ``optimizer.schedule: constant`` (the rates the optimizers were built or resumed with).
    With ``plateau`` the factor is ``training.plateau``'s, which each evaluation during training
    updates (:func:`~.schedule.plateau_update`) and each checkpoint keeps."""

    def evaluated(self, training, record: dict) -> None:
        if training.recipe.optimizer.schedule == "plateau":
            found = objective_of(record)
            if found is not None:
                training.plateau = plateau_update(training.plateau, found[1], training.recipe.optimizer)

    def before_optimizer_step(self, training) -> None:
        cfg = training.recipe.optimizer
        if cfg.schedule == "constant":
            return
        if cfg.schedule == "plateau":
            factor = training.plateau["factor"]
        else:
            total_steps = training.recipe.train.epochs * training.steps_per_epoch
            decay_after = cfg.decay_after_epochs * training.steps_per_epoch
            factor = lr_factor(cfg.schedule, training.step_count, total_steps, cfg.final_lr_ratio, decay_after)
        for optimizer, rate in ((training.optimizer, cfg.lr), (training.dense_optimizer, cfg.dense_lr)):
            for group in optimizer.param_groups if optimizer is not None else ():
                group["lr"] = rate * factor


class OptimizerMemory(Callback):
    """Meters memory: the largest anonymous-memory growth across one sparse optimizer step
    (``training.optimizer_ram``, kept in checkpoints) and the peak over the run (the summary's
    ``peak_rss_anon_mib``)."""

    def running(self, training) -> contextlib.AbstractContextManager:
        self.anon = PeakRssAnon(interval=0.1)
        return self.anon

    def before_optimizer_step(self, training) -> None:
        self.before = rss_anon_bytes()

    def after_optimizer_step(self, training) -> None:
        training.optimizer_ram = max(training.optimizer_ram, rss_anon_bytes() - self.before)

    def train_done(self, training, summary: dict) -> None:
        summary["peak_rss_anon_mib"] = round(self.anon.peak / MiB, 1)


class PeriodicCheckpoint(Callback):
    """A checkpoint every ``train.checkpoint_every`` steps."""

    def step_done(self, training, loss: float, rate: float) -> None:
        every = training.recipe.train.checkpoint_every
        if every and training.step_count % every == 0:
            training.save_checkpoint()


class CheckpointOnInterrupt(Callback):
    """Ctrl-C (SIGINT) ends the step under way, writes a checkpoint and raises
    ``KeyboardInterrupt`` (so ``--resume`` continues from there); a second Ctrl-C stops at once.
    Only in the main thread, where Python delivers signals, and not in a torchrun job (its ranks
    would each stop at another step: there, Ctrl-C stops at once)."""

    @contextlib.contextmanager
    def running(self, training):
        training.interrupted = False
        if threading.current_thread() is not threading.main_thread() or training.world is not None:
            yield
            return

        def first(signum, frame) -> None:
            training.interrupted = True
            logger.warning("interrupted: finishing this step and writing a checkpoint (Ctrl-C again stops at once)")
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the second one raises KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, first)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def step_done(self, training, loss: float, rate: float) -> None:
        if training.interrupted:
            training.checkpoint_unless_saved()
            raise KeyboardInterrupt


class PeriodicEvaluation(Callback):
    """Evaluates ``eval.split`` every ``eval.every_epochs`` epochs, but after the last (the
    final evaluation scores every split then), except with ``eval.select_best``, where the last
    epoch is a candidate too."""

    def epoch_done(self, training, record: dict) -> None:
        cfg, epochs = training.recipe.eval, training.recipe.train.epochs
        if not cfg.every_epochs:
            return
        if (training.epoch % cfg.every_epochs == 0 and training.epoch < epochs) or (
            cfg.select_best and training.epoch == epochs
        ):
            training.evaluate(cfg.split, final=False)  # which tells every callback's evaluated()


class BestEvaluation(Callback):
    """Keeps ``training.best``, the evaluation during training with the highest objective
    (:func:`~dsa_train.eval.objective.objective_of`: MRR, accuracy, AUC), and ``training.stale``,
    the evaluations since it that were no better. With ``eval.select_best`` each new best is
    checkpointed at once (its checkpoint then records it, and pruning keeps it); with
    ``eval.patience`` the loop stops once ``stale`` reaches it (``training.stopped_early``).
    Runs before any callback that may stop the run at an evaluation (tune's pruning)."""

    def evaluated(self, training, record: dict) -> None:
        cfg = training.recipe.eval
        found = objective_of(record) if cfg.select_best or cfg.patience else None
        if found is None:
            return
        metric, value = found
        if training.best is None or value > training.best["value"]:
            training.best = {"step": training.step_count, "epoch": training.epoch, "metric": metric, "value": value}
            training.stale = 0
            if cfg.select_best:  # replaces a checkpoint of this step saved before the evaluation
                training.save_checkpoint()
        else:
            training.stale += 1


def default_callbacks() -> list[Callback]:
    """The extras of every run, in the order their hooks run."""
    return [
        Progress(),
        LearningRateSchedule(),
        OptimizerMemory(),
        PeriodicCheckpoint(),
        CheckpointOnInterrupt(),
        PeriodicEvaluation(),
        BestEvaluation(),
    ]


@CALLBACKS.register_as("log_metrics")
class LogMetrics(Callback):
    """``output.callbacks: [log_metrics]``: every record of metrics.jsonl also as one INFO line
    of the ``dsa_train`` logger (``epoch step=1200 epoch=3 loss=0.4123 ...``; an evaluation's
    metrics as ``both.mrr=0.3012``), for a shell script's log or a notebook without bars."""

    def logged(self, training, record: dict) -> None:
        fields = []
        for key, value in record.items():
            if key == "kind":
                continue
            if isinstance(value, dict):
                fields += [f"{key}.{name}={_shown(v)}" for name, v in value.items()]
            else:
                fields.append(f"{key}={_shown(value)}")
        logger.info(" ".join([str(record.get("kind", "record")), *fields]))


def _shown(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def check_callback_names(names: list[str]) -> None:
    """A ConfigError, listing the known callbacks, for a name in ``output.callbacks`` that is
    not registered (in this process: a callback registered from Python is known only there)."""
    for name in names:
        CALLBACKS.get(name)


def named_callbacks(names: list[str]) -> list[Callback]:
    """The callbacks ``output.callbacks`` names, made (:func:`check_callback_names`' error for
    an unknown one)."""
    return [CALLBACKS.get(name)() for name in names]
