"""Checkpoints whose row files are deltas of the rows written since the previous checkpoint:
they restore bit for bit, across compactions; a damaged link is found and passed over;
pruning and clean keep every checkpoint a kept one is made of; a kill mid-delta leaves no
complete checkpoint."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train import DiskSparseAdam, fsutil
from dsa_train.errors import StateError
from dsa_train.fsutil import copy_sparse
from dsa_train.nn import DiskEmbedding
from dsa_train.storage import deltas
from dsa_train.storage.deltas import DELTA_SUFFIX, read_delta_header
from dsa_train.storage.format import load_manifest
from dsa_train.runs import checkpoint_rows as ckpt
from dsa_train.runs import checkpoint_store
from dsa_train.runs.changed_rows import DirtyRows, changed_rows
from dsa_train.runs.checkpoint_layout import VERSION
from dsa_train.runs.checkpoint_rows import MAX_LINKS
from dsa_train.runs.checkpoint_store import CheckpointStore
from dsa_train.runs.cleanup import plan_clean, remove
from dsa_train.runs.optimizer_state import load_optimizer_state, restore_state_dir

from .helpers import error_at_step, pagemap_hidden

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
        return {
            "t.table": (self.tables / "t.table").read_bytes(),
            "plain.weight.rows": (self.state / "plain.weight.rows").read_bytes(),
        }

    def save(self, checkpoints: Path, step: int, keep: int = 50) -> Path:
        return CheckpointStore(checkpoints).save(step, self.model, self.opt, {"run_id": "r", "step": step}, keep=keep)

    def close(self) -> None:
        self.opt.close()


@pytest.fixture
def parts(tmp_path):
    made = Parts(tmp_path / "tables", tmp_path / "state")
    yield made
    made.close()


def restored(checkpoint: Path, where: Path, owned: str) -> dict[str, bytes]:
    CheckpointStore.restore_tables(checkpoint, where / "tables")
    restore_state_dir(checkpoint, where / "state", owned={owned})
    return {
        "t.table": (where / "tables" / "t.table").read_bytes(),
        "plain.weight.rows": (where / "state" / "plain.weight.rows").read_bytes(),
    }


def kinds(checkpoint: Path) -> dict[str, str]:
    files = json.loads((checkpoint / "trainer.json").read_text())["files"]
    return {
        name.removesuffix(DELTA_SUFFIX): "delta" if name.endswith(DELTA_SUFFIX) else "base"
        for name in files
        if ".table" in name or ".rows" in name
    }


def test_dirty_rows_bitmap_holds_exactly_the_marked_rows():
    dirty = DirtyRows(1_000_003)
    marked = np.random.default_rng(0).integers(0, 1_000_003, 5000)
    dirty.mark(torch.from_numpy(marked))
    dirty.mark(np.array([1_000_002, 0, 0]))
    assert np.array_equal(dirty.rows(), np.union1d(marked, [0, 1_000_002]))
    assert dirty._bits.nbytes == 125_001  # one bit a row: 12.5 MB at 10^8 rows
    dirty.clear()
    assert len(dirty.rows()) == 0


def test_the_optimizer_announces_the_rows_it_writes_and_the_tracker_counts_them(parts):
    """DiskSparseAdam knows no checkpoint: its write hook names each row file and the rows a
    step touches, before the first byte; the checkpoint's ChangedRows attaches to it."""
    heard = []
    handle = parts.opt.register_write_hook(lambda path, rows: heard.append((path.name, sorted(set(rows.tolist())))))
    assert {p.name: n for p, n in parts.opt.row_files().items()} == {"t.table": ROWS, "plain.weight.rows": ROWS}
    assert changed_rows(parts.opt) is None  # nothing attached until a checkpoint says where the files are
    CheckpointStore.count_from_creation(parts.opt)
    tracker = changed_rows(parts.opt)
    assert tracker.since == "initial"
    parts.train(0, 1)
    g = torch.Generator().manual_seed(0)  # step 0's rows, as Parts.train draws them
    touched = sorted(set((torch.rand(12, generator=g) ** 3 * ROWS).long().tolist()))
    assert heard == [("t.table", touched), ("plain.weight.rows", touched)]
    assert tracker.rows(parts.tables / "t.table").tolist() == touched
    assert (
        tracker.rows(parts.state / "plain.weight.rows").tolist() == touched
        and tracker.rows(parts.tables / "other") is None
    )
    handle.remove()
    tracker.reset("0000000001:abc")
    parts.train(1, 1)
    assert len(heard) == 2 and len(tracker.rows(parts.tables / "t.table")) > 0 and tracker.since == "0000000001:abc"


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
    assert (
        delta["parent"]["snapshot"] == first.name and 0 < delta["rows"] <= 36
    )  # the rows 3 steps wrote, not the table
    assert (second / "tables" / "t.table.delta").stat().st_size < (parts.tables / "t.table").stat().st_size / 10

    back = restored(second, tmp_path / "back", parts.opt.state_id)
    assert back == live and back["t.table"] == full.read_bytes()

    # and it goes on exactly as the uninterrupted run does
    parts.train(6, 4)
    uninterrupted = parts.files()
    parts.close()
    again = Parts(tmp_path / "back" / "tables", tmp_path / "back" / "state")
    CheckpointStore.load_model(second, again.model)  # the in-memory embedding's weights
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
    merged = read_delta_header(CheckpointStore(checkpoints).complete()[compacted[0]] / "tables" / "t.table.delta")
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
    path, state, warnings = CheckpointStore(checkpoints).find()
    assert path.name == "0000000002" and len(warnings) == 1 and "t.table.delta does not match its digest" in warnings[0]


def test_a_damaged_earlier_link_damages_every_checkpoint_built_on_it(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in (1, 2, 3):
        parts.train(10 * n, 2)
        parts.save(checkpoints, n)
    flip(checkpoints / "0000000002" / "optimizer_state" / "plain.weight.rows.delta", -5)
    path, _, warnings = CheckpointStore(checkpoints).find()
    assert path.name == "0000000001" and len(warnings) == 2
    assert (
        "applies to checkpoint" in warnings[0]
        and "which is damaged" in warnings[0]
        and str(checkpoints / "0000000002") in warnings[0]
    )
    with pytest.raises(StateError, match="which is damaged"):
        CheckpointStore(checkpoints).find(3)


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
    changed_rows(parts.opt).reset(None)  # whatever the tracker says, step 2 is now written afresh (a base)
    parts.save(checkpoints, 2)
    path, _, warnings = CheckpointStore(checkpoints).find()
    assert path.name == "0000000002" and "another version of checkpoint" in warnings[0]


def test_pruning_keeps_what_a_kept_checkpoint_needs(parts, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for n in range(1, 6):
        parts.train(10 * n, 2)
        parts.save(checkpoints, n, keep=1)
    names = [p.name for p in CheckpointStore(checkpoints).complete()]
    needs = json.loads((checkpoints / "0000000005" / "trainer.json").read_text())["needs"]
    assert needs == names[:-1] and names[0] == "0000000001"  # the base and every link stay...
    path, _, warnings = CheckpointStore(checkpoints).find()
    assert path.name == "0000000005" and warnings == []  # ...so the newest is intact
    assert restored(path, tmp_path / "back", parts.opt.state_id) == parts.files()
    parts.train(100, 1, everywhere=True)
    parts.save(checkpoints, 6, keep=1)  # a new base: nothing older is needed any more
    assert [p.name for p in CheckpointStore(checkpoints).complete()] == ["0000000006"]


def test_clean_never_removes_a_needed_base(parts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(
        json.dumps({"format": "dsa-train/run", "version": 1, "run_id": "r", "state_id": None})
    )
    (run / "config.yaml").write_text("name: x\n")
    for n in range(1, 5):
        parts.train(10 * n, 2)
        parts.save(run / "checkpoints", n)
    plan = plan_clean([run], keep_last=1)
    assert [c.path.name for c in plan.candidates] == []
    assert sum("made of its deltas on this one" in why for _, why in plan.kept) == 3
    for candidate in plan_clean([run / "checkpoints"], keep_last=1).candidates:
        remove(candidate)
    assert CheckpointStore(run / "checkpoints").find()[0].name == "0000000004"
    assert len(plan_clean([run], keep_last=0).candidates) == 4  # nothing kept: all may go


KILLED_MID_DELTA = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.test_checkpoint_deltas import Parts
    from dsa_train.runs import checkpoint_rows as checkpoint

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
    script = KILLED_MID_DELTA.format(root=str(Path(__file__).parent.parent), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    checkpoints = tmp_path / "checkpoints"
    partial = checkpoints / ".partial-0000000002"
    assert list(partial.rglob("*.delta")), "the kill did not land inside a delta write"
    assert [p.name for p in CheckpointStore(checkpoints).complete()] == ["0000000001"]
    assert CheckpointStore(checkpoints).find()[0].name == "0000000001"
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
    assert "reflink clones" in CheckpointStore(tmp_path / "checkpoints").mode(parts.opt)
    for n in range(1, MAX_LINKS + 4):
        parts.train(10 * n, 2)
        parts.save(tmp_path / "checkpoints", n)
    assert cloned == ["t.table", "plain.weight.rows"] * 2  # the first base, and the one after MAX_LINKS deltas
    newest = CheckpointStore(tmp_path / "checkpoints").complete()[-1]
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


# -- a fresh run: deltas on the files as they were made (virtual bases) ---------------------


def on_disk(folder: Path) -> int:
    """Bytes the files below ``folder`` take on disk (holes excluded)."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def test_a_fresh_runs_first_checkpoint_is_a_delta_on_the_files_as_made(parts, tmp_path):
    CheckpointStore.count_from_creation(parts.opt)
    checkpoints = tmp_path / "checkpoints"
    parts.train(0, 3)
    first = parts.save(checkpoints, 3)
    live = parts.files()
    assert kinds(first) == {"tables/t.table": "delta", "optimizer_state/plain.weight.rows": "delta"}
    table_delta = read_delta_header(first / "tables" / "t.table.delta")
    rows_delta = read_delta_header(first / "optimizer_state" / "plain.weight.rows.delta")
    assert (
        table_delta["parent"] == {"virtual": "initial"}
        and table_delta["base"] == "initial"
        and table_delta["links"] == 1
    )
    assert rows_delta["parent"] == {"virtual": "zeros"} and 0 < table_delta["rows"] <= 36
    state = json.loads((first / "trainer.json").read_text())
    assert state["version"] == VERSION and state["needs"] == []  # no checkpoint holds a base
    assert on_disk(first / "tables") < (parts.tables / "t.table").stat().st_size / 10  # no file of the table's size
    assert on_disk(first / "optimizer_state") < on_disk(parts.state) / 2

    back = restored(first, tmp_path / "back", parts.opt.state_id)  # the table drawn again, the deltas laid over it
    assert back == live

    parts.train(3, 4)  # and it goes on exactly as the uninterrupted run does
    uninterrupted = parts.files()
    parts.close()
    again = Parts(tmp_path / "back" / "tables", tmp_path / "back" / "state")
    CheckpointStore.load_model(first, again.model)
    load_optimizer_state(again.opt, first)
    again.train(3, 4)
    assert again.files() == uninterrupted
    again.close()


def test_chains_on_the_initial_table_are_compacted_onto_it_and_restore(parts, tmp_path):
    CheckpointStore.count_from_creation(parts.opt)
    checkpoints = tmp_path / "checkpoints"
    expected, headers = {}, []
    for n in range(1, 2 * MAX_LINKS + 4):
        parts.train(10 * n, 2)
        path = parts.save(checkpoints, n, keep=2)
        expected[path.name] = parts.files()
        headers.append(read_delta_header(path / "tables" / "t.table.delta"))
        assert kinds(path)["tables/t.table"] == "delta"  # never a copy of the table
    links = [h["links"] for h in headers]
    assert links[: MAX_LINKS + 1] == [*range(1, MAX_LINKS + 1), 1]  # compacted after MAX_LINKS links...
    merged = headers[MAX_LINKS]
    assert (
        merged["parent"] == {"virtual": "initial"} and merged["rows"] > 24
    )  # ...the chain's union, on the initial table
    kept = CheckpointStore(checkpoints).complete()
    newest = json.loads((kept[-1] / "trainer.json").read_text())["needs"]
    assert [p.name for p in kept] == sorted({*newest, kept[-2].name, kept[-1].name})  # pruning kept the chain only
    for i, path in enumerate(kept):
        assert restored(path, tmp_path / f"r{i}", parts.opt.state_id) == expected[path.name], path.name


def test_a_fresh_run_touching_most_rows_writes_a_base(parts, tmp_path):
    CheckpointStore.count_from_creation(parts.opt)
    parts.train(0, 1, everywhere=True)
    first = parts.save(tmp_path / "checkpoints", 1)
    assert kinds(first)["tables/t.table"] == "base"
    assert restored(first, tmp_path / "back", parts.opt.state_id) == parts.files()


def test_damage_to_a_delta_on_the_initial_table_is_found(parts, tmp_path):
    CheckpointStore.count_from_creation(parts.opt)
    checkpoints = tmp_path / "checkpoints"
    for n in (1, 2):
        parts.train(10 * n, 2)
        parts.save(checkpoints, n)
    first = checkpoints / "0000000001"
    flip(first / "tables" / "t.table.delta", ckpt.HEADER_BYTES + 40)  # the header block: the creation parameters
    with pytest.raises(StateError, match="every checkpoint .* is damaged") as caught:
        CheckpointStore(checkpoints).find()
    assert "t.table.delta does not match its digest" in caught.value.message
    shutil.rmtree(first)  # a missing link
    with pytest.raises(StateError, match="needs checkpoint 0000000001, which is missing"):
        CheckpointStore(checkpoints).find(2)


def test_a_torch_that_draws_other_initial_weights_is_refused(parts, tmp_path, monkeypatch):
    from dsa_train.storage import table

    CheckpointStore.count_from_creation(parts.opt)
    parts.train(0, 2)
    first = parts.save(tmp_path / "checkpoints", 1)
    real = table.init_chunk

    def other_numbers(init, chunk, generator, **kwargs):
        real(init, chunk, generator, **kwargs)
        chunk.add_(1e-3)

    monkeypatch.setattr(table, "init_chunk", other_numbers)
    assert CheckpointStore(tmp_path / "checkpoints").find()[2] == []  # intact: the guard is not damage
    where = tmp_path / "back" / "tables"
    where.mkdir(parents=True)
    with pytest.raises(
        StateError, match=r"cannot be re-created from its seed: it was made under torch .*, and torch .* draws other"
    ) as caught:
        CheckpointStore.restore_tables(first, where)
    assert f"torch=={torch.__version__}" in caught.value.hint
    assert list(where.iterdir()) == []  # nothing half-restored left


def test_reading_a_chain_on_the_initial_table_draws_only_its_chunks(tmp_path):
    """A table of three 65,536-row chunks: rows read through a delta-on-initial chain (ranges and
    gathers, across chunk borders) equal the live file's; only the chunks asked for are drawn."""
    from dsa_train.storage import table
    from dsa_train.storage.deltas import ChainReader, chain_of

    rows = 2 * table.INIT_CHUNK_ROWS + 7
    emb = DiskEmbedding(rows, 2, path=tmp_path / "t.table", std=0.1, seed=5)
    model = torch.nn.ModuleDict({"t": emb})
    with DiskSparseAdam(model.named_parameters(), lr=0.01, state_dir=tmp_path / "state") as opt:
        CheckpointStore.count_from_creation(opt)
        picked = torch.tensor([0, 5, table.INIT_CHUNK_ROWS - 1, table.INIT_CHUNK_ROWS, rows - 1])
        emb(picked).pow(2).sum().backward()
        opt.step()
        path = CheckpointStore(tmp_path / "checkpoints").save(1, model, opt, {"run_id": "r", "step": 1}, keep=2)
        emb.flush()
    live = np.fromfile(tmp_path / "t.table", dtype=np.uint8, offset=ckpt.HEADER_BYTES).reshape(rows, -1)
    drawn = []
    real = table.initial_weights

    def monkey(creation, shape, dtype, index, out=None):
        drawn.append(index)
        return real(creation, shape, dtype, index, out)

    table.initial_weights = monkey
    try:
        with ChainReader(chain_of(path / "tables" / "t.table.delta"), live.shape[1]) as reader:
            border = table.INIT_CHUNK_ROWS
            assert np.array_equal(reader.read(border - 3, border + 3), live[border - 3 : border + 3])
            asked = np.array([rows - 1, 3, 3, table.INIT_CHUNK_ROWS, 17])
            assert np.array_equal(reader.gather(asked), live[asked])
            assert (
                sorted(set(drawn)) == [0, 1, 2] and drawn.count(2) == 1
            )  # each chunk drawn once (cached), the guard's 0 again
    finally:
        table.initial_weights = real


def test_inspect_state_reads_a_checkpoint_kept_as_a_delta_on_the_initial_table(parts, tmp_path):
    from dsa_train.storage.inspect import StateInspector

    CheckpointStore.count_from_creation(parts.opt)
    parts.train(0, 3)
    first = parts.save(tmp_path / "checkpoints", 3)
    moments = parts.table.table.rows.moments.clone()
    parts.train(3, 3)  # the live table moves on; the checkpoint's version stays
    inspector = StateInspector(first / "optimizer_state", checkpoint=first)
    touched = np.flatnonzero(moments[:, 1].abs().sum(1).numpy())
    asked = [int(touched[0]), int(touched[-1]), ROWS - 1 if ROWS - 1 not in touched else 1]
    m, v = inspector.read_rows("table.weight", asked)
    assert np.array_equal(m, moments[asked, 0].double().numpy()) and np.array_equal(
        v, moments[asked, 1].double().numpy()
    )
    assert not v[2].any() and v[0].any()
    summary = inspector.summary("table.weight")
    assert summary.chain[0]["file"].startswith("initial") and summary.allocated_bytes == 0
    assert inspector.check("table.weight")["bad_rows"] == 0


# -- whole runs: resume and eval from deltas on the initial table ----------------------------

RUN_RECIPE = """\
name: fresh
description: a disk table large enough for its first checkpoints to be deltas
dataset:
  kind: synthetic
  synthetic: {entities: 20000, relations: 8, triples: 6000, valid: 200, test: 200, clusters: 12, seed: 3}
model: {kind: distmult, dim: 16, init_std: 0.05, dropout: 0.1, embedding_storage: disk}
train: {epochs: 1, max_steps: 8, batch_size: 64, negatives: 16, log_every: 2, checkpoint_every: 3, keep_checkpoints: 2}
optimizer: {kind: dsa, lr: 0.01}
eval: {final_splits: [test], entity_chunk: 3000}
"""


def cli(*args):
    from typer.testing import CliRunner

    from dsa_train.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def history(run: Path) -> list[dict]:
    from dsa_train.runs.run_folder import MetricsLog

    timings = MetricsLog.MACHINE_FIELDS
    return [{k: v for k, v in r.items() if k not in timings} for r in MetricsLog.read(run / "metrics.jsonl")]


def final_versions(run: Path) -> dict[str, np.ndarray]:
    """The final checkpoint's table and row file records, read through their chains."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from torture_kill import records_of

    final = CheckpointStore(run / "checkpoints").complete()[-1]
    return {name: records_of(final, name) for name in ("tables/entities.table", "optimizer_state/rel_emb.weight.rows")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh")
    (root / "fresh.yaml").write_text(RUN_RECIPE)
    done = cli("run", root / "fresh.yaml", "--output", root / "whole")
    assert done.exit_code == 0, done.stderr
    return root / "fresh.yaml", root / "whole"


def test_a_run_resumed_from_its_first_checkpoint_a_delta_on_the_initial_table_ends_as_uninterrupted(
    uninterrupted, tmp_path
):

    recipe, whole = uninterrupted

    broken = tmp_path / "broken"
    with error_at_step(4):  # after the first checkpoint (step 3)
        assert cli("run", recipe, "--output", broken).exit_code == 1
    first = broken / "checkpoints" / "0000000003"
    assert read_delta_header(first / "tables" / "entities.table.delta")["parent"] == {"virtual": "initial"}
    assert not (first / "tables" / "entities.table").exists()
    assert on_disk(first) < (broken / "tables" / "entities.table").stat().st_size / 10
    resumed = cli("run", recipe, "--output", broken, "--resume")
    assert resumed.exit_code == 0 and "resuming from" in resumed.stderr and "step 3" in resumed.stderr, resumed.stderr
    assert history(broken) == history(whole)
    ours, theirs = final_versions(broken), final_versions(whole)
    assert ours.keys() == theirs.keys() and all(
        np.array_equal(ours[k], theirs[k]) for k in ours
    )  # (never empty: final_versions names two files)
    live = lambda run: np.fromfile(run / "tables" / "entities.table", dtype=np.uint8, offset=4096)  # noqa: E731
    assert np.array_equal(live(broken), live(whole))


KILLED_IN_THE_FIRST_DELTA = textwrap.dedent(
    """
    import os, signal, sys
    from dsa_train.runs import checkpoint_rows as checkpoint

    real = checkpoint.write_delta

    def killed_half_way(source, rows, target, meta):
        real(source, rows, target, meta)
        os.truncate(target, os.path.getsize(target) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.write_delta = killed_half_way
    from dsa_train.cli.app import main
    sys.argv = ["dsa-train", "run", {recipe!r}, "--output", {out!r}]
    main()
    """
)


def test_a_kill_in_the_first_delta_then_resume_ends_as_uninterrupted(uninterrupted, tmp_path):
    recipe, whole = uninterrupted
    victim = tmp_path / "victim"
    script = KILLED_IN_THE_FIRST_DELTA.format(recipe=str(recipe), out=str(victim))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert list((victim / "checkpoints").glob(".partial-0000000003/*/*.delta")), (
        "the kill did not land in the first delta"
    )
    assert CheckpointStore(victim / "checkpoints").complete() == []
    resumed = cli("run", recipe, "--output", victim, "--resume")
    assert resumed.exit_code == 0 and "has no checkpoint yet" in resumed.stderr, resumed.stderr
    assert history(victim) == history(whole)
    ours, theirs = final_versions(victim), final_versions(whole)
    assert ours.keys() == theirs.keys() and all(
        np.array_equal(ours[k], theirs[k]) for k in ours
    )  # (never empty: final_versions names two files)


def test_eval_of_a_delta_checkpoint_reads_it_through_its_chain_and_scores_as_the_table_itself(
    uninterrupted, monkeypatch
):
    """The reference: the same checkpoint scored with the run's live table (its version at the
    final step), mapped as a DiskEmbedding. eval writes nothing: no table is materialised, and
    nothing is made in the run folder (which may be read-only)."""
    from dsa_train.storage import deltas
    from dsa_train.train import loop
    from dsa_train.runs.run_folder import RunFolder
    from dsa_train.train.tables import TableSite
    from dsa_train.train.tasks import make_task

    recipe, whole = uninterrupted
    final = CheckpointStore(whole / "checkpoints").complete()[-1]
    assert (final / "tables" / "entities.table.delta").exists() and not (final / "tables" / "entities.table").exists()

    def never(*args, **kwargs):
        raise AssertionError("a table was materialised")

    monkeypatch.setattr(checkpoint_store, "materialise", never)
    monkeypatch.setattr(deltas, "copy_sparse", never)
    folders = [whole, *(p for p in whole.rglob("*") if p.is_dir())]
    before = {p: p.stat().st_mtime_ns for p in folders}  # an entry made (or removed) anywhere shows here
    path, metrics, _ = loop.evaluate_run(RunFolder.find(whole), "test")
    assert path == final and {p: p.stat().st_mtime_ns for p in folders} == before

    run_recipe = RunFolder.find(whole).read_config([])
    torch.manual_seed(run_recipe.train.seed)
    task = make_task(run_recipe, torch.device("cpu"), TableSite(whole / "tables", writable=False))
    CheckpointStore.load_model(final, task.model)
    task.model.eval()
    assert metrics == task.evaluate("test", final=True)
    assert metrics["both"]["queries"] == 400


NODE2VEC_RECIPE = """\
name: fresh-node2vec
description: node2vec with its node table on disk, checkpointed as deltas
dataset:
  kind: synthetic_graph
  graph: {nodes: 20000, communities: 4, average_degree: 4, homophily: 0.9, seed: 1}
  link_split: [0.1, 0.2]
model:
  kind: node2vec
  dim: 8
  embedding_storage: disk
  node2vec: {walk_length: 4, context_size: 2, walks_per_node: 1}
train: {epochs: 1, max_steps: 4, batch_size: 32, log_every: 2, checkpoint_every: 3, keep_checkpoints: 2}
optimizer: {kind: dsa, lr: 0.05}
eval: {final_splits: [test], link_negatives: 5}
"""


def test_node2vec_eval_of_a_delta_checkpoint_reads_only_the_rows_it_scores(tmp_path, monkeypatch):
    from dsa_train.nn import TableRows
    from dsa_train.train import loop
    from dsa_train.runs.run_folder import RunFolder
    from dsa_train.train.tables import TableSite
    from dsa_train.train.tasks import make_task

    (tmp_path / "n.yaml").write_text(NODE2VEC_RECIPE)
    assert cli("run", tmp_path / "n.yaml", "--output", tmp_path / "run").exit_code == 0
    run = RunFolder.find(tmp_path / "run")
    final = CheckpointStore(run.checkpoints).complete()[-1]
    assert read_delta_header(final / "tables" / "nodes.table.delta")["base"] == "initial"
    read, real = [], TableRows.__getitem__
    monkeypatch.setattr(TableRows, "__getitem__", lambda self, ids: read.append(len(ids)) or real(self, ids))
    _, metrics, _ = loop.evaluate_run(run, "test")
    assert read and "link" in metrics

    recipe = run.read_config([])
    torch.manual_seed(recipe.train.seed)
    task = make_task(recipe, torch.device("cpu"), TableSite(run.tables_dir, writable=False))
    CheckpointStore.load_model(final, task.model)
    task.model.eval()
    assert metrics == task.evaluate("test", final=True)


# A delta's digest is computed from its bytes as they are written (on a second thread), never
# by reading the file back: it must be file_digest's, byte for byte.


def _pattern(size: int, seed: int) -> bytes:
    """``size`` bytes, with whole 64 KiB blocks of zeros, a zero tail and zeros across a block
    boundary among random ones."""
    data = bytearray(np.random.default_rng(seed).integers(1, 256, size, dtype=np.uint8).tobytes())
    block = fsutil.DIGEST_BLOCK
    for start in range(block, size, 3 * block):  # every third block zero
        data[start : start + block] = bytes(len(data[start : start + block]))
    data[max(0, size - 100) :] = bytes(min(size, 100))
    if size > block + 50:
        data[block - 50 : block + 50] = bytes(100)  # zeros straddling a boundary (the block still has data)
    return bytes(data)


@pytest.mark.parametrize("size", [0, 1, 8191, 65535, 65536, 65537, 2 * 65536, 5 * 65536 + 12_345])
@pytest.mark.parametrize("pieces", ["whole", "header across a block boundary", "ragged"])
def test_the_digest_computed_while_writing_is_file_digest(tmp_path, size, pieces):
    data = _pattern(size, seed=size)
    if pieces == "whole":
        cuts = [size]
    elif pieces == "header across a block boundary":
        cuts = [min(size, 70_000), size]  # the first piece ends past the first block
    else:
        cuts = sorted({min(size, c) for c in (0, 3, 8192, 8193, 65_530, 65_536, 100_000, 200_001)} | {size})
    chunks = [data[a:b] for a, b in zip([0, *cuts], cuts)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        digest = fsutil.write_digested(fd, size, iter(chunks), depth=2)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert digest == fsutil.file_digest(path)
    streamed = fsutil.StreamDigest(size)
    for chunk in chunks:
        streamed.update(chunk)
    assert streamed.hexdigest() == digest


def test_zero_blocks_and_holes_digest_alike(tmp_path):
    """A block of zeros counts the same written or a hole: the streamed digest of written
    zeros equals file_digest of a sparse file with the same content."""
    block = fsutil.DIGEST_BLOCK
    data = b"x" * 10 + bytes(3 * block) + b"y" * 5
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.write(data[:10])
        f.seek(len(data) - 5)
        f.write(data[-5:])
    streamed = fsutil.StreamDigest(len(data))
    streamed.update(data)
    assert streamed.hexdigest() == fsutil.file_digest(sparse)


def test_a_delta_digest_is_file_digest_with_a_slow_hasher_and_a_reused_ring(tmp_path, monkeypatch):
    """Many small chunks through the ring of buffers, the hasher slowed down: a buffer is
    never refilled before it was hashed, and the digest is the file's; zero records make
    zero blocks."""
    table = DiskEmbedding(3000, 8, path=tmp_path / "t.table", std=0.1)
    records = tmp_path / "t.table"
    row_bytes = table.table.spec.row_bytes
    table.table.close()
    with open(records, "r+b") as f:  # rows 1000..1999: all zeros (whole zero blocks in the delta)
        f.seek(4096 + 1000 * row_bytes)
        f.write(bytes(1000 * row_bytes))
    real_update = fsutil.StreamDigest.update

    def slow_update(self, data):
        time.sleep(0.002)
        real_update(self, data)

    monkeypatch.setattr(fsutil.StreamDigest, "update", slow_update)
    monkeypatch.setattr(deltas, "WRITE_BYTES", 5000)  # a few rows a chunk, not block-aligned
    for n, rows in enumerate([np.arange(3000), np.arange(0, 3000, 7), np.array([5]), np.array([], dtype=np.int64)]):
        target = tmp_path / f"{n}.delta"
        meta = {
            "file": "tables/t.table",
            "row_bytes": row_bytes,
            "parent": {"virtual": "initial"},
            "base": "initial",
            "links": 1,
            "chain_bytes": len(rows) * row_bytes,
        }
        written = deltas.write_delta(records, rows, target, meta)
        assert written.size == target.stat().st_size == deltas.INDEX_OFFSET + len(rows) * (8 + row_bytes)
        assert written.digest == fsutil.file_digest(target)
        assert read_delta_header(target)["rows"] == len(rows)


def test_a_failure_while_writing_or_hashing_is_raised_and_leaves_no_thread(tmp_path, monkeypatch):
    threads = threading.active_count()

    def broken_chunks():
        yield b"a" * 100
        raise OSError(errno.EIO, "gathering failed")

    fd = os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with pytest.raises(OSError, match="gathering failed"):
            fsutil.write_digested(fd, 200, broken_chunks(), depth=2)
        with pytest.raises(ValueError, match="100 bytes were written, 200 announced"):
            fsutil.write_digested(fd, 200, iter([b"b" * 100]), depth=2)
        monkeypatch.setattr(fsutil.StreamDigest, "update", lambda self, data: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fsutil.write_digested(fd, 10 << 20, iter([bytes(1 << 20)] * 10), depth=2)
    finally:
        os.close(fd)
    assert threading.active_count() == threads


def test_a_checkpoint_fsyncs_each_file_once_and_never_reads_a_delta_back(parts, tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    parts.train(0, 3)
    parts.save(checkpoints, 3)
    parts.train(3, 3)
    synced, digested, real_fsync, real_digest = [], [], os.fsync, ckpt.file_digest

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ckpt, "file_digest", lambda path: digested.append(Path(path).name) or real_digest(path))
    second = parts.save(checkpoints, 6)
    monkeypatch.undo()
    files = [p for p in second.rglob("*") if p.is_file()]
    in_checkpoint = [
        Path(p).relative_to((checkpoints / ".partial-0000000006").resolve()) for p in synced if ".partial-" in p
    ]
    assert sorted(map(str, in_checkpoint)) == sorted(set(map(str, in_checkpoint)))  # each once...
    assert {str(p.relative_to(second)) for p in files} <= {str(p) for p in in_checkpoint}  # ...every file
    assert not [name for name in digested if name.endswith(DELTA_SUFFIX)]  # digested as written
    state = json.loads((second / "trainer.json").read_text())
    assert kinds(second) == {"tables/t.table": "delta", "optimizer_state/plain.weight.rows": "delta"}
    assert {name: fsutil.file_digest(second / name) for name in state["files"]} == state["files"]
    assert CheckpointStore(checkpoints).find()[0] == second


def _on_disk(paths: list[Path]) -> dict[str, bytes]:
    """The files' bytes as the disk has them (a read, not this process's mapping)."""
    return {path.name: path.read_bytes() for path in paths}


@pytest.mark.skipif(pagemap_hidden() is not None, reason=f"{pagemap_hidden()}, and a base flushes first")
def test_a_checkpoint_writes_the_changed_rows_once_into_itself_and_leaves_the_live_files(parts, tmp_path):
    """Bases (the first checkpoint) and deltas (the second) are taken from the rows as the
    optimizer holds them: the live files on disk are not written, the changed rows stay in
    memory, and the checkpoint restores to exactly what a flush then writes."""
    checkpoints, live = tmp_path / "checkpoints", [parts.tables / "t.table", parts.state / "plain.weight.rows"]
    parts.opt.flush()
    for round_, expected in ((0, "base"), (1, "delta")):
        parts.train(10 * round_, 3)
        before, stats = _on_disk(live), parts.opt.residency()
        checkpoint = parts.save(checkpoints, round_ + 1)
        assert set(kinds(checkpoint).values()) == {expected}
        assert _on_disk(live) == before  # nothing reached the live files...
        after = parts.opt.residency()
        assert (
            after["written_bytes"] == stats["written_bytes"] and after["resident_bytes"] == stats["resident_bytes"] > 0
        )  # ...the rows stay held
        manifest = load_manifest(checkpoint / "optimizer_state" / "manifest.json")
        assert manifest["clean"] and manifest["params"]["plain.weight"]["step"] == 3 * (round_ + 1)
        assert not load_manifest(parts.state / "manifest.json")[
            "clean"
        ]  # the live state is not flushed: a crash restores a checkpoint
        back = restored(checkpoint, tmp_path / f"back{round_}", parts.opt.state_id)
        assert back == parts.files()  # what a flush writes now is what the checkpoint holds


@pytest.mark.skipif(pagemap_hidden() is not None, reason=f"{pagemap_hidden()}, and a base flushes first")
def test_a_base_copied_from_memory_is_the_flushed_file_with_its_holes(tmp_path):
    """RowFile.copy_to: changed pages over the file's data and over its holes come from memory,
    the rest from the file; the copy is what a flush then writes, as sparse as the file."""
    rows, dim = 200_000, 8  # a 12.8 MB row file: rows 64 B, 64 to a page
    weight = torch.nn.Parameter(torch.zeros(rows, dim))
    opt = DiskSparseAdam([("w", weight)], lr=0.01, state_dir=tmp_path / "state")
    path = tmp_path / "state" / "w.rows"

    def step(picked):
        weight.grad = torch.sparse_coo_tensor(picked[None], torch.randn(len(picked), dim), (rows, dim))
        opt.step()

    step(torch.arange(0, 640))  # the file's data after a flush: ten pages
    opt.flush()
    step(torch.tensor([5, 100_000, 150_000, 199_999]))  # over data, and in three holes
    before = path.read_bytes()
    opt.live_row_file(path).copy_to(tmp_path / "copy.rows")
    assert path.read_bytes() == before  # the live file was not written
    copy = tmp_path / "copy.rows"
    assert copy.stat().st_blocks * 512 < 20 * 4096 + (64 << 10)  # data and the changed pages, holes kept
    opt.flush()
    assert copy.read_bytes() == path.read_bytes()
    with pytest.raises(FileExistsError):
        opt.live_row_file(path).copy_to(copy)  # never over an existing file or a link
    opt.close()


def test_the_parts_of_a_range_outside_others():
    ranges = [(0, 4096), (8192, 12288), (16384, 20480)]
    starts = [a for a, _ in ranges]
    assert list(fsutil._outside(0, 24576, ranges, starts)) == [(4096, 8192), (12288, 16384), (20480, 24576)]
    assert list(fsutil._outside(2000, 9000, ranges, starts)) == [(4096, 8192)]
    assert list(fsutil._outside(9000, 10000, ranges, starts)) == []
    assert list(fsutil._outside(5, 50, [], [])) == [(5, 50)]
