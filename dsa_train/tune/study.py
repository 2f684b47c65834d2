"""The search: Optuna trials, each an ordinary training run, in one tune folder.

::

    <tune folder>/
      tune.json             the marker: format, version, when it was made
      recipe.yaml           the base recipe, resolved (with --set), as the search started
      space.yaml            the space searched (see space.py)
      study.db              Optuna's SQLite storage: every trial, its values and its state
      trials/trial-0003/    each trial's run folder (eval, inspect-state and clean know it)
      trials.tsv            the table of trials (written after each search)
      best.yaml             the best trial's full recipe: dsa-train run takes it as it is
      best-test.json        the best model's test metrics, measured once, after the search
      .lock                 who holds the folder (one tune at a time: fsutil.DirectoryLock)

A trial trains its recipe with ``eval.split: valid`` and ``eval.final_splits: [valid]``, so the
search never sees the test split; its value is the final valid metric (MRR, probe accuracy or
link AUC, click AUC: :func:`objective`). Each evaluation made during training is reported to
Optuna at its epoch, and the median pruner stops a trial whose value there is below the
median of the earlier trials' at the same epoch. Every finished trial is committed to the
SQLite database before the next starts, so a search killed at any moment loses at most the
trials under way: :meth:`TuneFolder.requeue_unfinished` (``--resume``) marks those failed
(``killed``) and queues their settings again. Several worker processes share one study
through the database; the tune folder's lock keeps a second search out.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DatasetError, DsaError, StateError, TrainingError
from ..fsutil import DirectoryLock, atomic_write_bytes, create_owned_folder, read_json_object
from ..eval.objective import objective_of
from ..recipe import Recipe, load_recipe, recipe_to_yaml
from .space import Space, apply, choice_text, load_space, space_to_yaml

TUNE_FORMAT = "dsa-train/tune"
TUNE_VERSION = 1
STUDY = "tune"  # the study's name in the database
#: Trials that finish before the pruner compares with them; then a trial below the median of
#: the earlier ones at an evaluation stops there.
PRUNER_STARTUP_TRIALS = 2


def objective(metrics: dict) -> tuple[str, float]:
    """The metric a trial maximises, from an evaluation's metrics: its label and value."""
    found = objective_of(metrics)
    if found is not None:
        return found
    raise DatasetError(  # the dataset's, not the settings': every trial would fail alike, so the search stops
        f"the valid split gave nothing to maximise (metrics: {', '.join(metrics) or 'none'}): the dataset has no valid split to search on",
        hint="tune needs a valid split: knowledge graphs' valid.txt, labelled nodes in valid, dataset.link_split: [0.05, 0.05] "
        "(edges held out), a click log's held-out lines",
    )


def trial_recipe(base: Recipe, values: dict) -> Recipe:
    """The recipe one trial trains: ``base`` with the trial's values, scored on valid only
    (and evaluated during training, a quarter of the epochs apart, when ``base`` never is)."""
    recipe = apply(base, values)
    every = base.eval.every_epochs or max(1, base.train.epochs // 4)
    return apply(recipe, {"eval.split": "valid", "eval.final_splits": ["valid"], "eval.every_epochs": every})


def _optuna():
    try:
        import optuna
    except ImportError:
        raise DsaError(
            "dsa-train tune searches with Optuna, which is not installed",
            hint="pip install 'dsa-train[tune]' (or optuna)",
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


class TuneFolder:
    MARKER = "tune.json"
    RECIPE = "recipe.yaml"
    SPACE = "space.yaml"
    DATABASE = "study.db"
    TABLE = "trials.tsv"
    BEST = "best.yaml"
    BEST_TEST = "best-test.json"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.trials = self.path / "trials"
        self._lock: DirectoryLock | None = None

    # -- making, finding and holding one ----------------------------------------------------
    @classmethod
    def create(cls, base: Recipe, space: Space, path: Path) -> TuneFolder:
        """A new tune folder at ``path`` (absent or empty), locked, with its study made."""
        folder = cls(path)
        folder._lock = create_owned_folder(
            folder.path,
            "tune folder",
            link_hint="pass a real folder with -o",
            busy_hint="pass --resume to continue its search, or choose another -o",
        )
        path = folder.path
        try:
            atomic_write_bytes(path / cls.RECIPE, recipe_to_yaml(base).encode())
            atomic_write_bytes(path / cls.SPACE, space_to_yaml(space).encode())
            _optuna().create_study(study_name=STUDY, storage=folder.storage(), direction="maximize")
            folder.trials.mkdir()
            marker = {"format": TUNE_FORMAT, "version": TUNE_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            atomic_write_bytes(path / cls.MARKER, json.dumps(marker, indent=2).encode())  # last: the folder is complete
        except BaseException:
            folder.release()
            raise
        return folder

    @classmethod
    def find(cls, path: Path) -> TuneFolder:
        """An existing tune folder; a ``StateError`` says what is wrong."""
        folder = cls(path)
        marker = read_json_object(Path(path) / cls.MARKER)
        if marker is None or marker.get("format") != TUNE_FORMAT:
            raise StateError(
                f"'{path}' is not a tune folder (it has no valid {cls.MARKER})",
                hint="pass the folder `dsa-train tune` made (its -o), or start a new tune without --resume",
            )
        if marker.get("version") != TUNE_VERSION:
            raise StateError(
                f"tune folder '{path}' has format version {marker.get('version')!r}; this dsa-train reads {TUNE_VERSION}"
            )
        for name in (cls.DATABASE, "trials", cls.RECIPE, cls.SPACE):
            if (folder.path / name).is_symlink():
                raise StateError(
                    f"'{folder.path / name}' is a symbolic link; dsa-train never follows links inside a tune folder"
                )
        return folder

    def lock(self) -> None:
        """Hold the folder for one search (its worker processes share it through the database)."""
        if self._lock is None:
            lock = DirectoryLock(self.path, purpose="tune folder")
            lock.acquire()
            self._lock = lock

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- what is in it -----------------------------------------------------------------------
    def storage(self):
        """Optuna's storage: SQLite in the folder, waiting up to 5 minutes for another worker's write."""
        optuna = _optuna()
        return optuna.storages.RDBStorage(
            f"sqlite:///{(self.path / self.DATABASE).resolve()}", engine_kwargs={"connect_args": {"timeout": 300}}
        )

    def study(self, *, seed: int | None = None):
        optuna = _optuna()
        sampler = optuna.samplers.TPESampler(
            seed=seed, constant_liar=True
        )  # constant liar: parallel workers spread out
        pruner = optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP_TRIALS)
        return optuna.load_study(study_name=STUDY, storage=self.storage(), sampler=sampler, pruner=pruner)

    def base(self) -> Recipe:
        return load_recipe(self.path / self.RECIPE)

    def space(self, base: Recipe | None = None) -> Space:
        return load_space(self.path / self.SPACE, base or self.base())

    def requeue_unfinished(self) -> int:
        """Trials a killed search left running: failed, and their settings queued again (the
        new trial's ``requeued_from`` names the killed one); returns how many. Only while
        holding the lock (no worker is running)."""
        optuna = _optuna()
        study = self.study()
        stale = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        for trial in stale:
            study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        return len(stale)


def killed(trials) -> set[int]:
    """The numbers of trials a kill or an error cut short, whose settings were queued again."""
    return {t.user_attrs["requeued_from"] for t in trials if isinstance(t.user_attrs.get("requeued_from"), int)}


def counted(trials) -> int:
    """Trials that count toward ``--trials``: run, running or failed, but not killed ones (their
    settings run again) nor those still waiting in the queue."""
    cut = killed(trials)
    return sum(1 for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL", "RUNNING") and t.number not in cut)


# -- one worker's share of the search ---------------------------------------------------------
@dataclass
class TrialResult:
    number: int
    state: str  # COMPLETE, PRUNED or FAIL
    label: str
    value: float | None
    epoch: int | None  # pruned: the epoch it stopped at
    seconds: float
    values: dict
    error: str | None = None


def search(
    folder: TuneFolder,
    *,
    trials: int | None,
    deadline: float | None,
    trial_seconds: float | None = None,
    worker: int = 0,
    report: Callable[[TrialResult], None] | None = None,
) -> None:
    """Run trials until ``trials`` count in the study (all workers together) or the wall-clock
    ``deadline`` passes (a trial under way then finishes). Each trial trains at most
    ``trial_seconds`` (and no later than the deadline): it ends at the last epoch that fits,
    then scores valid as a whole trial does (:func:`~dsa_train.tune.budget.trial_share`). A trial that stops on a bad
    combination of settings (a ``ConfigError``, a non-finite loss) is failed and the search goes
    on; any other error ends it, after marking the trial failed and queueing its settings again."""
    optuna = _optuna()
    base = folder.base()
    space = folder.space(base)
    study = folder.study(seed=base.train.seed + worker)
    while (trials is None or counted(study.get_trials(deepcopy=False)) < trials) and (
        deadline is None or time.time() < deadline
    ):
        trial = study.ask()
        limit = trial_seconds
        if deadline is not None and limit is not None:
            limit = min(limit, deadline - time.time())
        result = _run_trial(folder, study, trial, base, space, optuna, limit)
        if report is not None:
            report(result)


def _run_trial(
    folder: TuneFolder, study, trial, base: Recipe, space: Space, optuna, seconds: float | None
) -> TrialResult:
    from ..train.callbacks import Callback, default_callbacks
    from ..train.lifecycle import train_run

    started = time.time()
    values = {key: param.suggest(trial) for key, param in space.items()}
    reported = {"label": "valid metric", "epoch": None, "value": None}  # the last evaluation reported to Optuna

    class ReportToStudy(Callback):
        """Each evaluation during training goes to Optuna's pruner, which may stop the trial."""

        def evaluated(self, training, record: dict) -> None:
            reported["label"], value = objective(record)
            reported["epoch"], reported["value"] = record["epoch"], value
            trial.report(value, record["epoch"])
            if trial.should_prune():
                raise optuna.TrialPruned()

    class WithinShare(Callback):
        """Ends training at an epoch's end when the next epoch (at the mean pace so far,
        evaluations included) would pass the trial's ``seconds``."""

        def epoch_start(self, training, steps: int) -> None:
            if not hasattr(self, "started"):
                self.started, self.first_epoch = time.perf_counter(), training.epoch

        def epoch_done(self, training, record: dict) -> None:
            elapsed = time.perf_counter() - self.started
            pace = elapsed / max(training.epoch - self.first_epoch, 1)
            if seconds is not None and elapsed + pace > seconds and training.epoch < training.recipe.train.epochs:
                training.stop_reason = f"its share of the search's time ({seconds:,.0f} s) ends before another epoch"

    def result(state: str, value: float | None, error: str | None = None) -> TrialResult:
        return TrialResult(
            trial.number,
            state,
            f"valid {reported['label']}",
            value,
            reported["epoch"],
            time.time() - started,
            values,
            error,
        )

    try:
        trained = train_run(
            trial_recipe(base, values),
            output=folder.trials / f"trial-{trial.number:04d}",
            callbacks=[*default_callbacks(), ReportToStudy(), WithinShare()],
            on_folder=lambda path: trial.set_user_attr("run", path.name),
        )
        label, value = objective(trained.final_metrics["valid"])
        trial.set_user_attr("metric", f"valid {label}")
        study.tell(trial, value)
        reported["label"] = label
        return result("COMPLETE", value)
    except optuna.TrialPruned:
        trial.set_user_attr("metric", f"valid {reported['label']}")
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return result("PRUNED", reported["value"])
    except (ConfigError, TrainingError) as e:  # these settings do not train: the search goes on
        trial.set_user_attr("error", e.message)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return result("FAIL", None, e.message)
    except BaseException:  # Ctrl-C, a missing dataset, a full disk: the search stops, this trial runs again on --resume
        study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise


# -- the results ---------------------------------------------------------------------------------
@dataclass
class Row:
    number: int
    state: str
    metric: str
    value: float | None  # the final valid metric; a pruned trial's last reported one
    epoch: int | None  # the epoch of the last report (where a pruned trial stopped)
    seconds: float | None
    params: dict
    run: str | None
    error: str | None


def rows(folder: TuneFolder) -> list[Row]:
    """Every trial of the study, oldest first (queued ones left out)."""
    trials = folder.study().get_trials(deepcopy=False)
    cut = killed(trials)
    found = []
    for t in trials:
        if t.state.name == "WAITING":
            continue
        last = max(t.intermediate_values) if t.intermediate_values else None
        value = t.value if t.state.name == "COMPLETE" else (t.intermediate_values[last] if last is not None else None)
        seconds = (
            (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start
            else None
        )
        state = "KILLED" if t.number in cut else t.state.name
        found.append(
            Row(
                t.number,
                state,
                t.user_attrs.get("metric", "valid metric"),
                value,
                last,
                seconds,
                dict(t.params),
                t.user_attrs.get("run"),
                t.user_attrs.get("error"),
            )
        )
    return found


def table_tsv(found: list[Row]) -> str:
    """The trials as TSV: trial, state, the valid metric, the epoch it was last reported at,
    seconds, the run folder, then one column per searched key."""
    keys = list(dict.fromkeys(k for r in found for k in r.params))
    out = io.StringIO()
    writer = csv.writer(out, delimiter="\t", lineterminator="\n")
    metric = next((r.metric for r in found if r.metric != "valid metric"), "valid metric")
    writer.writerow(["trial", "state", metric, "epoch", "seconds", "run", *keys])
    for r in found:
        writer.writerow(
            [
                r.number,
                r.state,
                "" if r.value is None else f"{r.value:.6g}",
                "" if r.epoch is None else r.epoch,
                "" if r.seconds is None else f"{r.seconds:.1f}",
                r.run or "",
                *[r.params.get(k, "") for k in keys],
            ]
        )
    return out.getvalue()


def read_table(path: Path) -> list[dict]:
    """A tune folder's trials.tsv as dicts (the plot's input)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def best_trial(found: list[Row]) -> Row:
    complete = [r for r in found if r.state == "COMPLETE" and r.value is not None]
    if not complete:
        raise DsaError(
            "no trial of this search has finished yet, so there is no best recipe",
            hint="run more trials (--resume with a longer --timeout or more --trials); the table shows why trials stopped",
        )
    return max(complete, key=lambda r: (r.value, -r.number))


def write_results(folder: TuneFolder) -> tuple[list[Row], Row]:
    """Write trials.tsv and best.yaml (the best trial's values on the base recipe, whose own
    evaluation settings, test included, come back); returns the rows and the best one."""
    found = rows(folder)
    atomic_write_bytes(folder.path / TuneFolder.TABLE, table_tsv(found).encode())
    best = best_trial(found)
    base = folder.base()
    values = _values(folder.study().trials[best.number], folder.space(base))
    atomic_write_bytes(folder.path / TuneFolder.BEST, recipe_to_yaml(apply(base, values, source="best trial")).encode())
    return found, best


def _values(trial, space: Space) -> dict:
    """A finished trial's recipe values (choices that Optuna stored as YAML text turned back)."""
    values = {}
    for key, stored in trial.params.items():
        param = space.get(key)
        if param is not None and param.kind == "choice":
            values[key] = next((c for c in param.choices if c == stored or choice_text(c) == stored), stored)
        else:
            values[key] = stored
    return values


def best_test(folder: TuneFolder, best: Row) -> dict:
    """The best trial's model scored on the test split (once; kept in best-test.json and read
    back while the best trial is the same)."""
    from ..train.loop import evaluate_run
    from ..runs.run_folder import RunFolder

    path = folder.path / TuneFolder.BEST_TEST
    kept = read_json_object(path)
    if kept and kept.get("trial") == best.number:
        return kept
    checkpoint, metrics, headline = evaluate_run(RunFolder.find(folder.trials / best.run), "test")
    record = {
        "trial": best.number,
        "run": best.run,
        "checkpoint": checkpoint.name,
        "headline": headline,
        "test": metrics,
    }
    atomic_write_bytes(path, json.dumps(record, indent=2).encode())
    return record
