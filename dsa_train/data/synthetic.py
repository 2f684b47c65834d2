r"""A seeded synthetic knowledge graph that scales to 10^8 entities.

Entity popularity follows a power law: the entity of popularity rank :math:`k` is drawn with
probability :math:`\propto (k + 1)^{-s}` (``zipf`` = :math:`s`), and ranks are scattered over
the ids by the bijection :math:`k \mapsto (a k + c) \bmod N`, so hot entities are not
neighbours. Entity :math:`e` belongs to cluster :math:`e \bmod C`. Each relation links a
random source cluster to a random target cluster: its heads are popular entities of the
source cluster and its tails popular entities of the target cluster (with probability
``noise``, any entity). Like the typed relations of real knowledge graphs, this is
something TransE and DistMult can learn, so link prediction is far better than chance.

Triples are generated in chunks and kept only as index tensors: 10^7 entities with 3 x 10^7
triples take about 1 GB at peak.
"""

from __future__ import annotations

import math

import torch

from ..recipe import SyntheticConfig
from .kg import KnowledgeGraph

CHUNK = 1 << 20


def power_law_ids(num_ids: int, count: int, generator: torch.Generator, zipf: float) -> torch.Tensor:
    """``count`` ids in ``[0, num_ids)``, power-law distributed, hot ids scattered."""
    if zipf == 0:
        return torch.randint(0, num_ids, (count,), generator=generator)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    if abs(zipf - 1.0) < 1e-9:
        ranks = torch.exp(u * math.log(num_ids + 1)).floor_() - 1
    else:  # inverse CDF of the continuous power law on [1, N + 1)
        top = (num_ids + 1) ** (1 - zipf)
        ranks = ((top - 1) * u + 1).pow(1 / (1 - zipf)).floor_() - 1
    ranks = ranks.long().clamp_(0, num_ids - 1)
    a = 2654435761
    while math.gcd(a, num_ids) != 1:
        a += 2
    return (ranks * a + 12345) % num_ids


def generate_knowledge_graph(config: SyntheticConfig) -> KnowledgeGraph:
    generator = torch.Generator().manual_seed(config.seed)
    n, clusters = config.entities, min(config.clusters, config.entities)
    source = torch.randint(0, clusters, (config.relations,), generator=generator)
    target = torch.randint(0, clusters, (config.relations,), generator=generator)
    keys = []
    for start in range(0, config.triples, CHUNK):
        count = min(CHUNK, config.triples - start)
        relation = torch.randint(0, config.relations, (count,), generator=generator)
        head = _into_cluster(power_law_ids(n, count, generator, config.zipf), source[relation], clusters, n)
        tail = _into_cluster(power_law_ids(n, count, generator, config.zipf), target[relation], clusters, n)
        noisy = torch.rand(count, generator=generator) < config.noise
        tail[noisy] = torch.randint(0, n, (int(noisy.sum()),), generator=generator)
        keys.append((head * config.relations + relation) * n + tail)
    unique = torch.unique(torch.cat(keys))  # duplicates collapse; a fact is a fact once
    del keys
    unique = unique[torch.randperm(len(unique), generator=generator)]
    triples = torch.stack([unique // (config.relations * n), unique // n % config.relations, unique % n], dim=1)
    held_out = config.valid + config.test
    train, valid, test = triples[held_out:], triples[: config.valid], triples[config.valid : held_out]
    return KnowledgeGraph(f"synthetic-{n}", n, config.relations, train, valid, test)


def _into_cluster(ids: torch.Tensor, cluster: torch.Tensor, clusters: int, n: int) -> torch.Tensor:
    """Move each id to the given cluster (id mod clusters), keeping it near its popularity."""
    moved = ids - ids % clusters + cluster
    return torch.where(moved >= n, moved - clusters, moved)
