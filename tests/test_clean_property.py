"""``dsa-train clean`` over generated hostile trees: it removes only what it planned, never
follows, removes or writes through a link, never touches a live run or state directory,
never removes a checkpoint's contents on their own, and removes every candidate it did not
refuse.

The trees are hand-written marker files (no training), under ``area/`` (the folder cleaned)
next to ``outside/`` (never passed to clean, only reachable through links).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsa_train.errors import DsaError
from dsa_train.fsutil import DirectoryLock, lock_holder
from dsa_train.storage.format import STATE_FORMAT
from dsa_train.runs.cleanup import plan_clean, remove
from dsa_train.runs.checkpoint_layout import CHECKPOINT_FORMAT
from dsa_train.runs.run_folder import RUN_FORMAT

OTHER_RUN = "f" * 32


def run_id(i: int) -> str:
    return f"{0xA0 + i:02x}" * 16


def state_id(i: int) -> str:
    return f"{0x50 + i:02x}" * 16


# -- writing marker files ------------------------------------------------------------------------
def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def make_state(folder: Path, sid: str | None, *, foreign_file: bool = False, rows_link: Path | None = None) -> None:
    """A DiskSparseAdam state directory: its manifest and the row file it lists."""
    write_json(
        folder / "manifest.json",
        {
            "format": STATE_FORMAT,
            "version": 1,
            "state_id": sid,
            "clean": True,
            "params": {"w": {"file": "w.rows", "layout": "m|v", "shape": [4, 2], "dtype": "float32"}},
        },
    )
    if rows_link is not None:
        (folder / "w.rows").symlink_to(rows_link)
    else:
        (folder / "w.rows").write_bytes(b"DSA-TRAIN ROWS\n" + folder.name.encode() * 8)
    if foreign_file:
        (folder / "thesis.tex").write_text("precious, not ours")


def make_checkpoint(folder: Path, rid: str, step: int, *, state: str = "real", link_to: Path | None = None) -> None:
    """A checkpoint folder: trainer.json naming ``rid``, model.pt, optimizer_state/ (a real
    state directory, a link to ``link_to``, or none), and optionally a link to a file."""
    write_json(folder / "trainer.json", {"format": CHECKPOINT_FORMAT, "version": 2, "run_id": rid, "step": step})
    (folder / "model.pt").write_bytes(b"weights %d" % step)
    if state == "real":
        make_state(folder / "optimizer_state", state_id(step))
    elif state == "link":
        (folder / "optimizer_state").symlink_to(link_to)


def make_run_files(folder: Path, rid: str, sid: str | None, *, finished: bool) -> None:
    write_json(folder / "run.json", {"format": RUN_FORMAT, "version": 1, "run_id": rid, "state_id": sid})
    (folder / "config.yaml").write_text("name: tiny\n")
    lines = [{"kind": "step", "step": 1, "loss": 0.5}] + ([{"kind": "summary", "loss": 0.25}] if finished else [])
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


# -- what a tree is ------------------------------------------------------------------------------
checkpoint_specs = st.fixed_dictionaries(
    {
        "foreign_id": st.sampled_from([False, False, True]),  # its trainer.json names another run
        "state": st.sampled_from(["real", "real", "link", "none"]),  # optimizer_state/: real, a link to outside/, none
        "file_link": st.booleans(),  # a link inside it to a file outside/
    }
)

run_specs = st.fixed_dictionaries(
    {
        "depth": st.sampled_from([1, 1, 1, 2, 3, 4]),  # 4: below clean's search depth, never found
        "checkpoints": st.integers(0, 3).flatmap(lambda n: st.lists(checkpoint_specs, min_size=n, max_size=n)),
        "scratch": st.lists(
            st.sampled_from([".partial-0000000009", ".deleting-0000000004", ".partial-x"]), unique=True, max_size=2
        ),
        "finished": st.booleans(),
        "state": st.sampled_from(["match", "match", "mismatch", "none", "link", "null-id"]),
        "live": st.sampled_from(["no", "no", "no", "run", "state"]),
        "checkpoints_link": st.integers(0, 5).map(lambda x: x == 5),  # checkpoints/ is a link to outside/
        "linked_children": st.booleans(),  # links in checkpoints/ named like checkpoints, to outside/
        "lock_link": st.integers(0, 5).map(lambda x: x == 5),  # .lock is a link to a file outside/
        "metrics_link": st.integers(0, 5).map(lambda x: x == 5),  # metrics.jsonl is a link to a finished log
    }
)

state_specs = st.fixed_dictionaries(
    {
        "depth": st.sampled_from([1, 2, 3, 4]),
        "live": st.booleans(),
        "foreign_file": st.booleans(),
        "rows_link": st.integers(0, 3).map(lambda x: x == 3),
    }
)

FOREIGN = ["checkpoints_folder", "partial_folder", "other_manifest", "other_run_json", "old_run"]
LINKS = [
    "to_outside",
    "to_outside_run",
    "to_outside_file",
    "to_run_inside",
    "to_file_inside",
    "optimizer_state",
    "dangling",
]

trees = st.fixed_dictionaries(
    {
        "runs": st.lists(run_specs, min_size=1, max_size=3),
        "states": st.lists(state_specs, max_size=2),
        "foreign": st.lists(st.sampled_from(FOREIGN), unique=True),
        "copies": st.lists(st.sampled_from([1, 2, 3]), max_size=2),  # depth of each checkpoint copy
        "links": st.lists(st.sampled_from(LINKS), unique=True),
        "keep_last": st.integers(0, 2),
    }
)


def nest(area: Path, depth: int, name: str) -> Path:
    """``area/<name>`` (depth 1) or ``area/d1/.../<name>`` (deeper)."""
    return area.joinpath(*[f"{name}-d{i}" for i in range(1, depth)], name)


def build(root: Path, tree: dict, *, live_checkpoint_states: bool = False) -> tuple[list[Path], list[dict]]:
    """Write ``tree`` under ``root``; returns the folders to hold live, and what each run is."""
    area, outside = root / "area", root / "outside"
    area.mkdir()
    outside.mkdir()
    (outside / "precious.txt").write_text("precious")
    (outside / "finished.jsonl").write_text(json.dumps({"kind": "summary"}) + "\n")
    make_state(outside / "state", state_id(90))
    elsewhere = outside / "run"  # a whole finished run, with old checkpoints and a matching state
    make_run_files(elsewhere, run_id(90), state_id(91), finished=True)
    make_state(elsewhere / "optimizer_state", state_id(91))
    for step in (1, 2, 3):
        make_checkpoint(elsewhere / "checkpoints" / f"{step:010d}", run_id(90), step)
    (elsewhere / "checkpoints" / ".partial-0000000004").mkdir()

    live: list[Path] = []
    runs: list[dict] = []
    for i, spec in enumerate(tree["runs"]):
        rid = run_id(i)
        run = nest(area, spec["depth"], f"run{i}")
        sid = {
            "match": state_id(10 + i),
            "mismatch": state_id(10 + i),
            "none": state_id(10 + i),
            "link": state_id(10 + i),
            "null-id": None,
        }[spec["state"]]
        make_run_files(run, rid, sid, finished=spec["finished"])
        if spec["metrics_link"]:
            (run / "metrics.jsonl").unlink()
            (run / "metrics.jsonl").symlink_to(outside / "finished.jsonl")
        if spec["state"] in ("match", "null-id"):
            make_state(run / "optimizer_state", state_id(10 + i) if spec["state"] == "match" else state_id(80))
        elif spec["state"] == "mismatch":
            make_state(run / "optimizer_state", state_id(70 + i))
        elif spec["state"] == "link":
            (run / "optimizer_state").symlink_to(outside / "state")
        own = []
        if spec["checkpoints_link"]:  # checkpoints/ itself is a link to checkpoint-looking folders outside/
            target = outside / f"checkpoints-of-run{i}"
            for step in (1, 2, 3):
                make_checkpoint(target / f"{step:010d}", rid, step)
            make_state(target / ".partial-0000000005" / "optimizer_state", state_id(5))
            (target / ".deleting-0000000002").mkdir()
            (target / ".deleting-0000000002" / "notes.txt").write_text("precious")
            (run / "checkpoints").symlink_to(target)
        else:
            checkpoints = run / "checkpoints"
            checkpoints.mkdir()
            for n, c in enumerate(spec["checkpoints"]):
                step = 10 * (n + 1)
                folder = checkpoints / f"{step:010d}"
                make_checkpoint(
                    folder, OTHER_RUN if c["foreign_id"] else rid, step, state=c["state"], link_to=outside / "state"
                )
                if c["file_link"]:
                    (folder / "notes.txt").symlink_to(outside / "precious.txt")
                if not c["foreign_id"]:
                    own.append(folder)
                if live_checkpoint_states and c["state"] == "real" and n == 0:
                    live.append(folder / "optimizer_state")
            for name in spec["scratch"]:  # what a killed save or prune left
                make_state(checkpoints / name / "optimizer_state", state_id(6))
                (checkpoints / name / "notes.txt").symlink_to(outside / "precious.txt")
            if spec["linked_children"]:
                target = outside / f"fake-checkpoint-of-run{i}"
                make_checkpoint(target, rid, 99)
                (checkpoints / "0000000099").symlink_to(target)
                scratch = outside / f"scratch-of-run{i}"
                scratch.mkdir()
                (scratch / "thesis.tex").write_text("precious")
                (checkpoints / ".partial-0000000098").symlink_to(scratch)
        if spec["live"] == "run":
            live.append(run)
        elif spec["live"] == "state" and spec["state"] in ("match", "mismatch", "null-id"):
            live.append(run / "optimizer_state")
        lock_link = spec["lock_link"] and run not in live
        if lock_link:
            (run / ".lock").symlink_to(outside / "precious.txt")
        runs.append({"path": run, "spec": spec, "own": own, "lock_link": lock_link})

    for i, spec in enumerate(tree["states"]):
        folder = nest(area, spec["depth"], f"state{i}")
        folder.mkdir(parents=True)
        make_state(
            folder,
            state_id(40 + i),
            foreign_file=spec["foreign_file"],
            rows_link=outside / "precious.txt" if spec["rows_link"] else None,
        )
        if spec["live"]:
            live.append(folder)

    foreign = set(tree["foreign"])
    if "checkpoints_folder" in foreign:  # a checkpoints/ folder with no run around it
        make_checkpoint(area / "checkpoints" / "0000000001", run_id(0), 1)
        (area / "checkpoints" / ".partial-0000000002").mkdir(parents=True)
        (area / "checkpoints" / ".partial-0000000002" / "notes.txt").write_text("precious")
        make_state(
            area / "checkpoints" / ".partial-0000000002" / "optimizer_state", state_id(7)
        )  # a standalone state dir by its markers
    if "partial_folder" in foreign:
        (area / ".partial-1").mkdir()
        (area / ".partial-1" / "thesis.tex").write_text("precious")
    if "other_manifest" in foreign:  # a manifest.json that is not ours, next to a .rows file
        write_json(
            area / "webapp" / "manifest.json",
            {"name": "my app", "state_id": "abc", "params": {"w": {"file": "w.rows"}}},
        )
        (area / "webapp" / "w.rows").write_text("precious")
    if "other_run_json" in foreign:  # a run.json of another format, with what looks like a run's checkpoints
        write_json(
            area / "other-tool" / "run.json", {"format": "other-tool/run", "run_id": run_id(0), "state_id": None}
        )
        (area / "other-tool" / "metrics.jsonl").write_text(json.dumps({"kind": "summary"}) + "\n")
        make_checkpoint(area / "other-tool" / "checkpoints" / "0000000001", run_id(0), 1)
        make_state(area / "other-tool" / "optimizer_state", state_id(8))  # a standalone state dir by its markers
    if "old_run" in foreign:  # a run of an older dsa-train (no run.json)
        (area / "old-run" / "checkpoints" / "0000000001").mkdir(parents=True)
        (area / "old-run" / "config.yaml").write_text("name: old\n")
        make_state(area / "old-run" / "optimizer_state", state_id(60))
    for i, depth in enumerate(tree["copies"]):  # a copy of a checkpoint, outside any run
        make_checkpoint(nest(area, depth, f"backup{i}") / "0000000010", run_id(0), 10)

    links = set(tree["links"])
    if "to_outside" in links:
        (area / "to-outside").symlink_to(outside)
    if "to_outside_run" in links:
        (area / "run-elsewhere").symlink_to(elsewhere)
    if "to_outside_file" in links:
        (area / "precious.txt").symlink_to(outside / "precious.txt")
    if "to_run_inside" in links:
        (area / "alias").symlink_to(runs[0]["path"] if runs else area / "missing")
    if "to_file_inside" in links:
        (area / "alias.rows").symlink_to(
            nest(area, tree["states"][0]["depth"], "state0") / "w.rows" if tree["states"] else area / "missing.rows"
        )
    if "optimizer_state" in links:
        (area / "optimizer_state").symlink_to(outside / "state")
    if "dangling" in links:
        (area / "dangling").symlink_to(root / "nowhere")
    return live, runs


# -- checking ------------------------------------------------------------------------------------
def snapshot(root: Path) -> dict[Path, tuple]:
    """Every path below ``root`` (links never followed): a folder, a file's digest, a link's target."""
    found = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(folder, name)
            if path.is_symlink():
                found[path] = ("link", os.readlink(path))
            elif path.is_dir():
                found[path] = ("dir",)
            else:
                found[path] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def checkpoints_in(root: Path) -> list[Path]:
    """Every real folder with a valid trainer.json (regular file, our format), anywhere."""
    found = []
    for folder, _dirs, files in os.walk(root, followlinks=False):
        trainer = Path(folder, "trainer.json")
        if "trainer.json" in files and not trainer.is_symlink():
            try:
                if json.loads(trainer.read_bytes()).get("format") == CHECKPOINT_FORMAT:
                    found.append(Path(folder))
            except ValueError:
                pass
    return found


def below(path: Path, top: Path) -> bool:
    return path == top or top in path.parents


def is_run(folder: Path) -> bool:
    marker = folder / "run.json"
    try:
        return not marker.is_symlink() and json.loads(marker.read_bytes()).get("format") == RUN_FORMAT
    except (OSError, ValueError):
        return False


def clean_and_check(tree: dict, *, live_checkpoint_states: bool = False) -> None:
    root = Path(os.path.realpath(tempfile.mkdtemp(prefix="clean-prop-")))
    locks = []
    try:
        live, runs = build(root, tree, live_checkpoint_states=live_checkpoint_states)
        for folder in live:  # a live process holds these (flock conflicts even within one process)
            lock = DirectoryLock(folder, purpose="live")
            lock.acquire()
            locks.append(lock)
        area, outside = root / "area", root / "outside"
        before = snapshot(root)
        checkpoints = checkpoints_in(root)
        k = tree["keep_last"]
        try:
            plan = plan_clean([area], keep_last=k)
        except DsaError as e:  # an area with nothing of ours in it
            assert "holds none" in e.message, e
            plan = None
        candidates = [Path(c.path) for c in plan.candidates] if plan else []
        owners = {Path(c.owner) for c in plan.candidates} if plan else set()
        refused = {}
        for candidate in plan.candidates if plan else []:
            try:
                remove(candidate)
            except DsaError as e:
                refused[Path(candidate.path)] = e.message
        after = snapshot(root)
        event(f"candidates: {min(len(candidates), 5)}{'+' if len(candidates) >= 5 else ''}, refused: {bool(refused)}")

        def under_candidate(path: Path) -> bool:
            return any(below(path, c) for c in candidates)

        # 0. every candidate is a real path inside area/, never a link nor below one
        for c in candidates:
            assert below(c, area) and c != area, c
            assert before.get(c) == ("dir",), f"candidate {c} is {before.get(c)}"
            assert not any(before.get(p, ("dir",))[0] == "link" for p in c.parents if below(p, root)), c

        # 1. every path that disappeared is a planned candidate's path or below one
        gone = sorted(set(before) - set(after))
        stray = [p for p in gone if not under_candidate(p)]
        assert not stray, f"removed without being planned: {stray}"
        # ... and nothing appeared or changed except the lock record remove() writes in an owner
        lock_records = {o / DirectoryLock.FILE_NAME for o in owners}
        new = [p for p in set(after) - set(before) if p not in lock_records]
        changed = [p for p in set(before) & set(after) if before[p] != after[p] and p not in lock_records]
        assert not new and not changed, f"appeared: {new}, changed: {changed}"

        # 2. outside/ byte for byte, and every link still there with its target (one below a
        # removed candidate goes with the folder it is in: the link, never what it points to)
        assert {p: v for p, v in before.items() if below(p, outside)} == {
            p: v for p, v in after.items() if below(p, outside)
        }
        for path, value in before.items():
            if value[0] == "link" and not (path in gone and under_candidate(path)):
                assert after.get(path) == value, f"link {path} became {after.get(path)}"

        # 3. nothing inside a live (locked) run or state directory changed
        for folder in live:
            inside = {p: v for p, v in before.items() if below(p, folder)}
            assert inside == {p: v for p, v in after.items() if below(p, folder)}, f"live {folder} changed"

        # 4. a checkpoint loses nothing unless it went whole, and a copy outside a run nothing at all
        for checkpoint in checkpoints:
            lost = [p for p in gone if below(p, checkpoint)]
            if lost:
                assert under_candidate(checkpoint), f"{lost} removed from checkpoint {checkpoint} on their own"
            if not any(is_run(p) for p in checkpoint.parents if below(p, root)):
                assert not lost, f"{lost} removed from the copy {checkpoint}"

        # 5. every candidate that was not refused is gone
        for c in candidates:
            if c not in refused:
                assert not os.path.lexists(c), f"{c} planned, not refused, still there"

        # 6. and clean does its job: a reachable idle run keeps exactly its newest keep_last checkpoints
        for run in runs:
            spec, path = run["spec"], run["path"]
            if spec["depth"] > 3 or spec["checkpoints_link"] or run["lock_link"] or any(below(f, path) for f in live):
                continue
            if lock_holder(path):  # another process's flock on an equal inode number (other fs): skip
                continue
            left = [p for p in run["own"] if os.path.lexists(p)]
            assert left == (run["own"][-k:] if k else []), f"{path}: kept {left} of {run['own']} with keep_last={k}"
    finally:
        for lock in locks:
            lock.release()
        shutil.rmtree(root, ignore_errors=True)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(tree=trees)
def test_clean_removes_only_what_it_planned(tree):
    clean_and_check(tree, live_checkpoint_states=True)


# -- the nastiest cases, written out -------------------------------------------------------------
def one_run(root: Path, *, checkpoints: int = 3, finished: bool = True) -> Path:
    run = root / "area" / "run"
    make_run_files(run, run_id(0), state_id(0), finished=finished)
    make_state(run / "optimizer_state", state_id(0))
    for n in range(1, checkpoints + 1):
        make_checkpoint(run / "checkpoints" / f"{10 * n:010d}", run_id(0), 10 * n)
    return run


def test_a_runs_checkpoints_linked_to_outside_is_never_entered(tmp_path):
    outside = tmp_path / "outside"
    for step in (1, 2, 3):
        make_checkpoint(outside / f"{step:010d}", run_id(0), step)
    (outside / ".partial-0000000004").mkdir()
    (outside / ".partial-0000000004" / "thesis.tex").write_text("precious")
    (outside / ".deleting-0000000005").mkdir()
    run = one_run(tmp_path, checkpoints=0)
    (run / "checkpoints").symlink_to(outside)
    before = snapshot(tmp_path)
    plan = plan_clean([tmp_path / "area"], keep_last=0)
    assert not any(below(Path(c.path), run / "checkpoints") for c in plan.candidates)
    assert (run / "checkpoints", "a symbolic link: clean never follows links") in plan.kept
    for candidate in plan.candidates:  # the finished run's own optimizer_state only
        remove(candidate)
    after = snapshot(tmp_path)
    assert {p: v for p, v in after.items() if below(p, outside)} == {
        p: v for p, v in before.items() if below(p, outside)
    }
    assert after[run / "checkpoints"] == ("link", str(outside))
    with pytest.raises(DsaError, match="symbolic link"):
        plan_clean([run / "checkpoints"], keep_last=0)


def test_cleaning_a_runs_checkpoints_folder_keeps_each_remaining_checkpoints_state(tmp_path):
    run = one_run(tmp_path)
    plan = plan_clean([run / "checkpoints"], keep_last=1)
    assert sorted(Path(c.path).name for c in plan.candidates) == ["0000000010", "0000000020"]
    assert all(c.kind == "checkpoint" for c in plan.candidates)
    for candidate in plan.candidates:
        remove(candidate)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000000030"]
    newest = run / "checkpoints" / "0000000030" / "optimizer_state"
    assert sorted(p.name for p in newest.iterdir()) == ["manifest.json", "w.rows"]
    assert (run / "optimizer_state" / "manifest.json").is_file()  # the run's own state is not below the path
    with pytest.raises(DsaError, match="part of the checkpoint"):
        plan_clean([newest], keep_last=0)
    everything = plan_clean([run / "checkpoints"], keep_last=0)  # even keep_last=0 takes checkpoints whole
    assert [c.kind for c in everything.candidates] == ["checkpoint"]
    for candidate in everything.candidates:
        remove(candidate)
    assert list((run / "checkpoints").iterdir()) == [] and (run / "optimizer_state" / "w.rows").is_file()


@pytest.mark.parametrize("held", ["run", "optimizer_state"])
def test_a_live_runs_folder_is_refused(tmp_path, held):
    run = one_run(tmp_path)
    stale = plan_clean([tmp_path / "area"], keep_last=0)  # planned before the run started
    assert sorted(c.kind for c in stale.candidates) == ["checkpoint"] * 3 + ["finished run's optimizer state"]
    live = run if held == "run" else run / "optimizer_state"
    lock = DirectoryLock(live, purpose="live")
    lock.acquire()
    try:
        before = snapshot(tmp_path)
        plan = plan_clean([tmp_path / "area"], keep_last=0)
        assert not plan.candidates and [p for p, why in plan.kept if "in progress" in why] == [run]
        assert not plan_clean([run], keep_last=0).candidates
        with pytest.raises(DsaError, match="in progress"):
            plan_clean([run / "checkpoints"], keep_last=0)
        # the stale plan's candidates: each refused, whether the run folder or only its state is held
        for candidate in stale.candidates:
            with pytest.raises(DsaError, match="left alone"):
                remove(candidate)
        record = run / DirectoryLock.FILE_NAME  # remove() records itself there while it holds the run folder
        assert {p: v for p, v in snapshot(tmp_path).items() if p != record} == {
            p: v for p, v in before.items() if p != record
        }
    finally:
        lock.release()


# Found by the property test above: a checkpoint whose optimizer_state/ a live process holds
# (DiskSparseAdam opened on a checkpoint's copy) was planned and removed whole.
def test_a_checkpoint_whose_state_a_live_process_holds_is_left_alone(tmp_path):
    run = one_run(tmp_path, finished=False)
    held = run / "checkpoints" / "0000000010" / "optimizer_state"
    lock = DirectoryLock(held, purpose="live")
    lock.acquire()
    try:
        before = {p: v for p, v in snapshot(tmp_path).items() if below(p, held)}
        for candidate in plan_clean([tmp_path / "area"], keep_last=1).candidates:
            try:
                remove(candidate)
            except DsaError:
                pass
        assert {p: v for p, v in snapshot(tmp_path).items() if below(p, held)} == before
    finally:
        lock.release()


# Also found by it: a plan made while the run was idle, carried out after a process opened
# DiskSparseAdam on <run>/optimizer_state without holding the run folder: every removal is refused.
def test_a_stale_plans_checkpoints_are_refused_while_the_runs_state_is_held(tmp_path):
    run = one_run(tmp_path)
    stale = plan_clean([tmp_path / "area"], keep_last=0)
    lock = DirectoryLock(run / "optimizer_state", purpose="live")
    lock.acquire()
    try:
        for candidate in stale.candidates:
            with pytest.raises(DsaError, match="left alone"):
                remove(candidate)
    finally:
        lock.release()
