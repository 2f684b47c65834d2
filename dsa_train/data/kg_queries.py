r"""The distinct queries of a triple set, each with all its answers: k-vs-all's training items.

k-vs-all training (``train.labels: all``) asks each distinct tail query :math:`(h, r, ?)` and
head query :math:`(?, r, t)` of the training split once per epoch, labelled with every answer
the split gives it, rather than each triple's two queries with one answer each. The queries
are the distinct keys of a :class:`~dsa_train.data.triple_index.TripleIndex` of the training
triples (tail side first, then head side); its :meth:`~TripleIndex.known` finds their answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .triple_index import TripleIndex


@dataclass
class QueryBatch:
    """A batch of queries: tail queries ``(anchor, relation, ?)`` first (``tails`` of them),
    then head queries ``(?, relation, anchor)``; each label is a pair (query number, entity)."""

    anchors: Tensor
    relations: Tensor
    tails: int
    label_query: Tensor
    label_entity: Tensor

    def sides(self) -> tuple[tuple[str, slice], tuple[str, slice]]:
        """Each side with the slice of its queries: the tail queries, then the head queries."""
        return ("tail", slice(0, self.tails)), ("head", slice(self.tails, len(self.anchors)))


class DistinctQueries:
    """Every distinct query of ``triples`` (``(M, 3)`` head, relation, tail ids), numbered from
    0: the tail queries in key order, then the head queries."""

    def __init__(self, triples: Tensor, num_entities: int, num_relations: int) -> None:
        self.index = TripleIndex.from_triples(triples.long(), num_entities, num_relations)
        self.num_relations = num_relations
        self.keys = {side: self.index.queries(side) for side in ("tail", "head")}

    def __len__(self) -> int:
        return len(self.keys["tail"]) + len(self.keys["head"])

    def batch(self, picked: Tensor) -> QueryBatch:
        """The queries numbered ``picked`` with all their answers."""
        picked = picked.long().cpu()
        tail_count = len(self.keys["tail"])
        chosen = {"tail": picked[picked < tail_count], "head": picked[picked >= tail_count] - tail_count}
        anchors, relations, label_query, label_entity, offset = [], [], [], [], 0
        for side in ("tail", "head"):
            key = self.keys[side][chosen[side]]
            anchor, relation = key // self.num_relations, key % self.num_relations
            query, entity = self.index.known(anchor, relation, side)
            anchors.append(anchor)
            relations.append(relation)
            label_query.append(query + offset)
            label_entity.append(entity)
            offset += len(key)
        return QueryBatch(
            torch.cat(anchors),
            torch.cat(relations),
            len(chosen["tail"]),
            torch.cat(label_query),
            torch.cat(label_entity),
        )
