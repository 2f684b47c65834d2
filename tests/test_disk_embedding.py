"""DiskEmbedding / DiskEmbeddingBag: weights in a table file, moments in the same records.

The reference is always torch: nn.Embedding / nn.EmbeddingBag with sparse=True trained by
torch.optim.SparseAdam on the same inputs, compared bit for bit after every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dsa_train import DiskEmbedding, DiskEmbeddingBag, DiskSparseAdam, StateError
from dsa_train.memory import PeakRssAnon, rss_anon_bytes
from dsa_train.storage.format import HEADER_BYTES, read_row_header
from dsa_train.optim.prefetch import Prefetcher
from dsa_train.storage.table import INIT_CHUNK_ROWS

ROWS, DIM = 500, 12


@pytest.fixture(autouse=True)
def _both_row_paths(row_path):
    """Every parity test runs with the compiled kernel and with the pure-torch update."""


def twin(tmp_path, module, *, dtype=torch.float32, **init):
    """A disk module and an in-memory torch twin holding the same initial weights."""
    disk_cls, torch_cls, extra = module
    disk = disk_cls(ROWS, DIM, path=tmp_path / "t.table", dtype=dtype, **extra, **init)
    ref = torch_cls(ROWS, DIM, sparse=True, dtype=dtype, **extra)
    with torch.no_grad():
        ref.weight.copy_(disk.weight)
    return disk, ref


EMBEDDING = (DiskEmbedding, nn.Embedding, {})
BAG = (DiskEmbeddingBag, nn.EmbeddingBag, {"mode": "sum"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("maximize", [False, True])
def test_disk_embedding_trains_exactly_like_sparse_adam(tmp_path, dtype, maximize):
    disk, ref = twin(tmp_path, EMBEDDING, dtype=dtype, std=0.1)
    kwargs = dict(lr=0.01, betas=(0.8, 0.99), maximize=maximize)
    ours = DiskSparseAdam(disk.named_parameters(), state_dir=tmp_path / "state", **kwargs)
    theirs = torch.optim.SparseAdam(ref.parameters(), **kwargs)
    for step in range(60):
        # Few distinct rows and many repeats: duplicates summed, rows touched again and again.
        idx = torch.randint(0, ROWS if step % 2 else 40, (256,))
        for model, opt in ((disk, ours), (ref, theirs)):
            opt.zero_grad()
            (model(idx) ** 2).sum().backward()
            opt.step()
        assert torch.equal(disk.weight, ref.weight), f"weights differ after step {step}"
    # The moments are in the table's records, next to the weights: no row file of their own.
    m, v = disk.table.rows.moments[:, 0], disk.table.rows.moments[:, 1]
    assert torch.equal(m, theirs.state[ref.weight]["exp_avg"])
    assert torch.equal(v, theirs.state[ref.weight]["exp_avg_sq"])
    ours.close()
    assert not list((tmp_path / "state").glob("*.rows"))
    entry = json.loads((tmp_path / "state" / "manifest.json").read_text())["params"]["weight"]
    assert entry["layout"] == "w|m|v" and entry["table"] == str((tmp_path / "t.table").resolve())


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_disk_embedding_bag_trains_exactly_like_sparse_adam(tmp_path, mode):
    disk, ref = twin(tmp_path, (DiskEmbeddingBag, nn.EmbeddingBag, {"mode": mode}), std=0.1)
    ours = DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "state")
    theirs = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    for step in range(30):
        idx = torch.randint(0, ROWS if step % 2 else 20, (200,))  # repeats within and across bags
        offsets = torch.cat([torch.tensor([0, 0, 3]), torch.arange(5, 200, 5)])  # an empty bag, uneven ones
        weights = torch.rand(200) if mode == "sum" else None
        for model, opt in ((disk, ours), (ref, theirs)):
            opt.zero_grad()
            model(idx, offsets, per_sample_weights=weights).pow(2).sum().backward()
            opt.step()
        assert torch.equal(disk.weight, ref.weight), f"weights differ after step {step}"
    fixed = torch.randint(0, ROWS, (7, 3))  # 2-d input: one bag per row
    assert torch.equal(disk(fixed), ref(fixed))
    ours.close()


def test_disk_embedding_bag_max_mode_has_torch_dense_gradient(tmp_path):
    """torch refuses mode 'max' with sparse=True; the disk bag gives it, equal to the dense one."""
    disk = DiskEmbeddingBag(ROWS, DIM, mode="max", path=tmp_path / "t.table", std=0.1)
    ref = nn.EmbeddingBag(ROWS, DIM, mode="max")
    with torch.no_grad():
        ref.weight.copy_(disk.weight)
    idx, offsets = torch.randint(0, ROWS, (60,)), torch.arange(0, 60, 6)
    out, expected = disk(idx, offsets), ref(idx, offsets)
    assert torch.equal(out, expected)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    (expected * torch.arange(out.numel()).view_as(out)).sum().backward()
    assert torch.equal(disk.weight.grad.to_dense(), ref.weight.grad)


def test_disk_embedding_bag_reads_only_the_looked_up_rows(tmp_path):
    """Its forward never copies the table (F.embedding_bag on the table's strided view would
    make a contiguous copy of every row: 64 MiB of anonymous memory here, at every step)."""

    def peak_mib():  # the process's peak resident memory since the last reset
        return next(int(line.split()[1]) >> 10 for line in open("/proc/self/status") if line.startswith("VmHWM"))

    bag = DiskEmbeddingBag(500_000, 32, mode="sum", path=tmp_path / "big.table")
    idx, offsets = torch.randint(0, 500_000, (4096,)), torch.arange(0, 4096, 4)
    bag(idx, offsets).sum().backward()  # the first call's own allocations
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to what is resident now
    before = peak_mib()
    out = bag(idx, offsets)
    out.sum().backward()
    assert peak_mib() - before < 16
    assert torch.equal(out, nn.functional.embedding_bag(idx, bag.weight.detach().contiguous(), offsets, mode="sum"))


def test_mixed_model_of_disk_and_memory_tables(tmp_path):
    """A disk table and a plain nn.Embedding in one optimizer: each keeps its own layout."""
    disk, ref = twin(tmp_path, EMBEDDING, std=0.1)
    plain = nn.Embedding(30, DIM, sparse=True)
    plain_ref = nn.Embedding(30, DIM, sparse=True)
    plain_ref.load_state_dict(plain.state_dict())
    ours = DiskSparseAdam([("ent", disk.weight), ("rel", plain.weight)], lr=0.01, state_dir=tmp_path / "state")
    theirs = torch.optim.SparseAdam([ref.weight, plain_ref.weight], lr=0.01)
    for _ in range(20):
        e, r = torch.randint(0, ROWS, (64,)), torch.randint(0, 30, (64,))
        for (ent, rel), opt in (((disk, plain), ours), ((ref, plain_ref), theirs)):
            opt.zero_grad()
            (ent(e) * rel(r)).sum().pow(2).backward()
            opt.step()
        assert torch.equal(disk.weight, ref.weight) and torch.equal(plain.weight, plain_ref.weight)
    ours.close()
    assert sorted(p.name for p in (tmp_path / "state").glob("*.rows")) == ["rel.rows"]


def test_reopening_table_and_state_continues_the_run(tmp_path):
    """Close everything mid-run, reopen the table file and the state directory: the run goes
    on as if it had never stopped (weights from the file, moments and step counters too)."""
    disk, ref = twin(tmp_path, EMBEDDING, std=0.1)
    theirs = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    ours = DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "state")
    for step in range(40):
        if step == 20:
            ours.close()
            disk.table.close()
            disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table")
            ours = DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "state")
        idx = torch.randint(0, ROWS, (128,))
        for model, opt in ((disk, ours), (ref, theirs)):
            opt.zero_grad()
            model(idx).sum().backward()
            opt.step()
        assert torch.equal(disk.weight, ref.weight), f"weights differ after step {step}"
    ours.close()


def test_table_and_state_that_do_not_belong_together_are_refused(tmp_path):
    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "a.table")
    opt = DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "state")
    disk(torch.arange(5)).sum().backward()
    opt.step()
    opt.close()
    # A fresh optimizer state would continue the trained moments from step 0.
    with pytest.raises(StateError, match="already holds moments"):
        DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "fresh")
    assert not (tmp_path / "fresh" / "manifest.json").exists()
    # The state directory refuses another table in the same role.
    other = DiskEmbedding(ROWS, DIM, path=tmp_path / "b.table")
    with pytest.raises(StateError, match="holds the moments of table"):
        DiskSparseAdam(other.parameters(), lr=0.01, state_dir=tmp_path / "state")
    # A table opened with another shape is refused by the table itself.
    with pytest.raises(StateError, match="shape"):
        DiskEmbedding(ROWS + 1, DIM, path=tmp_path / "a.table")
    # A read-only table cannot be trained.
    frozen = DiskEmbedding(ROWS, DIM, path=tmp_path / "a.table", writable=False)
    assert frozen(torch.arange(3)).shape == (3, DIM)
    with pytest.raises(ValueError, match="read-only"):
        DiskSparseAdam(frozen.parameters(), lr=0.01, state_dir=tmp_path / "state")


def test_initialisation_is_chunked_seeded_and_has_the_asked_distribution(tmp_path):
    rows = 3 * INIT_CHUNK_ROWS + 17  # several chunks and a ragged last one
    before = rss_anon_bytes()
    with PeakRssAnon() as peak:
        a = DiskEmbedding(rows, 128, path=tmp_path / "a.table", init="normal", std=0.5, seed=7)
    table_bytes = rows * 128 * 4
    assert peak.peak - before < table_bytes / 2, "the weights were materialised in memory at once"
    b = DiskEmbedding(rows, 128, path=tmp_path / "b.table", init="normal", std=0.5, seed=7)
    c = DiskEmbedding(rows, 128, path=tmp_path / "c.table", init="normal", std=0.5, seed=8)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)
    assert abs(a.weight.std().item() - 0.5) < 0.005 and abs(a.weight.mean().item()) < 0.005
    # Distinct chunks draw distinct numbers (no chunk repeats another's generator).
    assert not torch.equal(a.weight[:100], a.weight[INIT_CHUNK_ROWS : INIT_CHUNK_ROWS + 100])
    x = DiskEmbedding(1000, 50, path=tmp_path / "x.table", init="xavier_uniform")
    bound = (6 / 1050) ** 0.5
    assert x.weight.abs().max() <= bound and x.weight.abs().max() > 0.95 * bound
    u = DiskEmbedding(1000, 50, path=tmp_path / "u.table", init="uniform", bound=0.2)
    assert u.weight.abs().max() <= 0.2 and u.weight.abs().max() > 0.19
    # The moments start at zero, and the header says what the file is.
    assert not a.table.rows.moments.any()
    meta = read_row_header(tmp_path / "a.table")
    assert meta["layout"] == "w|m|v" and meta["shape"] == [rows, 128] and meta["moments_of"] is None
    assert (tmp_path / "a.table").stat().st_size == HEADER_BYTES + rows * 3 * 128 * 4
    assert not list(tmp_path.glob(".*partial*"))


def test_state_dict_references_the_table_and_loads_torch_weights(tmp_path):
    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table")
    state = disk.state_dict()
    assert set(state) == {"table"} and state["table"]["table_id"] == disk.table.table_id
    disk.load_state_dict(state)  # its own reference: fine
    plain = nn.Embedding(ROWS, DIM)
    disk.load_state_dict(plain.state_dict())  # torch weights are copied into the table
    assert torch.equal(disk.weight, plain.weight)
    other = DiskEmbedding(ROWS, DIM, path=tmp_path / "o.table")
    with pytest.raises(RuntimeError, match="refers to table"):
        other.load_state_dict(state)


def test_to_moves_outputs_not_the_weight(tmp_path):
    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table")
    moved = disk.to(torch.float64)  # a dtype change leaves the table as it is
    assert moved is disk and disk.weight.dtype == torch.float32 and disk.weight.device.type == "cpu"
    assert disk.output_device.type == "cpu"


@pytest.mark.parametrize("claim", [False, True])
def test_prefetching_overlapping_batches_changes_nothing(tmp_path, claim):
    """Prefetch the next batch while this one trains, with consecutive batches sharing most
    rows, reading their pages or claiming them for writing: the result equals training
    without prefetch bit for bit (no stale row, no lost update), and equals SparseAdam."""
    disk, ref = twin(tmp_path, EMBEDDING, std=0.1)
    ours = DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "state")
    theirs = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    prefetcher = Prefetcher(threads=4)
    batches = [torch.randint(0, 60, (128,)) for _ in range(40)]  # 60 hot rows: heavy overlap
    for step, idx in enumerate(batches):
        if step + 1 < len(batches):
            prefetcher.submit(disk.table.rows, batches[step + 1], claim=claim)
        for model, opt in ((disk, ours), (ref, theirs)):
            opt.zero_grad()
            (model(idx) ** 2).sum().backward()
            opt.step()
        assert torch.equal(disk.weight, ref.weight), f"weights differ after step {step}"
    prefetcher.close()
    ours.close()


def test_inspect_state_reads_moments_from_the_table(tmp_path):
    from dsa_train.storage.inspect import StateInspector

    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table")
    opt = DiskSparseAdam(disk.named_parameters(), lr=0.01, state_dir=tmp_path / "state")
    disk(torch.tensor([3, 3, 7])).sum().backward()
    opt.step()
    opt.flush()
    inspector = StateInspector(tmp_path / "state")
    m, v = inspector.read_rows("weight", [3, 7, 8])
    assert torch.equal(torch.from_numpy(m).float(), disk.table.rows.moments[[3, 7, 8], 0])
    assert torch.equal(torch.from_numpy(v).float(), disk.table.rows.moments[[3, 7, 8], 1])
    assert inspector.summary("weight").layout == "w|m|v"
    opt.close()


def test_a_table_records_how_it_was_made_and_an_older_header_still_opens(tmp_path):
    """The header's creation parameters re-create the table exactly; a table made before they
    were recorded opens as before, and a fresh run's first checkpoint of it is a full copy
    (there is nothing to re-create it from)."""
    from dsa_train.storage.table import InitialTable, Table, table_header
    from dsa_train.runs.checkpoint_store import CheckpointStore

    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table", init="uniform", bound=0.3, seed=11)
    meta = read_row_header(tmp_path / "t.table")
    creation = meta["creation"]
    assert {k: creation[k] for k in ("init", "bound", "seed", "chunk_rows")} == {
        "init": "uniform",
        "bound": 0.3,
        "seed": 11,
        "chunk_rows": INIT_CHUNK_ROWS,
    }
    assert creation["torch"] == torch.__version__ and len(creation["first_chunk_digest"]) == 32
    drawn = InitialTable(meta, "test").records(torch.arange(ROWS).numpy())
    assert drawn.tobytes() == (tmp_path / "t.table").read_bytes()[HEADER_BYTES:]

    old = tmp_path / "old" / "t.table"  # the same table with a header of before: no creation
    old.parent.mkdir()
    old.write_bytes((tmp_path / "t.table").read_bytes())
    with open(old, "r+b") as f:
        f.write(table_header(disk.table.spec, moments_of=None, creation=None))
    assert Table.open(old, (ROWS, DIM), torch.float32).creation is None
    older = DiskEmbedding(ROWS, DIM, path=old)
    opt = DiskSparseAdam(older.named_parameters(), lr=0.01, state_dir=tmp_path / "state")
    CheckpointStore.count_from_creation(opt)
    older(torch.tensor([1, 2])).sum().backward()
    opt.step()
    first = CheckpointStore(tmp_path / "checkpoints").save(1, older, opt, {"step": 1}, keep=1)
    assert (first / "tables" / "t.table").is_file() and not (first / "tables" / "t.table.delta").exists()
    opt.close()


def test_the_table_link_is_explicit_and_a_deepcopy_says_why_it_cannot(tmp_path):
    """DiskSparseAdam finds a DiskEmbedding's table through the registry, not an attribute of
    the tensor (a plain tensor with the same values is not a table's weight), and deepcopy of
    a model holding one fails with a sentence naming the file instead of 'cannot pickle mmap'."""
    import copy

    from dsa_train.storage.table import table_of

    emb = DiskEmbedding(50, 4, path=tmp_path / "t.table")
    assert table_of(emb.weight) is emb.table
    assert table_of(torch.nn.Parameter(emb.weight.detach().clone())) is None
    assert not hasattr(emb.weight, "_dsa_table")
    model = torch.nn.Sequential(emb)
    with pytest.raises(
        TypeError, match=r"cannot be deep-copied: its weight is the memory-mapped table file '.*t\.table'"
    ):
        copy.deepcopy(model)
