"""Finding what ``dsa-train clean`` may remove, and removing exactly that.

Things are recognised by the markers dsa-train writes into them, never by a folder's name:

* a run folder by its ``run.json`` (format ``dsa-train/run`` and the run's id);
* a checkpoint by its ``trainer.json`` (format ``dsa-train/checkpoint``), which names the run
  it belongs to; it counts only directly inside that run's own ``checkpoints/`` folder;
* a state directory by its ``manifest.json`` (the DiskSparseAdam state format).

What may be removed: a run's older checkpoints (all but the newest ``keep_last`` and the
earlier checkpoints those are made of: a checkpoint whose row files are deltas lists the
checkpoints of their chains in its ``trainer.json``'s ``needs``, and they stay with it) and the
checkpoints a killed save or prune left (``checkpoints/.partial-*``, ``.deleting-*``); the
live ``optimizer_state/`` of a finished run whose final checkpoint holds a copy (and whose
manifest names the state id the run recorded); a standalone state directory (its manifest's
row files, the manifest, then the folder if nothing else is left in it).

What never is: anything reached through a symbolic link (links are neither entered nor
counted nor removed); anything in a run or state directory whose lock a live process holds
(``remove`` takes that lock, so no run can start while its files go); anything inside a
checkpoint, or a copy of a checkpoint, on its own; a path outside those the plan lists.
Each removal walks from the locked folder through ``O_NOFOLLOW`` descriptors and checks the
marker again there, right before it removes.

A torchrun job's run folder (:mod:`.sharded_run`) holds one ordinary run folder per rank in
``ranks/<rank>-of-<world>/``, cleaned by the rules above, with one more: a checkpoint of the job
is the same step in every rank, and it is complete only once ``checkpoints.json`` lists it. So
``keep_last`` counts the job's listed steps: every rank keeps the ``keep_last`` newest steps
``checkpoints.json`` lists, and any step newer than its newest (one not every rank may have
finished); the newest listed step also stays while any rank keeps an older checkpoint (its
optimizer state open, or a kept one made of its deltas). Where ``checkpoints.json`` is not there
or not ours (it lives on rank 0's machine only), or does not match the rank folders (another
world size, or a rank without the newest listed step), no step is known complete and every
rank checkpoint stays. A link in ``ranks/`` (or ``ranks/`` itself) is never entered; an entry
not named ``<rank>-of-<world>`` or without a run marker is left alone. Removing a rank's
checkpoint also locks the job's folder and reads ``checkpoints.json`` again there.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DsaError, StateError
from ..fsutil import DirectoryLock, allocated_bytes, is_regular_file, lock_holder, read_json_object
from ..storage.format import MANIFEST, PENDING_SUFFIX, ROWS_SUFFIX, STATE_FORMAT, TABLE_LAYOUT
from .checkpoint_layout import CHECKPOINT_FORMAT, CHECKPOINTS, TRAINER, real_directories
from .checkpoint_store import CheckpointStore
from .run_folder import (
    JOB_MANIFEST,
    RANKS,
    STATE_DIR as STATE,
    RunFolder,
    is_job,
    job_checkpoints,
    rank_name,
    read_marker,
)

SEARCH_DEPTH = 3  # how deep below a given folder runs and state directories are looked for


@dataclass
class Candidate:
    """One thing the plan removes: ``owner`` is the folder locked while it goes (a run folder
    or the state directory itself) and ``parts`` the path from there (empty: the owner)."""

    kind: str
    path: Path
    bytes: int
    modified: float
    owner: Path
    parts: tuple[str, ...]
    job: Path | None = None  # a rank's checkpoint: the torchrun job's folder, checked again at removal
    keep_last: int = 0  # and the --keep-last it was planned with


@dataclass
class CleanPlan:
    candidates: list[Candidate] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)  # (path, why it stays)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.candidates)


def parse_age(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise DsaError(
            f"--older-than {text!r} is not an age", hint="write a number and a unit: 90s, 30m, 12h, 7d or 2w"
        )
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match[2]]


# -- recognising ---------------------------------------------------------------------------------
def state_manifest(path: Path) -> dict | None:
    manifest = read_json_object(path / MANIFEST)
    return (
        manifest
        if manifest and manifest.get("format") == STATE_FORMAT and isinstance(manifest.get("state_id"), str)
        else None
    )


def is_state_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode) and state_manifest(path) is not None
    except OSError:
        return False


def checkpoint_state(path: Path) -> dict | None:
    state = read_json_object(CheckpointStore.get_trainer_file(path))
    return state if state and state.get("format") == CHECKPOINT_FORMAT else None


@dataclass
class RankFolder:
    """An entry of a torchrun job folder's ``ranks/``: rank ``rank`` of ``world_size`` (from its
    name), or ``problem`` says why it is not a rank's run folder (then it is never entered)."""

    rank: int | None
    world_size: int | None
    path: Path
    problem: str | None = None

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def job_of(run: Path) -> Path | None:
    """The torchrun job folder whose rank folder ``run`` is (``<job>/ranks/<rank>-of-<world>``),
    found from its real path; ``None`` for any other folder."""
    real = Path(os.path.realpath(run))
    return real.parent.parent if real.parent.name == RANKS and rank_name(real.name) is not None else None


def job_ranks(job: Path) -> list[RankFolder]:
    """The entries of ``<job>/ranks/``, by world size and rank (those with a problem last):
    links are listed, never entered. A ``StateError`` when ``ranks/`` is a link or not a folder."""
    ranks = Path(job) / RANKS
    if ranks.is_symlink():
        raise StateError(
            f"'{ranks}' is a symbolic link; dsa-train never follows links inside a run folder",
            hint="replace it with the real folder (or move the whole run folder instead)",
        )
    try:
        entries = list(os.scandir(ranks))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StateError(
            f"cannot read the rank folders in '{ranks}': {e.strerror}",
            hint="pass a torchrun job's run folder you can read",
        ) from None
    found = []
    for entry in entries:
        path, named = Path(entry.path), rank_name(entry.name)
        if entry.is_symlink():
            problem = "a symbolic link"
        elif not entry.is_dir(follow_symlinks=False):
            problem = "not a folder"
        elif named is None:
            problem = "not named <rank>-of-<world>"
        elif read_marker(path) is None:
            problem = f"no valid {RunFolder.MARKER}"
        else:
            problem = None
        rank, world = named or (None, None)
        found.append(RankFolder(rank, world, path, problem))
    return sorted(found, key=lambda r: (r.problem is not None, r.world_size or 0, r.rank or 0, r.path.name))


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


# -- planning ------------------------------------------------------------------------------------
def plan_clean(paths: list[Path], *, keep_last: int = 1, older_than: float | None = None) -> CleanPlan:
    """What cleaning ``paths`` would remove; a ``DsaError`` for a path that is none of ours."""
    plan = CleanPlan()
    for path in paths:
        path = Path(path)
        if path.is_symlink():
            raise DsaError(f"'{path}' is a symbolic link; clean does not follow links", hint="pass the real path")
        if not path.is_dir():
            raise DsaError(
                f"'{path}' is not a directory", hint="pass a run folder, a state directory, or a folder holding them"
            )
        run, inside = _enclosing(path)
        if run is not None:
            _plan_inside_run(run, path, inside, plan, keep_last)
            continue
        if inside is not None and Path(os.path.abspath(inside)) != Path(os.path.abspath(path)):
            raise DsaError(
                f"'{path}' is part of the checkpoint '{inside}', which is not in its run's checkpoints/ folder "
                "(a copy); clean never removes a checkpoint's contents",
                hint="delete a copy you made yourself with rm; clean removes checkpoints inside their run",
            )
        found = list(_recognised(path, SEARCH_DEPTH, plan))
        if not found and not plan.kept:
            raise DsaError(
                f"'{path}' is not a run folder or a DiskSparseAdam state directory, and holds none",
                hint="clean only removes what dsa-train made; pass e.g. runs/ or ./opt_state_cache",
            )
        for kind, item in found:
            (_plan_run if kind == "run" else _plan_state_dir)(item, plan, keep_last)
    if older_than is not None:
        cutoff = time.time() - older_than
        plan.kept += [(c.path, "younger than --older-than") for c in plan.candidates if c.modified > cutoff]
        plan.candidates = [c for c in plan.candidates if c.modified <= cutoff]
    return plan


def _enclosing(path: Path) -> tuple[Path | None, Path | None]:
    """The run folder strictly above ``path`` (if any), and the checkpoint at or above it."""
    checkpoint = None
    for folder in [Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents]:
        if read_marker(folder) is not None:
            return (folder, checkpoint) if folder != Path(os.path.abspath(path)) else (None, None)
        if checkpoint is None and checkpoint_state(folder) is not None:
            checkpoint = folder
    return None, checkpoint


def _recognised(path: Path, depth: int, plan: CleanPlan):
    """Run folders and state directories at or below ``path``; links are never entered."""
    if read_marker(path) is not None:
        yield "run", path
    elif is_state_dir(path):
        yield "state", path
    elif checkpoint_state(path) is not None:
        plan.kept.append((path, "a checkpoint outside its run's checkpoints/ folder (a copy): never removed by clean"))
    elif is_regular_file(path / RunFolder.CONFIG) and not os.path.lexists(path / RunFolder.MARKER):
        plan.kept.append((path, f"looks like a run of an older dsa-train (no {RunFolder.MARKER}): left alone"))
    elif depth > 0:
        try:
            children = real_directories(path)
        except OSError as e:  # unreadable (permission denied, say): say so and go on
            plan.kept.append((path, f"not searched: {e.strerror}"))
            return
        for child in children:
            yield from _recognised(child, depth - 1, plan)


def _plan_inside_run(run: Path, path: Path, inside: Path | None, plan: CleanPlan, keep_last: int) -> None:
    """``path`` lies inside the run folder ``run``: the run's plan, cut to what is below it."""
    holder = _run_holder(run)
    if holder:
        raise DsaError(
            f"'{path}' is inside the run '{run}', which is in progress ({holder}); clean never touches a live run",
            hint="wait for the run to end (or stop it), then clean again",
        )
    if inside is not None and Path(os.path.abspath(inside)) != Path(os.path.abspath(path)):
        raise DsaError(
            f"'{path}' is part of the checkpoint '{inside}'; clean never removes a checkpoint's contents on their own",
            hint=f"clean the run folder '{run}' (or its checkpoints/ folder) instead",
        )
    whole = CleanPlan()
    _plan_run(run, whole, keep_last)
    _take_below(whole, plan, path)


def _take_below(whole: CleanPlan, plan: CleanPlan, path: Path) -> None:
    """Add to ``plan`` what ``whole`` plans and keeps at or below ``path`` (compared by real
    paths: a rank folder's job is planned from its real path)."""
    target = Path(os.path.realpath(path))

    def below(p: Path) -> bool:
        p = Path(os.path.realpath(p))
        return p == target or target in p.parents

    plan.candidates += [c for c in whole.candidates if below(c.path)]
    plan.kept += [(p, why) for p, why in whole.kept if below(p)]


def _run_holder(run: Path) -> str | None:
    state = run / STATE
    return lock_holder(run) or (lock_holder(state) if state.is_dir() and not state.is_symlink() else None)


def _plan_state_dir(path: Path, plan: CleanPlan, keep_last: int) -> None:
    holder = lock_holder(path)
    if holder:
        plan.kept.append((path, f"in use by {holder}"))
        return
    plan.candidates.append(Candidate("state directory", path, allocated_bytes(path), _mtime(path / MANIFEST), path, ()))


def _plan_run(path: Path, plan: CleanPlan, keep_last: int) -> None:
    job = job_of(path)
    if job is not None:  # one rank's folder: planned with its whole job, whose steps it shares
        holder = lock_holder(job) if read_marker(job) is not None else None
        if holder:
            plan.kept.append((path, f"a rank of the torchrun job '{job}', which is in progress ({holder})"))
            return
        whole = CleanPlan()
        _plan_job(job, whole, keep_last)
        _take_below(whole, plan, path)
        return
    if is_job(path):
        _plan_job(path, plan, keep_last)
        return
    run = _survey(path, plan)
    if run is not None:
        keep = {
            c: f"one of the newest {keep_last} checkpoints (--keep-last)"
            for c in (run.complete[-keep_last:] if keep_last else [])
        }
        _settle(run, plan, _with_needs(run, keep))
        elsewhere = RunFolder(path).live_state_dir
        if elsewhere != path / STATE and os.path.isdir(elsewhere):  # the recipe's own optimizer.state_dir
            plan.kept.append(
                (
                    elsewhere,
                    f"the optimizer state of run '{path}', outside its folder (optimizer.state_dir): "
                    f"dsa-train clean {elsewhere} removes it once the run is finished",
                )
            )


@dataclass
class _Run:
    """What planning a run folder found: its marker, its own complete checkpoints (oldest
    first) and those of them whose optimizer state a live process holds (why each stays)."""

    path: Path
    marker: dict
    complete: list[Path]
    open: dict[Path, str]

    def step(self, step: int) -> Path | None:
        return next((c for c in self.complete if int(c.name) == step), None)


def _survey(path: Path, plan: CleanPlan) -> _Run | None:
    """A run folder's checkpoints, and its scratch folders planned; ``None`` (and why, in
    ``plan.kept``) for a run in progress."""
    holder = _run_holder(path)
    if holder:
        plan.kept.append((path, f"run in progress, {holder}"))
        return None
    marker = read_marker(path)
    if marker is None:  # gone or replaced since it was recognised
        plan.kept.append((path, f"no valid {RunFolder.MARKER}: left alone"))
        return None
    for name in (CHECKPOINTS, STATE):
        if (path / name).is_symlink():
            plan.kept.append((path / name, "a symbolic link: clean never follows links"))
    store = CheckpointStore.of_run(path)
    for folder in store.scratch():
        plan.candidates.append(
            Candidate(
                "unfinished checkpoint",
                folder,
                allocated_bytes(folder),
                _mtime(folder),
                path,
                (CHECKPOINTS, folder.name),
            )
        )
    complete = []
    for folder in store.complete():
        state = checkpoint_state(folder)
        if state is None:
            continue
        if state.get("run_id") == marker["run_id"]:
            complete.append(folder)
        else:
            plan.kept.append((folder, "a checkpoint of another run (its trainer.json names another run id)"))
    opened = {}
    for checkpoint in complete:
        holder = (
            lock_holder(checkpoint / STATE)
            if (checkpoint / STATE).is_dir() and not (checkpoint / STATE).is_symlink()
            else None
        )
        if holder:
            opened[checkpoint] = f"its optimizer state is open in {holder}"
    return _Run(path, marker, complete, opened)


def _with_needs(run: _Run, keep: dict[Path, str]) -> dict[Path, str]:
    """Why each kept checkpoint stays: an open optimizer state, ``keep``'s reason, or a kept
    checkpoint made of its deltas (``needs`` lists a chain whole)."""
    held = dict(run.open)
    for checkpoint, reason in keep.items():
        held.setdefault(checkpoint, reason)
    return CheckpointStore.of_run(run.path).retained(0, complete=run.complete, held=held)


def _settle(run: _Run, plan: CleanPlan, why: dict[Path, str], *, job: Path | None = None, keep_last: int = 0) -> None:
    """Plan a surveyed run: every complete checkpoint not in ``why`` goes, and the optimizer
    state of a finished run whose final checkpoint holds a copy."""
    path = run.path
    for checkpoint in run.complete:
        if checkpoint in why:
            plan.kept.append((checkpoint, why[checkpoint]))
        else:
            plan.candidates.append(
                Candidate(
                    "checkpoint",
                    checkpoint,
                    allocated_bytes(checkpoint),
                    _mtime(CheckpointStore.get_trainer_file(checkpoint)),
                    path,
                    (CHECKPOINTS, checkpoint.name),
                    job,
                    keep_last,
                )
            )
    state = path / STATE
    manifest = state_manifest(state) if state.is_dir() and not state.is_symlink() else None
    if manifest is not None and run.complete and _finished(path) and manifest["state_id"] == run.marker.get("state_id"):
        plan.candidates.append(
            Candidate(
                "finished run's optimizer state",
                state,
                allocated_bytes(state),
                _mtime(state / MANIFEST),
                path,
                (STATE,),
            )
        )


def _plan_job(job: Path, plan: CleanPlan, keep_last: int) -> None:
    """A torchrun job's folder: its own files as a run's (rank 0's machine), then every rank's
    folder, the steps each keeps decided for the whole job (:func:`_job_keeps`)."""
    if read_marker(job) is not None:
        holder = _run_holder(job)
        if holder:
            plan.kept.append((job, f"run in progress, {holder}"))
            return
        top = _survey(job, plan)  # a job's own folder holds no checkpoints; should it, they are a run's
        if top is not None:
            keep = {
                c: f"one of the newest {keep_last} checkpoints (--keep-last)"
                for c in (top.complete[-keep_last:] if keep_last else [])
            }
            _settle(top, plan, _with_needs(top, keep))
    if (job / RANKS).is_symlink():
        plan.kept.append((job / RANKS, "a symbolic link: clean never follows links"))
        return
    try:
        entries = job_ranks(job)
    except StateError as e:
        plan.kept.append((job / RANKS, f"not searched: {e.message}"))
        return
    ranks: list[tuple[RankFolder, _Run]] = []
    for entry in entries:
        if entry.problem == "a symbolic link":
            plan.kept.append((entry.path, "a symbolic link: clean never follows links"))
        elif entry.problem:
            plan.kept.append((entry.path, f"in the job's {RANKS}/ folder, but {entry.problem}: left alone"))
        else:
            run = _survey(entry.path, plan)
            if run is not None:
                ranks.append((entry, run))
    keeps = _job_keeps(job, ranks, keep_last)
    for entry, run in ranks:
        _settle(run, plan, keeps[entry.path], job=job, keep_last=keep_last)


def _job_keeps(job: Path, ranks: list[tuple[RankFolder, _Run]], keep_last: int) -> dict[Path, dict[Path, str]]:
    """Why each rank's kept checkpoints stay, by rank folder: the ``keep_last`` newest steps
    ``checkpoints.json`` lists as complete and every newer step; all of them when it cannot
    say which steps are complete; and its newest listed step while any rank keeps an older one."""
    listed = job_checkpoints(job)
    world, steps = listed if listed is not None else (None, [])
    newest = steps[-1] if steps else None
    lacking = [e.label for e, run in ranks if e.world_size == world and newest is not None and run.step(newest) is None]
    kept = set(steps[-keep_last:]) if keep_last else set()
    keeps = {}
    for entry, run in ranks:
        if listed is None:
            why = (
                f"no valid {JOB_MANIFEST} in the job's folder (it is on rank 0's machine, once a checkpoint of "
                "every rank is complete): no step is known complete"
            )
            keep = dict.fromkeys(run.complete, why)
        elif entry.world_size != world:
            keep = dict.fromkeys(
                run.complete, f"the job's {JOB_MANIFEST} is for {world} ranks, this folder is {entry.label}"
            )
        elif lacking:
            why = f"the job's {JOB_MANIFEST} lists step {newest} as complete, but {lacking[0]} has no checkpoint of it: every checkpoint kept"
            keep = dict.fromkeys(run.complete, why)
        else:
            keep = {}
            for checkpoint in run.complete:
                step = int(checkpoint.name)
                if step in kept:
                    keep[checkpoint] = (
                        f"one of the job's newest {keep_last} complete checkpoints (--keep-last, {JOB_MANIFEST})"
                    )
                elif newest is None or step > newest:
                    keep[checkpoint] = (
                        f"newer than the job's newest complete checkpoint ({JOB_MANIFEST}): one every rank may not have"
                    )
        keeps[entry.path] = _with_needs(run, keep)
    if newest is not None and any(int(c.name) < newest for why in keeps.values() for c in why):
        for entry, run in ranks:  # the step a resume starts from never goes while an older one stays
            newest_here = run.step(newest)
            if newest_here is not None and newest_here not in keeps[entry.path]:
                why = "the job's newest complete checkpoint: kept while a rank keeps an older one"
                keeps[entry.path] = _with_needs(run, {**keeps[entry.path], newest_here: why})
    return keeps


def _finished(run: Path) -> bool:
    """A summary record is the last thing a run logs (a torchrun job's rank then logs only
    its exchange's byte counts)."""
    metrics = run / RunFolder.METRICS
    if not is_regular_file(metrics):
        return False
    try:
        for line in reversed(metrics.read_text(errors="replace").splitlines()):
            kind = json.loads(line).get("kind")
            if kind != "exchange":
                return kind == "summary"
        return False
    except (OSError, ValueError, AttributeError):
        return False


# -- removing ------------------------------------------------------------------------------------
def remove(candidate: Candidate) -> None:
    """Remove one planned candidate, holding its owner's lock, after checking there, through
    descriptors that never follow a link, that it is still what it was planned as."""
    job = None
    if candidate.job is not None:  # a rank's checkpoint: no job may start (or commit) while it goes
        job = DirectoryLock(candidate.job, purpose="torchrun job folder", follow_link=False)
        try:
            job.acquire()
        except StateError as e:
            raise DsaError(f"'{candidate.path}' left alone: {e.message}") from None
    lock = DirectoryLock(
        candidate.owner, purpose="run folder" if candidate.parts else "state directory", follow_link=False
    )
    try:
        lock.acquire()  # a live run or optimizer holds it: refused, nothing removed
    except StateError as e:
        if job is not None:
            job.release()
        raise DsaError(f"'{candidate.path}' left alone: {e.message}") from None
    guard = None
    try:
        if job is not None:
            _check_job(job.fd, lock.fd, candidate)
        if candidate.kind == "state directory":
            _remove_state_dir(lock.fd, candidate)
        elif candidate.kind == "finished run's optimizer state":
            _remove_run_state(lock.fd, candidate)
        else:
            guard = _hold(STATE, lock.fd, candidate)  # an optimizer open on the run's state: a live run
            _remove_checkpoint(lock.fd, candidate)
    except OSError as e:
        raise DsaError(f"'{candidate.path}' could not be removed: {e.strerror or e}") from None
    finally:
        if guard is not None:
            os.close(guard)
        lock.release()
        if job is not None:
            job.release()


def _check_job(job_fd: int, run_fd: int, candidate: Candidate) -> None:
    """A rank's checkpoint goes only while the locked rank folder is still that rank's folder
    in the locked job folder, and the job's ``checkpoints.json``, read again there, still
    lists complete steps for its world size, this one neither among their ``keep_last``
    newest nor newer than all of them."""
    try:
        ranks_fd = _open_dir(RANKS, job_fd)
    except OSError:
        raise _changed(candidate, f"the job's {RANKS}/ is no longer a real folder") from None
    try:
        here = os.stat(candidate.owner.name, dir_fd=ranks_fd, follow_symlinks=False)
    except OSError:
        here = None
    finally:
        os.close(ranks_fd)
    if here is None or not os.path.samestat(here, os.fstat(run_fd)):
        raise _changed(candidate, f"its rank folder is no longer the one in the job's {RANKS}/")
    listed, named = job_checkpoints(None, dir_fd=job_fd), rank_name(candidate.owner.name)
    step, keep = int(candidate.parts[1]), candidate.keep_last
    if (
        listed is None
        or named is None
        or named[1] != listed[0]
        or not listed[1]
        or step > listed[1][-1]
        or (keep and step in listed[1][-keep:])
    ):
        raise _changed(candidate, f"the job's {JOB_MANIFEST} no longer lets it go")


def _hold(name: str, parent_fd: int, candidate: Candidate) -> int | None:
    """Lock the state directory ``name`` in ``parent_fd`` (if it is one) for the removal; a
    ``DsaError`` when a live optimizer holds it. Returns the descriptor to close."""
    try:
        fd = _open_dir(name, parent_fd)
    except OSError:
        return None  # absent, or not a real folder: nothing to hold
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DsaError(f"'{candidate.path}' left alone: an optimizer holds its run's (or its own) {name}/") from None
    return fd


def _changed(candidate: Candidate, why: str) -> DsaError:
    return DsaError(f"'{candidate.path}' changed since it was planned ({why}); left alone")


def _open_dir(name: str, parent_fd: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)


def _remove_checkpoint(run_fd: int, candidate: Candidate) -> None:
    marker = read_json_object(RunFolder.MARKER, dir_fd=run_fd)
    folder, name = candidate.parts
    try:
        checkpoints_fd = _open_dir(folder, run_fd)
    except OSError:
        raise _changed(candidate, f"{folder}/ is no longer a real folder") from None
    try:
        try:
            checkpoint_fd = _open_dir(name, checkpoints_fd)
        except OSError:
            raise _changed(candidate, "it is no longer a real folder") from None
        inner = None
        try:
            inner = _hold(STATE, checkpoint_fd, candidate)  # someone opened the checkpoint's copy: leave it
            if candidate.kind == "checkpoint":
                state = read_json_object(TRAINER, dir_fd=checkpoint_fd)
                if not (
                    marker
                    and state
                    and state.get("format") == CHECKPOINT_FORMAT
                    and state.get("run_id") == marker.get("run_id")
                ):
                    raise _changed(candidate, "it is no longer a checkpoint of this run")
                doomed = CheckpointStore.get_doomed_dir(Path(name)).name
                os.rename(name, doomed, src_dir_fd=checkpoints_fd, dst_dir_fd=checkpoints_fd)  # incomplete from here
                name = doomed
            elif not CheckpointStore.is_scratch_name(name):
                raise _changed(candidate, "not a scratch folder")
            if not os.path.samestat(os.fstat(checkpoint_fd), os.lstat(name, dir_fd=checkpoints_fd)):
                raise _changed(candidate, "it was replaced")
            shutil.rmtree(name, dir_fd=checkpoints_fd)  # descriptor-based: never follows a link
        finally:
            if inner is not None:
                os.close(inner)
            os.close(checkpoint_fd)
    finally:
        os.close(checkpoints_fd)


def _remove_run_state(run_fd: int, candidate: Candidate) -> None:
    marker = read_json_object(RunFolder.MARKER, dir_fd=run_fd)
    state_fd = _hold(STATE, run_fd, candidate)  # an optimizer has it open: refused
    if state_fd is None:
        raise _changed(candidate, "it is no longer a real folder")
    try:
        manifest = read_json_object(MANIFEST, dir_fd=state_fd)
        if not (
            marker
            and manifest
            and manifest.get("format") == STATE_FORMAT
            and manifest.get("state_id") == marker.get("state_id")
        ):
            raise _changed(candidate, "its manifest no longer names this run's state")
        shutil.rmtree(STATE, dir_fd=run_fd)
    finally:
        os.close(state_fd)


def _remove_state_dir(state_fd: int, candidate: Candidate) -> None:
    """The manifest's row files, then the manifest, then the folder if nothing else is in it."""
    manifest = read_json_object(MANIFEST, dir_fd=state_fd)
    if not (manifest and manifest.get("format") == STATE_FORMAT and isinstance(manifest.get("params"), dict)):
        raise _changed(candidate, "it has no DiskSparseAdam manifest any more")
    names = []
    for entry in manifest["params"].values():
        if isinstance(entry, dict) and isinstance(entry.get("file"), str) and entry.get("layout") != TABLE_LAYOUT:
            file = entry["file"]
            if "/" not in file and file.endswith(ROWS_SUFFIX):
                names += [file, file.removesuffix(ROWS_SUFFIX) + PENDING_SUFFIX]
    scratch = (DirectoryLock.FILE_NAME + ".tmp-", f".{MANIFEST}.tmp-", ".write-probe-")  # our own temporary names
    names += [name for name in os.listdir(state_fd) if name.startswith(scratch)]
    for name in [*names, DirectoryLock.FILE_NAME, MANIFEST]:
        try:
            info = os.lstat(name, dir_fd=state_fd)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            os.unlink(name, dir_fd=state_fd)
    left = sorted(os.listdir(state_fd))
    if left:
        raise DsaError(
            f"removed the optimizer state in '{candidate.path}' but kept the folder: it also holds "
            f"{', '.join(left[:3])}{' ...' if len(left) > 3 else ''}, which dsa-train did not write"
        )
    os.rmdir(candidate.path)
