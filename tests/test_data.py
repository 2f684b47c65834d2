"""Datasets: TSV folders (and every malformed line), PyG's classes, the synthetic generator."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from dsa_train.data import load_knowledge_graph, remote
from dsa_train.data.downloads import Expected
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, SyntheticConfig

from .conftest import copy_dataset

GOOD = "a\tlikes\tb\nb\tlikes\tc\n"


def write_folder(folder, train=GOOD, valid="a\tlikes\tc\n", test="c\thates\ta\n"):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        (folder / f"{name}.txt").write_bytes(text.encode() if isinstance(text, str) else text)
    return folder


def named(kg, split):
    return [
        (*kg.entity_names([h]), *kg.relation_names([r]), *kg.entity_names([t])) for h, r, t in kg.split(split).tolist()
    ]


def test_tsv_folder_ids_are_shared_across_splits(tmp_path):
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(write_folder(tmp_path / "kg"))))
    assert (kg.num_entities, kg.num_relations) == (3, 2)
    assert named(kg, "train") == [("a", "likes", "b"), ("b", "likes", "c")]
    assert named(kg, "valid") == [("a", "likes", "c")] and named(kg, "test") == [("c", "hates", "a")]
    assert sorted(kg.entity_names(range(3))) == ["a", "b", "c"]  # one id per name, across splits


def test_relative_path_uses_the_data_root(tmp_path, monkeypatch):
    write_folder(tmp_path / "root" / "kg")
    monkeypatch.setenv("DSA_DATA_ROOT", str(tmp_path / "root"))
    assert load_knowledge_graph(DatasetConfig(kind="tsv", path="kg")).num_entities == 3


def test_names_keep_leading_zeros(tmp_path):
    folder = write_folder(tmp_path / "kg", train="00001\tr\t1\n1\tr\t00001\n")
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    assert kg.num_entities == 4  # '00001', '1' and the two from valid/test files: a, c


MALFORMED = [
    (b"a\tlikes\tb\r\n", r"train.txt:1: line has a Windows \(CRLF\) line ending"),
    (b"a\tlikes\tb\nb\tlikes\n", r"train.txt:2: line has 2 tab-separated columns, expected 3"),
    (b"a likes b\n", r"train.txt:1: line has 1 tab-separated columns, expected 3"),
    (b"a\tlikes\tb\textra\n", r"train.txt:1: line has 4 tab-separated columns"),
    (b"a\t\tb\n", r"train.txt:1: line has an empty column"),
    (b"a\tlikes\tb\n\n", r"train.txt:2: line has 1 tab-separated columns"),
    (b"a\tlikes\t\xff\n", r"train.txt:1: line is not valid UTF-8"),
]


@pytest.mark.parametrize("content,expected", MALFORMED, ids=[m[1].split(": line ")[1][:25] for m in MALFORMED])
def test_malformed_lines_are_reported_with_file_and_line(tmp_path, content, expected):
    folder = write_folder(tmp_path / "kg", train=content)
    with pytest.raises(DatasetError, match=expected):
        load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))


def test_missing_files_say_what_to_place_where(tmp_path):
    folder = write_folder(tmp_path / "kg")
    (folder / "valid.txt").unlink()
    with pytest.raises(DatasetError, match="lacks valid.txt") as err:
        load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    assert str(folder) in err.value.hint


def test_pyg_dataset_offline_says_which_files_to_place_where(tmp_path, monkeypatch):
    with socket.socket() as s:  # nobody listens there: the connection is refused
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("DSA_DOWNLOAD_MIRROR", f"http://127.0.0.1:{s.getsockname()[1]}")
    with pytest.raises(DatasetError, match=r"'fb15k237' could not be downloaded") as err:
        load_knowledge_graph(DatasetConfig(kind="fb15k237", root=str(tmp_path)))
    for f in ("train.txt", "valid.txt", "test.txt"):
        assert f"{tmp_path / 'FB15k-237' / 'raw' / f}  <-  " in err.value.message
        assert f"/villmow/datasets_knowledge_embedding/master/FB15k-237/{f}" in err.value.message
    assert "by hand" in err.value.hint


def test_pyg_raw_files_are_checked_before_pyg_reads_them(tmp_path, monkeypatch):
    raw = write_folder(tmp_path / "FB15k-237" / "raw", train=b"a\tr\tb\r\n")
    assert raw.is_dir()
    with pytest.raises(DatasetError, match="is not fb15k237's raw/train.txt"):  # its digest first
        load_knowledge_graph(DatasetConfig(kind="fb15k237", root=str(tmp_path)))
    unknown = tuple(dataclasses.replace(f, expected=Expected()) for f in remote.DATASETS["fb15k237"].files)
    monkeypatch.setitem(remote.DATASETS, "fb15k237", dataclasses.replace(remote.DATASETS["fb15k237"], files=unknown))
    with pytest.raises(DatasetError, match="CRLF"):  # then every line, whatever the digest
        load_knowledge_graph(DatasetConfig(kind="fb15k237", root=str(tmp_path)))


@pytest.mark.parametrize(
    "kind,folder,sizes",
    [
        ("fb15k237", "FB15k-237", (14541, 237, 272115, 17535, 20466)),
        ("wn18rr", "WN18RR", (40943, 11, 86835, 3034, 3134)),
    ],
)
def test_pyg_datasets(test_data, tmp_path, kind, folder, sizes):
    root = copy_dataset(test_data, folder, tmp_path)
    kg = load_knowledge_graph(DatasetConfig(kind=kind, root=str(root)))
    assert (kg.num_entities, kg.num_relations, len(kg.train), len(kg.valid), len(kg.test)) == sizes
    assert int(kg.train[:, [0, 2]].max()) < kg.num_entities


@pytest.mark.parametrize("name,sizes", [("umls", (135, 46, 5216, 652, 661)), ("nations", (14, 55, 1592, 199, 201))])
def test_tsv_datasets(test_data, name, sizes):
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(test_data / name)))
    assert (kg.num_entities, kg.num_relations, len(kg.train), len(kg.valid), len(kg.test)) == sizes


def test_synthetic_is_seeded_power_law_and_deduplicated(tmp_path):
    config = SyntheticConfig(entities=5000, relations=10, triples=60_000, valid=500, test=500, seed=3)
    a = load_knowledge_graph(DatasetConfig(kind="synthetic", synthetic=config, root=str(tmp_path / "a")))
    b = load_knowledge_graph(DatasetConfig(kind="synthetic", synthetic=config, root=str(tmp_path / "b")))
    assert torch.equal(a.train, b.train) and torch.equal(a.test, b.test)
    everything = torch.cat([a.train, a.valid, a.test]).long()
    assert len(torch.unique(everything, dim=0)) == len(everything)  # no fact twice
    assert (len(a.valid), len(a.test)) == (500, 500)
    degree = torch.bincount(everything[:, 0], minlength=5000).sort(descending=True).values.double()
    assert degree[:50].sum() > 5 * degree[-2500:].sum()  # the top 1% dwarf the bottom half
    other = load_knowledge_graph(
        DatasetConfig(kind="synthetic", synthetic=SyntheticConfig(**{**config.__dict__, "seed": 4}), root=str(tmp_path))
    )
    assert not torch.equal(a.train[:100], other.train[:100])
