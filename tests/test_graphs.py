"""Graph data, neighbour sampling and the node-embedding evaluations."""

from __future__ import annotations

import pytest
import torch

from dsa_train.data.graphs import Graph, csr_from_edges, generate_graph, load_graph, split_edges
from dsa_train.data.neighbors import sample_subgraph
from dsa_train.errors import DatasetError
from dsa_train.eval.node import _auc, link_prediction, probe_accuracy
from dsa_train.recipe import DatasetConfig, GraphSyntheticConfig

from .conftest import copy_dataset


def test_csr_is_symmetric_sorted_and_without_loops():
    rowptr, col = csr_from_edges(torch.tensor([[0, 1], [1, 0], [2, 1], [3, 3], [0, 2]]), 4)
    assert rowptr.tolist() == [0, 2, 4, 6, 6]
    assert col.tolist() == [1, 2, 0, 2, 0, 1]


def test_edge_split_holds_out_edges_from_the_adjacency():
    g = generate_graph(GraphSyntheticConfig(nodes=500, communities=5, average_degree=8, seed=1))
    before = g.num_edges
    g = split_edges(g, 0.1, 0.2, seed=0)
    assert len(g.valid_edges) == int(0.1 * before) and len(g.test_edges) == int(0.2 * before)
    assert g.num_edges == before - len(g.valid_edges) - len(g.test_edges)
    keys = set(g.edge_keys().tolist())
    for u, v in torch.cat([g.valid_edges, g.test_edges]).tolist():
        assert u * 500 + v not in keys and v * 500 + u not in keys


def test_synthetic_graph_is_seeded_homophilous_and_power_law():
    config = GraphSyntheticConfig(nodes=20_000, communities=10, average_degree=10, homophily=0.8, seed=3)
    a, b = generate_graph(config), generate_graph(config)
    assert torch.equal(a.col, b.col) and torch.equal(a.rowptr, b.rowptr)
    rows = torch.repeat_interleave(torch.arange(a.num_nodes), a.degree())
    same = (a.labels[rows] == a.labels[a.col]).double().mean()
    assert same > 0.75  # homophily 0.8 plus chance
    degree = a.degree().sort(descending=True).values.double()
    assert degree[:200].sum() > degree[-10_000:].sum()  # the top 1% outweigh the bottom half
    assert a.num_classes == 10 and (a.train_mask | a.val_mask | a.test_mask).all()


def test_karate_is_built_in():
    g = load_graph(DatasetConfig(kind="karate"))
    assert (g.num_nodes, g.num_edges, g.num_classes, int(g.train_mask.sum())) == (34, 78, 4, 4)


def test_planetoid_offline_says_which_files_to_place_where(tmp_path):
    with pytest.raises(DatasetError, match=r"Planetoid Cora files in .*Cora/raw' are ind.cora.x, .* missing") as err:
        load_graph(DatasetConfig(kind="planetoid", name="Cora", root=str(tmp_path)))
    assert "kimiyoung/planetoid" in err.value.hint


def test_cora(test_data, tmp_path):
    g = load_graph(DatasetConfig(kind="planetoid", name="Cora", root=str(copy_dataset(test_data, "Cora", tmp_path))))
    assert (g.num_nodes, g.num_edges, g.num_classes) == (2708, 5278, 7)
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())) == (140, 500, 1000)


@pytest.mark.parametrize("fanout", [[3], [2, 4]])
def test_neighbour_sampling_returns_a_valid_subgraph(fanout):
    g = generate_graph(GraphSyntheticConfig(nodes=2000, average_degree=6, seed=2))
    torch.manual_seed(0)
    seeds = torch.unique(torch.randint(0, 2000, (50,)))
    n_id, edge_index = sample_subgraph(g.rowptr, g.col, seeds, fanout, use_pyg=False)
    assert torch.equal(n_id[: len(seeds)], seeds) and len(torch.unique(n_id)) == len(n_id)
    keys = set(g.edge_keys().tolist())
    src, dst = n_id[edge_index[0]], n_id[edge_index[1]]
    assert all(s * 2000 + d in keys for s, d in zip(src.tolist(), dst.tolist()))  # real edges only
    per_target = torch.bincount(edge_index[1], minlength=len(n_id))
    assert per_target.max() <= max(fanout)
    first_hop = per_target[: len(seeds)]
    assert torch.equal(first_hop.clamp(max=1), g.degree()[seeds].clamp(max=1))  # every seed with neighbours got some


def test_probe_matches_scikit_learn():
    sklearn = pytest.importorskip("sklearn.linear_model", reason="scikit-learn is the reference here; not a dependency")
    torch.manual_seed(0)
    x = torch.randn(400, 12)
    y = (x @ torch.randn(12, 4) + torch.randn(400, 4)).argmax(1)
    train = torch.rand(400) < 0.3
    ours = probe_accuracy(x, y, train, {"test": ~train})["test"]
    reference = sklearn.LogisticRegression(max_iter=1000).fit(x[train].numpy(), y[train].numpy()).score(x[~train].numpy(), y[~train].numpy())
    assert ours == pytest.approx(reference, abs=1 / 400)


def test_probe_separates_separable_classes():
    x = torch.cat([torch.randn(50, 2) + 5, torch.randn(50, 2) - 5])
    y = torch.cat([torch.zeros(50), torch.ones(50)]).long()
    train = torch.zeros(100, dtype=torch.bool)
    train[::10] = True
    assert probe_accuracy(x, y, train, {"test": ~train})["test"] == 1.0


def test_auc_and_link_metrics_by_hand():
    assert _auc(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0.0, 2.0, 5.0])) == pytest.approx(4.5 / 9)
    edges = torch.stack([torch.arange(100), torch.arange(100) + 1], 1)  # i -- i + 1
    knows = lambda u, v: (v == u + 1).double()  # noqa: E731  (scores exactly the true edges)
    perfect = link_prediction(knows, edges, 10_000, negatives=50)
    assert perfect["auc"] == pytest.approx(1.0, abs=0.01) and perfect["mrr"] == pytest.approx(1.0, abs=0.01)
    blind = link_prediction(lambda u, v: torch.zeros(len(u)), edges, 10_000, negatives=50)  # all ties
    assert blind["auc"] == 0.5 and blind["mrr"] == pytest.approx(1 / 26)  # rank 1 + 50/2 for every edge
