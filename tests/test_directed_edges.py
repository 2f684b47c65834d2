"""Directed edge lists (``dataset.edges.directed: true``): the CSR holds each edge in its
source's row only, walks follow edges one way and stay at a node without out-edges (as PyG's
Node2Vec does through pyg-lib's random_walk), held-out edges keep their direction, and
GraphSAGE refuses a directed graph by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsa_train.data.walks import WalkSampler
from dsa_train.errors import ConfigError
from dsa_train.recipe import parse_recipe

from .test_edge_list import graph_of
from .test_graph_import import pairs_of

#: a directed graph whose walks can only go one way: a -> {b, c} -> d -> e, and e a sink;
#: f -> a joins in, and b -> c crosses (but c never goes back to b)
EDGES = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "e"), ("f", "a"), ("b", "c"), ("a", "b"), ("d", "d")]


def directed_pairs(graph) -> set[tuple[str, str]]:
    names = graph.node_names(range(graph.num_nodes))
    return {(names[a], names[b]) for a, b in pairs_of(graph.rowptr, graph.col)}


def test_the_csr_holds_each_edge_in_its_source_row_only(tmp_path):
    path = tmp_path / "dag.txt"
    path.write_text("".join(f"{a} {b}\n" for a, b in EDGES))
    graph = graph_of(path, directed=True)
    expected = {e for e in EDGES if e[0] != e[1]}  # the repeat kept once, the self-loop dropped
    assert graph.directed and directed_pairs(graph) == expected
    assert graph.num_edges == len(graph.col) == 7 and graph.dataset.meta["num_edges"] == 7
    ids = dict(zip("abcdef", graph.node_ids(list("abcdef"))))
    assert graph.degree(torch.tensor([ids["e"], ids["a"]])).tolist() == [0, 2]  # out-degrees
    undirected = graph_of(path)
    assert not undirected.directed and undirected.num_edges == 7 and len(undirected.col) == 14


@pytest.mark.parametrize("p,q", [(1.0, 1.0), (0.25, 4.0), (4.0, 0.25)])
def test_walks_never_step_against_an_edge_and_stay_at_a_sink(tmp_path, p, q):
    path = tmp_path / "dag.txt"
    path.write_text("".join(f"{a} {b}\n" for a, b in EDGES))
    graph = graph_of(path, directed=True)
    names = graph.node_names(range(graph.num_nodes))
    torch.manual_seed(0)
    sampler = WalkSampler(graph.rowptr, graph.col, p=p, q=q, use_pyg_lib=False, max_degree=graph.max_degree)
    walks = sampler.walks(torch.arange(graph.num_nodes).repeat(200), 6)
    steps = {
        (names[x], names[y]) for x, y in zip(walks[:, :-1].reshape(-1).tolist(), walks[:, 1:].reshape(-1).tolist())
    }
    edges = {e for e in EDGES if e[0] != e[1]}
    assert steps == edges | {("e", "e")}  # every step is an edge, forward; only the sink stays; every edge is walked
    e = names.index("e")
    reached = walks[:, 1:] == e
    assert (walks[:, 1:][reached.cumsum(1) > 0] == e).all()  # once at e, a walk stays there


def test_held_out_edges_keep_their_direction(tmp_path):
    """A ring of 300 edges i -> i + 1 and 100 reverse edges i + 1 -> i: every edge is in the
    adjacency or held out (as given, never reversed), never both."""
    path = tmp_path / "ring.txt"
    forward = [(i, (i + 1) % 300) for i in range(300)]
    backward = [(b, a) for a, b in forward[:100]]
    path.write_text("".join(f"{a} {b}\n" for a, b in forward + backward))
    from dsa_train.data import load_graph
    from dsa_train.recipe import DatasetConfig, EdgeListConfig

    graph = load_graph(
        DatasetConfig(
            kind="edge_list", path=str(path), link_split=(0.1, 0.2), edges=EdgeListConfig(ids="integers", directed=True)
        )
    )
    held = [tuple(e) for e in torch.cat([graph.valid_edges, graph.test_edges]).tolist()]
    adjacency = pairs_of(graph.rowptr, graph.col)
    assert sorted(held + list(adjacency)) == sorted(forward + backward)
    assert graph.num_edges + len(held) == 400 and 60 < len(held) < 180
    assert any(a > b for a, b in held)  # not rewritten as u < v
    valid = graph.valid_edges.long()
    assert torch.equal(valid[:, 0], valid[:, 0].sort().values)


def test_sage_refuses_a_directed_graph():
    text = """
dataset: {kind: edge_list, path: e.txt, edges: {directed: true}, link_split: [0.1, 0.1]}
model: {kind: sage}
"""
    with pytest.raises(
        ConfigError, match=r"dataset.edges.directed \(line 2\): graphsage aggregates over undirected neighbourhoods"
    ):
        parse_recipe(text)
    parse_recipe(text.replace("sage", "node2vec"))  # node2vec reads it


def test_undirected_import_is_unchanged(tmp_path):
    """The same file read undirected holds both directions of every edge (the form the
    existing tests pin bit for bit)."""
    rng = np.random.default_rng(2)
    u, v = rng.integers(0, 50, 300), rng.integers(0, 50, 300)
    path = tmp_path / "r.txt"
    path.write_text("".join(f"{a} {b}\n" for a, b in zip(u, v)))
    graph = graph_of(path, ids="integers")
    pairs = set(pairs_of(graph.rowptr, graph.col))
    assert pairs == {(a, b) for a, b in zip(u.tolist(), v.tolist()) if a != b} | {
        (b, a) for a, b in zip(u.tolist(), v.tolist()) if a != b
    }
