"""Walks: every step follows an edge, and node2vec's p/q bias matches the exact probabilities."""

from __future__ import annotations

import pytest
import torch

from dsa_train.data import walks as walks_module
from dsa_train.data import load_graph
from dsa_train.data.walks import WalkSampler, pyg_lib_walks_available
from dsa_train.recipe import DatasetConfig, GraphSyntheticConfig

from .test_graph_import import brute_force_csr

# A small graph where previous node t = 0, current v = 1, and v's neighbours are:
# 0 (= t, weight 1/p), 2 and 3 (neighbours of t, weight 1), 4 and 5 (not, weight 1/q).
EDGES = torch.tensor([[0, 1], [1, 2], [1, 3], [1, 4], [1, 5], [0, 2], [0, 3], [4, 6], [5, 6]])
N = 7


def sampler(p, q, pyg_lib=False):
    rowptr, col = brute_force_csr(EDGES[:, 0], EDGES[:, 1], N)
    return WalkSampler(rowptr, col, p=p, q=q, use_pyg_lib=pyg_lib)


def exact(p, q):
    weights = torch.tensor([1 / p, 0, 1, 1, 1 / q, 1 / q, 0])
    return weights / weights.sum()


PATHS = [False] + ([True] if pyg_lib_walks_available() else [])


@pytest.mark.parametrize("pyg_lib", PATHS, ids=lambda x: "pyg-lib" if x else "pure-torch")
@pytest.mark.parametrize("p,q", [(1.0, 1.0), (0.25, 4.0), (4.0, 0.25), (2.0, 0.5)])
def test_second_step_distribution_matches_node2vec(p, q, pyg_lib):
    torch.manual_seed(0)
    s = sampler(p, q, pyg_lib)
    n = 200_000
    # walks from 0 whose first step went to 1: their second step is the biased one
    walks = s.walks(torch.zeros(n, dtype=torch.long), 2)
    second = walks[walks[:, 1] == 1, 2]
    observed = torch.bincount(second, minlength=N).double() / len(second)
    expected = exact(p, q).double()
    # 5 standard errors of a binomial proportion, per node
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / len(second)) + 1e-9
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)


@pytest.mark.parametrize("p,q", [(1.0, 1.0), (0.5, 2.0)])
def test_every_step_follows_an_edge(p, q):
    torch.manual_seed(1)
    s = sampler(p, q)
    walks = s.walks(torch.arange(N).repeat(50), 10)
    keys = set((EDGES[:, 0] * N + EDGES[:, 1]).tolist()) | set((EDGES[:, 1] * N + EDGES[:, 0]).tolist())
    steps = (walks[:, :-1] * N + walks[:, 1:]).flatten().tolist()
    assert all(k in keys for k in steps)
    assert torch.equal(walks[:, 0], torch.arange(N).repeat(50))


def test_isolated_node_stays():
    rowptr, col = brute_force_csr([0], [1], 3)  # node 2 has no neighbours
    walks = WalkSampler(rowptr, col, p=0.5, q=2).walks(torch.tensor([2, 0]), 4)
    assert walks[0].tolist() == [2, 2, 2, 2, 2] and walks[1].tolist() == [0, 1, 0, 1, 0]


class InRamWalks:
    """The sampler as it was before graphs moved to disk (int64 CSR in RAM, a degree array of
    every node): the reference that the memory-mapped one must follow draw for draw."""

    def __init__(self, rowptr, col, p, q):
        self.rowptr, self.col, self.p, self.q = rowptr, col, p, q
        self.degree = rowptr[1:] - rowptr[:-1]
        self.steps = int(self.degree.max()).bit_length()

    def walks(self, start, length):
        walk = torch.empty(len(start), length + 1, dtype=torch.long)
        walk[:, 0] = start
        for step in range(1, length + 1):
            if step == 1 or (self.p == 1 and self.q == 1):
                walk[:, step] = self.uniform(walk[:, step - 1])
            else:
                walk[:, step] = self.biased(walk[:, step - 2], walk[:, step - 1])
        return walk

    def uniform(self, node):
        degree = self.degree[node]
        offset = (torch.rand(len(node)) * degree).long()
        return torch.where(degree == 0, node, self.col[(self.rowptr[node] + offset).clamp_(max=len(self.col) - 1)])

    def biased(self, previous, node):
        bound = max(1 / self.p, 1.0, 1 / self.q)
        chosen, pending = torch.empty_like(node), torch.arange(len(node))
        while len(pending):
            t = previous[pending].repeat_interleave(walks_module.PROPOSALS)
            v = node[pending].repeat_interleave(walks_module.PROPOSALS)
            x = self.uniform(v)
            linked = torch.tensor(
                [int(b) in set(self.col[self.rowptr[a] : self.rowptr[a + 1]].tolist()) for a, b in zip(t, x)]
            )
            weight = torch.where(x == t, 1 / self.p, torch.where(linked, 1.0, 1 / self.q))
            accept = ((torch.rand(len(x)) * bound < weight) | (self.degree[v] == 0)).view(-1, walks_module.PROPOSALS)
            done, first = accept.any(1), accept.int().argmax(1)
            chosen[pending[done]] = x.view(-1, walks_module.PROPOSALS)[done, first[done]]
            pending = pending[~done]
        return chosen


@pytest.mark.parametrize("p,q", [(1.0, 1.0), (0.5, 2.0)])
def test_walks_on_the_memory_mapped_graph_equal_the_in_ram_sampler(p, q):
    """Same seed, same walks: the imported graph (int32 columns, read-only maps, degrees read
    per step) changes nothing but where the arrays live."""
    g = load_graph(
        DatasetConfig(kind="synthetic_graph", graph=GraphSyntheticConfig(nodes=300, average_degree=4, seed=4))
    )
    assert g.col.dtype == torch.int32 and not g.dataset.array("col").flags.writeable
    start = torch.arange(300).repeat(3)
    torch.manual_seed(7)
    ours = WalkSampler(g.rowptr, g.col, p=p, q=q, use_pyg_lib=False, max_degree=g.max_degree).walks(start, 8)
    torch.manual_seed(7)
    reference = InRamWalks(g.rowptr.clone(), g.col.long(), p, q).walks(start, 8)
    assert torch.equal(ours, reference)
