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
from ..fsutil import DirectoryLock, is_regular_file, lock_holder, read_json_object
from ..optim.format import MANIFEST, PENDING_SUFFIX, ROWS_SUFFIX, STATE_FORMAT, TABLE_LAYOUT
from .run_folder import CHECKPOINT_FORMAT, DOOMED, PARTIAL, TRAINER, RunFolder, checkpoint_needs, read_marker, real_directories

SEARCH_DEPTH = 3  # how deep below a given folder runs and state directories are looked for
STATE = "optimizer_state"
CHECKPOINTS = "checkpoints"


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
        raise DsaError(f"--older-than {text!r} is not an age", hint="write a number and a unit: 90s, 30m, 12h, 7d or 2w")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match[2]]


# -- recognising ---------------------------------------------------------------------------------
def state_manifest(path: Path) -> dict | None:
    manifest = read_json_object(path / MANIFEST)
    return manifest if manifest and manifest.get("format") == STATE_FORMAT and isinstance(manifest.get("state_id"), str) else None


def is_state_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode) and state_manifest(path) is not None
    except OSError:
        return False


def checkpoint_state(path: Path) -> dict | None:
    state = read_json_object(path / TRAINER)
    return state if state and state.get("format") == CHECKPOINT_FORMAT else None


def allocated_bytes(path: Path) -> int:
    """Bytes a file or folder really occupies (sparse holes excluded); links are not followed."""
    try:
        info = path.lstat()
    except OSError:
        return 0
    total = info.st_blocks * 512
    if stat.S_ISDIR(info.st_mode):
        for root, dirs, files in os.walk(path, followlinks=False):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total


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
            raise DsaError(f"'{path}' is not a directory", hint="pass a run folder, a state directory, or a folder holding them")
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
    target = Path(os.path.abspath(path))

    def below(p: Path) -> bool:
        p = Path(os.path.abspath(p))
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
    holder = _run_holder(path)
    if holder:
        plan.kept.append((path, f"run in progress, {holder}"))
        return
    marker = read_marker(path)
    for name in (CHECKPOINTS, STATE):
        if (path / name).is_symlink():
            plan.kept.append((path / name, "a symbolic link: clean never follows links"))
    checkpoints = path / CHECKPOINTS
    complete = []
    for folder in real_directories(checkpoints) if not checkpoints.is_symlink() else []:
        if folder.name.startswith((PARTIAL, DOOMED)):
            plan.candidates.append(
                Candidate("unfinished checkpoint", folder, allocated_bytes(folder), _mtime(folder), path, (CHECKPOINTS, folder.name))
            )
        elif folder.name.isdigit() and checkpoint_state(folder) is not None:
            if checkpoint_state(folder).get("run_id") == marker["run_id"]:
                complete.append(folder)
            else:
                plan.kept.append((folder, "a checkpoint of another run (its trainer.json names another run id)"))
    keep = complete[len(complete) - keep_last :] if keep_last else []
    why: dict[Path, str] = {}
    for checkpoint in complete:
        holder = lock_holder(checkpoint / STATE) if (checkpoint / STATE).is_dir() and not (checkpoint / STATE).is_symlink() else None
        if holder:
            why[checkpoint] = f"its optimizer state is open in {holder}"
        elif checkpoint in keep:
            why[checkpoint] = f"one of the newest {keep_last} checkpoints (--keep-last)"
    for kept in list(why):  # a kept checkpoint's chain (needs lists it whole) stays with it
        for name in checkpoint_needs(kept):
            why.setdefault(kept.parent / name, f"checkpoint {kept.name} is made of its deltas on this one: kept with it")
    for checkpoint in complete:
        if checkpoint in why:
            plan.kept.append((checkpoint, why[checkpoint]))
        else:
            plan.candidates.append(
                Candidate("checkpoint", checkpoint, allocated_bytes(checkpoint), _mtime(checkpoint / TRAINER), path, (CHECKPOINTS, checkpoint.name))
            )
    state = path / STATE
    manifest = state_manifest(state) if state.is_dir() and not state.is_symlink() else None
    if manifest is not None and complete and _finished(path) and manifest["state_id"] == marker.get("state_id"):
        plan.candidates.append(
            Candidate("finished run's optimizer state", state, allocated_bytes(state), _mtime(state / MANIFEST), path, (STATE,))
        )


def _finished(run: Path) -> bool:
    """A summary record is the last thing a run logs."""
    metrics = run / RunFolder.METRICS
    if not is_regular_file(metrics):
        return False
    try:
        lines = metrics.read_text(errors="replace").splitlines()
        return bool(lines) and json.loads(lines[-1]).get("kind") == "summary"
    except (OSError, ValueError, AttributeError):
        return False


# -- removing ------------------------------------------------------------------------------------
def remove(candidate: Candidate) -> None:
    """Remove one planned candidate, holding its owner's lock, after checking there, through
    descriptors that never follow a link, that it is still what it was planned as."""
    lock = DirectoryLock(candidate.owner, purpose="run folder" if candidate.parts else "state directory", follow_link=False)
    try:
        lock.acquire()  # a live run or optimizer holds it: refused, nothing removed
    except StateError as e:
        raise DsaError(f"'{candidate.path}' left alone: {e.message}") from None
    guard = None
    try:
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
                if not (marker and state and state.get("format") == CHECKPOINT_FORMAT and state.get("run_id") == marker.get("run_id")):
                    raise _changed(candidate, "it is no longer a checkpoint of this run")
                doomed = DOOMED + name
                os.rename(name, doomed, src_dir_fd=checkpoints_fd, dst_dir_fd=checkpoints_fd)  # incomplete from here
                name = doomed
            elif not name.startswith((PARTIAL, DOOMED)):
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
        if not (marker and manifest and manifest.get("format") == STATE_FORMAT and manifest.get("state_id") == marker.get("state_id")):
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
