"""Embedding models: TransE, DistMult, ComplEx and RotatE over sparse entity and relation tables; skip-gram and SAGE for graphs."""

from .kge import ComplEx, DistMult, KGEModel, RotatE, TransE, build_kge_model

__all__ = ["ComplEx", "DistMult", "KGEModel", "RotatE", "TransE", "build_kge_model"]
