"""The entry points that load the dataset a recipe names: :func:`load_knowledge_graph` and
:func:`load_graph`, each importing (or generating) it first if it has not been, or if its
sources changed.

Every dataset (a TSV folder, a PyG dataset, a generated one) is imported once into the
on-disk dataset format (:mod:`.store`) in its folder under ``<data root>/imported/``
(:mod:`.paths`) and mapped from there by every later run, ``--resume`` or ``eval``, as a
:class:`~.kg.KnowledgeGraph` or a :class:`~.graphs.Graph`. Each kind of dataset's loader
lives in its own module (:mod:`.tsv_import`, :mod:`.synthetic`, :mod:`.pyg` for knowledge
graphs; :mod:`.graph_synthetic`, :mod:`.graph_pyg` for graphs; :mod:`.clicks_import`,
:mod:`.clicks_synthetic` for click logs, a :class:`~.clicks.ClickLog`); this module picks one by
``dataset.kind`` and names what the import is made from. The loaders are referred to
through their modules (both generators have a ``GENERATOR_VERSION``); ``torch_geometric``
is imported inside the PyG loaders only, when a PyG dataset is read.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial

from ..errors import DatasetError
from ..progress import work
from ..recipe import DatasetConfig
from . import (
    clicks_import,
    clicks_synthetic,
    edge_import,
    graph_import,
    graph_pyg,
    graph_synthetic,
    ogb_import,
    pyg,
    remote,
    synthetic,
    tsv,
    tsv_import,
)
from .clicks import ClickLog
from .graphs import Graph
from .kg import FILTER_INDEX, LAYOUT, KnowledgeGraph
from .paths import data_root, dataset_path, import_target, places_looked
from .store import SPLITS, DatasetWriter, file_sources, import_folder
from .triple_index import write_triple_index


def load_knowledge_graph(config: DatasetConfig) -> KnowledgeGraph:
    """Load the knowledge graph a recipe names, importing (or generating) it first if it has
    not been, or if its sources changed. Raises ``DatasetError``."""
    name, target, sources, write = _knowledge_graph_source(config)
    sources = {**sources, "layout": LAYOUT}

    def build(writer: DatasetWriter) -> None:
        write(writer)

        def chunks():
            for split in SPLITS:
                yield from writer.blocks(split)

        work("building the filter index", 0, 1)
        write_triple_index(writer.path(FILTER_INDEX), chunks, writer.meta["num_entities"], writer.meta["num_relations"])
        work("building the filter index", 1, 1)

    dataset = import_folder(target, kind="kg", name=name, sources=sources, build=build)
    return KnowledgeGraph.of(dataset)


def _knowledge_graph_source(config: DatasetConfig):
    """The dataset's name, import folder, sources, and the function that writes it."""
    if config.kind == "synthetic":
        settings = asdict(config.synthetic)
        sources = {"generator": f"synthetic-{synthetic.GENERATOR_VERSION}", "settings": settings}
        write = partial(synthetic.write_synthetic_knowledge_graph, config=config.synthetic)
        return f"synthetic-{config.synthetic.entities}", import_target(config, "synthetic", sources), sources, write
    if config.kind == "tsv":
        if config.fetch and not config.path:  # by name: its folder under the data root, downloaded if missing
            folder = remote.fetch(config.fetch, data_root(config))
            files = tsv.tsv_files(folder)
        else:
            folder = dataset_path(config, config.path)
            files = tsv.tsv_files(folder, looked=places_looked(config, config.path))
        delimiter, header = tsv.triple_format(
            files[0], delimiter=config.triples.delimiter, header=config.triples.header
        )
        form = (
            {} if (delimiter, header) == ("\t", False) else {"delimiter": delimiter, "header": header}
        )  # the plain form's sources as before
        sources = file_sources(files, importer=f"tsv-{tsv_import.IMPORTER_VERSION}", **form)
        write = partial(tsv_import.write_knowledge_graph, files=files, delimiter=delimiter, header=header)
        return folder.name, import_target(config, f"tsv-{folder.name}", str(folder.resolve())), sources, write
    if config.kind == "ogbl":  # OGB's zip, by name: downloaded on first use, its files taken out of it
        folder = remote.fetch(config.fetch, data_root(config))
        files = ogb_import.ogb_files(config.fetch, folder)
        sources = file_sources(files, importer=f"ogbl-{ogb_import.IMPORTER_VERSION}")
        write = partial(ogb_import.write_ogbl, name=config.fetch, folder=folder)
        return config.fetch, import_target(config, config.fetch, str(folder.resolve())), sources, write
    name, files, write = pyg.pyg_source(config.kind, data_root(config))
    sources = file_sources(files, importer="pyg-1")
    return name, import_target(config, config.kind, config.kind), sources, write


def load_graph(config: DatasetConfig) -> Graph:
    """Load the graph a recipe names, importing (or generating) it first if it has not been,
    or if its sources changed (other generator settings, files or ``link_split``). Raises
    ``DatasetError``."""
    name, target, sources, write = _graph_source(config)
    return Graph.of(import_folder(target, kind="graph", name=name, sources=sources, build=write))


def _graph_source(config: DatasetConfig):
    """The graph's name, import folder, sources, and the function that writes it. The held-out
    edges depend on ``link_split`` and the seed: they are sources too (a new split re-imports
    into the same folder)."""
    split = {
        "link_split": [float(f) for f in config.link_split],
        "split_seed": config.graph.seed,
        "importer": f"graph-{graph_import.IMPORTER_VERSION}",
    }
    link = {"link_split": tuple(config.link_split), "seed": config.graph.seed}
    if config.kind == "synthetic_graph":
        identity = {
            "generator": f"synthetic_graph-{graph_synthetic.GENERATOR_VERSION}",
            "settings": asdict(config.graph),
        }
        write = partial(graph_synthetic.write_synthetic_graph, config=config.graph, link_split=link["link_split"])
        return (
            f"sbm-{config.graph.nodes}",
            import_target(config, "synthetic-graph", identity),
            {**identity, **split},
            write,
        )
    if config.kind == "karate":
        sources = {"dataset": "KarateClub", "torch_geometric": graph_pyg.torch_geometric_version(), **split}
        return "KarateClub", import_target(config, "karate", "karate"), sources, partial(graph_pyg.write_karate, **link)
    root = data_root(config)
    if config.kind == "edge_list":
        path = dataset_path(config, config.path)
        files = edge_import.edge_files(path, looked=places_looked(config, config.path))
        labels = None
        if config.labels:
            labels = dataset_path(config, config.labels)
            if not labels.is_file():
                raise DatasetError(
                    f"labels file '{config.labels}' does not exist: looked in {places_looked(config, config.labels)}",
                    hint="check dataset.labels (node<TAB>label lines), or leave it out",
                )
        sources = file_sources(
            files + ([labels] if labels else []),
            **split,
            edge_importer=f"edge_list-{edge_import.IMPORTER_VERSION}",
            edges=edge_import.edge_sources(config.edges),
            labels=str(labels.resolve()) if labels else None,
        )
        write = partial(edge_import.write_edge_list, files=files, labels=labels, config=config.edges, **link)
        return path.stem, import_target(config, f"edges-{path.stem}", str(path.resolve())), sources, write
    files = graph_pyg.planetoid_files(config.name, root)
    write = partial(graph_pyg.write_planetoid, name=config.name, root=root, files=files, **link)
    target = import_target(config, f"planetoid-{config.name}", str((root / config.name).resolve()))
    return config.name, target, file_sources(files, **split), write


def load_click_log(config: DatasetConfig) -> ClickLog:
    """Load the click log a recipe names (a file, or generated), importing it first if it has
    not been, or if its sources changed (the file, the generator's or the columns' settings).
    Raises ``DatasetError``."""
    if config.kind == "synthetic_clicks":
        sources = {
            "generator": f"synthetic_clicks-{clicks_synthetic.GENERATOR_VERSION}",
            "settings": asdict(config.clicks),
        }
        write = partial(clicks_synthetic.write_synthetic_clicks, config=config.clicks)
        name, target = f"clicks-{config.clicks.samples}", import_target(config, "synthetic-clicks", sources)
    else:
        path = clicks_import.click_log_file(
            dataset_path(config, config.path), looked=places_looked(config, config.path)
        )
        columns = clicks_import.click_columns(config)
        described = json.loads(json.dumps(asdict(columns)))  # as the manifest holds it (lists, not tuples)
        sources = file_sources([path], importer=f"clicks-{clicks_import.IMPORTER_VERSION}", columns=described)
        write = partial(clicks_import.write_click_log, path=path, config=columns)
        name, target = path.stem, import_target(config, f"clicks-{path.stem}", str(path.resolve()))
    return ClickLog.of(import_folder(target, kind="clicks", name=name, sources=sources, build=write))
