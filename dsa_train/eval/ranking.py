r"""Filtered link-prediction ranking: MR, MRR and Hits@1/3/10 for heads and tails.

Each test triple :math:`(h, r, t)` asks two queries, :math:`(h, r, ?)` answered by :math:`t`
and :math:`(?, r, t)` answered by :math:`h`. A query's candidates are all entities (or, for
tables too big to score, the answer plus a seeded sample of entities, as OGB does) minus
every *other* entity that makes a known true triple in any split (the "filtered" setting).
With :math:`s` the answer's score,

.. math::
    \mathrm{rank} = 1 + \frac{\#\{e : f(e) > s\} + \#\{e : f(e) \ge s\}}{2}

over the remaining candidates: the mean of the optimistic and the pessimistic rank, so ties
neither help nor hurt ("realistic" ranks). MR is the mean rank, MRR the mean of
:math:`1/\mathrm{rank}`, Hits@k the fraction of ranks :math:`\le k`.

The known true triples come from a :class:`~dsa_train.data.triple_index.TripleIndex`: per
side, (query, answer) columns sorted by the query :math:`q = \text{anchor} \cdot R +
\text{relation}`, which stays below :math:`E R < 2^{63}` (the single key
:math:`(h R + r) E + t` it replaces overflowed int64 once :math:`E^2 R \ge 2^{63}`, e.g.
:math:`E = 10^8` with more than 922 relations). A batch of queries costs two binary searches
each on that column, in RAM or memory-mapped from disk, plus the rows it finds.

Scores are computed in chunks of queries and of entities, so memory stays at
``batch_size x entity_chunk`` scores whatever the number of entities: the entity chunks are
made one at a time, never all at once. One evaluation writes every chunk's scores and
comparisons into the same two buffers (:class:`ScoreBuffers`). Matrices made and freed per
batch (the scores, a NaN-free copy, and two ``bool`` comparisons that summing cast to
``int64``: about six score matrices a batch) fragmented glibc's heap, whose mmap threshold
rises to the largest block freed: the final evaluation of a one-epoch FB15k-237 run that
trains in 300 MB peaked at 0.4 to 2 GB of anonymous memory, and now at 335 MB. The answer's score is
read from the same score matrix as its competitors' (a second pass when the entities span
several chunks), so rounding can never split a tie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..data.triple_index import TripleIndex

HITS = (1, 3, 10)


@dataclass
class RankingMetrics:
    mr: float
    mrr: float
    hits_at_1: float
    hits_at_3: float
    hits_at_10: float
    queries: int

    @classmethod
    def of(cls, ranks: Tensor) -> RankingMetrics:
        ranks = ranks.double()
        hits = [(ranks <= k).double().mean().item() if len(ranks) else float("nan") for k in HITS]
        mean = lambda t: t.mean().item() if len(t) else float("nan")  # noqa: E731
        return cls(mean(ranks), mean(1.0 / ranks), *hits, len(ranks))

    def as_dict(self) -> dict:
        return asdict(self)


# score_fn(anchor ids (B,), relation ids (B,), candidate ids (K,), side, *, out) -> (B, K) scores;
# out: a contiguous (B, K) float buffer the function may write its scores into and return
ScoreFn = Callable[..., Tensor]


class ScoreBuffers:
    """The ``(B, K)`` score matrix and comparison flags of one evaluation, reused by every
    batch and chunk (grown when a larger one is asked for, never shrunk).

    The flags are floats, 1.0 where a rival's score beats the answer's: a comparison writes
    them without a temporary and they sum without one (summing a ``bool`` matrix first casts
    all of it to ``int64``, eight bytes per score). Sums of ones are exact in ``float32`` up to
    :math:`2^{24}` candidates a chunk, and in ``float64`` beyond."""

    def __init__(self) -> None:
        self.dtype = torch.float32  # the scores' type: the score function's, once it has scored
        self._scores, self._flags = _Reused(), _Reused()

    def scores(self, rows: int, cols: int) -> Tensor:
        return self._scores.matrix(rows, cols, self.dtype)

    def flags(self, rows: int, cols: int) -> Tensor:
        return self._flags.matrix(rows, cols, torch.float32 if cols <= 2**24 else torch.float64)


class _Reused:
    """One flat buffer, handed out as matrices of any shape that fits it."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def matrix(self, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        if self.buffer.numel() < rows * cols or self.buffer.dtype != dtype:
            self.buffer = torch.empty(0)  # the old one goes before the new one comes
            self.buffer = torch.empty(rows * cols, dtype=dtype)
        return self.buffer[: rows * cols].view(rows, cols)


@torch.no_grad()
def query_ranks(
    score_fn: ScoreFn,
    anchor: Tensor,
    relation: Tensor,
    answer: Tensor,
    side: str,
    index: TripleIndex,
    *,
    num_entities: int,
    entity_chunk: int,
    sampled: Tensor | None = None,
    scope: RankingScope | None = None,
    buffers: ScoreBuffers | None = None,
) -> Tensor:
    """Realistic filtered ranks of one batch of queries (see the module docstring).

    ``sampled``: rank against these entities only (plus each query's own answer).
    ``scope``: the share of the entities this process scores, and how the processes combine
    their partial results (default: all entities, one process). ``buffers``: where scores go
    (shared by the batches of one evaluation; default: new ones).
    """
    scope = scope or RankingScope()
    buffers = buffers or ScoreBuffers()
    scope.prepare(anchor)
    known_query, known_entity = index.known(anchor, relation, side)
    rows = torch.arange(len(anchor))
    if sampled is None:
        single = scope.chunk_count(num_entities, entity_chunk) <= 1

        def chunks():  # one chunk at a time: a list of them all would be O(E) per batch
            for chunk in scope.chunks(num_entities, entity_chunk):
                yield chunk, None
    else:  # one candidate set: the sample and the answers, each answer visible to its own query only
        single = True
        sampled = torch.unique(sampled)
        candidates = scope.mine(torch.unique(torch.cat([sampled, answer])))
        sample_mask = torch.isin(candidates, sampled)

        def chunks():
            yield candidates, sample_mask

    true = torch.full((len(anchor),), float("-inf"))
    for chunk, _ in chunks():  # the answer's score, from the matrix its competitors come from
        scores = _scores(score_fn, anchor, relation, chunk, side, buffers)
        true = true.to(scores.dtype)
        found, position = _locate(chunk, answer)
        true[found] = scores[rows[found], position[found]]
    true = scope.combine(true, "max")  # each answer is scored by the one process that has it
    true = torch.where(true == float("inf"), float("-inf"), true)  # a NaN answer (made +inf) ranks last
    greater = torch.zeros(len(anchor), dtype=torch.float64)  # counts, exact to 2^53
    at_least = torch.zeros(len(anchor), dtype=torch.float64)
    for chunk, sample_mask in chunks():
        if not single:
            scores = _scores(score_fn, anchor, relation, chunk, side, buffers)
        # Excluded columns become NaN, which compares false with everything (real NaN scores
        # were made +inf by _scores).
        found, position = _locate(chunk, answer)
        scores[rows[found], position[found]] = float("nan")  # the answer is not its own rival
        if sample_mask is not None:
            scores[:, ~sample_mask] = float("nan")  # other queries' answers were not sampled
        found, position = _locate(chunk, known_entity)
        scores[known_query[found], position[found]] = float("nan")  # filtered: other true answers
        flags = buffers.flags(*scores.shape)
        greater += torch.gt(scores, true[:, None], out=flags).sum(1)
        at_least += torch.ge(scores, true[:, None], out=flags).sum(1)
    greater, at_least = scope.combine(greater, "sum"), scope.combine(at_least, "sum")
    return 1 + (greater + at_least) / 2


class RankingScope:
    """Which entities this process scores, and how processes that each score a share combine
    their partial results (:class:`~dsa_train.train.sharded_kge.ShardedKGETask` scores each
    entity on the rank that holds its row). The default: every entity, one process."""

    def __init__(self, owned: Tensor | None = None) -> None:
        self.owned = owned  # sorted ids of the entities this process scores (None: all)

    def chunk_count(self, num_entities: int, entity_chunk: int) -> int:
        total = num_entities if self.owned is None else len(self.owned)
        return -(-total // entity_chunk)

    def chunks(self, num_entities: int, entity_chunk: int):
        if self.owned is None:
            for s in range(0, num_entities, entity_chunk):
                yield torch.arange(s, min(s + entity_chunk, num_entities))
        else:
            yield from torch.split(self.owned, entity_chunk)

    def prepare(self, anchor: Tensor) -> None:
        """A batch of queries with these anchor ids is about to be scored."""

    def mine(self, candidates: Tensor) -> Tensor:
        return candidates if self.owned is None else candidates[torch.isin(candidates, self.owned)]

    def combine(self, partial: Tensor, op: str) -> Tensor:
        """The result over all processes of every process's ``partial`` (``op``: "max" or "sum")."""
        return partial


def _scores(
    score_fn: ScoreFn, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str, buffers: ScoreBuffers
) -> Tensor:
    """The ``(B, K)`` scores in host memory, in ``buffers`` wherever the function or a copy can
    put them, NaN made +inf (a NaN rival beats the answer)."""
    scores = score_fn(anchor, relation, candidates, side, out=buffers.scores(len(anchor), len(candidates)))
    buffers.dtype = scores.dtype
    if scores.device.type != "cpu":  # an accelerator's scores come back into the buffer
        scores = buffers.scores(len(anchor), len(candidates)).copy_(scores)
    return scores.nan_to_num_(nan=float("inf"))


def _locate(sorted_candidates: Tensor, entities: Tensor) -> tuple[Tensor, Tensor]:
    """Which ``entities`` are among the candidates, and at which column."""
    position = torch.searchsorted(sorted_candidates, entities.contiguous()).clamp_(max=len(sorted_candidates) - 1)
    return sorted_candidates[position] == entities, position


def evaluate_link_prediction(
    score_fn: ScoreFn,
    triples: Tensor,
    index: TripleIndex,
    *,
    num_entities: int,
    batch_size: int = 256,
    entity_chunk: int = 65_536,
    sampled_negatives: int | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    scope: RankingScope | None = None,
    ranks_out: dict[str, Tensor] | None = None,
) -> dict[str, RankingMetrics]:
    """Filtered ranking metrics of ``triples`` for tail queries, head queries and both.

    ``progress(n)`` is called after every batch with the number of queries it ranked;
    ``ranks_out``, if given, receives each query's rank (``"tail"`` and ``"head"``, in the
    order of ``triples``).
    """
    generator = torch.Generator().manual_seed(seed)
    buffers = ScoreBuffers()
    ranks = {}
    for side in ("tail", "head"):
        anchor, answer = (triples[:, 0], triples[:, 2]) if side == "tail" else (triples[:, 2], triples[:, 0])
        found = []
        for start in range(0, len(triples), batch_size):
            window = slice(start, start + batch_size)
            sampled = None
            if sampled_negatives is not None:
                sampled = torch.randint(0, num_entities, (sampled_negatives,), generator=generator)
            found.append(
                query_ranks(
                    score_fn,
                    anchor[window],
                    triples[window, 1],
                    answer[window],
                    side,
                    index,
                    num_entities=num_entities,
                    entity_chunk=entity_chunk,
                    sampled=sampled,
                    scope=scope,
                    buffers=buffers,
                )
            )
            if progress is not None:
                progress(len(found[-1]))
        ranks[side] = torch.cat(found) if found else torch.empty(0)
    if ranks_out is not None:
        ranks_out.update(ranks)
    ranks["both"] = torch.cat([ranks["tail"], ranks["head"]])
    return {side: RankingMetrics.of(r) for side, r in ranks.items()}
