"""Finding what ``dsa-train clean`` may remove, and removing exactly that.

Only things recognised by their own markers are ever candidates:

* a run folder's older checkpoints (``checkpoints/<step>/`` with a ``trainer.json``), all but
  the newest ``keep_last`` (the newest is kept unless ``keep_last`` is 0), and checkpoints
  left half-written or half-removed by a killed process (``checkpoints/.partial-*``,
  ``checkpoints/.deleting-*``);
* the live ``optimizer_state/`` of a finished run (its final checkpoint holds a copy);
* a standalone DiskSparseAdam state directory (its ``manifest.json`` names the format).

A directory whose lock a live process holds is never a candidate, symbolic links are never
followed (a link is neither entered nor counted), and every candidate is checked again just
before it is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DsaError
from ..optim.inspect import live_holder
from ..optim.format import MANIFEST, STATE_FORMAT
from .run_folder import TRAINER, RunFolder, complete_checkpoints, scratch_folders

SEARCH_DEPTH = 3  # how deep below a given folder runs and state directories are looked for


@dataclass
class Candidate:
    kind: str
    path: Path
    bytes: int
    modified: float


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


def is_state_dir(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == STATE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def is_run_folder(path: Path) -> bool:
    return (path / RunFolder.CONFIG).is_file() and any((path / p).exists() for p in (RunFolder.METRICS, "checkpoints"))


def allocated_bytes(path: Path) -> int:
    """Bytes a file or folder really occupies (sparse holes excluded); links are not followed."""
    info = path.lstat()
    if not path.is_dir() or path.is_symlink():
        return info.st_blocks * 512
    total = info.st_blocks * 512
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def plan_clean(paths: list[Path], *, keep_last: int = 1, older_than: float | None = None) -> CleanPlan:
    """What cleaning ``paths`` would remove; a ``DsaError`` for a path that is none of ours."""
    plan = CleanPlan()
    cutoff = None if older_than is None else time.time() - older_than
    for path in paths:
        if path.is_symlink():
            raise DsaError(f"'{path}' is a symbolic link; clean does not follow links", hint="pass the real path")
        if not path.is_dir():
            raise DsaError(f"'{path}' is not a directory", hint="pass a run folder, a state directory, or a folder holding them")
        found = list(_recognised(path, SEARCH_DEPTH))
        if not found:
            raise DsaError(
                f"'{path}' is not a run folder or a DiskSparseAdam state directory, and holds none",
                hint="clean only removes what dsa-train made; pass e.g. runs/ or ./opt_state_cache",
            )
        for kind, item in found:
            (_plan_run if kind == "run" else _plan_state_dir)(item, plan, keep_last)
    if cutoff is not None:
        young = [c for c in plan.candidates if c.modified > cutoff]
        plan.kept += [(c.path, "younger than --older-than") for c in young]
        plan.candidates = [c for c in plan.candidates if c.modified <= cutoff]
    return plan


def _recognised(path: Path, depth: int):
    """Run folders and state directories at or below ``path`` (links not followed)."""
    if is_run_folder(path):
        yield "run", path
    elif is_state_dir(path):
        yield "state", path
    elif depth > 0:
        for child in sorted(path.iterdir()):
            if child.is_dir() and not child.is_symlink():
                yield from _recognised(child, depth - 1)


def _plan_state_dir(path: Path, plan: CleanPlan, keep_last: int) -> None:
    holder = live_holder(path)
    if holder:
        plan.kept.append((path, f"in use by {holder}"))
        return
    plan.candidates.append(Candidate("state directory", path, allocated_bytes(path), (path / MANIFEST).stat().st_mtime))


def _plan_run(path: Path, plan: CleanPlan, keep_last: int) -> None:
    run = RunFolder(path)
    state_dirs = [d for d in (path / "optimizer_state",) if d.is_dir()]
    holder = next((h for h in map(live_holder, [path, *state_dirs]) if h), None)
    if holder:
        plan.kept.append((path, f"run in progress, {holder}"))
        return
    for scratch in scratch_folders(run.checkpoints):
        plan.candidates.append(Candidate("unfinished checkpoint", scratch, allocated_bytes(scratch), scratch.stat().st_mtime))
    complete = complete_checkpoints(run.checkpoints)
    keep = complete[len(complete) - keep_last :] if keep_last else []
    for checkpoint in complete:
        if checkpoint in keep:
            plan.kept.append((checkpoint, f"one of the newest {keep_last} checkpoints (--keep-last)"))
        else:
            plan.candidates.append(
                Candidate("checkpoint", checkpoint, allocated_bytes(checkpoint), (checkpoint / TRAINER).stat().st_mtime)
            )
    for state_dir in state_dirs:
        if _finished(run) and complete and is_state_dir(state_dir):
            plan.candidates.append(
                Candidate("finished run's optimizer state", state_dir, allocated_bytes(state_dir), (state_dir / MANIFEST).stat().st_mtime)
            )


def _finished(run: RunFolder) -> bool:
    """A summary record is the last thing a run logs."""
    try:
        lines = run.metrics_path.read_text().splitlines()
        return bool(lines) and json.loads(lines[-1]).get("kind") == "summary"
    except (OSError, ValueError):
        return False


def remove(candidate: Candidate) -> None:
    """Remove one planned candidate after checking it is still what it was planned as."""
    path = candidate.path
    if path.is_symlink() or not path.is_dir():
        raise DsaError(f"'{path}' changed since it was planned (it is no longer a directory); left alone")
    if candidate.kind in ("state directory", "finished run's optimizer state"):
        if not is_state_dir(path) or live_holder(path):
            raise DsaError(f"'{path}' changed since it was planned (no longer a free state directory); left alone")
    elif candidate.kind == "checkpoint" and not (path / TRAINER).is_file():
        raise DsaError(f"'{path}' changed since it was planned (no longer a checkpoint); left alone")
    shutil.rmtree(path)
