"""Datasets: knowledge graphs from TSV folders, PyG's classes, or a synthetic generator."""

from .kg import KnowledgeGraph, data_root, load_knowledge_graph

__all__ = ["KnowledgeGraph", "data_root", "load_knowledge_graph"]
