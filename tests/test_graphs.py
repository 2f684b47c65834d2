"""Graph data, neighbour sampling and the node-embedding evaluations."""

from __future__ import annotations

import pytest
import torch

from dsa_train.data import load_graph
from dsa_train.data.graph_import import write_csr
from dsa_train.data.neighbors import NeighbourSampler
from dsa_train.errors import DatasetError
from dsa_train.eval.node import _auc, link_prediction, probe_accuracy
from dsa_train.recipe import DatasetConfig, GraphSyntheticConfig

from .conftest import copy_dataset
from .test_graph_import import pairs_of, written


def synthetic(root=None, link_split=(0.0, 0.0), **settings):
    return load_graph(
        DatasetConfig(kind="synthetic_graph", graph=GraphSyntheticConfig(**settings), link_split=link_split, root=root)
    )


def test_csr_is_symmetric_sorted_and_without_loops(tmp_path):
    edges = torch.tensor([[0, 1], [1, 0], [2, 1], [3, 3], [0, 2]]).numpy()
    dataset = written(tmp_path, lambda w: write_csr(w, [(edges[:, 0], edges[:, 1])], 4, edges_bound=len(edges)))
    assert dataset.tensor("rowptr").tolist() == [0, 2, 4, 6, 6]
    assert dataset.tensor("col").tolist() == [1, 2, 0, 2, 0, 1]


def test_edge_split_holds_out_edges_from_the_adjacency():
    """Each edge is held out by its own seeded hash (see graph_import): the counts are
    binomial around the fractions (they were exact fractions of a global permutation)."""
    before = synthetic(nodes=500, communities=5, average_degree=8, seed=1).num_edges
    g = synthetic(nodes=500, communities=5, average_degree=8, seed=1, link_split=(0.1, 0.2))
    for held, fraction in ((g.valid_edges, 0.1), (g.test_edges, 0.2)):
        assert abs(len(held) - fraction * before) < 5 * (fraction * (1 - fraction) * before) ** 0.5
    assert g.num_edges == before - len(g.valid_edges) - len(g.test_edges)
    kept = pairs_of(g.rowptr, g.col)
    for u, v in torch.cat([g.valid_edges, g.test_edges]).tolist():
        assert (u, v) not in kept and (v, u) not in kept


def test_synthetic_graph_is_seeded_homophilous_and_power_law(tmp_path):
    settings = dict(nodes=20_000, communities=10, average_degree=10, homophily=0.8, seed=3)
    a, b = synthetic(tmp_path / "a", **settings), synthetic(tmp_path / "b", **settings)  # two imports
    assert torch.equal(a.col, b.col) and torch.equal(a.rowptr, b.rowptr)
    degrees = a.degree(torch.arange(a.num_nodes))
    rows = torch.repeat_interleave(torch.arange(a.num_nodes), degrees)
    same = (a.labels[rows] == a.labels[a.col.long()]).double().mean()
    assert same > 0.75  # homophily 0.8 plus chance
    degree = degrees.sort(descending=True).values.double()
    assert degree[:200].sum() > degree[-10_000:].sum()  # the top 1% outweigh the bottom half
    assert a.max_degree == int(degree[0])
    splits = torch.cat([a.nodes(s) for s in ("train", "valid", "test")]).long()
    assert a.num_classes == 10 and torch.equal(splits.sort().values, torch.arange(a.num_nodes))


def test_karate_is_built_in():
    g = load_graph(DatasetConfig(kind="karate"))
    assert (g.num_nodes, g.num_edges, g.num_classes, len(g.nodes("train"))) == (34, 78, 4, 4)
    assert len(g.nodes("valid")) == 0 and len(g.nodes("test")) == 30


def test_planetoid_offline_says_which_files_to_place_where(tmp_path, monkeypatch):
    from torch_geometric.datasets import Planetoid

    def offline(self):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(Planetoid, "download", offline)  # offline even where there is a network
    with pytest.raises(
        DatasetError,
        match=r"Planetoid Cora: ind.cora.x, .*, ind.cora.test.index are missing from '.*Cora/raw' and could not be downloaded",
    ) as err:
        load_graph(DatasetConfig(kind="planetoid", name="Cora", root=str(tmp_path)))
    assert (
        "kimiyoung/planetoid" in err.value.hint
        and "DSA_DATA_ROOT" in err.value.hint
        and "'Cora/raw/'" in err.value.hint
    )


def test_cora(test_data, tmp_path):
    g = load_graph(DatasetConfig(kind="planetoid", name="Cora", root=str(copy_dataset(test_data, "Cora", tmp_path))))
    assert (g.num_nodes, g.num_edges, g.num_classes) == (2708, 5278, 7)
    assert tuple(len(g.nodes(s)) for s in ("train", "valid", "test")) == (140, 500, 1000)


@pytest.mark.parametrize("fanout", [[3], [2, 4]])
def test_neighbour_sampling_returns_a_valid_subgraph(fanout):
    g = synthetic(nodes=2000, average_degree=6, seed=2)
    torch.manual_seed(0)
    seeds = torch.unique(torch.randint(0, 2000, (50,)))
    n_id, edge_index = NeighbourSampler(g.rowptr, g.col, fanout).sample(seeds)
    assert torch.equal(n_id[: len(seeds)], seeds) and len(torch.unique(n_id)) == len(n_id)
    edges = pairs_of(g.rowptr, g.col)
    src, dst = n_id[edge_index[0]], n_id[edge_index[1]]
    assert all((s, d) in edges for s, d in zip(src.tolist(), dst.tolist()))  # real edges only
    per_target = torch.bincount(edge_index[1], minlength=len(n_id))
    assert per_target.max() <= max(fanout)
    first_hop = per_target[: len(seeds)]
    assert torch.equal(first_hop.clamp(max=1), g.degree(seeds).clamp(max=1))  # every seed with neighbours got some


def test_probe_matches_scikit_learn():
    from sklearn import linear_model  # the reference; the test extra installs it: its absence fails, never skips

    torch.manual_seed(0)
    x = torch.randn(400, 12)
    y = (x @ torch.randn(12, 4) + torch.randn(400, 4)).argmax(1)
    train = torch.rand(400) < 0.3
    ours = probe_accuracy(x, y, train, {"test": ~train})["test"]
    reference = (
        linear_model.LogisticRegression(max_iter=1000)
        .fit(x[train].numpy(), y[train].numpy())
        .score(x[~train].numpy(), y[~train].numpy())
    )
    assert ours == pytest.approx(reference, abs=1 / 400)


def test_probe_separates_separable_classes():
    x = torch.cat([torch.randn(50, 2) + 5, torch.randn(50, 2) - 5])
    y = torch.cat([torch.zeros(50), torch.ones(50)]).long()
    train = torch.zeros(100, dtype=torch.bool)
    train[::10] = True
    assert probe_accuracy(x, y, train, {"test": ~train})["test"] == 1.0


@pytest.mark.parametrize("levels", [None, 5], ids=["continuous", "many-ties"])
def test_auc_matches_scikit_learn(levels):
    from sklearn import metrics  # the reference; the test extra installs it: its absence fails, never skips

    g = torch.Generator().manual_seed(4)
    positive, negative = torch.randn(300, generator=g) + 0.5, torch.randn(200, generator=g)
    if levels is not None:  # few distinct scores: ties between and within the classes
        positive, negative = (positive * levels).round(), (negative * levels).round()
    labels = torch.cat([torch.ones(300), torch.zeros(200)])
    reference = metrics.roc_auc_score(labels.numpy(), torch.cat([positive, negative]).numpy())
    assert _auc(positive, negative) == pytest.approx(reference, abs=1e-12)


def test_auc_and_link_metrics_by_hand():
    assert _auc(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0.0, 2.0, 5.0])) == pytest.approx(4.5 / 9)
    edges = torch.stack([torch.arange(100), torch.arange(100) + 1], 1)  # i -- i + 1
    knows = lambda u, v: (v == u + 1).double()  # noqa: E731  (scores exactly the true edges)
    perfect = link_prediction(knows, edges, 10_000, negatives=50)
    assert perfect["auc"] == pytest.approx(1.0, abs=0.01) and perfect["mrr"] == pytest.approx(1.0, abs=0.01)
    blind = link_prediction(lambda u, v: torch.zeros(len(u)), edges, 10_000, negatives=50)  # all ties
    assert blind["auc"] == 0.5 and blind["mrr"] == pytest.approx(1 / 26)  # rank 1 + 50/2 for every edge


def in_ram_subgraph(rowptr, col, seeds, fanout):
    """The sampler as it was before graphs moved to disk (int64 CSR, a degree array of every
    node): the reference that the memory-mapped one must follow draw for draw."""
    degree = rowptr[1:] - rowptr[:-1]
    n_id, frontier, sources, targets = seeds, seeds, [], []
    for k in fanout:
        reachable = frontier[degree[frontier] > 0]
        if len(reachable) == 0:
            break
        picks = (torch.rand(len(reachable), k) * degree[reachable][:, None]).long()
        pairs = torch.unique(
            torch.stack(
                [reachable[:, None].expand(-1, k).reshape(-1), col[rowptr[reachable][:, None] + picks].reshape(-1)], 1
            ),
            dim=0,
        )
        targets.append(pairs[:, 0])
        sources.append(pairs[:, 1])
        new = torch.unique(pairs[:, 1])
        frontier = new[~torch.isin(new, n_id)]
        n_id = torch.cat([n_id, frontier])
    position = {int(g): i for i, g in enumerate(n_id)}
    local = lambda ids: torch.tensor([position[int(g)] for g in ids], dtype=torch.long)  # noqa: E731
    return n_id, torch.stack([local(torch.cat(sources)), local(torch.cat(targets))])


def test_neighbour_sampling_on_the_memory_mapped_graph_equals_the_in_ram_sampler():
    g = synthetic(nodes=1000, average_degree=5, seed=8)
    seeds = torch.unique(torch.randint(0, 1000, (64,)))
    torch.manual_seed(3)
    ours = NeighbourSampler(g.rowptr, g.col, [5, 3]).sample(seeds)
    torch.manual_seed(3)
    reference = in_ram_subgraph(g.rowptr.clone(), g.col.long(), seeds, [5, 3])
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
