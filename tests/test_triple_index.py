"""The on-disk filter index: exact lookups, a sort that does not depend on its memory budget,
no overflow where the old single int64 key wrapped, and folders that are refused when torn."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train.data import triple_index
from dsa_train.data.triple_index import MIN_MEMORY, TripleIndex, write_triple_index
from dsa_train.errors import DatasetError


def random_graph(seed, entities, relations, count):
    """Train/valid/test splits with duplicates inside and across splits, as int32 arrays."""
    g = np.random.default_rng(seed)
    triples = np.stack(
        [g.integers(0, entities, count), g.integers(0, relations, count), g.integers(0, entities, count)], 1
    )
    triples = np.concatenate([triples, triples[g.integers(0, count, count // 5)]])  # duplicates
    g.shuffle(triples)
    cut = [len(triples) * 8 // 10, len(triples) * 9 // 10]
    return [split.astype(np.int32) for split in np.split(triples, cut)]


def brute_force(triples, anchor, relation, side):
    """(query number, entity) pairs by scanning every triple: the contract of ``known``."""
    pairs = set()
    for i, (a, r) in enumerate(zip(anchor.tolist(), relation.tolist())):
        for h, rel, t in triples:
            if rel == r and (h if side == "tail" else t) == a:
                pairs.add((i, t if side == "tail" else h))
    return sorted(pairs)


def lookups(index, anchor, relation, side):
    query, entity = index.known(torch.as_tensor(anchor), torch.as_tensor(relation), side)
    assert query.dtype == entity.dtype == torch.int64
    pairs = list(zip(query.tolist(), entity.tolist()))
    assert pairs == sorted(pairs), "grouped by query, entities ascending"
    return pairs


def all_queries(entities, relations):
    anchor, relation = np.meshgrid(np.arange(entities), np.arange(relations), indexing="ij")
    return anchor.ravel(), relation.ravel()


def column_bytes(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("seed,entities,relations", [(0, 17, 3), (1, 40, 1), (2, 5, 7)])
def test_lookups_match_brute_force_on_both_sides(tmp_path, seed, entities, relations):
    splits = random_graph(seed, entities, relations, 300)
    triples = [tuple(t) for split in splits for t in split.tolist()]
    write_triple_index(tmp_path / "disk", lambda: splits, entities, relations, memory_bytes=MIN_MEMORY)
    on_disk = TripleIndex.open(tmp_path / "disk")
    in_ram = TripleIndex.from_triples(torch.from_numpy(np.concatenate(splits)), entities, relations)
    assert on_disk.rows == in_ram.rows == len(set(triples))  # duplicates collapse
    anchor, relation = all_queries(entities, relations)  # every query, answered or not
    for side in ("tail", "head"):
        expected = brute_force(triples, anchor, relation, side)
        assert lookups(on_disk, anchor, relation, side) == expected
        assert lookups(in_ram, anchor, relation, side) == expected
    # a batch in any order, with repeated queries
    pick = np.random.default_rng(seed).integers(0, len(anchor), 50)
    assert lookups(on_disk, anchor[pick], relation[pick], "head") == brute_force(
        triples, anchor[pick], relation[pick], "head"
    )


def test_a_tiny_memory_budget_writes_the_same_bytes(tmp_path, monkeypatch):
    g = np.random.default_rng(3)
    entities, relations = 1000, 20
    splits = random_graph(4, entities, relations, 20_000)
    hub = np.stack([np.full(2000, 7), np.full(2000, 3), g.integers(0, entities, 2000)], 1)  # one query, ~900 answers
    same = np.tile([[5, 1, 9]], (1000, 1))  # one triple a thousand times
    chunks = [*splits, hub, same]
    sorted_buckets, splits_made = [], []
    sort, split = triple_index._Builder._sort, triple_index._Builder._split
    monkeypatch.setattr(
        triple_index._Builder, "_sort", lambda self, side, b: (sorted_buckets.append(b.range), sort(self, side, b))[1]
    )
    monkeypatch.setattr(
        triple_index._Builder, "_split", lambda self, side, b: (splits_made.append(b.range), split(self, side, b))[1]
    )
    write_triple_index(tmp_path / "tiny", lambda: iter(chunks), entities, relations, memory_bytes=MIN_MEMORY)
    assert len(sorted_buckets) > 500 and any(r.by_answer for r in splits_made)  # many buckets, a hub split by answer
    tiny = len(sorted_buckets)
    write_triple_index(tmp_path / "single", lambda: [np.concatenate(chunks)], entities, relations)
    assert len(sorted_buckets) - tiny == 2  # one bucket per side
    assert column_bytes(tmp_path / "tiny") == column_bytes(tmp_path / "single")
    index = TripleIndex.open(tmp_path / "tiny")
    triples = {tuple(t) for t in np.concatenate(chunks).tolist()}
    assert index.rows == len(triples)
    _, entity = index.known(torch.tensor([7]), torch.tensor([3]), "tail")
    assert entity.tolist() == sorted(t for h, r, t in triples if (h, r) == (7, 3))
    _, entity = index.known(torch.tensor([9]), torch.tensor([1]), "head")
    assert entity.tolist() == sorted(h for h, r, t in triples if (r, t) == (1, 9))
    assert sorted(os.listdir(tmp_path / "tiny")) == [
        "head.answer.npy",
        "head.query.npy",
        "index.json",
        "tail.answer.npy",
        "tail.query.npy",
    ]


def test_the_overflow_case_where_the_old_key_wrapped(tmp_path):
    E, R = 2**31 + 1, 5000
    # The old key (h * R + r) * E + t needs E^2 R < 2^63; here E^2 R is about 2^74.3, so
    # int64 wraps. Two triples whose (h R + r) differ by x = 2^33 - 4 and tails by 4 get the
    # same key: x * E = 2^64 + 2^33 - 4 * 2^31 - 4 = 2^64 - 4.
    h1, r1, t1 = E - 1, R - 1, E - 1
    h2, r2 = divmod(h1 * R + r1 - (2**33 - 4), R)
    t2 = t1 - 4
    old = torch.tensor([[h1, r1, t1], [h2, r2, t2]])
    old_key = (old[:, 0] * R + old[:, 1]) * E + old[:, 2]  # what the old TripleIndex sorted
    exact = [(h * R + r) * E + t for h, r, t in old.tolist()]
    assert exact[0] != exact[1] and min(exact) >= 2**63  # distinct, and beyond int64
    assert old_key[0] == old_key[1]  # ... yet equal once wrapped: the old index confused them
    g = np.random.default_rng(5)
    top = np.stack([E - 1 - g.integers(0, 3, 200), R - 1 - g.integers(0, 3, 200), E - 1 - g.integers(0, 3, 200)], 1)
    triples = np.concatenate([old.numpy(), top, [[0, 0, 2**31], [2**31, R - 1, 0]]])
    write_triple_index(tmp_path / "big", lambda: [triples[:100], triples[100:]], E, R, memory_bytes=MIN_MEMORY)
    index = TripleIndex.open(tmp_path / "big")
    assert index._columns["tail"][1].dtype == torch.int64  # ids up to 2^31 do not fit int32
    assert json.loads((tmp_path / "big" / "index.json").read_text())["dtypes"] == {"query": "<i8", "answer": "<i8"}
    as_set = [tuple(t) for t in triples.tolist()]
    anchor = np.array([h1, h2, 0, 2**31, *top[:20, 0]])
    relation = np.array([r1, r2, 0, R - 1, *top[:20, 1]])
    for side in ("tail", "head"):
        assert lookups(index, anchor, relation, side) == brute_force(as_set, anchor, relation, side)
    for built in (index, TripleIndex.from_triples(torch.from_numpy(triples), E, R)):
        assert lookups(built, [h2], [r2], "tail") == [(0, t2)]  # not confused with (h1, r1, t1)
        assert (0, t1) in lookups(built, [h1], [r1], "tail") and (0, h2) not in lookups(built, [t1], [r1], "head")


@pytest.mark.parametrize("entities,relations", [(2**40, 2**10), (2**63 - 1, 1)])
def test_keys_too_wide_for_one_sort_are_split_until_they_fit(tmp_path, entities, relations):
    # E * R < 2^63, but (q - q_lo) * E + a overflows over any wide range of queries: the
    # sort narrows ranges level by level (down to one query, then by answer) until it fits.
    top_e, top_r = entities - 1, relations - 1
    triples = np.array(
        [
            [0, 0, 0],
            [top_e, top_r, top_e],
            [top_e, 0, 0],
            [0, top_r, top_e],
            [top_e, top_r, 0],
            [top_e, top_r, top_e - 1],
            [1, 0, top_e],
        ]
    )
    write_triple_index(tmp_path / "wide", lambda: [triples], entities, relations)
    index = TripleIndex.open(tmp_path / "wide")
    as_set = [tuple(t) for t in triples.tolist()]
    anchor, relation = np.array([0, top_e, 1, top_e - 1]), np.array([0, top_r, 0, top_r])
    for side in ("tail", "head"):
        assert lookups(index, anchor, relation, side) == brute_force(as_set, anchor, relation, side)


def test_sizes_whose_query_id_overflows_are_refused(tmp_path):
    triples = np.array([[0, 0, 0]])
    for call in (
        lambda: write_triple_index(tmp_path / "x", lambda: [triples], 2**62, 2),
        lambda: TripleIndex.from_triples(torch.from_numpy(triples), 2**32, 2**31),
    ):
        with pytest.raises(DatasetError, match="beyond int64") as error:
            call()
        assert "2^63" in error.value.hint
    with pytest.raises(DatasetError, match="positive integer num_relations"):
        write_triple_index(tmp_path / "x", lambda: [triples], 10, 0)
    assert not (tmp_path / "x").exists()


def test_bad_triples_are_refused_and_leave_nothing_behind(tmp_path):
    good = np.array([[0, 1, 2], [3, 0, 4]])
    for chunks, message in (
        ([good, np.array([[0, 2, 1]])], "chunk 1 of the triples has relation id 2, outside \\[0, 2\\)"),
        ([np.array([[0, 0, -1]])], "tail id -1"),
        ([np.array([[0, 0, 5]])], "tail id 5, outside \\[0, 5\\)"),
        ([good.astype(float)], "not \\(k, 3\\) integer ids"),
        ([good[:, :2]], "not \\(k, 3\\) integer ids"),
    ):
        with pytest.raises(DatasetError, match=message):
            write_triple_index(tmp_path / "bad", lambda c=chunks: c, 5, 2)
    calls = []

    def changing():  # a generator that is consumed the first time: the second call yields less
        calls.append(1)
        return [good] if len(calls) == 1 else [good[:1]]

    with pytest.raises(DatasetError, match="second call") as error:
        write_triple_index(tmp_path / "bad", changing, 5, 2)
    assert "same triples" in error.value.hint
    assert os.listdir(tmp_path / "bad") == []  # no temporary folder, no half-written column


def test_open_refuses_torn_or_foreign_folders(tmp_path):
    write_triple_index(tmp_path / "good", lambda: [np.array([[0, 1, 2], [2, 0, 1]])], 3, 2)
    assert TripleIndex.open(tmp_path / "good").rows == 2

    def broken(name, damage):
        folder = tmp_path / name
        write_triple_index(folder, lambda: [np.array([[0, 1, 2], [2, 0, 1]])], 3, 2)
        damage(folder)
        with pytest.raises(DatasetError) as error:
            TripleIndex.open(folder)
        assert "rebuild" in error.value.hint
        return error.value.message

    def edit(**changes):
        def damage(folder):
            manifest = json.loads((folder / "index.json").read_text())
            (folder / "index.json").write_text(json.dumps({**manifest, **changes}))

        return damage

    def link_column(folder):
        (folder / "tail.answer.npy").rename(folder / "elsewhere.npy")
        (folder / "tail.answer.npy").symlink_to(folder / "elsewhere.npy")

    assert "missing" in broken("no-manifest", lambda f: (f / "index.json").unlink())
    assert "missing" in broken("not-json", lambda f: (f / "index.json").write_text("[1, 2"))
    assert "not a dsa-train-triple-index" in broken("foreign", edit(format="something-else"))
    assert "version 2" in broken("newer", edit(version=2))
    assert "dtypes" in broken("dtypes", edit(dtypes={"query": "<i8", "answer": "<i8"}))
    assert "files" in broken("files", edit(files={"tail": {"query": "../../etc/passwd"}}))
    assert "not those of an index" in broken("rows", edit(rows=2.5))
    assert "not those of an index" in broken("sizes", edit(num_entities=2**62, num_relations=4))
    assert "not those of an index" in broken("no-relations", edit(num_relations=0))
    assert "manifest says" in broken("more-rows", edit(rows=3))
    assert "manifest says" in broken(
        "truncated", lambda f: os.truncate(f / "head.query.npy", os.path.getsize(f / "head.query.npy") - 1)
    )
    assert "manifest says" in broken("appended", lambda f: (f / "tail.answer.npy").open("ab").write(b"\0" * 4))
    assert "cannot open" in broken("missing-column", lambda f: (f / "head.answer.npy").unlink())
    assert "cannot open" in broken("linked-column", link_column)
    assert "not a .npy column" in broken("garbage", lambda f: (f / "tail.query.npy").write_bytes(b"\0" * 200))


def test_rewriting_replaces_the_index_and_an_empty_one_works(tmp_path):
    folder = tmp_path / "filter"
    write_triple_index(folder, lambda: [np.array([[0, 0, 1]])], 4, 1)
    write_triple_index(folder, lambda: [np.array([[2, 0, 3], [2, 0, 1]])], 4, 1)
    assert lookups(TripleIndex.open(folder), [2, 0], [0, 0], "tail") == [(0, 1), (0, 3)]
    calls = []

    def failing():  # the source breaks during the second pass: the old index stays whole
        calls.append(1)
        yield np.array([[1, 0, 1]])
        if len(calls) == 2:
            raise OSError("the source went away")

    with pytest.raises(OSError, match="went away"):
        write_triple_index(folder, failing, 4, 1)
    assert lookups(TripleIndex.open(folder), [2, 0], [0, 0], "tail") == [(0, 1), (0, 3)]
    write_triple_index(folder, lambda: iter([np.empty((0, 3), np.int64)]), 4, 1)
    empty = TripleIndex.open(folder)
    assert empty.rows == 0 and lookups(empty, [2], [0], "tail") == []
    assert sorted(os.listdir(folder)) == [
        "head.answer.npy",
        "head.query.npy",
        "index.json",
        "tail.answer.npy",
        "tail.query.npy",
    ]


def test_a_linked_folder_is_never_written_through(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("not a folder")
    for name in ("link", "file"):
        with pytest.raises(DatasetError, match="not a folder"):
            write_triple_index(tmp_path / name, lambda: [np.array([[0, 0, 0]])], 1, 1)
    assert os.listdir(tmp_path / "real") == [] and (tmp_path / "file").read_text() == "not a folder"


def test_sorting_memory_stays_within_the_budget(tmp_path):
    budget = 1 << 20
    triples = np.stack([np.random.default_rng(6).integers(0, 10**6, 400_000, dtype=np.int32) for _ in range(3)], 1) % [
        10**6,
        50,
        10**6,
    ]
    triples = triples.astype(np.int32)  # 4.8 MB of triples, yielded as views (the caller's memory)
    tracemalloc.start()
    try:
        write_triple_index(
            tmp_path / "budget",
            lambda: (triples[s : s + 10_000] for s in range(0, len(triples), 10_000)),
            10**6,
            50,
            memory_bytes=budget,
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= budget, f"{peak:,} bytes traced at peak for a budget of {budget:,}"
    assert TripleIndex.open(tmp_path / "budget").rows == len({tuple(t) for t in triples.tolist()})


def test_index_from_a_path_string_and_a_bad_side(tmp_path):
    write_triple_index(Path(tmp_path), lambda: [np.array([[0, 0, 0]])], 1, 1)
    index = TripleIndex.open(str(tmp_path))
    with pytest.raises(ValueError, match="'tail' or 'head'"):
        index.known(torch.tensor([0]), torch.tensor([0]), "middle")
