"""Walks: every step follows an edge, and node2vec's p/q bias matches the exact probabilities."""

from __future__ import annotations

import pytest
import torch

from dsa_train.data.graphs import csr_from_edges
from dsa_train.data.walks import WalkSampler, pyg_lib_walks_available

# A small graph where previous node t = 0, current v = 1, and v's neighbours are:
# 0 (= t, weight 1/p), 2 and 3 (neighbours of t, weight 1), 4 and 5 (not, weight 1/q).
EDGES = torch.tensor([[0, 1], [1, 2], [1, 3], [1, 4], [1, 5], [0, 2], [0, 3], [4, 6], [5, 6]])
N = 7


def sampler(p, q, pyg_lib=False):
    rowptr, col = csr_from_edges(EDGES, N)
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
    rowptr, col = csr_from_edges(torch.tensor([[0, 1]]), 3)  # node 2 has no neighbours
    walks = WalkSampler(rowptr, col, p=0.5, q=2).walks(torch.tensor([2, 0]), 4)
    assert walks[0].tolist() == [2, 2, 2, 2, 2] and walks[1].tolist() == [0, 1, 0, 1, 0]
