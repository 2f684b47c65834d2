r"""Random walks on a CSR graph: DeepWalk's uniform ones and node2vec's biased second-order ones.

A node2vec walk at node :math:`v`, having come from :math:`t`, moves to a neighbour :math:`x`
of :math:`v` with probability proportional to

.. math::
    \alpha_{pq}(t, x) = \begin{cases} 1/p & x = t \\ 1 & x \in N(t) \\ 1/q & \text{otherwise} \end{cases}

(Grover & Leskovec, KDD 2016). The pure-torch sampler moves every walk at once: it proposes
uniform neighbours and accepts one with probability :math:`\alpha / \max(1/p, 1, 1/q)`,
redrawing for the walks that accepted none (rejection sampling, as pyg-lib does), and tests
:math:`x \in N(t)` by a vectorised binary search inside :math:`t`'s sorted neighbour list.
With :math:`p = q = 1` every proposal is accepted.
When ``pyg-lib`` is importable its compiled sampler is used instead. A node without
neighbours ends its walk by staying where it is (as pyg-lib does).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor


#: Candidate moves drawn per walk per rejection round.
PROPOSALS = 8
#: Nodes whose degrees are read at once when the largest degree is looked for.
BLOCK = 1 << 22


def pyg_lib_walks_available() -> bool:
    return importlib.util.find_spec("pyg_lib") is not None


class WalkSampler:
    """Samples walks of ``walk_length`` steps from a graph's CSR adjacency."""

    def __init__(
        self,
        rowptr: Tensor,
        col: Tensor,
        *,
        p: float = 1.0,
        q: float = 1.0,
        use_pyg_lib: bool | None = None,
        max_degree: int | None = None,
    ) -> None:
        """``rowptr`` and ``col`` may be memory-mapped and read-only: a step reads only the rows
        its walks visit (degrees come from ``rowptr`` per step, never for every node).
        ``max_degree`` (a dataset's meta has it) bounds the binary search; if not given it is
        found by a pass over ``rowptr`` in blocks."""
        self.rowptr, self.col, self.p, self.q = rowptr, col, p, q
        self.num_nodes = len(rowptr) - 1
        self.use_pyg_lib = pyg_lib_walks_available() if use_pyg_lib is None else use_pyg_lib
        if max_degree is None:
            blocks = (torch.arange(i, min(self.num_nodes, i + BLOCK)) for i in range(0, self.num_nodes, BLOCK))
            max_degree = max((int(self.degree(nodes).max()) for nodes in blocks), default=0)
        self._search_steps = int(max_degree).bit_length()
        # pyg-lib's kernel takes int64 columns: with it, an int32 col is widened once here.
        self._pyg_col = col.long() if self.use_pyg_lib else None

    def degree(self, node: Tensor) -> Tensor:
        return self.rowptr[node + 1] - self.rowptr[node]

    def walks(self, start: Tensor, walk_length: int) -> Tensor:
        """``(len(start), walk_length + 1)`` node ids, each row a walk from ``start[i]``."""
        if self.use_pyg_lib:
            import pyg_lib  # noqa: F401  (registers torch.ops.pyg)

            return torch.ops.pyg.random_walk(self.rowptr, self._pyg_col, start, walk_length, self.p, self.q)[0]
        walk = torch.empty(len(start), walk_length + 1, dtype=torch.long)
        walk[:, 0] = start
        for step in range(1, walk_length + 1):
            current = walk[:, step - 1]
            if step == 1 or (self.p == 1 and self.q == 1):
                walk[:, step] = self._uniform_neighbour(current)
            else:
                walk[:, step] = self._biased_neighbour(walk[:, step - 2], current)
        return walk

    def _uniform_neighbour(self, node: Tensor, first: Tensor | None = None, degree: Tensor | None = None) -> Tensor:
        """A uniform neighbour of each node (``first``/``degree``: its row's start and length,
        when the caller has read them already)."""
        if first is None:
            first = self.rowptr[node]
            degree = self.rowptr[node + 1] - first
        offset = (torch.rand(len(node)) * degree).long()  # uniform in [0, degree)
        stuck = degree == 0
        nxt = self.col[(first + offset).clamp_(max=max(len(self.col) - 1, 0))].long() if len(self.col) else node.clone()
        return torch.where(stuck, node, nxt)

    def _biased_neighbour(self, previous: Tensor, node: Tensor) -> Tensor:
        weight_back, weight_out = 1.0 / self.p, 1.0 / self.q
        bound = max(weight_back, 1.0, weight_out)
        chosen = torch.empty_like(node)
        pending = torch.arange(len(node))
        while len(pending):
            # PROPOSALS candidates per walk at once: the first accepted one is the walk's draw
            # (the same distribution as one proposal at a time), in fewer rounds.
            current = node[pending]
            first = self.rowptr[current]
            degree = (self.rowptr[current + 1] - first).repeat_interleave(PROPOSALS)
            t = previous[pending].repeat_interleave(PROPOSALS)
            x = self._uniform_neighbour(
                current.repeat_interleave(PROPOSALS), first.repeat_interleave(PROPOSALS), degree
            )
            weight = torch.where(x == t, weight_back, torch.where(self._is_neighbour(t, x), 1.0, weight_out))
            accept = ((torch.rand(len(x)) * bound < weight) | (degree == 0)).view(-1, PROPOSALS)
            done = accept.any(1)
            first_accepted = accept.int().argmax(1)
            chosen[pending[done]] = x.view(-1, PROPOSALS)[done, first_accepted[done]]
            pending = pending[~done]
        return chosen

    def _is_neighbour(self, t: Tensor, x: Tensor) -> Tensor:
        """Whether ``x[i]`` is a neighbour of ``t[i]``: binary search in t's sorted neighbours."""
        lo, hi = self.rowptr[t], self.rowptr[t + 1]
        end = hi.clone()
        x = x.to(self.col.dtype)  # compared with col's entries: no widening per halving
        last = max(len(self.col) - 1, 0)
        for _ in range(self._search_steps):  # enough halvings for the largest degree
            mid = (lo + hi) // 2
            right = (mid < end) & (self.col[mid.clamp(max=last)] < x)
            lo = torch.where(right, mid + 1, lo)
            hi = torch.where(right, hi, mid)
        return (lo < end) & (self.col[lo.clamp(max=last)] == x)
