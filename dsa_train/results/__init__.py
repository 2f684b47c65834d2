"""What a finished run gives back: its tables, names, scores and neighbours
(:func:`open_run`, approximate ones through an :class:`AnnIndex`), and files other tools read (:func:`export_run`)."""

from .ann import AnnIndex
from .export import FORMATS, export_run
from .reader import Answer, TrainedRun, open_run

__all__ = ["FORMATS", "AnnIndex", "Answer", "TrainedRun", "export_run", "open_run"]
