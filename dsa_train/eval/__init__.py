"""Evaluation: filtered link-prediction ranking metrics."""

from ..data.triple_index import TripleIndex  # its home is the data layer; callers import it from here too
from .ranking import RankingMetrics, evaluate_link_prediction

__all__ = ["RankingMetrics", "TripleIndex", "evaluate_link_prediction"]
