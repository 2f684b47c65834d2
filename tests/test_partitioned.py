"""Partition-ordered training (train.order: partitioned): the layout, the buckets, the buffer
schedule, the epoch order, the partition buffer, and runs checked against random order."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.data import load_knowledge_graph
from dsa_train.data.buckets import EntityPartitions, bucket_of, load_buckets
from dsa_train.data.kg import KnowledgeGraph
from dsa_train.data.order import Shuffle
from dsa_train.data.partition_order import PartitionedOrder, buffer_schedule
from dsa_train.errors import ConfigError
from dsa_train.storage.buffer import PartitionBuffer
from dsa_train.storage.table import Table
from dsa_train.recipe import DatasetConfig, SyntheticConfig, parse_recipe
from dsa_train.runs.run_folder import MetricsLog

from .helpers import error_at_step

TINY = """\
name: tiny
dataset:
  kind: synthetic
  synthetic: {entities: 300, relations: 6, triples: 4000, valid: 100, test: 100, clusters: 10, seed: 1}
model: {kind: distmult, dim: 16, init_std: 0.05, dropout: 0.1, embedding_storage: disk}
train: {epochs: 3, batch_size: 256, negatives: 64, log_every: 4, checkpoint_every: 5, keep_checkpoints: 3, regularization: 0.001}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 2, final_splits: [valid, test]}
"""
TIMINGS = (*MetricsLog.MACHINE_FIELDS, "buffer")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def records(run, kind):
    found = [r for r in MetricsLog.read(run / "metrics.jsonl") if r["kind"] == kind]
    for record in found:
        for timing in TIMINGS:
            record.pop(timing, None)
    return found


def table_records(run):
    return np.fromfile(
        run / "tables" / "entities.table", dtype=np.float32, offset=4096
    )  # past the header, which names the run


def random_kg(entities=200, relations=5, triples=3000, seed=0) -> KnowledgeGraph:
    g = torch.Generator().manual_seed(seed)
    train = torch.stack(
        [
            torch.randint(0, entities, (triples,), generator=g),
            torch.randint(0, relations, (triples,), generator=g),
            torch.randint(0, entities, (triples,), generator=g),
        ],
        1,
    ).int()
    empty = torch.empty((0, 3), dtype=torch.int32)
    return KnowledgeGraph("random", entities, relations, train, empty, empty)


# --- the layout --------------------------------------------------------------------------


@pytest.mark.parametrize("entities,partitions", [(1, 1), (300, 1), (300, 4), (1000, 7), (65_537, 16)])
def test_entity_partitions_are_a_permutation_cut_into_equal_ranges(entities, partitions):
    layout = EntityPartitions(entities, partitions, seed=3)
    ids = torch.arange(entities)
    slots = layout.slots(ids)
    assert torch.equal(torch.sort(slots).values, ids)  # a permutation
    assert torch.equal(layout.ids(slots), ids)  # and its inverse
    if partitions == 1:
        assert torch.equal(slots, ids)  # one partition: no permutation, the random order's layout
    sizes = torch.bincount(layout.partition_of(ids), minlength=partitions)
    assert (
        (sizes[:-1] == layout.block).all() and sizes[-1] <= layout.block and int(sizes.sum()) == entities
    )  # equal but the last
    assert [layout.span(p)[1] - layout.span(p)[0] for p in range(partitions)] == sizes.tolist()


def test_the_hot_low_ids_spread_over_every_partition():
    layout = EntityPartitions(100_000, 8, seed=0)
    hot = layout.partition_of(torch.arange(800))  # the 800 lowest ids, the hottest of a power law
    assert (
        torch.bincount(hot, minlength=8).min() >= 60
    )  # 100 each on average; without the permutation all in partition 0


# --- the buckets -------------------------------------------------------------------------


def test_buckets_hold_the_training_split_sorted_by_bucket_stably():
    kg = random_kg()
    layout = EntityPartitions(kg.num_entities, 4, seed=1)
    buckets = load_buckets(kg, layout)
    assert buckets.offsets[0] == 0 and buckets.offsets[-1] == len(kg.train) and len(buckets.offsets) == 17
    of = bucket_of(layout, buckets.triples)
    for b in range(16):
        part = buckets.triples[buckets.offsets[b] : buckets.offsets[b + 1]]
        assert (of[buckets.offsets[b] : buckets.offsets[b + 1]] == b).all()
        expected = kg.train[bucket_of(layout, kg.train) == b]  # in the split's order: a stable sort
        assert torch.equal(part, expected)


def test_buckets_on_disk_are_written_once_and_equal_the_ones_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_DATA_ROOT", str(tmp_path))
    config = DatasetConfig(
        kind="synthetic", synthetic=SyntheticConfig(entities=500, relations=4, triples=6000, valid=50, test=50, seed=2)
    )
    kg = load_knowledge_graph(config)
    layout = EntityPartitions(kg.num_entities, 5, seed=7)
    monkeypatch.setattr(
        "dsa_train.data.buckets.BLOCK_ROWS", 1000
    )  # several blocks: the counting sort's cursors carry over
    on_disk = load_buckets(kg, layout)
    in_memory = load_buckets(
        KnowledgeGraph(kg.name, kg.num_entities, kg.num_relations, kg.train.clone(), kg.valid, kg.test), layout
    )
    assert torch.equal(on_disk.triples.long(), in_memory.triples.long()) and torch.equal(
        on_disk.offsets, in_memory.offsets
    )
    folders = sorted(p.name for p in (tmp_path / "imported").iterdir() if ".buckets-" in p.name)
    assert len(folders) == 1
    again = load_buckets(kg, layout)  # mapped, not written again
    assert torch.equal(again.triples, on_disk.triples)
    assert sorted(p.name for p in (tmp_path / "imported").iterdir() if ".buckets-" in p.name) == folders
    other = load_buckets(kg, EntityPartitions(kg.num_entities, 5, seed=8))  # another layout: its own buckets
    assert not torch.equal(other.offsets, on_disk.offsets)


def test_a_bucket_folder_that_is_a_link_or_foreign_is_never_followed_nor_removed(tmp_path, monkeypatch):
    """The bucket folder is an import folder like the dataset's: a symbolic link at its name
    is moved aside, not followed; a folder we did not write is refused and left as it is; a
    damaged bucket file is written anew."""
    import os

    from dsa_train.errors import DatasetError

    monkeypatch.setenv("DSA_DATA_ROOT", str(tmp_path / "root"))
    config = DatasetConfig(
        kind="synthetic", synthetic=SyntheticConfig(entities=400, relations=4, triples=5000, valid=50, test=50, seed=3)
    )
    kg = load_knowledge_graph(config)
    layout = EntityPartitions(kg.num_entities, 4, seed=0)
    folder = load_buckets(kg, layout).folder
    reference = load_buckets(
        KnowledgeGraph(kg.name, kg.num_entities, kg.num_relations, kg.train.clone(), kg.valid, kg.test), layout
    )
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    os.rename(folder, tmp_path / "moved")
    folder.symlink_to(victim)
    again = load_buckets(kg, layout)
    assert not folder.is_symlink() and torch.equal(again.triples.long(), reference.triples.long())
    assert sorted(p.name for p in victim.iterdir()) == ["precious"] and (victim / "precious").read_text() == "keep me"

    triples = folder / "triples.npy"
    with open(triples, "r+b") as f:
        f.truncate(triples.stat().st_size - 12)
    assert torch.equal(load_buckets(kg, layout).triples.long(), reference.triples.long())

    os.rename(folder, tmp_path / "moved-again")
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="not a dataset dsa-train imported; nothing was changed"):
        load_buckets(kg, layout)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


# --- the schedule and the order ----------------------------------------------------------


@pytest.mark.parametrize("partitions,capacity", [(1, 1), (3, 3), (4, 2), (5, 2), (8, 3), (16, 4), (12, 11)])
def test_the_schedule_trains_every_bucket_once_swapping_one_partition_at_a_time(partitions, capacity):
    states = buffer_schedule(partitions, capacity)
    seen = [b for _, buckets in states for b in buckets]
    assert sorted(seen) == list(range(partitions * partitions))
    for buffer, buckets in states:
        assert len(buffer) == min(capacity, partitions) and len(set(buffer)) == len(buffer)
        assert all(b // partitions in buffer and b % partitions in buffer for b in buckets)
    for (before, _), (after, _) in zip(states, states[1:]):
        assert len(set(before) - set(after)) == 1  # one partition out, one in
    if capacity < partitions:  # each swap makes at most 2 (C - 1) + 1 buckets trainable
        fewest = math.ceil((partitions**2 - capacity**2) / (2 * capacity - 1))
        assert fewest <= len(states) - 1 <= 1.4 * fewest


def test_an_epoch_visits_every_triple_once_and_each_batch_stays_in_its_buffer():
    kg = random_kg(triples=5000)
    layout = EntityPartitions(kg.num_entities, 6, seed=2)
    buckets = load_buckets(kg, layout)
    order = PartitionedOrder(buckets, 3, seed=0, epoch_seed=11)
    batch = 97
    rows = torch.cat([order.slice(s, s + batch) for s in range(0, order.n, batch)])
    assert torch.equal(torch.sort(rows).values, torch.arange(len(kg.train)))
    for start in range(0, order.n, batch):
        picked = order.slice(start, start + batch)
        states = torch.unique(order.state_of(torch.arange(start, min(start + batch, order.n)))).tolist()
        held = {p for k in states for p in order.states[k]}
        triples = buckets.triples[picked].long()
        touched = set(layout.partition_of(triples[:, [0, 2]].flatten()).tolist())
        assert touched <= held and len(states) <= 2
    again = PartitionedOrder(buckets, 3, seed=0, epoch_seed=11)
    assert torch.equal(again.slice(1000, 1500), order.slice(1000, 1500))  # any batch can be computed again (resume)
    other = PartitionedOrder(buckets, 3, seed=0, epoch_seed=12)
    assert other.states != order.states  # each epoch relabels the partitions


def test_one_partition_orders_the_split_as_random_order_does():
    kg = random_kg(triples=2000)
    order = PartitionedOrder(load_buckets(kg, EntityPartitions(kg.num_entities, 1, seed=0)), 1, seed=0, epoch_seed=5)
    assert torch.equal(order.slice(300, 700), Shuffle(2000, 5).slice(300, 700))


# --- the buffer ----------------------------------------------------------------------------


def test_partitions_moved_through_the_disk_lose_no_update(tmp_path):
    """Rows written while their partition is held, dropped (written back, unmapped, out of the
    cache) and read back in, in every order, against the same updates on a plain tensor. Each
    write is announced with ``reserve`` first, as the optimizer's are."""
    rows, dim, parts = 4000, 24, 5
    table = Table.create(
        tmp_path / "t.table", (rows, dim), torch.float32, name="t", init="normal", std=0.1, bound=0.0, seed=0
    )
    expected = table.weight.clone()
    layout = EntityPartitions(rows, parts, seed=0)
    buffer = PartitionBuffer(table.rows, [layout.span(p) for p in range(parts)])
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        held = torch.randperm(parts, generator=g)[:2].tolist()
        buffer.hold(held)
        buffer.release(buffer.held - set(held))
        for p in held:
            first, stop = layout.span(p)
            picked = torch.randint(first, stop, (50,), generator=g)
            delta = torch.randn(50, dim, generator=g)
            table.rows.reserve(picked)
            table.weight.index_add_(0, picked, delta)
            expected.index_add_(0, picked, delta)
        table.rows.reserve(picked)
        table.rows.m[picked] += 1.0  # the moments travel with the weights
    buffer.release(buffer.held)
    buffer.close()
    assert buffer.stats["loads"] >= 40 and buffer.stats["read_bytes"] > 0
    assert torch.equal(table.weight, expected)
    table.flush()
    table.close()
    reopened = Table.open(tmp_path / "t.table", (rows, dim), torch.float32)
    assert torch.equal(reopened.weight, expected)


# --- runs ----------------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_one_partition_trains_as_random_order_bit_for_bit(tiny, tmp_path):
    random_run, partitioned = tmp_path / "random", tmp_path / "partitioned"
    assert invoke("run", tiny, "-o", random_run).exit_code == 0
    done = invoke("run", tiny, "-o", partitioned, "--set", "train.order=partitioned", "--set", "train.partitions=1")
    assert done.exit_code == 0, done.stderr
    for kind in ("train", "epoch", "eval", "summary"):
        assert records(partitioned, kind) == records(random_run, kind), kind
    assert np.array_equal(table_records(partitioned), table_records(random_run))


def test_partitioned_run_resumes_after_a_failed_step_exactly(tiny, tmp_path):
    settings = ["--set", "train.order=partitioned", "--set", "train.partitions=4", "--set", "train.buffer=2"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    first = invoke("run", tiny, "-o", whole, *settings)
    assert first.exit_code == 0 and "partition buffer: 2 of 4 partitions of" in first.stdout

    with error_at_step(12):  # mid-epoch, after the checkpoint of step 10
        assert invoke("run", tiny, "-o", broken, *settings).exit_code == 1
    resumed = invoke("run", tiny, "-o", broken, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    for kind in ("train", "epoch", "eval", "summary"):
        assert records(broken, kind) == records(whole, kind), kind
    assert np.array_equal(table_records(broken), table_records(whole))
    summary = next(r for r in MetricsLog.read(whole / "metrics.jsonl") if r["kind"] == "summary")
    assert summary["buffer"]["partitions"] == 4 and summary["buffer"]["buffer"] == 2 and summary["buffer"]["loads"] >= 4


def test_negatives_come_from_the_buffer_and_the_quality_holds(tiny, tmp_path):
    """Every uniform negative of a step lies in the partitions the buffer holds; and the
    model learns about as well as in random order (the same steps, MRR within 0.05 here)."""
    from dsa_train.train.tables import TableSite
    from dsa_train.train.tasks import make_task

    recipe = parse_recipe(TINY, overrides=["train.order=partitioned", "train.partitions=6", "train.buffer=2"])
    task = make_task(recipe, torch.device("cpu"), TableSite(tmp_path / "tables"))
    order = task.epoch_order(5, task.epoch_items())
    for start in range(0, order.n, 256):
        picked = order.slice(start, start + 256)
        task.prefetch(picked)
        task.loss(picked)
        drawn = task.draw_negatives(500)
        assert set(task.partitions.partition_of(drawn).tolist()) <= set(task.held.current)
    task.close()
    runs = {}
    for name, extra in (
        ("random", []),
        ("partitioned", ["--set", "train.order=partitioned", "--set", "train.partitions=4"]),
    ):
        assert invoke("run", tiny, "-o", tmp_path / name, "--set", "train.epochs=6", *extra).exit_code == 0
        final = next(r for r in MetricsLog.read(tmp_path / name / "metrics.jsonl") if r["kind"] == "summary")["final"]
        runs[name] = final["test"]["both"]["mrr"]
    assert abs(runs["partitioned"] - runs["random"]) < 0.05, runs


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["model.embedding_storage=memory"], "set model.embedding_storage: disk"),
        (
            ["train.partitions=4", "train.buffer=1"],
            r"train.buffer.*at least 2 with train.partitions 4 \(a bucket joins two partitions\), got 1",
        ),
    ],
)
def test_partitioned_recipes_that_cannot_run_are_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_recipe(TINY, overrides=["train.order=partitioned", *overrides])


def test_eval_of_a_partitioned_run_reads_its_table_by_slot(tiny, tmp_path):
    """`eval RUN` builds the run's own task: ids looked up through the layout, so the metrics
    are those the run ended with (a table read by id would score other rows)."""
    run = tmp_path / "run"
    assert (
        invoke(
            "run",
            tiny,
            "-o",
            run,
            "--set",
            "train.order=partitioned",
            "--set",
            "train.partitions=3",
            "--set",
            "train.epochs=1",
        ).exit_code
        == 0
    )
    final = next(r for r in MetricsLog.read(run / "metrics.jsonl") if r["kind"] == "summary")["final"]
    scored = invoke("eval", run, "--json")
    assert scored.exit_code == 0, scored.stderr
    assert json.loads(scored.stdout)["metrics"] == final["test"]


def test_import_of_a_partitioned_recipe_writes_its_buckets_for_the_run(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_DATA_ROOT", str(tmp_path / "data"))
    settings = ["--set", "train.order=partitioned", "--set", "train.partitions=3"]
    imported = invoke("import", tiny, *settings)
    assert imported.exit_code == 0, imported.stderr
    assert "training triples in buckets for train.order: partitioned" in imported.stdout
    folders = sorted(p.name for p in (tmp_path / "data" / "imported").iterdir() if ".buckets-3-" in p.name)
    assert len(folders) == 1
    stamp = (tmp_path / "data" / "imported" / folders[0] / "triples.npy").stat().st_mtime_ns
    assert invoke("run", tiny, "-o", tmp_path / "run", *settings, "--set", "train.epochs=1").exit_code == 0
    assert (
        tmp_path / "data" / "imported" / folders[0] / "triples.npy"
    ).stat().st_mtime_ns == stamp  # mapped, not written again


def test_a_buffer_beyond_the_memory_available_is_refused_with_the_keys_to_change(tmp_path, monkeypatch):
    """C + 1 partitions are in memory at once (the buffer, and the next one being read)."""
    from dsa_train import DiskEmbedding, memory
    from dsa_train.errors import DsaError
    from dsa_train.train.partitioned import HeldPartitions, SlotTable

    table = SlotTable(DiskEmbedding(10_000, 8, path=tmp_path / "t.table"), EntityPartitions(10_000, 4, seed=0))
    monkeypatch.delenv("DSA_MEMORY_CHECK", raising=False)
    needed = 3 * 2_500 * table.table.table.rows.spec.row_bytes
    monkeypatch.setattr(memory, "host_available_bytes", lambda: needed - 1)
    with pytest.raises(DsaError) as refused:
        HeldPartitions(table, 2)
    assert refused.value.message.startswith(
        "train.buffer=2, train.partitions=4: the partition buffer (2 + 1 partitions of"
    )
    assert "lower train.buffer" in refused.value.hint
    monkeypatch.setattr(memory, "host_available_bytes", lambda: needed)
    HeldPartitions(table, 2).close()
