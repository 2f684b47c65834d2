"""The state directory: layout on disk, reopening, state_dict, flush, locking, bad state.

The row files are read here with numpy, independently of the optimizer's own mmap code, and
compared with the moments torch.optim.SparseAdam keeps in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
from pathlib import Path

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam, StateError

HEADER = 4096


def train(emb, opt, steps, *, seed=0, lookups=16):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        idx = torch.randint(0, emb.num_embeddings, (lookups,), generator=g)
        (emb(idx) * torch.randn(lookups, emb.embedding_dim, generator=g)).sum().backward()
        opt.step()


def read_rows(path, num_rows, width, dtype=np.float32):
    """The (N, 2, W) moments of a row file, read straight from disk."""
    return np.fromfile(path, dtype=dtype, offset=HEADER).reshape(num_rows, 2, width)


def snapshot(directory):
    """Content hash of every file (the lock file aside), to prove nothing was touched."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.name != ".lock"
    }


def run_python(code, **env):
    """Run ``code`` in a fresh interpreter (another process) and return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def trained(state_dir):
    """A closed state directory after 30 steps on a named 60 x 4 table, and that table."""
    emb = nn.Embedding(60, 4, sparse=True)
    with DiskSparseAdam(emb.named_parameters(), lr=0.01, state_dir=state_dir) as opt:
        train(emb, opt, 30)
    return emb


# -- layout -------------------------------------------------------------------------------
def test_row_file_holds_sparse_adams_moments(state_dir):
    reference_emb = nn.Embedding(60, 4, sparse=True)
    emb = nn.Embedding(60, 4, sparse=True)
    emb.load_state_dict(reference_emb.state_dict())
    reference = torch.optim.SparseAdam(reference_emb.parameters(), lr=0.01)
    with DiskSparseAdam(emb.named_parameters(), lr=0.01, state_dir=state_dir) as opt:
        train(reference_emb, reference, 30)
        train(emb, opt, 30)
    rows = read_rows(state_dir / "weight.rows", 60, 4)
    state = reference.state[reference_emb.weight]
    np.testing.assert_array_equal(rows[:, 0], state["exp_avg"].numpy())
    np.testing.assert_array_equal(rows[:, 1], state["exp_avg_sq"].numpy())

    manifest = json.loads((state_dir / "manifest.json").read_text())
    assert manifest["format"] == "dsa-train/disk-sparse-adam-state" and manifest["version"] == 1
    assert manifest["clean"] is True
    entry = manifest["params"]["weight"]
    assert entry == {
        "shape": [60, 4],
        "dtype": "float32",
        "layout": "m|v",
        "row_bytes": 32,
        "step": 30,
        "file": "weight.rows",
    }
    assert manifest["groups"][0]["lr"] == 0.01
    header = (state_dir / "weight.rows").read_bytes()[:HEADER]
    assert header.startswith(b"DSA-TRAIN ROWS\n")
    assert json.loads(header.split(b"\n")[1])["state_id"] == manifest["state_id"]


def test_row_file_is_sparse_and_never_read_whole(state_dir):
    n, d = 2_000_000, 32  # 512 MB of moments
    emb = nn.Embedding(n, d, sparse=True)
    with DiskSparseAdam(emb.named_parameters(), state_dir=state_dir) as opt:
        opt.zero_grad()
        emb(torch.tensor([5, 1_000_000, n - 1])).sum().backward()
        opt.step()
        resident = _mapped_resident_kib(state_dir / "weight.rows")
        # The kernel maps up to 64 KiB around each fault; the file is 512 MiB.
        assert resident <= 1024, f"{resident} KiB of the row file is resident after touching 3 rows"
    stat = (state_dir / "weight.rows").stat()
    assert stat.st_size == HEADER + n * 2 * d * 4
    assert stat.st_blocks * 512 < 1 << 20, "the row file should only allocate the touched rows"


def _mapped_resident_kib(path):
    """Resident KiB of this process's mapping of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_positional_keys_for_unnamed_parameters(state_dir):
    a, b = nn.Embedding(3, 2, sparse=True), nn.Embedding(4, 2, sparse=True)
    with DiskSparseAdam([{"params": [a.weight]}, {"params": [b.weight], "lr": 0.1}], state_dir=state_dir):
        pass
    assert sorted(p.name for p in state_dir.glob("*.rows")) == ["param0.rows", "param1.rows"]


def test_names_are_sanitised_into_file_names(state_dir):
    w = nn.Parameter(torch.randn(3, 2))
    with DiskSparseAdam([("encoder/emb weight", w)], state_dir=state_dir):
        pass
    assert [p.name for p in state_dir.glob("*.rows")] == ["encoder_emb_weight.rows"]


# -- reopening, state_dict, flush ---------------------------------------------------------
def test_reopen_restores_steps_and_moments(state_dir, trained):
    before = read_rows(state_dir / "weight.rows", 60, 4).copy()
    with DiskSparseAdam(trained.named_parameters(), lr=0.01, state_dir=state_dir) as opt:
        assert opt.state[trained.weight]["step"] == 30
        assert opt.state_dict()["state"] == {0: {"step": 30}}
    np.testing.assert_array_equal(read_rows(state_dir / "weight.rows", 60, 4), before)


def test_state_dict_is_small_and_round_trips(state_dir):
    emb = nn.Embedding(1_000_000, 64, sparse=True)  # 512 MB of moments
    with DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=state_dir) as opt:
        train(emb, opt, 3)
        saved = opt.state_dict()
        assert len(pickle.dumps(saved)) < 2048
        assert saved["state"] == {0: {"step": 3}}
        assert saved["disk_state"]["state_dir"] == str(state_dir.resolve())
        opt.param_groups[0]["lr"] = 0.5
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.01
    with DiskSparseAdam(emb.parameters(), lr=0.3, state_dir=state_dir) as reopened:
        reopened.load_state_dict(saved)  # same directory, same steps: hyper-parameters come back
        assert reopened.param_groups[0]["lr"] == 0.01


def test_load_state_dict_refuses_what_cannot_be_true(tmp_path):
    emb = nn.Embedding(10, 2, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "a") as opt:
        train(emb, opt, 2)
        old = opt.state_dict()
        train(emb, opt, 1)
        with pytest.raises(StateError, match=r"saved at steps \[2\].*holds moments at steps \[3\]"):
            opt.load_state_dict(old)
        with pytest.raises(StateError, match="not made by DiskSparseAdam"):
            opt.load_state_dict(torch.optim.SparseAdam(emb.parameters()).state_dict())
        with DiskSparseAdam(nn.Embedding(10, 2, sparse=True).parameters(), state_dir=tmp_path / "b") as other:
            with pytest.raises(StateError, match="belongs to the state directory"):
                other.load_state_dict(opt.state_dict())


def test_flush_makes_state_durable_for_another_process(state_dir):
    emb = nn.Embedding(20, 3, sparse=True)
    reference_emb = nn.Embedding(20, 3, sparse=True)
    reference_emb.load_state_dict(emb.state_dict())
    reference = torch.optim.SparseAdam(reference_emb.parameters())
    train(reference_emb, reference, 5)
    opt = DiskSparseAdam(emb.named_parameters(), state_dir=state_dir)
    try:
        train(emb, opt, 5)
        opt.flush()
        out = run_python(
            f"""
            import json, numpy as np
            m = json.load(open({str(state_dir / "manifest.json")!r}))
            rows = np.fromfile({str(state_dir / "weight.rows")!r}, dtype=np.float32, offset=4096)
            print(json.dumps({{"clean": m["clean"], "step": m["params"]["weight"]["step"], "rows": rows.tolist()}}))
            """
        )
    finally:
        opt.close()
    seen = json.loads(out)
    assert seen["clean"] is True and seen["step"] == 5
    state = reference.state[reference_emb.weight]
    expected = torch.stack([state["exp_avg"], state["exp_avg_sq"]], 1).flatten()
    np.testing.assert_array_equal(np.array(seen["rows"], dtype=np.float32), expected.numpy())


def test_interpreter_exit_without_close_flushes(state_dir):
    run_python(
        f"""
        import torch
        from dsa_train import DiskSparseAdam
        emb = torch.nn.Embedding(10, 2, sparse=True)
        opt = DiskSparseAdam(emb.parameters(), state_dir={str(state_dir)!r})
        for _ in range(4):
            opt.zero_grad(); emb(torch.tensor([1, 2])).sum().backward(); opt.step()
        """
    )
    manifest = json.loads((state_dir / "manifest.json").read_text())
    assert manifest["clean"] is True and manifest["params"]["param0"]["step"] == 4


def test_exit_without_close_after_the_directory_was_removed_warns_in_one_line(tmp_path):
    """The common path (the seed's example never calls close()): the finalizer's flush at exit
    fails because the state directory is gone. One warning line on stderr naming it, no
    traceback, exit status 0; the optimizer beside it, whose directory is there, still flushes."""
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import shutil, torch
                from dsa_train import DiskSparseAdam
                a, b = torch.nn.Embedding(10, 2, sparse=True), torch.nn.Embedding(10, 2, sparse=True)
                lost = DiskSparseAdam(a.parameters(), state_dir={str(gone)!r})
                fine = DiskSparseAdam(b.parameters(), state_dir={str(kept)!r})
                (a(torch.tensor([1, 2])).sum() + b(torch.tensor([3])).sum()).backward()
                lost.step(); fine.step()
                shutil.rmtree({str(gone)!r})
                """
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr and "Exception ignored" not in child.stderr, child.stderr
    lines = child.stderr.splitlines()
    assert len(lines) == 1, child.stderr
    assert lines[0].startswith("dsa-train: warning: DiskSparseAdam was never closed"), lines
    assert f"could not flush state_dir '{gone}'" in lines[0], lines
    manifest = json.loads((kept / "manifest.json").read_text())
    assert manifest["clean"] is True and manifest["params"]["param0"]["step"] == 1


def test_killed_writer_leaves_an_unclean_directory(state_dir):
    run_python(
        f"""
        import os, torch
        from dsa_train import DiskSparseAdam
        emb = torch.nn.Embedding(10, 2, sparse=True)
        opt = DiskSparseAdam(emb.parameters(), state_dir={str(state_dir)!r})
        opt.zero_grad(); emb(torch.tensor([1, 2])).sum().backward(); opt.step()
        os._exit(0)  # like SIGKILL: no flush, no finalizer
        """
    )
    emb = nn.Embedding(10, 2, sparse=True)
    files = snapshot(state_dir)
    with pytest.raises(StateError, match="(?s)not closed cleanly.*allow_unclean") as err:
        DiskSparseAdam(emb.parameters(), state_dir=state_dir)
    assert "pid" in str(err.value)
    assert snapshot(state_dir) == files
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir, allow_unclean=True) as opt:
        assert "step" not in opt.state[emb.weight]  # no flush ever recorded a step


def test_add_param_group_creates_and_reopens_files(state_dir):
    a, b = nn.Embedding(5, 2, sparse=True), nn.Embedding(7, 2, sparse=True)
    with DiskSparseAdam(a.parameters(), state_dir=state_dir) as opt:
        opt.add_param_group({"params": [b.weight], "lr": 0.1})
        train(b, opt, 2)
    assert sorted(p.name for p in state_dir.glob("*.rows")) == ["param0.rows", "param1.rows"]
    with pytest.warns(UserWarning, match="also holds 'param1'"):
        opt = DiskSparseAdam(a.parameters(), state_dir=state_dir)
    with opt:
        opt.add_param_group({"params": [b.weight], "lr": 0.1})
        assert opt.state[b.weight]["step"] == 2


def test_forked_child_exiting_does_not_touch_the_state(state_dir):
    emb = nn.Embedding(10, 2, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:
        train(emb, opt, 2)  # the manifest now says "not clean" until the next flush
        before = snapshot(state_dir)
        lock = (state_dir / ".lock").read_text()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say, running the optimizer's exit handler
            try:
                opt._finalizer()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert snapshot(state_dir) == before
        assert (state_dir / ".lock").read_text() == lock
        with pytest.raises(StateError, match="locked by"):
            DiskSparseAdam(emb.parameters(), state_dir=state_dir)


# -- locking ------------------------------------------------------------------------------
def test_second_optimizer_in_this_process_is_refused(state_dir):
    emb = nn.Embedding(5, 2, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir):
        with pytest.raises(StateError, match=rf"locked by pid {os.getpid()} .*this process"):
            DiskSparseAdam(emb.parameters(), state_dir=state_dir)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir):  # released on exit
        pass


def test_other_process_holding_the_lock_is_named(state_dir):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, torch
                from dsa_train import DiskSparseAdam
                opt = DiskSparseAdam([torch.nn.Parameter(torch.zeros(5, 2))], state_dir={str(state_dir)!r})
                print("ready", flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StateError, match=rf"locked by pid {holder.pid} on .*running '-c'"):
            DiskSparseAdam([nn.Parameter(torch.zeros(5, 2))], state_dir=state_dir)
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the dead holder's lock: no stale lock blocks us.
    with DiskSparseAdam([nn.Parameter(torch.zeros(5, 2))], state_dir=state_dir, allow_unclean=True):
        pass


# -- bad state: each case is refused with a clear error and leaves every file untouched -----
def _edit_json(path, resign=False, **changes):
    """Change manifest fields; ``resign`` recomputes the checksum (to reach later checks)."""
    from dsa_train.storage.format import manifest_bytes

    data = json.loads(path.read_text())
    data.update(changes)
    path.write_bytes(manifest_bytes(data) if resign else json.dumps(data).encode())


def _rewrite_header(path, **changes):
    raw = bytearray(path.read_bytes())
    meta = json.loads(raw[:HEADER].split(b"\n")[1])
    meta.update(changes)
    header = (b"DSA-TRAIN ROWS\n" + json.dumps(meta).encode() + b"\n").ljust(HEADER, b"\0")
    raw[:HEADER] = header
    path.write_bytes(bytes(raw))


CORRUPTIONS = [
    ("manifest not json", lambda d: (d / "manifest.json").write_text("{not json"), r"manifest .* is corrupt"),
    (
        "manifest truncated",
        lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes()[:40]),
        r"manifest .* is corrupt",
    ),
    (
        "manifest other version",
        lambda d: _edit_json(d / "manifest.json", version=2),
        r"format version 2, this dsa-train reads version 1",
    ),
    (
        "manifest other format",
        lambda d: _edit_json(d / "manifest.json", format="x"),
        "not a DiskSparseAdam state manifest",
    ),
    (
        "manifest bad field",
        lambda d: _edit_json(d / "manifest.json", True, params={"weight": {"shape": 3}}),
        "field is missing",
    ),
    (
        "manifest edited",
        lambda d: _edit_json(d / "manifest.json", clean=True, state_id="f" * 32),
        "checksum does not match",
    ),
    (
        "manifest lost",
        lambda d: (d / "manifest.json").unlink(),
        r"has no manifest.json but is not empty \(weight.rows\)",
    ),
    (
        "row file missing",
        lambda d: (d / "weight.rows").unlink(),
        r"row file .*weight.rows' of parameter 'weight' is missing",
    ),
    (
        "row file truncated",
        lambda d: os.truncate(d / "weight.rows", HEADER + 100),
        r"parameter 'weight' is 4196 bytes, shape \[60, 4\] float32 needs 6016: it was truncated",
    ),
    (
        "row file extended",
        lambda d: os.truncate(d / "weight.rows", HEADER + 9000),
        "it was extended",
    ),
    (
        "row file header overwritten",
        lambda d: (d / "weight.rows").write_bytes(b"\0" * 10 + (d / "weight.rows").read_bytes()[10:]),
        "does not start with the dsa-train row header",
    ),
    (
        "row file other version",
        lambda d: _rewrite_header(d / "weight.rows", version=7),
        r"format version 7, this dsa-train reads version 1",
    ),
    (
        "row file of another shape",
        lambda d: _rewrite_header(d / "weight.rows", shape=[61, 4]),
        r"parameter 'weight' has shape \[61, 4\], the manifest and parameter have \[60, 4\]",
    ),
    (
        "row file of another state",
        lambda d: _rewrite_header(d / "weight.rows", state_id="0" * 32),
        "has state_id '0000",
    ),
]


@pytest.mark.parametrize("corrupt,expected", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_state_is_refused_untouched(state_dir, trained, corrupt, expected):
    corrupt(state_dir)
    files = snapshot(state_dir)
    with pytest.raises(StateError, match=expected):
        DiskSparseAdam(trained.named_parameters(), state_dir=state_dir)
    assert snapshot(state_dir) == files


MISMATCHES = [
    (
        "other shape",
        lambda: [("weight", nn.Parameter(torch.zeros(61, 4)))],
        r"parameter 'weight' has shape \[61, 4\].* shape \[60, 4\]",
    ),
    (
        "other dtype",
        lambda: [("weight", nn.Parameter(torch.zeros(60, 4, dtype=torch.float64)))],
        r"parameter 'weight' has dtype float64.* dtype float32",
    ),
    (
        "unknown name",
        lambda: [("entity.weight", nn.Parameter(torch.zeros(60, 4)))],
        r"holds no parameter named 'entity.weight' \(it holds 'weight'\)",
    ),
]


@pytest.mark.parametrize("params,expected", [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES])
def test_mismatched_parameters_are_refused_untouched(state_dir, trained, params, expected):
    files = snapshot(state_dir)
    with pytest.raises(StateError, match=expected):
        DiskSparseAdam(params(), state_dir=state_dir)
    assert snapshot(state_dir) == files
    with DiskSparseAdam(trained.named_parameters(), state_dir=state_dir):  # lock was released
        pass


def test_interrupted_creation_is_finished_on_reopen(state_dir, trained):
    # The manifest listing weight.rows was committed, the rename from its pending name was not.
    os.replace(state_dir / "weight.rows", state_dir / "weight.rows.pending")
    with DiskSparseAdam(trained.named_parameters(), state_dir=state_dir) as opt:
        assert opt.state[trained.weight]["step"] == 30
    assert (state_dir / "weight.rows").exists() and not (state_dir / "weight.rows.pending").exists()


def test_state_dir_that_is_a_file(tmp_path):
    target = tmp_path / "state"
    target.write_text("precious")
    with pytest.raises(StateError, match="is a file, not a directory"):
        DiskSparseAdam([nn.Parameter(torch.zeros(3, 2))], state_dir=target)
    assert target.read_text() == "precious"


def test_foreign_directory_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(StateError, match=r"has no manifest.json but is not empty \(notes.txt\)"):
        DiskSparseAdam([nn.Parameter(torch.zeros(3, 2))], state_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_state_dir_not_writable(tmp_path, monkeypatch):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o500)
    else:  # root writes anywhere: make the file system say no, as a read-only mount would
        real_open = os.open

        def refuse(path, *args, **kwargs):
            if Path(path).parent == target:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(StateError, match=r"'.*ro' is not writable: Permission denied"):
        DiskSparseAdam([nn.Parameter(torch.zeros(3, 2))], state_dir=target)
