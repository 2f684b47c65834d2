"""Evaluation: filtered link-prediction ranking metrics."""

from .ranking import RankingMetrics, TripleIndex, evaluate_link_prediction

__all__ = ["RankingMetrics", "TripleIndex", "evaluate_link_prediction"]
