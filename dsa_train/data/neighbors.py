"""Uniform neighbour sampling for mini-batch GNN training, in pure torch.

:class:`NeighbourSampler` has a fan-out per hop; its ``sample`` takes seed nodes, samples
that many neighbours of every frontier node (uniformly, with replacement, repeats dropped; all of them when a node
has fewer), and returns the union as a subgraph: the global ids of its nodes (seeds first,
in order) and its edges in local ids, flowing from neighbour to target. Only the sampled
nodes' embedding rows are then looked up, so a step touches O(batch x fan-out) rows.

PyG's ``NeighborSampler`` (with pyg-lib or torch-sparse) is not used: it takes the whole graph
as an in-memory ``edge_index`` and builds its own CSC copy of it, while this one reads the
(memory-mapped) CSR rows of the frontier only, and draws the same neighbours for the same
seed whatever optional packages are installed.
"""

from __future__ import annotations

import torch
from torch import Tensor


class NeighbourSampler:
    """Samples subgraphs of one CSR graph (``rowptr``, ``col``: possibly memory-mapped and
    read-only) with ``fanout[i]`` neighbours per node at hop ``i``. A step reads the degrees
    and neighbours of its frontier nodes only."""

    def __init__(self, rowptr: Tensor, col: Tensor, fanout: list[int]) -> None:
        self.rowptr, self.col, self.fanout = rowptr, col, list(fanout)

    def sample(self, seeds: Tensor) -> tuple[Tensor, Tensor]:
        """``(n_id, edge_index)``: the sampled nodes (seeds first) and local-id edges (2, E)."""
        rowptr, col = self.rowptr, self.col
        n_id = seeds
        frontier = seeds
        sources, targets = [], []
        for k in self.fanout:
            degree = rowptr[frontier + 1] - rowptr[frontier]
            reachable = frontier[degree > 0]
            if len(reachable) == 0:
                break
            deg = degree[degree > 0]
            picks = (torch.rand(len(reachable), k) * deg[:, None]).long()  # uniform in [0, degree)
            neighbours = col[rowptr[reachable][:, None] + picks].long()
            pairs = torch.unique(
                torch.stack([reachable[:, None].expand(-1, k).reshape(-1), neighbours.reshape(-1)], 1), dim=0
            )
            targets.append(pairs[:, 0])
            sources.append(pairs[:, 1])
            new = torch.unique(pairs[:, 1])
            new = new[~torch.isin(new, n_id)]
            n_id = torch.cat([n_id, new])
            frontier = new
        if not sources:
            return n_id, torch.empty(2, 0, dtype=torch.long)
        order = torch.argsort(n_id)
        local = lambda g: order[torch.searchsorted(n_id[order], g)]  # noqa: E731  (global id -> position in n_id)
        return n_id, torch.stack([local(torch.cat(sources)), local(torch.cat(targets))])
