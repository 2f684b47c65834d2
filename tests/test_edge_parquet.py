"""Parquet edge lists (``dataset.kind: edge_list`` with a ``.parquet`` file or a folder of
them): the same graph as a text file and as parquet imports into the same arrays, byte for
byte; integer and string ids, weights; missing columns, nulls and a missing pyarrow are
named errors that leave nothing under the dataset's name."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa  # the test extra installs it: its absence fails, never skips
import pyarrow.parquet as pq
import pytest

from dsa_train.data import edge_parquet, load_graph
from dsa_train.errors import ConfigError, DatasetError

from .test_edge_list import graph_of, named_edges, nothing_imported


def write_parquet(path: Path, row_group_size: int | None = None, **columns) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def arrays(graph) -> dict[str, bytes]:
    """Every file of an imported dataset but its manifest (which names its sources)."""
    return {p.name: p.read_bytes() for p in sorted(graph.dataset.folder.iterdir()) if p.name != "manifest.json"}


def test_string_ids_and_weights(tmp_path):
    path = write_parquet(
        tmp_path / "e.parquet", src=["a", "b", "c", "a"], dst=["b", "c", "a", "a"], w=[0.5, 2.0, 1.0, 3.0]
    )
    graph = graph_of(path, source="src", target="dst", weight="w", min_weight=1.0)
    assert named_edges(graph) == {
        frozenset(("b", "c")),
        frozenset(("c", "a")),
    }  # (a, b) below min_weight, (a, a) a self-loop
    meta = graph.dataset.meta
    assert (meta["input_edges"], meta["below_min_weight"], meta["self_loops"], meta["num_edges"]) == (3, 1, 1, 2)


def test_integer_ids_as_rows_and_as_names(tmp_path):
    path = write_parquet(tmp_path / "e.parquet", a=np.array([0, 1, 7], np.int32), b=np.array([1, 2, 0], np.int32))
    rows = graph_of(path, ids="integers")
    assert (
        rows.num_nodes == 8
        and rows.rowptr.tolist() == [0, 2, 4, 5, 5, 5, 5, 5, 6]
        and rows.col.tolist() == [1, 7, 0, 2, 1, 0]
    )
    as_rows = arrays(rows)  # read now: another import of the same path replaces it
    named = graph_of(path)  # ids: names (the default): a number's name is its decimal text
    assert named.num_nodes == 4 and named_edges(named) == {frozenset(p) for p in [("0", "1"), ("1", "2"), ("7", "0")]}
    digits = write_parquet(tmp_path / "digits.parquet", a=["0", "1", "7"], b=["1", "2", "0"])
    assert arrays(graph_of(digits, ids="integers")) == as_rows


@pytest.mark.parametrize("ids", ["names", "integers"])
def test_the_same_graph_as_text_and_as_parquet_imports_alike(tmp_path, monkeypatch, ids):
    """A graph written as a SNAP-style text file and as a folder of parquet files (several
    row groups, read in several batches, Spark's _SUCCESS beside them) gives the same arrays
    byte for byte: the same names, ids, CSR, held-out edges and labels."""
    monkeypatch.setattr(edge_parquet, "BATCH_ROWS", 700)
    rng = np.random.default_rng(5)
    u, v = rng.integers(0, 400, 3000), (400 * rng.random(3000) ** 2).astype(np.int64)
    u[:20] = v[:20]  # self-loops
    text = tmp_path / "graph.txt"
    text.write_text("# a generated graph\n" + "".join(f"{a}\t{b}\n" for a, b in zip(u, v)))
    labels = tmp_path / "labels.tsv"
    labels.write_text("".join(f"{i}\t{i % 5}\n" for i in range(0, 400, 3)))
    folder = tmp_path / "graph.parquet"
    folder.mkdir()
    write_parquet(
        folder / "part-0.parquet", 500, source=u[:1800], target=v[:1800].astype(str)
    )  # a column of ints, one of strings
    write_parquet(folder / "part-1.parquet", 500, source=u[1800:], target=v[1800:].astype(str))
    (folder / "_SUCCESS").write_bytes(b"")
    from dsa_train.recipe import DatasetConfig, EdgeListConfig

    def load(path):
        return load_graph(
            DatasetConfig(
                kind="edge_list",
                path=str(path),
                labels=str(labels),
                link_split=(0.1, 0.1),
                edges=EdgeListConfig(ids=ids),
            )
        )

    from_text, from_parquet = load(text), load(folder)
    assert from_text.num_nodes == from_parquet.num_nodes and from_text.num_edges == from_parquet.num_edges > 1000
    assert len(from_text.test_edges) > 50
    assert arrays(from_text) == arrays(from_parquet)
    assert from_text.dataset.meta == from_parquet.dataset.meta


def test_missing_column_is_named(tmp_path):
    path = write_parquet(tmp_path / "e.parquet", src=["a"], dst=["b"])
    with pytest.raises(
        ConfigError, match=r"dataset.edges.target: '.*e.parquet' has no column 'to' \(its columns: src, dst\)"
    ):
        graph_of(path, source="src", target="to")
    with pytest.raises(ConfigError, match=r"column 2 is past the 2 columns of '.*e.parquet' \(src, dst\)"):
        graph_of(path, weight=2)
    with pytest.raises(ConfigError, match=r"dataset.edges.delimiter: applies to text edge lists, not to parquet"):
        graph_of(path, delimiter=",")
    assert nothing_imported()


@pytest.mark.parametrize(
    "columns,settings,message",
    [
        (
            {"s": ["a", "b", None, "d"], "t": ["b", "c", "d", None]},
            {},
            r"column 's' is null in row 1002 \(counting from 0\)",
        ),
        ({"s": [1, 2, 3, -4], "t": [2, 3, 4, 5]}, {"ids": "integers"}, r"column 's' holds a negative id in row 1003"),
        (
            {"s": ["1", "2", "x", "4"], "t": ["2", "3", "4", "5"]},
            {"ids": "integers"},
            r"column 's' holds a value that is not a whole number .* in row 1002",
        ),
        ({"s": ["a", "b", "", "d"], "t": ["b", "c", "d", "e"]}, {}, r"column 's' holds an empty name in row 1002"),
        (
            {"s": ["a", "b", "c", "d"], "t": ["b", "c", "d", "e"], "w": [1.0, None, 2.0, 3.0]},
            {"weight": "w"},
            r"column 'w' is null in row 1001",
        ),
        (
            {"s": [1.5, 2.0, 3.0, 4.0], "t": [2, 3, 4, 5]},
            {},
            r"column 's' \(source\) holds double, not integers or strings",
        ),
    ],
)
def test_bad_values_name_file_column_and_row(tmp_path, monkeypatch, columns, settings, message):
    monkeypatch.setattr(edge_parquet, "BATCH_ROWS", 3)  # the bad row is in a later batch than the first
    good = {"s": 0, "t": 1, "w": 1.0}  # 1,000 good rows (in their column's type) before the bad ones
    first = {name: [type(values[0])(good[name])] * 1000 for name, values in columns.items()}
    path = write_parquet(tmp_path / "bad.parquet", **{name: first[name] + values for name, values in columns.items()})
    with pytest.raises(DatasetError, match=message) as caught:
        graph_of(path, **settings)
    assert str(path) in str(caught.value)
    assert nothing_imported()


def test_parquet_and_text_in_one_folder_are_refused(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_parquet(folder / "a.parquet", s=["a"], t=["b"])
    (folder / "b.txt").write_text("b c\n")
    with pytest.raises(DatasetError, match=r"b.txt' is not a parquet file, but '.*a.parquet' is"):
        graph_of(folder)
    assert nothing_imported()


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "e.parquet", s=["a"], t=["b"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"parquet edge list needs pyarrow") as caught:
        graph_of(path)
    assert "dsa-train[parquet]" in str(caught.value)
    assert nothing_imported()
