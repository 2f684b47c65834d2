"""The safety audit, attack by attack: each test builds the attack and checks nothing of the
user's is touched, nothing escapes its folder, nothing tampered runs or is silently accepted."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from dsa_train import DiskSparseAdam, StateError
from dsa_train.cli.app import app
from dsa_train.fsutil import DirectoryLock, create_owned_folder
from dsa_train.optim import functional
from dsa_train.storage import row_file
from dsa_train.runs.checkpoint_store import trainer_checksum
from dsa_train.runs.run_folder import RunFolder

from .test_state_tools import finished_run, runs  # noqa: F401  (fixtures: a finished tiny run, made once)
from .test_train_kge import TINY


class Result:
    """A CLI result whose stderr is joined back into one line per message (rich wraps)."""

    def __init__(self, result):
        self.exit_code, self.stdout, self.raw_stderr = result.exit_code, result.stdout, result.stderr
        self.stderr = " ".join(result.stderr.split())


def invoke(*args):
    return Result(CliRunner().invoke(app, [str(a) for a in args]))


def tree(root: Path) -> dict[str, str]:
    """Every entry below ``root`` (links not followed): a digest of a file, a link's target."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


@pytest.fixture
def run(runs):  # noqa: F811
    return runs / "tiny-1"


@pytest.fixture
def user_folder(tmp_path, finished_run):  # noqa: F811
    """A user's folder holding things with our names, and a genuine-looking checkpoint."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".partial-0000000001").mkdir()
    (mine / ".partial-0000000001" / "thesis.tex").write_text("precious")
    (mine / ".deleting-0000000002").mkdir()
    shutil.copytree(finished_run / "checkpoints" / "0000000020", mine / "0000000005")
    (mine / "notes.txt").write_text("precious")
    return mine


# -- 1, 2: clean --------------------------------------------------------------------------------
def test_clean_never_descends_a_linked_checkpoints_folder(run, user_folder):
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(user_folder)
    before = tree(user_folder)
    result = invoke("clean", run.parent, "--keep-last", "0", "--yes")
    assert result.exit_code == 0, result.stderr
    assert "a symbolic link: clean never follows links" in result.stderr
    assert tree(user_folder) == before and (run / "checkpoints").is_symlink()


@pytest.mark.parametrize("inner", ["checkpoints", "optimizer_state", "tables"])
def test_resume_and_eval_refuse_a_run_whose_folders_are_links(run, tmp_path, inner):
    """A run whose ``checkpoints/``, ``optimizer_state/`` or ``tables/`` is a symbolic link
    (here to an intact copy, so following it would work) is refused by ``--resume`` and
    ``eval`` with the link named, and nothing behind the link changes."""
    moved = tmp_path / "elsewhere" / inner
    moved.parent.mkdir()
    if (run / inner).exists():
        shutil.move(run / inner, moved)
    else:  # this run keeps its tables in memory: a linked tables/ is refused all the same
        moved.mkdir()
    (run / inner).symlink_to(moved)
    before = tree(moved.parent)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    resumed = invoke(
        "run", recipe, "--output", run, "--resume", "--set", "train.epochs=99", "--set", "train.max_steps=32"
    )  # (short, if it ran)
    scored = invoke("eval", run, "--json")
    for result in (resumed, scored):
        assert (
            result.exit_code == 1
            and f"'{run / inner}' is a symbolic link; dsa-train never follows links" in result.stderr
        ), result.stderr
        assert "Traceback" not in result.stderr
    assert tree(moved.parent) == before and (run / inner).is_symlink()


def test_clean_of_a_checkpoints_folder_keeps_every_checkpoints_state(run):
    result = invoke("clean", run / "checkpoints", "--yes")
    assert result.exit_code == 0, result.stderr
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["0000000030"] and (run / "optimizer_state").exists()  # only older checkpoints went
    assert (run / "checkpoints" / "0000000030" / "optimizer_state" / "manifest.json").exists()
    one = invoke("clean", run / "checkpoints" / "0000000030" / "optimizer_state", "--keep-last", "0", "--yes")
    assert one.exit_code == 1 and "part of the checkpoint" in one.stderr
    assert (run / "checkpoints" / "0000000030" / "optimizer_state" / "manifest.json").exists()
    assert invoke("eval", run, "--json").exit_code == 0


def test_clean_never_removes_a_copy_of_a_checkpoint(run, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(run / "checkpoints" / "0000000025", copy)
    before = tree(copy)
    result = invoke("clean", copy, "--keep-last", "0", "--yes")
    assert result.exit_code == 0 and "never removed by clean" in result.stderr and tree(copy) == before
    inner = invoke("clean", copy / "optimizer_state", "--yes")
    assert inner.exit_code == 1 and "never removes a checkpoint's contents" in inner.stderr and tree(copy) == before


def test_clean_refuses_a_path_inside_a_live_run(run):
    before = tree(run)
    holder = RunFolder(run)
    holder.lock()
    try:
        result = invoke("clean", run / "checkpoints", "--keep-last", "0", "--yes")
    finally:
        holder.release()
    assert result.exit_code == 1 and "which is in progress" in result.stderr
    assert {k: v for k, v in tree(run).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


def test_clean_takes_the_lock_so_a_run_started_after_the_plan_is_left_alone(run):
    from dsa_train.runs.cleanup import plan_clean, remove
    from dsa_train.errors import DsaError

    plan = plan_clean([run.parent], keep_last=0)
    assert plan.candidates
    holder = RunFolder(run)
    holder.lock()  # a run starts between the plan and the removal
    try:
        for candidate in plan.candidates:
            with pytest.raises(DsaError, match="left alone: run folder .* is locked"):
                remove(candidate)
    finally:
        holder.release()
    assert all(c.path.exists() for c in plan.candidates)


@pytest.mark.parametrize("root", ["/", "/proc/1"])
def test_clean_of_unreadable_places_is_not_a_leaked_error(root):
    result = invoke("clean", root, "--dry-run")
    assert "PermissionError" not in result.stderr and "Traceback" not in result.stderr
    # Whether the machine holds any run or state directory decides between a plan and this error.
    assert result.exit_code == 0 or result.stderr.startswith(f"Error: '{root}' is not a run folder")


# -- 3, 14: locks ---------------------------------------------------------------------------------
def test_a_linked_lock_file_is_never_written_through(run, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("precious")
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(precious)
    result = invoke("run", run.parent.parent / "unused.yaml", "--output", run, "--resume")
    assert result.exit_code == 1  # the recipe does not exist; nothing may have been written
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    result = invoke("run", recipe, "--output", run, "--resume")
    assert result.exit_code == 1 and "not a regular file" in result.stderr
    assert precious.read_text() == "precious"
    state = tmp_path / "state"
    state.mkdir()
    (state / ".lock").symlink_to(precious)
    with pytest.raises(StateError, match="not a regular file"):
        DiskSparseAdam(nn.Embedding(4, 2, sparse=True).parameters(), state_dir=state)
    assert precious.read_text() == "precious"


def test_deleting_the_lock_record_does_not_let_a_second_writer_in(tmp_path):
    emb = nn.Embedding(4, 2, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s"):
        (tmp_path / "s" / ".lock").unlink()
        with pytest.raises(StateError, match="is locked by"):
            DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    folder = tmp_path / "run"
    folder.mkdir()
    first = DirectoryLock(folder, purpose="run folder")
    first.acquire()
    (folder / ".lock").unlink()
    with pytest.raises(StateError, match="is locked by"):
        DirectoryLock(folder, purpose="run folder").acquire()
    first.release()


def test_a_second_run_on_one_output_writes_nothing_before_it_is_refused(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    out = tmp_path / "out"
    out.mkdir()
    winner = DirectoryLock(out, purpose="run folder")
    winner.acquire()  # the other process won the race and has not written its config yet
    try:
        result = invoke("run", recipe, "--output", out)
    finally:
        winner.release()
    assert result.exit_code == 1 and "is locked by" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the winner's record only


# -- 4: paths from user text ------------------------------------------------------------------------
def test_run_folder_never_lands_outside_output_dir(tmp_path):
    from dsa_train.errors import ConfigError
    from dsa_train.recipe import parse_recipe

    recipe = parse_recipe(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    recipe.output.dir = str(tmp_path / "runs")
    for name in ("../escape", "/tmp/escape", "a/b"):
        recipe.name = name
        with pytest.raises(ConfigError, match="not a plain folder name"):
            RunFolder.create(recipe)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "runs").exists()


# -- 5: a state_dir that is not the run's -------------------------------------------------------------
@pytest.mark.parametrize("foreign", ["user files", "another state"])
def test_resume_never_touches_a_state_dir_that_is_not_the_runs(run, tmp_path, foreign):
    target = tmp_path / "theirs"
    if foreign == "user files":
        target.mkdir()
        (target / "manifest.json").write_text('{"my": "data"}')
        (target / "param0.rows").write_text("precious")
    else:
        with DiskSparseAdam(nn.Embedding(300, 16, sparse=True).named_parameters(), state_dir=target):
            pass
    before = tree(target)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    # more epochs than the (finished) run had, so the resume goes on to open the state
    result = invoke(
        "run", recipe, "--output", run, "--resume", "--set", f"optimizer.state_dir={target}", "--set", "train.epochs=99"
    )
    assert result.exit_code == 1 and "nothing in it was changed" in result.stderr
    assert tree(target) == before


@pytest.mark.parametrize("left", [".manifest.json.tmp-k1ll3d", "notes.txt"])
def test_a_state_dir_left_by_a_kill_during_its_first_manifest_write_is_ours_to_clear(tmp_path, left):
    """A kill between the manifest's temporary and its rename leaves only that temporary: the
    run may clear it (its name is the atomic writer's), never anything else."""
    from dsa_train.runs.optimizer_state import restore_state_dir

    state = tmp_path / "optimizer_state"
    state.mkdir()
    (state / left).write_text('{"format": "dsa-train/st')  # torn mid-write
    if left.startswith("."):
        restore_state_dir(None, state, owned={"some-id"})
        assert [p.name for p in state.iterdir()] == [".lock"]  # the temporary is gone; the lock's record stays
    else:
        with pytest.raises(StateError, match="no manifest.json of a DiskSparseAdam state; nothing in it was changed"):
            restore_state_dir(None, state, owned={"some-id"})
        assert (state / left).read_text() == '{"format": "dsa-train/st'


# -- 6, 7: tampered checkpoints -----------------------------------------------------------------------
class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


PWNED = None


def reseal(checkpoint: Path, **changes) -> None:
    """What an attacker does after editing a checkpoint: fix the digests and the checksum."""
    from dsa_train.fsutil import file_digest

    state = json.loads((checkpoint / "trainer.json").read_text())
    state.update(changes)
    state["files"] = {name: file_digest(checkpoint / name) for name in state["files"]}
    state["checksum"] = trainer_checksum(state)
    (checkpoint / "trainer.json").write_text(json.dumps(state))


@pytest.mark.parametrize("file", ["optimizer.pt", "model.pt"])
def test_a_tampered_checkpoint_never_runs_code(run, tmp_path, file):
    global PWNED
    PWNED = tmp_path / "pwned"
    newest = run / "checkpoints" / "0000000030"
    torch.save({"state": Payload()}, newest / file)
    reseal(newest)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    result = invoke(
        "run", recipe, "--output", run, "--resume", "--set", "train.epochs=99"
    )  # more: the finished run loads its checkpoint
    assert not PWNED.exists()
    assert result.exit_code == 1 and "holds something other than tensors" in result.stderr
    assert "Traceback" not in result.stderr
    if file == "model.pt":
        assert invoke("eval", run).exit_code == 1 and not PWNED.exists()


def test_an_edited_trainer_state_is_found_and_passed_over(run, tmp_path):
    newest = run / "checkpoints" / "0000000030"
    text = (newest / "trainer.json").read_text()
    (newest / "trainer.json").write_text(text.replace('"step": 30', '"step": 31'))
    result = invoke("eval", run, "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["checkpoint"] == 25
    assert "trainer.json does not match its checksum" in result.stderr  # 9: --json warns too
    assert any("does not match its checksum" in warning for warning in json.loads(result.stdout)["warnings"])


def test_a_file_added_to_a_checkpoint_is_found(run):
    newest = run / "checkpoints" / "0000000030"
    (newest / "optimizer_state" / "extra.rows").write_bytes(b"x")
    result = invoke("eval", run, "--json")
    assert json.loads(result.stdout)["checkpoint"] == 25 and "does not list" in result.stderr


def test_a_flipped_byte_in_a_checkpoints_moments_is_found(run):
    rows = next((run / "checkpoints" / "0000000030" / "optimizer_state").glob("*.rows"))
    data = bytearray(rows.read_bytes())
    touched = next(i for i in range(4096, len(data)) if data[i])
    data[touched] ^= 0x10
    rows.write_bytes(bytes(data))
    result = invoke("eval", run, "--json")
    assert json.loads(result.stdout)["checkpoint"] == 25 and "does not match its digest" in result.stderr


def test_a_checkpoint_of_another_run_is_refused(run, tmp_path):
    newest = run / "checkpoints" / "0000000030"
    reseal(newest, run_id="0" * 32)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    result = invoke(
        "run", recipe, "--output", run, "--resume", "--set", "train.epochs=99"
    )  # more: the finished run loads its checkpoint
    assert result.exit_code == 1 and "belongs to run" in result.stderr


def test_a_corrupt_metrics_log_is_named(run, tmp_path):
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:-5]
    metrics.write_text("\n".join(lines) + "\n")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    result = invoke("run", recipe, "--output", run, "--resume")
    assert result.exit_code == 1 and "metrics.jsonl' line 2 is not a JSON record" in result.stderr


# -- 8: silent acceptance in the optimizer -----------------------------------------------------------
def train(emb, opt, rows=(1, 2)):
    opt.zero_grad()
    emb(torch.tensor(list(rows))).pow(2).sum().backward()
    opt.step()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("lr", float("nan"), "Invalid learning rate: nan"),
        ("lr", float("inf"), "Invalid learning rate: inf"),
        ("eps", -1.0, "Invalid epsilon value: -1.0"),
        ("betas", (1.0, 0.999), "Invalid beta parameter at index 0: 1.0"),
    ],
)
def test_load_state_dict_refuses_bad_hyperparameters(state_dir, field, value, message):
    emb = nn.Embedding(5, 2, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:
        train(emb, opt)
        saved = opt.state_dict()
        saved["param_groups"][0][field] = value
        with pytest.raises(ValueError, match=f"param group 0: {message}"):
            opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 1e-3


def test_unnamed_parameters_of_one_shape_are_not_reopened_by_position(state_dir):
    a, b = nn.Embedding(6, 3, sparse=True), nn.Embedding(6, 3, sparse=True)
    with DiskSparseAdam([a.weight, b.weight], state_dir=state_dir) as opt:
        train(a, opt)
    with pytest.raises(StateError, match=r"unnamed parameters of the same shape and dtype \(param0, param1\)"):
        DiskSparseAdam([b.weight, a.weight], state_dir=state_dir)
    with DiskSparseAdam([("param0", a.weight), ("param1", b.weight)], state_dir=state_dir) as opt:  # the hint works
        assert opt.state[a.weight]["step"] == 1


def test_a_parameter_name_too_long_for_a_file_is_a_clear_error(state_dir):
    with pytest.raises(StateError, match="has 300 characters"):
        DiskSparseAdam([("x" * 300, nn.Parameter(torch.zeros(3, 2)))], state_dir=state_dir)


# -- 12, 15: errors half-way ----------------------------------------------------------------------------
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_a_step_that_stops_half_way_leaves_the_state_unclean(state_dir, monkeypatch, error):
    users, items = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3, sparse=True)
    opt = DiskSparseAdam([("users", users.weight), ("items", items.weight)], state_dir=state_dir)
    train(users, opt)
    opt.flush()
    real = DiskSparseAdam._update
    calls = []

    def second_fails(self, p, *args):
        calls.append(p)
        if len(calls) == 2:
            raise error
        return real(self, p, *args)

    monkeypatch.setattr(DiskSparseAdam, "_update", second_fails)
    opt.zero_grad()
    (users(torch.tensor([1])).sum() + items(torch.tensor([2])).sum()).backward()
    with pytest.raises(type(error)):
        opt.step()
    with pytest.raises(StateError, match="a step stopped half-way"):
        opt.flush()
    opt.close()  # no error, no clean mark
    assert json.loads((state_dir / "manifest.json").read_text())["clean"] is False
    with pytest.raises(StateError, match="was not closed cleanly"):
        DiskSparseAdam([("users", users.weight), ("items", items.weight)], state_dir=state_dir)


def test_a_failing_update_thread_stops_the_step_only_after_the_others(monkeypatch):
    workspace = functional.Workspace()
    finished, started = [], threading.Event()

    def work(part):
        if part == 0:
            started.wait(5)  # the other part is writing when this one fails
            raise OSError(errno.EIO, "Input/output error")
        started.set()
        time.sleep(0.3)
        finished.append(threading.current_thread().name)

    with pytest.raises(OSError, match="Input/output error"):
        workspace.run(work, 2)
    assert len(finished) == 1  # the other part was waited for: no thread writes after the error
    workspace.close_pool()


def test_a_full_disk_error_is_not_masked_by_closing(tmp_path, monkeypatch):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY % {"model": "transe", "optimizer": "dsa", "storage": "memory"})
    steps = []

    def reserve(self, lookups):
        steps.append(1)
        if len(steps) > 3:
            raise StateError("the disk is full: no room for the rows this step writes", hint="free some space")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(row_file.RowFile, "reserve", reserve)
    monkeypatch.setattr(row_file.RowFile, "flush", flush)
    result = invoke("run", recipe, "--output", tmp_path / "out")
    assert result.exit_code == 1
    errors = [line for line in result.raw_stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: the disk is full: no room for the rows this step writes"]


def test_a_link_planted_at_a_pending_row_file_is_never_written_through(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("precious")
    state = tmp_path / "state"
    state.mkdir()
    (state / "param0.rows.pending").symlink_to(precious)  # the name a new row file is written under
    with pytest.raises(StateError, match="is in the way of a new row file and is not a regular file"):
        DiskSparseAdam(nn.Embedding(4, 2, sparse=True).parameters(), state_dir=state)
    assert precious.read_text() == "precious" and (state / "param0.rows.pending").is_symlink()


def test_an_owned_folder_is_new_or_empty_never_a_link_and_locked_before_use(tmp_path):
    """The run folder's and the tune folder's creation (fsutil.create_owned_folder)."""
    hints = dict(link_hint="pass a real folder", busy_hint="choose another folder")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(StateError, match=r"run folder '.*link' is a symbolic link") as err:
        create_owned_folder(tmp_path / "link", "run folder", **hints)
    assert (
        err.value.hint == "pass a real folder" and not DirectoryLock(target, purpose="x").path.exists()
    )  # nothing written through it
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("someone's")
    with pytest.raises(StateError, match=r"tune folder '.*used' already exists and is not empty") as err:
        create_owned_folder(tmp_path / "used", "tune folder", **hints)
    assert err.value.hint == "choose another folder"
    lock = create_owned_folder(tmp_path / "new" / "run", "run folder", **hints)  # parents made
    try:
        assert lock.held and (tmp_path / "new" / "run" / DirectoryLock.FILE_NAME).is_file()
        with pytest.raises(StateError, match="is locked by"):  # a second process started at the same instant
            create_owned_folder(tmp_path / "new" / "run", "run folder", **hints)
    finally:
        lock.release()
    again = create_owned_folder(tmp_path / "new" / "run", "run folder", **hints)  # only our lock record in it: empty
    again.release()
