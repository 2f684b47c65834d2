"""Checkpoints whose row files are deltas of the rows written since the previous checkpoint:
they restore bit for bit, across compactions; a damaged link is found and passed over;
pruning and clean keep every checkpoint a kept one is made of; a kill mid-delta leaves no
complete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train import DiskSparseAdam
from dsa_train.errors import StateError
from dsa_train.fsutil import copy_sparse
from dsa_train.nn import DiskEmbedding
from dsa_train.optim.deltas import DELTA_SUFFIX, DirtyRows, read_delta_header
from dsa_train.train import checkpoint as ckpt
from dsa_train.train.checkpoint import MAX_LINKS, find_checkpoint, load_model_state, restore_tables, save_checkpoint
from dsa_train.train.cleanup import plan_clean, remove
from dsa_train.train.optimizers import load_optimizer_state, restore_state_dir
from dsa_train.train.run_folder import complete_checkpoints

ROWS = 4000  # table rows; a step touches a few of them, so deltas stay small


class Parts:
    """A disk table and an in-memory embedding trained by one DiskSparseAdam."""

    def __init__(self, tables: Path, state: Path) -> None:
        torch.manual_seed(0)
        self.table = DiskEmbedding(ROWS, 4, path=tables / "t.table", std=0.1)
        self.model = torch.nn.ModuleDict({"table": self.table, "plain": torch.nn.Embedding(ROWS, 4, sparse=True)})
        self.opt = DiskSparseAdam(self.model.named_parameters(), lr=0.01, state_dir=state)
        self.tables, self.state = tables, state

    def train(self, first: int, steps: int, *, everywhere: bool = False) -> None:
        """Steps ``first .. first + steps - 1``; the rows of step ``s`` depend on ``s`` only
        (a dozen, low rows hot; or every row)."""
        for step in range(first, first + steps):
            g = torch.Generator().manual_seed(step)
            picked = torch.arange(ROWS) if everywhere else (torch.rand(12, generator=g) ** 3 * ROWS).long()
            self.opt.zero_grad()
            (self.model["table"](picked).pow(2).sum() + self.model["plain"](picked).pow(2).sum()).backward()
            self.opt.step()

    def files(self) -> dict[str, bytes]:
        """The live row files' bytes (after a flush)."""
        self.opt.flush()
        self.table.flush()
        return {"t.table": (self.tables / "t.table").read_bytes(), "plain.weight.rows": (self.state / "plain.weight.rows").read_bytes()}

    def save(self, checkpoints: Path, step: int, keep: int = 50) -> Path:
        return save_checkpoint(checkpoints, step, self.model, self.opt, {"run_id": "r", "step": step}, keep=keep)

    def close(self) -> None:
        self.opt.close()


@pytest.fixture
def parts(tmp_path):
    made = Parts(tmp_path / "tables", tmp_path / "state")
    yield made
    made.close()


def restored(checkpoint: Path, where: Path, owned: str) -> dict[str, bytes]:
    restore_tables(checkpoint, where / "tables")
    restore_state_dir(checkpoint, where / "state", owned={owned})
    return {"t.table": (where / "tables" / "t.table").read_bytes(), "plain.weight.rows": (where / "state" / "plain.weight.rows").read_bytes()}


def kinds(checkpoint: Path) -> dict[str, str]:
    files = json.loads((checkpoint / "trainer.json").read_text())["files"]
    return {name.removesuffix(DELTA_SUFFIX): "delta" if name.endswith(DELTA_SUFFIX) else "base" for name in files if ".table" in name or ".rows" in name}


def test_dirty_rows_bitmap_holds_exactly_the_marked_rows():
    dirty = DirtyRows(1_000_003)
    marked = np.random.default_rng(0).integers(0, 1_000_003, 5000)
    dirty.mark(torch.from_numpy(marked))
    dirty.mark(np.array([1_000_002, 0, 0]))
    assert np.array_equal(dirty.rows(), np.union1d(marked, [0, 1_000_002]))
    assert dirty._bits.nbytes == 125_001  # one bit a row: 12.5 MB at 10^8 rows
    dirty.clear()
    assert len(dirty.rows()) == 0


def test_a_delta_checkpoint_restores_bit_for_bit(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    parts.train(0, 3)
    first = parts.save(checkpoints, 3)
    parts.train(3, 3)
    second = parts.save(checkpoints, 6)
    live = parts.files()
    full = tmp_path / "full.table"
    copy_sparse(parts.tables / "t.table", full)  # what a full copy holds
    assert kinds(first) == {"tables/t.table": "base", "optimizer_state/plain.weight.rows": "base"}
    assert kinds(second) == {"tables/t.table": "delta", "optimizer_state/plain.weight.rows": "delta"}
    delta = read_delta_header(second / "tables" / "t.table.delta")
    assert delta["parent"]["snapshot"] == first.name and 0 < delta["rows"] <= 36  # the rows 3 steps wrote, not the table
    assert (second / "tables" / "t.table.delta").stat().st_size < (parts.tables / "t.table").stat().st_size / 10

    back = restored(second, tmp_path / "back", parts.opt.state_id)
    assert back == live and back["t.table"] == full.read_bytes()

    # and it goes on exactly as the uninterrupted run does
    parts.train(6, 4)
    uninterrupted = parts.files()
    parts.close()
    again = Parts(tmp_path / "back" / "tables", tmp_path / "back" / "state")
    load_model_state(second, again.model)  # the in-memory embedding's weights
    load_optimizer_state(again.opt, second)
    again.train(6, 4)
    assert again.files() == uninterrupted
    again.close()


def test_chains_are_compacted_and_every_checkpoint_restores(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    expected, links = {}, []
    for n in range(1, 2 * MAX_LINKS + 4):
        parts.train(10 * n, 2)
        path = parts.save(checkpoints, n)
        expected[path] = parts.files()
        delta = path / "tables" / ("t.table" + DELTA_SUFFIX)
        links.append(read_delta_header(delta)["links"] if delta.exists() else 0)
    assert links[0] == 0 and max(links) == MAX_LINKS  # a base, then deltas up to the bound...
    compacted = [i for i in range(1, len(links)) if links[i - 1] == MAX_LINKS]
    assert compacted and all(links[i] == 1 for i in compacted)  # ...then the union of the chain, on the base
    merged = read_delta_header(complete_checkpoints(checkpoints)[compacted[0]] / "tables" / "t.table.delta")
    assert merged["parent"]["snapshot"] == merged["base"] == "0000000001"
    for i, (path, files) in enumerate(expected.items()):
        assert restored(path, tmp_path / f"r{i}", parts.opt.state_id) == files, path.name


def test_a_chain_past_half_the_file_becomes_a_new_base(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    parts.train(0, 1)
    parts.save(checkpoints, 1)
    parts.train(1, 1, everywhere=True)  # touches every row: a delta would be most of the file
    big = parts.save(checkpoints, 2)
    assert kinds(big)["tables/t.table"] == "base" and json.loads((big / "trainer.json").read_text())["needs"] == []
    assert restored(big, tmp_path / "back", parts.opt.state_id) == parts.files()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_delta_passes_the_checkpoint_over(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in (1, 2, 3):
        parts.train(10 * n, 2)
        parts.save(checkpoints, n)
    newest = checkpoints / "0000000003"
    flip(newest / "tables" / "t.table.delta", -5)  # a byte of the last record
    path, state, warnings = find_checkpoint(checkpoints)
    assert path.name == "0000000002" and len(warnings) == 1 and "t.table.delta does not match its digest" in warnings[0]


def test_a_damaged_earlier_link_damages_every_checkpoint_built_on_it(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in (1, 2, 3):
        parts.train(10 * n, 2)
        parts.save(checkpoints, n)
    flip(checkpoints / "0000000002" / "optimizer_state" / "plain.weight.rows.delta", -5)
    path, _, warnings = find_checkpoint(checkpoints)
    assert path.name == "0000000001" and len(warnings) == 2
    assert "applies to checkpoint" in warnings[0] and "which is damaged" in warnings[0] and str(checkpoints / "0000000002") in warnings[0]
    with pytest.raises(StateError, match="which is damaged"):
        find_checkpoint(checkpoints, 3)


def test_a_replaced_parent_breaks_the_chain(parts, tmp_path):
    """A checkpoint saved again at the same step (a resumed run reaching it) is another version
    of it: a delta made on the old version must not be applied to the new one."""
    checkpoints = tmp_path / "checkpoints"
    parts.train(0, 2)
    parts.save(checkpoints, 1)
    parts.train(2, 2)
    parts.save(checkpoints, 2)
    parts.train(4, 2)
    parts.save(checkpoints, 3)  # a delta on checkpoint 2
    parts.opt.reset_dirty(None)  # whatever the tracker says, step 2 is now written afresh (a base)
    parts.save(checkpoints, 2)
    path, _, warnings = find_checkpoint(checkpoints)
    assert path.name == "0000000002" and "another version of checkpoint" in warnings[0]


def test_pruning_keeps_what_a_kept_checkpoint_needs(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in range(1, 6):
        parts.train(10 * n, 2)
        parts.save(checkpoints, n, keep=1)
    names = [p.name for p in complete_checkpoints(checkpoints)]
    needs = json.loads((checkpoints / "0000000005" / "trainer.json").read_text())["needs"]
    assert needs == names[:-1] and names[0] == "0000000001"  # the base and every link stay...
    path, _, warnings = find_checkpoint(checkpoints)
    assert path.name == "0000000005" and warnings == []  # ...so the newest is intact
    assert restored(path, tmp_path / "back", parts.opt.state_id) == parts.files()
    parts.train(100, 1, everywhere=True)
    parts.save(checkpoints, 6, keep=1)  # a new base: nothing older is needed any more
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["0000000006"]


def test_clean_never_removes_a_needed_base(parts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"format": "dsa-train/run", "version": 1, "run_id": "r", "state_id": None}))
    (run / "config.yaml").write_text("name: x\n")
    for n in range(1, 5):
        parts.train(10 * n, 2)
        parts.save(run / "checkpoints", n)
    plan = plan_clean([run], keep_last=1)
    assert [c.path.name for c in plan.candidates] == []
    assert sum("made of its deltas on this one" in why for _, why in plan.kept) == 3
    for candidate in plan_clean([run / "checkpoints"], keep_last=1).candidates:
        remove(candidate)
    assert find_checkpoint(run / "checkpoints")[0].name == "0000000004"
    assert len(plan_clean([run], keep_last=0).candidates) == 4  # nothing kept: all may go


KILLED_MID_DELTA = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_checkpoint_deltas import Parts
    from dsa_train.train import checkpoint

    tmp = Path({tmp!r})
    parts = Parts(tmp / "tables", tmp / "state")
    parts.train(0, 2)
    parts.save(tmp / "checkpoints", 1)
    parts.train(2, 2)
    real = checkpoint.write_delta

    def killed_half_way(source, rows, target, meta):
        real(source, rows, target, meta)
        os.truncate(target, os.path.getsize(target) // 2)  # the rest never reached the disk
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.write_delta = killed_half_way
    parts.save(tmp / "checkpoints", 2)
    """
)


def test_a_delta_write_killed_midway_leaves_no_complete_checkpoint(tmp_path):
    script = KILLED_MID_DELTA.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    checkpoints = tmp_path / "checkpoints"
    partial = checkpoints / ".partial-0000000002"
    assert list(partial.rglob("*.delta")), "the kill did not land inside a delta write"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["0000000001"]
    assert find_checkpoint(checkpoints)[0].name == "0000000001"
    parts = Parts(tmp_path / "t2", tmp_path / "s2")
    try:
        parts.save(checkpoints, 3)
        assert not partial.exists()  # the next save clears it
    finally:
        parts.close()


def test_clones_are_used_for_bases_where_the_file_system_has_them(parts, tmp_path, monkeypatch):
    """ext4 has no reflink: a fake clone (a copy, counted) shows that bases go through it and
    deltas do not, and that a chain due for compaction becomes a new (cloned) base."""
    cloned = []

    def fake_clone(source, target):
        copy_sparse(source, target)
        cloned.append(Path(target).name)
        return True

    monkeypatch.setattr(ckpt, "_clone", fake_clone)
    monkeypatch.setitem(ckpt._CLONES, str((tmp_path / "checkpoints").resolve()), True)
    (tmp_path / "checkpoints").mkdir()
    assert "reflink clones" in ckpt.checkpoint_mode(tmp_path / "checkpoints", parts.opt)
    for n in range(1, MAX_LINKS + 4):
        parts.train(10 * n, 2)
        parts.save(tmp_path / "checkpoints", n)
    assert cloned == ["t.table", "plain.weight.rows"] * 2  # the first base, and the one after MAX_LINKS deltas
    newest = complete_checkpoints(tmp_path / "checkpoints")[-1]
    assert kinds(newest)["tables/t.table"] == "delta"
    assert restored(newest, tmp_path / "back", parts.opt.state_id) == parts.files()


def test_no_clones_here_is_detected_once(tmp_path):
    calls = []
    real = ckpt._clone

    def counting(source, target):
        calls.append(target)
        return real(source, target)

    ckpt._CLONES.pop(str(tmp_path.resolve()), None)
    original, ckpt._clone = ckpt._clone, counting
    try:
        first, second = ckpt.clones(tmp_path / "checkpoints"), ckpt.clones(tmp_path / "checkpoints")
    finally:
        ckpt._clone = original
    assert first == second and len(calls) == 1 and os.listdir(tmp_path) == []  # the probe leaves nothing
