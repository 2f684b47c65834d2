"""Click logs in their real formats: Criteo's headerless tab files (dataset.layout: criteo),
a headered file whatever its extension, Avazu's columns, gzip; each read against the same
impressions in the plain headered TSV the reader has always taken."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from dsa_train.data import load_click_log
from dsa_train.data.clicks_import import CRITEO
from dsa_train.errors import DatasetError
from dsa_train.recipe import ClickColumnsConfig, DatasetConfig

SPLIT_ARRAYS = ("labels", "dense", "bags", "ids")


def criteo_rows(count: int = 30) -> list[list[str]]:
    rng = np.random.default_rng(2)
    rows = []
    for i in range(count):
        dense = [str(int(x)) if x >= 0 else "" for x in rng.integers(-3, 50, 13)]
        sparse = [f"{rng.integers(0, 2**32):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        rows.append([str(i % 2), *dense, *sparse])
    return rows


def load(tmp_path, name: str, content: bytes, layout=None, **columns):
    path = tmp_path / name
    path.write_bytes(content)
    config = DatasetConfig(kind="click_log", path=str(path), layout=layout, columns=ClickColumnsConfig(**columns))
    from dsa_train.data.load import load_click_log as loader

    return loader(config)


def arrays(log) -> dict:
    return {
        f"{s}_{a}": np.asarray(log.dataset.array(f"{s}_{a}")) for s in ("train", "valid", "test") for a in SPLIT_ARRAYS
    }


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def text(rows, delimiter="\t", header=None) -> bytes:
    lines = ([delimiter.join(header)] if header else []) + [delimiter.join(r) for r in rows]
    return ("\n".join(lines) + "\n").encode()


def test_criteo_headerless_headered_txt_and_gz_read_alike(tmp_path, notes):
    rows = criteo_rows()
    reference = load(tmp_path, "ref.tsv", text(rows, header=CRITEO))  # the form the reader always took
    assert reference.features == CRITEO[14:] and reference.dense_features == CRITEO[1:14]
    notes.clear()
    kaggle = load(tmp_path, "train.txt", text(rows), layout="criteo")  # Kaggle's train.txt: no header, tabs
    assert kaggle.features == reference.features and same(arrays(kaggle), arrays(reference))
    assert "tab-separated (given by the recipe" in notes[0] and "no header" in notes[0]
    day = load(tmp_path, "day_0.gz", gzip.compress(text(rows)), layout="criteo")  # Terabyte's day_N, compressed
    assert same(arrays(day), arrays(reference))
    notes.clear()
    sample = load(tmp_path, "criteo_sample.txt", text(rows, ",", CRITEO))  # DeepCTR's sample: a CSV named .txt
    assert same(arrays(sample), arrays(reference))
    assert "comma-separated (read from the first line" in notes[0]
    both = load(
        tmp_path, "headered.txt", text(rows, header=CRITEO), layout="criteo"
    )  # the preset, and a header after all
    assert same(arrays(both), arrays(reference))


def test_avazu_uses_every_categorical_column(tmp_path, notes):
    header = "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21".split(
        ","
    )
    rows = [
        [
            f"{10**18 + i}",
            str(i % 2),
            "14102100",
            "1005",
            "0",
            "1fbe01fe",
            "f3845767",
            "28905ebd",
            "ecad2386",
            "7801e8d9",
            "07d7df22",
            "a99f214a",
            f"ddd2926{i}",
            "44956a24",
            "1",
            "2",
            "15706",
            "320",
            "50",
            "1722",
            "0",
            "35",
            "-1",
            "79",
        ]
        for i in range(20)
    ]
    notes.clear()
    log = load(tmp_path, "avazu.csv", text(rows, ",", header), label="click")
    assert log.features == header[2:] and len(log.features) == 22 and log.dense_features == []
    assert "22 categorical" in notes[0] and "ignored: id" in notes[0]
    notes.clear()
    load(tmp_path, "avazu2.csv", text(rows, ",", header), label="click", sparse=["site_id", "app_id"])
    assert "ignored: id, hour, C1, banner_pos" in notes[0]


@pytest.mark.parametrize(
    "name,content,settings,message",
    [
        (
            "nohead.txt",
            b"0\t1\tx\n",
            {"header": False},
            "has no header (dataset.columns.header: false) and dataset.columns.names is not set",
        ),
        ("one.txt", b"label\n1\n", {}, "its first line holds neither a tab nor a comma"),
        ("broken.gz", b"not gzip data at all\n", {}, "cannot be read"),
        ("short.txt", b"0\t1\tx\n1\t2\n", {"names": ["label", "I1", "C1"]}, "line 2: 2 cells where the header names 3"),
        (
            "wrong.txt",
            b"0\t1\tx\n",
            {"names": ["label", "I1", "C9"], "sparse": ["C1"]},
            "has no column 'C1' (its header: label, I1, C9)",
        ),
    ],
)
def test_bad_click_log_formats(tmp_path, name, content, settings, message):
    with pytest.raises(DatasetError) as caught:
        load(tmp_path, name, content, **settings)
    assert message in caught.value.message and name in caught.value.message and caught.value.hint


def test_load_click_log_is_reused_not_imported_again(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_bytes(text(criteo_rows(5), header=CRITEO))
    config = DatasetConfig(kind="click_log", path=str(path))
    assert load_click_log(config).dataset.fresh and not load_click_log(config).dataset.fresh
