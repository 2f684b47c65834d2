"""Importing datasets into the on-disk format: exact against a plain dict-based parser, bounded
in memory, cached until a source changes, and never half-written (even under kill -9)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train.data import load_knowledge_graph
from dsa_train.data import tsv as tsv_module
from dsa_train.data import tsv_import
from dsa_train.data.fingerprint import fingerprint_of, fingerprints
from dsa_train.data.store import Dataset
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, SyntheticConfig

SPLITS = ("train", "valid", "test")


def reference_parse(folder):
    """The obvious parser (what dsa-train did before): names to ids with dicts, in RAM."""
    out = {}
    for split in SPLITS:
        lines = (folder / f"{split}.txt").read_bytes().decode("utf-8").split("\n")
        out[split] = [tuple(line.split("\t")) for line in lines if line]
    return out


def random_names(rng, count):
    alphabet = "abcxyz0123 é漢-_/."
    names = set()
    while len(names) < count:
        length = rng.choice([1, 2, 7, 8, 9, 15, 16, 17, 40, 70])
        names.add("".join(rng.choice(alphabet) for _ in range(length)).strip() or "n")
    return sorted(names)


def write_random_kg(folder, *, entities=300, relations=12, rows=(2000, 150, 150), seed=0):
    rng = random.Random(seed)
    ents, rels = random_names(rng, entities), random_names(rng, relations)
    folder.mkdir(parents=True)
    for split, count in zip(SPLITS, rows):
        lines = [f"{rng.choice(ents)}\t{rng.choice(rels)}\t{rng.choice(ents)}" for _ in range(count)]
        lines += lines[:5]  # duplicate facts stay as they are
        (folder / f"{split}.txt").write_text(
            "\n".join(lines) + ("\n" if split != "test" else "")
        )  # test: no final newline
    return folder


def as_names(kg, split):
    rows = kg.split(split).long()
    heads, relations, tails = kg.entity_names(rows[:, 0]), kg.relation_names(rows[:, 1]), kg.entity_names(rows[:, 2])
    return list(zip(heads, relations, tails))


def check_against_reference(kg, folder):
    expected = reference_parse(folder)
    for split in SPLITS:
        assert as_names(kg, split) == expected[split], split
    entities = {n for s in expected.values() for h, _, t in s for n in (h, t)}
    assert kg.num_entities == len(entities) and sorted(kg.entity_names(range(kg.num_entities))) == sorted(entities)
    assert kg.num_relations == len({r for s in expected.values() for _, r, _ in s})
    prints = kg.dataset.array("entities.fingerprints")  # sorted: the name -> id lookup
    order = np.lexsort((prints[:, 1], prints[:, 0]))
    assert (order == np.arange(len(prints))).all()


@pytest.mark.parametrize(
    "memory_bytes,chunk_bytes", [(256 << 20, 8 << 20), (4096, 97)], ids=["one-partition", "many-partitions-tiny-chunks"]
)
def test_import_equals_a_dict_based_parse(tmp_path, monkeypatch, memory_bytes, chunk_bytes):
    folder = write_random_kg(tmp_path / "kg")
    monkeypatch.setattr(tsv_module, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(tsv_import, "WINDOW_ROWS", 37)
    monkeypatch.setattr(tsv_import, "TOKEN_BLOCK", 53 if chunk_bytes < 1000 else tsv_import.TOKEN_BLOCK)
    real = tsv_import.write_knowledge_graph
    monkeypatch.setattr(
        tsv_import, "write_knowledge_graph", lambda writer, **kw: real(writer, **{**kw, "memory_bytes": memory_bytes})
    )
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    check_against_reference(kg, folder)
    assert kg.train.dtype == torch.int32


def test_names_that_share_the_first_half_of_a_fingerprint_keep_their_own_ids(tmp_path, monkeypatch):
    """Force 64-bit clashes (h1 keeps only its top 4 bits): h2 must still tell names apart."""
    folder = write_random_kg(tmp_path / "kg", entities=200)

    def clashing(text, starts, lengths):
        prints = fingerprints(text, starts, lengths)
        prints[:, 0] &= np.uint64(0xF << 60)
        return prints

    monkeypatch.setattr(tsv_import, "fingerprints", clashing)
    check_against_reference(load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder))), folder)


@pytest.mark.parametrize(
    "distinct,clashes", [(50, True), (20_000, True), (20_000, False)]
)  # few names repeated, many names (clashing or not)
def test_distinct_rows_are_one_per_fingerprint_in_fingerprint_order(distinct, clashes):
    """Against a set: one row per distinct fingerprint, none twice, in h1 order, with
    fingerprints that share h1's top bits, all of h1, or nothing, and repeats."""
    rng = np.random.default_rng(distinct)
    base = rng.integers(0, 2**63, (distinct, 2), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    if clashes:
        base[1::7, 0] = base[0::7, 0][: len(base[1::7])] ^ np.uint64(1)  # h1 differs in its lowest bit only
        base[2::7, 0] = base[0::7, 0][: len(base[2::7])]  # the same h1, another h2
    prints = base[rng.integers(0, distinct, 100_000)]
    rows = tsv_import._distinct(prints)
    got = [tuple(p) for p in prints[rows].tolist()]
    assert len(got) == len(set(got)) and set(got) == {tuple(p) for p in prints.tolist()}
    assert (np.diff(prints[rows, 0].astype(np.float64)) >= 0).all()


def test_fingerprints_are_per_string_and_position_independent():
    names = [b"a", b"ab", b"ab\x00", b"x" * 64, b"x" * 63 + b"y", "é漢".encode(), b"12345678", b"123456789"]
    text = b"#" + b"|".join(names)
    starts = np.cumsum([1] + [len(n) + 1 for n in names[:-1]])
    prints = fingerprints(np.frombuffer(text, np.uint8), starts, np.array([len(n) for n in names]))
    assert [fingerprint_of(n) for n in names] == [tuple(map(int, p)) for p in prints]
    assert len({tuple(p) for p in prints.tolist()}) == len(names)


def test_second_load_reuses_the_import_and_a_changed_source_reimports(tmp_path, notes):
    folder = write_random_kg(tmp_path / "kg")
    config = DatasetConfig(kind="tsv", path=str(folder))
    first = load_knowledge_graph(config)
    assert first.dataset.fresh
    second = load_knowledge_graph(config)
    assert not second.dataset.fresh and second.dataset.folder == first.dataset.folder
    with open(folder / "train.txt", "a") as f:
        f.write("brand\tnew\tfact\n")
    notes.clear()
    third = load_knowledge_graph(config)
    assert third.dataset.fresh and "changed" in notes[0]
    assert as_names(third, "train")[-1] == ("brand", "new", "fact")
    assert as_names(first, "train") == as_names(third, "train")[:-1]  # the old mapping still reads its own files


def test_a_damaged_import_is_imported_again_never_read(tmp_path):
    folder = write_random_kg(tmp_path / "kg")
    config = DatasetConfig(kind="tsv", path=str(folder))
    path = load_knowledge_graph(config).dataset.folder / "train.npy"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 12)
    with pytest.raises(DatasetError, match="truncated or changed"):
        Dataset.open(path.parent)
    kg = load_knowledge_graph(config)
    assert kg.dataset.fresh
    check_against_reference(kg, folder)


def test_an_import_folder_that_is_a_link_is_replaced_not_followed(tmp_path):
    folder = write_random_kg(tmp_path / "kg")
    config = DatasetConfig(kind="tsv", path=str(folder))
    target = load_knowledge_graph(config).dataset.folder
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    os.rename(target, tmp_path / "moved")
    target.symlink_to(victim)
    kg = load_knowledge_graph(config)
    assert kg.dataset.fresh and not target.is_symlink()
    assert (victim / "precious").read_text() == "keep me" and sorted(p.name for p in victim.iterdir()) == ["precious"]


KILLER = """
import os, signal, sys
from collections import Counter
from dsa_train import progress
from dsa_train.data import load_knowledge_graph, tsv, tsv_import
from dsa_train.recipe import DatasetConfig
tsv.CHUNK_BYTES = 64
tsv_import.partitions_for = lambda total, memory: 8
class Killer(progress.SilentReporter):
    what, calls = None, Counter()
    def work_start(self, what, total):
        self.what = what
    def work_advance(self, done):
        self.calls[self.what] += 1
        if self.what == {when!r} and self.calls[self.what] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
with progress.reporting(Killer()):
    load_knowledge_graph(DatasetConfig(kind="tsv", path=sys.argv[1]))
"""


@pytest.mark.parametrize("when", ["reading the text", "numbering entities", "writing the id arrays"])
def test_an_import_killed_midway_leaves_no_dataset_and_the_next_one_cleans_up(tmp_path, when):
    folder = write_random_kg(tmp_path / "kg", rows=(3000, 100, 100))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLER.format(when=when)), str(folder)], env=env, capture_output=True
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    root = os.path.join(os.environ["DSA_DATA_ROOT"], "imported")  # the fixture's fresh data root
    left = set(os.listdir(root)) - {".lock"}  # the lock's holder record
    assert left and all(name.startswith(".partial-") for name in left)  # no dataset, only scratch
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    check_against_reference(kg, folder)
    assert not [name for name in os.listdir(root) if name.startswith(".partial-")]


def test_malformed_lines_across_chunk_boundaries_keep_their_line_numbers(tmp_path, monkeypatch):
    folder = write_random_kg(tmp_path / "kg", rows=(50, 5, 5))
    lines = (folder / "train.txt").read_text().split("\n")
    lines[40] = "only\ttwo"
    (folder / "train.txt").write_text("\n".join(lines))
    monkeypatch.setattr(tsv_module, "CHUNK_BYTES", 50)
    with pytest.raises(DatasetError, match=r"train.txt:41: line has 2 tab-separated columns"):
        load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))


def test_synthetic_import_does_not_depend_on_the_memory_budget(tmp_path, monkeypatch):
    from dsa_train.data import synthetic

    config = SyntheticConfig(entities=3000, relations=7, triples=40_000, valid=300, test=200, seed=5)
    a = load_knowledge_graph(DatasetConfig(kind="synthetic", synthetic=config, root=str(tmp_path / "a")))
    real = synthetic.write_synthetic_knowledge_graph
    monkeypatch.setattr(
        synthetic,
        "write_synthetic_knowledge_graph",
        lambda writer, **kw: real(writer, **{**kw, "memory_bytes": 1 << 16}),
    )
    b = load_knowledge_graph(DatasetConfig(kind="synthetic", synthetic=config, root=str(tmp_path / "b")))
    for split in SPLITS:  # the same facts in each split (train's order follows the partitions)
        rows = lambda kg, split=split: sorted(map(tuple, kg.split(split).tolist()))  # noqa: E731
        assert rows(a) == rows(b), split
    assert torch.equal(a.valid, b.valid) and torch.equal(a.test, b.test)
    train = set(map(tuple, a.train.tolist()))
    assert not train & set(map(tuple, a.valid.tolist())) and not train & set(map(tuple, a.test.tolist()))


def test_a_foreign_folder_in_the_way_is_left_alone(tmp_path):
    folder = write_random_kg(tmp_path / "kg")
    config = DatasetConfig(kind="tsv", path=str(folder))
    target = load_knowledge_graph(config).dataset.folder
    os.rename(target, tmp_path / "moved")
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="not a dataset dsa-train imported; nothing was changed"):
        load_knowledge_graph(config)
    assert (target / "notes.txt").read_text() == "mine"


def test_an_imported_folder_that_is_a_link_is_refused(tmp_path):
    folder = write_random_kg(tmp_path / "kg")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, os.path.join(os.environ["DSA_DATA_ROOT"], "imported"))
    with pytest.raises(DatasetError, match="is a symbolic link"):
        load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    assert not list(elsewhere.iterdir())


def test_names_are_looked_up_on_disk(tmp_path):
    folder = write_random_kg(tmp_path / "kg")
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    names = kg.entity_names(range(kg.num_entities))
    assert kg.entity_ids(names) == list(range(kg.num_entities))
    assert kg.entity_ids(["no such entity", names[0] + " "]) == [None, None]
    relations = kg.relation_names(range(kg.num_relations))
    assert kg.relation_ids(relations[::-1]) == list(range(kg.num_relations))[::-1]
    synthetic = load_knowledge_graph(
        DatasetConfig(kind="synthetic", synthetic=SyntheticConfig(entities=100, triples=2000, valid=10, test=10))
    )
    with pytest.raises(DatasetError, match="has no names"):
        synthetic.entity_ids(["0"])


def test_a_second_importer_is_told_who_holds_the_import_folder(tmp_path):
    from dsa_train.fsutil import DirectoryLock

    folder = write_random_kg(tmp_path / "kg")
    imported = os.path.join(os.environ["DSA_DATA_ROOT"], "imported")
    os.makedirs(imported)
    other = DirectoryLock(imported, purpose="dataset import folder")  # another importer, as far as flock knows
    other.acquire()
    try:
        with pytest.raises(DatasetError, match=r"another process is importing into .*imported.*pid") as error:
            load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
        assert "wait for it" in error.value.hint
    finally:
        other.release()
    check_against_reference(load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder))), folder)


def test_a_full_disk_mid_import_keeps_the_old_dataset_and_leaves_no_partial(tmp_path, monkeypatch):
    import errno

    from dsa_train.data import store

    folder = write_random_kg(tmp_path / "kg")
    config = DatasetConfig(kind="tsv", path=str(folder))
    old = load_knowledge_graph(config)
    with open(folder / "train.txt", "a") as f:
        f.write("one\tmore\tfact\n")
    real = store.Appender.append

    def full(self, rows):
        if self.path.name.startswith("train"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, rows)

    monkeypatch.setattr(store.Appender, "append", full)
    with pytest.raises(DatasetError, match="No space left on device") as error:
        load_knowledge_graph(config)
    assert "free space" in error.value.hint
    parent = old.dataset.folder.parent
    assert not [name for name in os.listdir(parent) if name.startswith(".partial-")]
    check_against_reference(opened(old.dataset.folder), without_last_fact(folder))  # the old import, intact


@pytest.mark.parametrize("errno_name", ["EACCES", "EROFS"])
def test_a_read_only_data_root_says_so_and_how_to_copy_it(tmp_path, monkeypatch, errno_name):
    """A data root that cannot be written (a read-only mount, a shared folder of another user)
    fails on its first write with what it is, not a hint to free disk space."""
    import errno

    from dsa_train.data import store

    folder = write_random_kg(tmp_path / "kg")

    def refused(self, rows):
        raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)), str(self.path))

    monkeypatch.setattr(store.Appender, "append", refused)
    with pytest.raises(DatasetError, match=r"The data root must be writable") as error:
        load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    assert os.strerror(getattr(errno, errno_name)) in error.value.message
    assert "DSA_DATA_ROOT" in error.value.hint and "free space" not in error.value.hint


def test_a_data_root_without_write_permission_is_refused_on_creating_imported(tmp_path, monkeypatch):
    folder = write_random_kg(tmp_path / "kg")
    if os.geteuid() != 0:
        tmp_path.chmod(0o555)  # the data root: kg/ is readable, imported/ cannot be made beside it
    else:  # root writes anywhere (CI runs as root): make the file system say no, as the permission would
        real_mkdir = os.mkdir

        def refuse(path, *args, **kwargs):
            if Path(path).parent == tmp_path:
                raise PermissionError(13, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", refuse)
    try:
        with pytest.raises(DatasetError, match=r"cannot create .*imported.*Permission denied.*must be writable"):
            load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder), root=str(tmp_path)))
    finally:
        tmp_path.chmod(0o755)
    assert not (tmp_path / "imported").exists()


def opened(path):
    """The knowledge graph of an imported folder, opened afresh from disk."""
    from dsa_train.data.kg import KnowledgeGraph

    return KnowledgeGraph.of(Dataset.open(path))


def without_last_fact(folder):
    """A copy of the TSV folder as it was before the test appended its fact."""
    copy = folder.parent / "before"
    copy.mkdir()
    for split in SPLITS:
        text = (folder / f"{split}.txt").read_text()
        (copy / f"{split}.txt").write_text(text.removesuffix("one\tmore\tfact\n") if split == "train" else text)
    return copy
