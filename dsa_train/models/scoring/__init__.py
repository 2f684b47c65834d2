"""Knowledge-graph scoring functions: one module each, registered in
:data:`~dsa_train.models.kge.SCORING_FUNCTIONS` as it is imported.

Importing this package imports every module in it, so a new scoring function is one module
here (a :class:`~dsa_train.models.kge.KGEModel` subclass with ``@SCORING_FUNCTIONS.register_as``)
and nothing else: the recipe's choices and checks, the memory sizing, sharded training, export
and neighbour search read what its class declares. The shipped ones come first, in the order
the docs list them.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch

from ..kge import SCORING_FUNCTIONS, KGEModel

SHIPPED = ("transe", "distmult", "complex", "rotate")

for _module in (*SHIPPED, *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in SHIPPED)):
    importlib.import_module(f"{__name__}.{_module}")


def build_kge_model(
    config, num_entities: int, num_relations: int, entity_table: torch.nn.Module | None = None
) -> KGEModel:
    """The scoring function ``config.kind`` (a recipe's ``model`` section) over ``num_entities``
    entities and ``num_relations`` relations; ``entity_table``: an initialised entity table to
    use instead of an ``nn.Embedding`` (a disk table)."""
    cls = SCORING_FUNCTIONS.get(config.kind)
    common = dict(
        reciprocal=config.reciprocal,
        init_std=config.init_std,
        dropout=config.dropout,
        relation_dropout=config.relation_dropout,
        normalize_entities=config.normalize_entities,
        entity_table=entity_table,
    )
    options = {key: getattr(config, key) for key in cls.options}
    return cls(num_entities, num_relations, config.dim, **options, **common)


__all__ = ["SCORING_FUNCTIONS", "build_kge_model"]
