"""Graphs imported out of core: the CSR against a brute-force construction in RAM, held-out
edges, re-imports, and a killed import."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train.data import graph_import, graph_synthetic, load_graph
from dsa_train.data.graph_import import write_csr
from dsa_train.data.graph_synthetic import write_synthetic_graph
from dsa_train.data.store import Dataset, DatasetWriter, imports_root
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, GraphSyntheticConfig

SMALL = GraphSyntheticConfig(nodes=3000, communities=7, average_degree=6, homophily=0.7, zipf=1.2, seed=5)


def brute_force_csr(u, v, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSR of the undirected graph of pairs (u, v), from a Python set: both directions,
    no self-loops, no repeats, rows and columns sorted (int64)."""
    pairs = {(a, b) for a, b in zip(np.asarray(u).tolist(), np.asarray(v).tolist()) if a != b}
    pairs |= {(b, a) for a, b in pairs}
    ordered = sorted(pairs)
    counts = np.bincount(np.array([a for a, _ in ordered], dtype=np.int64), minlength=num_nodes)
    rowptr = np.concatenate([[0], np.cumsum(counts)])
    return torch.from_numpy(rowptr).long(), torch.tensor([b for _, b in ordered], dtype=torch.long)


def pairs_of(rowptr: torch.Tensor, col: torch.Tensor) -> set[tuple[int, int]]:
    rows = torch.repeat_interleave(torch.arange(len(rowptr) - 1), rowptr[1:] - rowptr[:-1])
    return set(zip(rows.tolist(), col.long().tolist()))


def written(tmp_path: Path, build, name: str = "g") -> Dataset:
    """A dataset folder written by ``build(writer)`` (without the import machinery)."""
    with DatasetWriter(tmp_path / name, kind="graph", name=name, sources={}) as writer:
        build(writer)
        writer.commit()
    return Dataset.open(tmp_path / name)


def skewed_edges(count: int, num_nodes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random pairs, a third of them touching node 7 (a hot node), with repeats and loops."""
    rng = np.random.default_rng(seed)
    u, v = rng.integers(0, num_nodes, count), rng.integers(0, num_nodes, count)
    u[: count // 3] = 7
    u[-10:] = v[-10:]  # self-loops
    return np.concatenate([u, v[:50]]), np.concatenate([v, u[:50]])  # some pairs in both directions


@pytest.mark.parametrize(
    "memory_bytes", [256 << 20, 64 * 40, 64 * 3], ids=["one-partition", "many-partitions", "tiny-budget"]
)
def test_csr_equals_brute_force(tmp_path, memory_bytes):
    """Tiny budgets force many partitions, the range splits of an oversized partition (node 7
    holds a third of the keys) and the bitmap of a narrow range: the arrays stay the same."""
    u, v = skewed_edges(2000, 300, seed=1)
    chunks = [(u[i : i + 333], v[i : i + 333]) for i in range(0, len(u), 333)]
    dataset = written(tmp_path, lambda w: write_csr(w, chunks, 300, edges_bound=len(u), memory_bytes=memory_bytes))
    rowptr, col = brute_force_csr(u, v, 300)
    assert torch.equal(dataset.tensor("rowptr"), rowptr)
    assert dataset.array("col").dtype == np.int32 and torch.equal(dataset.tensor("col").long(), col)
    assert dataset.meta["num_edges"] * 2 == len(col) and dataset.meta["max_degree"] == int(
        (rowptr[1:] - rowptr[:-1]).max()
    )
    assert not (tmp_path / "g" / ".scratch").exists()


def test_partition_spans_keep_keys_within_int64():
    assert graph_import._span(300, 10, 1000) == 300  # one partition
    assert graph_import._span(3000, 64_000, 1000) == 3000 // 64 + 1  # as many as the budget asks
    n = 5 * 10**9  # N^2 > 2^63: a key (u - low) * N + v must stay below 2^63
    span = graph_import._span(n, 10, 10**12)
    assert span * n < 2**63 and -(-n // span) <= graph_import.MAX_PARTITIONS
    with pytest.raises(DatasetError, match="needs more than 256 partitions"):
        graph_import._span(10**11, 10, 10**12)


@pytest.mark.parametrize("memory_bytes", [256 << 20, 64 * 500], ids=["one-partition", "many-partitions"])
def test_synthetic_graph_equals_in_ram_construction(tmp_path, memory_bytes):
    dataset = written(
        tmp_path, lambda w: write_synthetic_graph(w, config=SMALL, link_split=(0.0, 0.0), memory_bytes=memory_bytes)
    )
    u, v = map(np.concatenate, zip(*graph_synthetic._synthetic_edges(SMALL)))  # the generator's draws
    assert len(u) == SMALL.nodes * SMALL.average_degree // 2
    rowptr, col = brute_force_csr(u, v, SMALL.nodes)
    assert torch.equal(dataset.tensor("rowptr"), rowptr) and torch.equal(dataset.tensor("col").long(), col)
    labels = dataset.tensor("labels")
    assert labels.dtype == torch.int8 and torch.equal(labels.long(), torch.arange(SMALL.nodes) % 7)
    splits = [dataset.tensor(f"{s}_nodes").long() for s in ("train", "valid", "test")]
    assert torch.equal(torch.sort(torch.cat(splits)).values, torch.arange(SMALL.nodes))  # disjoint, complete
    for nodes, fraction in zip(splits, (0.1, 0.1, 0.8)):
        assert abs(len(nodes) - fraction * SMALL.nodes) < 5 * (fraction * (1 - fraction) * SMALL.nodes) ** 0.5
        assert torch.equal(nodes, torch.sort(nodes).values)


def test_held_out_edges_are_real_edges_absent_from_the_csr_both_ways(tmp_path):
    config = DatasetConfig(kind="synthetic_graph", graph=SMALL, link_split=(0.1, 0.2))
    g = load_graph(config)
    u, v = map(np.concatenate, zip(*graph_synthetic._synthetic_edges(SMALL)))
    everything = pairs_of(*brute_force_csr(u, v, SMALL.nodes))
    kept = pairs_of(g.rowptr, g.col)
    valid, test = [set(map(tuple, e.long().tolist())) for e in (g.valid_edges, g.test_edges)]
    assert all(a < b for a, b in valid | test) and not valid & test
    held = valid | test
    assert held <= everything  # real edges
    assert not any((a, b) in kept or (b, a) in kept for a, b in held)  # gone in both directions
    assert kept | held | {(b, a) for a, b in held} == everything  # and nothing else is
    edges = len(everything) // 2
    for count, fraction in ((len(valid), 0.1), (len(test), 0.2)):  # each edge held out independently
        assert abs(count - fraction * edges) < 5 * (fraction * (1 - fraction) * edges) ** 0.5
    assert g.num_edges == edges - len(held)
    again = load_graph(DatasetConfig(kind="synthetic_graph", graph=SMALL, link_split=(0.1, 0.2)))
    assert torch.equal(again.test_edges, g.test_edges)  # seeded


def test_changed_settings_import_again(tmp_path, notes):
    first = load_graph(DatasetConfig(kind="synthetic_graph", graph=SMALL))
    same = load_graph(DatasetConfig(kind="synthetic_graph", graph=SMALL))
    assert same.dataset.folder == first.dataset.folder and not notes  # reused
    split = load_graph(DatasetConfig(kind="synthetic_graph", graph=SMALL, link_split=(0.1, 0.1)))
    assert split.dataset.folder == first.dataset.folder and len(notes) == 1 and "changed" in notes[0]
    assert split.num_edges < first.num_edges and len(split.test_edges) > 0
    assert split.dataset.manifest["sources"]["link_split"] == [0.1, 0.1]
    reseeded = load_graph(DatasetConfig(kind="synthetic_graph", graph=dataclasses.replace(SMALL, seed=6)))
    assert reseeded.dataset.folder != first.dataset.folder  # other generator settings: another dataset
    assert not torch.equal(reseeded.col[:100], first.col[:100])


def test_killed_import_leaves_no_half_dataset(tmp_path):
    """kill -9 in the middle of an import (the CSR written, the node arrays not): no dataset
    appears, and the next load imports it whole and removes the leftover."""
    root = tmp_path / "data"
    script = (
        "import os, signal\n"
        "from dsa_train.data import graph_synthetic, load_graph\n"
        "from dsa_train.recipe import DatasetConfig, GraphSyntheticConfig\n"
        "graph_synthetic.write_nodes = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"load_graph(DatasetConfig(kind='synthetic_graph', graph=GraphSyntheticConfig(**{SMALL.__dict__!r})))\n"
    )
    env = {**os.environ, "DSA_DATA_ROOT": str(root)}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    left = sorted(p.name for p in imports_root(root).iterdir() if not p.name.startswith("."))
    assert left == [], left
    assert any(p.name.startswith(".partial-") for p in imports_root(root).iterdir())  # what the kill left
    g = load_graph(DatasetConfig(kind="synthetic_graph", graph=SMALL, root=str(root)))
    assert g.num_nodes == SMALL.nodes and len(g.nodes("test")) > 0
    assert not any(p.name.startswith(".partial-") for p in imports_root(root).iterdir())
