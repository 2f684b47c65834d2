"""Knowledge-graph folders in their other forms: a header line (detected or declared) and
CSV files, each imported exactly as the plain TSV form of the same triples."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_train.data import load_knowledge_graph
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, TriplesConfig

TRIPLES = {
    "train": [
        ("alice", "knows", "bob"),
        ("bob", "knows", "carol"),
        ("carol", "likes", "alice"),
        ("dave", "likes", "bob"),
    ],
    "valid": [("alice", "likes", "carol")],
    "test": [("bob", "likes", "dave")],
}


def folder(tmp_path, name, suffix="txt", delimiter="\t", header=None):
    path = tmp_path / name
    path.mkdir()
    for split, rows in TRIPLES.items():
        lines = ([delimiter.join(header)] if header else []) + [delimiter.join(r) for r in rows]
        (path / f"{split}.{suffix}").write_text("\n".join(lines) + "\n")
    return path


def named_triples(kg) -> dict:
    out = {}
    for split in ("train", "valid", "test"):
        rows = np.asarray(kg.split(split))
        out[split] = [
            (kg.entity_names([h])[0], kg.relation_names([r])[0], kg.entity_names([t])[0]) for h, r, t in rows.tolist()
        ]
    return out


@pytest.mark.parametrize(
    "suffix,delimiter,header,triples",
    [
        ("txt", "\t", ["head", "relation", "tail"], TriplesConfig()),  # detected
        ("csv", ",", None, TriplesConfig()),  # the CSV form
        ("csv", ",", ["subject", "predicate", "object"], TriplesConfig()),
        (
            "txt",
            "\t",
            ["h_name", "r_name", "t_name"],
            TriplesConfig(header=True),
        ),  # words the detection does not know: declared
    ],
)
def test_header_and_csv_read_as_the_plain_form(tmp_path, suffix, delimiter, header, triples):
    plain = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder(tmp_path, "plain"))))
    other = load_knowledge_graph(
        DatasetConfig(kind="tsv", path=str(folder(tmp_path, "other", suffix, delimiter, header)), triples=triples)
    )
    assert named_triples(other) == named_triples(plain) == TRIPLES
    for split in ("train", "valid", "test"):
        assert np.array_equal(
            np.asarray(other.split(split)), np.asarray(plain.split(split))
        )  # same ids: fingerprint order


def test_a_bad_csv_line_names_file_line_and_form(tmp_path):
    path = folder(tmp_path, "bad", "csv", ",")
    (path / "train.csv").write_text("a,r,b\nc,r\n")
    with pytest.raises(DatasetError) as caught:
        load_knowledge_graph(DatasetConfig(kind="tsv", path=str(path)))
    assert (
        "train.csv:2: line has 2 ','-separated columns, expected 3" in caught.value.message
        and "head,relation,tail" in caught.value.hint
    )
