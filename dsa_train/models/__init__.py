"""Embedding models: TransE and DistMult over sparse entity and relation tables."""

from .kge import DistMult, KGEModel, TransE, build_kge_model

__all__ = ["DistMult", "KGEModel", "TransE", "build_kge_model"]
