"""Uniform neighbour sampling for mini-batch GNN training, in pure torch.

``sample_subgraph`` takes seed nodes and a fan-out per hop, samples that many neighbours of
every frontier node (uniformly, with replacement, repeats dropped; all of them when a node
has fewer), and returns the union as a subgraph: the global ids of its nodes (seeds first,
in order) and its edges in local ids, flowing from neighbour to target. Only the sampled
nodes' embedding rows are then looked up, so a step touches O(batch x fan-out) rows.

When pyg-lib or torch-sparse is importable, PyG's own ``NeighborSampler`` (the sampler behind
its ``NeighborLoader``) draws the neighbours instead, without replacement.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor


def pyg_sampler_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse"))


def sample_subgraph(rowptr: Tensor, col: Tensor, seeds: Tensor, fanout: list[int], *, use_pyg: bool | None = None) -> tuple[Tensor, Tensor]:
    """``(n_id, edge_index)``: the sampled nodes (seeds first) and local-id edges (2, E)."""
    if use_pyg if use_pyg is not None else pyg_sampler_available():
        return _pyg_subgraph(rowptr, col, seeds, fanout)
    degree = rowptr[1:] - rowptr[:-1]
    n_id = seeds
    frontier = seeds
    sources, targets = [], []
    for k in fanout:
        reachable = frontier[degree[frontier] > 0]
        if len(reachable) == 0:
            break
        deg = degree[reachable]
        picks = (torch.rand(len(reachable), k) * deg[:, None]).long()  # uniform in [0, degree)
        neighbours = col[rowptr[reachable][:, None] + picks]
        pairs = torch.unique(torch.stack([reachable[:, None].expand(-1, k).reshape(-1), neighbours.reshape(-1)], 1), dim=0)
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


def _pyg_subgraph(rowptr: Tensor, col: Tensor, seeds: Tensor, fanout: list[int]) -> tuple[Tensor, Tensor]:
    from torch_geometric.data import Data
    from torch_geometric.sampler import NeighborSampler, NodeSamplerInput

    num_nodes = len(rowptr) - 1
    rows = torch.repeat_interleave(torch.arange(num_nodes), rowptr[1:] - rowptr[:-1])
    sampler = NeighborSampler(Data(edge_index=torch.stack([col, rows]), num_nodes=num_nodes), num_neighbors=fanout)
    out = sampler.sample_from_nodes(NodeSamplerInput(input_id=None, node=seeds))
    return out.node, torch.stack([out.row, out.col])
