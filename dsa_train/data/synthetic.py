r"""A seeded synthetic knowledge graph that scales to 10^8 entities.

Entity popularity follows a power law: the entity of popularity rank :math:`k` is drawn with
probability :math:`\propto (k + 1)^{-s}` (``zipf`` = :math:`s`), and ranks are scattered over
the ids by the bijection :math:`k \mapsto (a k + c) \bmod N`, so hot entities are not
neighbours. Entity :math:`e` belongs to cluster :math:`e \bmod C`; each relation maps the
head's cluster to a tail cluster through its own random permutation of the clusters, and the
tail is a popular entity of that cluster (or, with probability ``noise``, any entity). Models
can learn the maps, so link prediction is far better than chance.

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
    cluster_maps = torch.stack([torch.randperm(clusters, generator=generator) for _ in range(config.relations)])
    keys = []
    for start in range(0, config.triples, CHUNK):
        count = min(CHUNK, config.triples - start)
        relation = torch.randint(0, config.relations, (count,), generator=generator)
        head = power_law_ids(n, count, generator, config.zipf)
        tail = power_law_ids(n, count, generator, config.zipf)
        tail = tail - tail % clusters + cluster_maps[relation, head % clusters]
        tail = torch.where(tail >= n, tail - clusters, tail)
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
