"""Datasets: knowledge graphs from TSV folders, PyG's classes, or a synthetic generator, and
graphs for node embeddings from PyG's classes or a synthetic generator."""

from .graphs import Graph
from .kg import KnowledgeGraph
from .load import load_graph, load_knowledge_graph
from .paths import data_root

__all__ = ["Graph", "KnowledgeGraph", "data_root", "load_graph", "load_knowledge_graph"]
