"""One run's lifecycle, in the library: its folder created (or found and locked to resume), the
recipe it trains, setup, training, closing after an error, the lock released, and a new run
that failed before its first step removed (no folder that ``clean`` would not know and
``--resume`` would pick). ``dsa-train run``, :func:`dsa_train.run` and tune's trials stand on it.

Messages go through ``logging`` (the ``dsa_train`` logger), progress through the process's
reporter (:mod:`dsa_train.progress`): the library prints nothing itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..recipe import Recipe, recipe_differences, with_data_root
from ..runs.checkpoint_store import CheckpointStore
from ..runs.run_folder import MetricsLog, RunFolder
from .callbacks import check_callback_names

log = logging.getLogger(__name__)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or another ``KeyboardInterrupt``) inside a run: it was closed as after any
    error, its newest checkpoint kept; ``folder`` resumes it."""

    def __init__(self, folder: Path, step: int, checkpointed: bool) -> None:
        super().__init__(f"interrupted at step {step:,}")
        self.folder, self.step, self.checkpointed = folder, step, checkpointed


@dataclass
class RunResult:
    """A run that trained to its end (or had already): its folder, the recipe it trained (the
    run's own config.yaml when resumed), its summary record and the final evaluation's metrics
    by split (empty when the run had finished before: they are in its metrics.jsonl)."""

    folder: Path
    recipe: Recipe
    summary: dict
    final_metrics: dict
    already_finished: bool = False  # resumed a run that had nothing left to train


def train_run(
    recipe: Recipe,
    *,
    output: Path | None = None,
    resume: bool = False,
    overrides: Sequence[str] = (),
    callbacks: list | None = None,
    on_folder: Callable[[Path], None] | None = None,
    warm_start: Callable | None = None,
) -> RunResult:
    """Train ``recipe`` in this process into a new run folder (``output``, default
    ``<output.dir>/<name>-<timestamp>``), or continue the run in ``output`` (default: the
    recipe's newest) from its newest checkpoint. ``overrides`` (``key=value``) are applied to a
    resumed run's own config.yaml, which wins over ``recipe`` elsewhere. ``callbacks``: the
    loop's (default :func:`~.callbacks.default_callbacks`); ``on_folder(path)`` is told the run
    folder before training starts (a tune trial records it); ``warm_start``: how a fresh run's
    rows come from a finished run's (``model.init_from``; the callers above pass
    ``results.warm_start.carry_over``, which this layer may not import).

    Raises what training raises, after closing the run (its checkpoints kept, its lock
    released); :class:`RunInterrupted` for a ``KeyboardInterrupt``."""
    from .loop import Training  # torch and PyG: imported only when training

    check_callback_names(recipe.output.callbacks)  # an unknown name stops here, before a run folder exists
    if resume:
        folder = RunFolder.find(output) if output else RunFolder.newest(recipe)
        folder.lock()  # a second process on this run folder stops here, told who holds it
    else:
        folder = RunFolder.create(recipe, output)  # locked before anything is written into it
    discard = False
    try:
        if resume:
            saved = with_data_root(folder.read_config(list(overrides)), stored=True)
            warn_differences(recipe, saved)
            recipe = saved
            folder.write_config(recipe)
            done = finished_summary(folder, recipe)
            if done is not None:
                return RunResult(folder.path, recipe, done, {}, already_finished=True)
        log.info("run folder: %s", folder.path)
        if on_folder is not None:
            on_folder(folder.path)
        training = Training(recipe, folder, warm_start=warm_start, callbacks=callbacks)
        try:
            training.setup(resume=resume)
            summary = training.train()
        except KeyboardInterrupt:
            training.close(after_error=True)
            raise RunInterrupted(folder.path, training.step_count, training.interrupted) from None
        except BaseException:
            training.close(after_error=True)  # the first error is the one the user sees
            discard = not resume and training.step_count == 0 and not CheckpointStore(folder.checkpoints).complete()
            raise
        training.close()
        return RunResult(folder.path, recipe, summary, training.final_metrics)
    finally:
        folder.release()
        if discard:
            folder.discard()
            log.warning("(removed %s: the run stopped before its first step)", folder.path)


def finished_summary(folder: RunFolder, recipe: Recipe) -> dict | None:
    """The run's summary record if it finished the training ``recipe`` asks for, else ``None``."""
    if not folder.metrics_path.is_file():
        return None
    records = MetricsLog.read(folder.metrics_path)
    last = records[-1] if records else {}
    if last.get("kind") != "summary":
        return None
    limit = recipe.train.max_steps
    return (
        last
        if last.get("epochs", 0) >= recipe.train.epochs or (limit is not None and last.get("step", 0) >= limit)
        else None
    )


def warn_differences(recipe: Recipe, saved: Recipe) -> None:
    """Say which keys of the recipe given to resume differ from the run's own config.yaml."""
    changed = recipe_differences(saved, recipe)
    if changed:
        log.warning(
            "the recipe differs from the run's config.yaml in %s. The run's values win; --set overrides them.",
            "; ".join(f"{key} ({ours!r} in the run, {theirs!r} in the recipe)" for key, ours, theirs in changed),
        )
