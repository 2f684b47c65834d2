"""Datasets: knowledge graphs from TSV folders, PyG's classes, or a synthetic generator;
graphs for node embeddings from PyG's classes or a synthetic generator; click logs for
recommenders from TSV/CSV files or a synthetic generator."""

from .clicks import ClickLog
from .graphs import Graph
from .kg import KnowledgeGraph
from .load import load_click_log, load_graph, load_knowledge_graph
from .paths import data_root

__all__ = ["ClickLog", "Graph", "KnowledgeGraph", "data_root", "load_click_log", "load_graph", "load_knowledge_graph"]
