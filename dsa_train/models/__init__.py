"""Embedding models: knowledge-graph scoring functions (TransE, DistMult, ComplEx, RotatE and
whatever else :mod:`.scoring` holds) over sparse entity and relation tables; skip-gram and SAGE
for graphs; DLRM for click logs."""

from .kge import SCORING_FUNCTIONS, KGEModel
from .scoring import build_kge_model
from .scoring.complex import ComplEx
from .scoring.distmult import DistMult
from .scoring.rotate import RotatE
from .scoring.transe import TransE

__all__ = ["SCORING_FUNCTIONS", "ComplEx", "DistMult", "KGEModel", "RotatE", "TransE", "build_kge_model"]
