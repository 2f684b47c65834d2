"""The recipe schema: one dataclass per section, and what each of its values must be.

Each field carries its help text and, where a value has limits, a check (value -> problem or
None) in its metadata (:func:`_help`); a class's ``problems()`` checks what depends on more
than one field, once every field is valid. Nothing here reads YAML: :mod:`.loader` builds these
classes from the data, by their type annotations and these checks.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..storage.residency import DEFAULT_BUDGET, resolve_budget
from ..registry import declared

MAX_NAME_BYTES = 200  # the run folder <name>-<YYYYmmdd-HHMMSS> stays under NAME_MAX (255 bytes)
SEED_MAX = 2**63 - 1  # torch and numpy take seeds as 64-bit integers


def _help(text: str, check=None, *, choices=None, **kwargs):
    """A dataclass field with help text, an optional check (value -> problem or None) and, for
    a value that names a registered class, ``choices() -> names`` (asked when a recipe is read)."""
    return field(metadata={"help": text, "check": check, "choices": choices}, **kwargs)


def _positive(v):
    return None if v > 0 else "must be > 0"


def _distinct(v):
    return None if len(set(v)) == len(v) else "names a callback twice"


def _non_negative(v):
    return None if v >= 0 else "must be >= 0"


def _fraction(v):
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _memory_budget(v):
    try:
        resolve_budget(v)
    except ValueError as e:
        return str(e).removeprefix("Invalid memory_budget: ")
    return None


def _betas(v):
    return None if all(0 <= b < 1 for b in v) else "each beta must be in [0, 1)"


def _seed(v):
    return (
        None if 0 <= v <= SEED_MAX else "must be a whole number in [0, 2**63 - 1] (torch and numpy take 64-bit seeds)"
    )


def _folder_name(v):
    """A name that becomes one folder: nothing that climbs out of, or hides in, its parent."""
    if not v or v.startswith(".") or any(c in "/\\" or c < " " for c in v):
        return (
            "must be a plain folder name (no '/', '\\', NUL or control characters; not '.', '..' or starting with '.')"
        )
    try:
        size = len(v.encode())
    except UnicodeEncodeError:
        return "must be valid Unicode text (it holds an unpaired surrogate escape)"
    if size > MAX_NAME_BYTES:
        return (
            f"is {size} bytes long; at most {MAX_NAME_BYTES} (the run folder adds -YYYYmmdd-HHMMSS, "
            "and a folder name has at most 255 bytes)"
        )
    return None


def _inside_data_root(v):
    if "\0" in v:
        return "must not contain a NUL character"
    if os.path.isabs(v) or Path(os.path.normpath(v)).parts[:1] != ("..",):
        return None
    return (
        "climbs out of its folder (a relative path is read from the current folder where it exists there, else under dataset.root, "
        "$DSA_DATA_ROOT or ./datasets); "
        "write an absolute path if a folder outside it is really meant"
    )


def _split(v):
    return None if all(0 <= f < 1 for f in v) and sum(v) < 1 else "fractions must be in [0, 1) and sum below 1"


@dataclass
class SyntheticConfig:
    """A generated knowledge graph: power-law entity degrees and a latent cluster structure
    that relations map between (so models have something to learn)."""

    entities: int = _help("number of entities", _positive, default=10_000)
    relations: int = _help("number of relations", _positive, default=20)
    triples: int = _help("number of triples, before the valid and test ones are held out", _positive, default=100_000)
    valid: int = _help("triples held out for validation", _non_negative, default=1_000)
    test: int = _help("triples held out for testing", _non_negative, default=1_000)
    clusters: int = _help("latent entity clusters that relations map between", _positive, default=64)
    noise: float = _help("fraction of triples whose tail is uniformly random", _fraction, default=0.1)
    zipf: float = _help("power-law exponent of entity popularity (0: uniform)", _non_negative, default=1.0)
    seed: int = _help("random seed of the generator", _seed, default=0)

    def problems(self) -> list[tuple[str, str]]:
        found = []
        if self.valid + self.test >= self.triples:
            found.append(("triples", f"must exceed valid + test ({self.valid + self.test})"))
        if self.relations * self.entities >= 2**63:  # the filter index's query column is entity * R + relation
            found.append(
                ("relations", f"times entities must stay below 2^63 (at most {(2**63 - 1) // self.entities:,})")
            )
        return found


@dataclass
class GraphSyntheticConfig:
    """A generated graph: a degree-corrected stochastic block model with power-law degrees."""

    nodes: int = _help("number of nodes", _positive, default=100_000)
    communities: int = _help("number of communities (the node labels)", _positive, default=10)
    average_degree: int = _help("edges per node, on average (each edge counts for both ends)", _positive, default=10)
    homophily: float = _help("probability that an edge stays inside its community", _fraction, default=0.8)
    zipf: float = _help("power-law exponent of node popularity (0: uniform)", _non_negative, default=1.0)
    seed: int = _help("random seed of the generator and of the edge split", _seed, default=0)


@dataclass
class ClicksSyntheticConfig:
    """A generated click log: power-law categorical ids, multi-hot bags, dense features and a
    planted signal (a hidden effect per id, pairwise id interactions, dense weights) that
    decides each click, so a model can learn far above AUC 0.5 (the generator's own AUC on
    the test split, from the true click probabilities, is the ceiling)."""

    samples: int = _help("training samples (impressions)", _positive, default=100_000)
    valid: int = _help("validation samples", _non_negative, default=10_000)
    test: int = _help("test samples", _non_negative, default=10_000)
    features: int = _help("categorical features (fields)", _positive, default=8)
    ids: int = _help("distinct ids of each categorical feature", _positive, default=100_000)
    dense: int = _help("dense (numeric) features", _non_negative, default=4)
    max_hot: int = _help("ids per feature and sample: 1 to max_hot, uniformly (1: one-hot)", _positive, default=1)
    weighted: bool = _help(
        "give each id of a bag a weight in (0, 1] (per-sample weights, as in the TSV's id:weight)", default=False
    )
    zipf: float = _help("power-law exponent of id popularity (0: uniform)", _non_negative, default=1.1)
    signal: float = _help(
        "strength of the planted signal (0: clicks are coin flips at the base rate)", _non_negative, default=2.0
    )
    click_rate: float = _help("base click rate (of a sample with no signal)", _fraction, default=0.25)
    seed: int = _help("random seed of the generator", _seed, default=0)

    def problems(self) -> list[tuple[str, str]]:
        return [("click_rate", "must be > 0")] if self.click_rate <= 0 else []


def _one_character(v):
    return None if len(v) == 1 and v not in "\r\n" else "must be one character (not a line break)"


@dataclass
class ClickColumnsConfig:
    """click_log: which columns of the file's header are the label, dense and categorical
    features (defaults: the Criteo layout, ``label``, ``I1``... and ``C1``...)."""

    label: str = _help("the click column (0 or 1)", default="label")
    dense: list[str] | None = _help(
        "dense columns, numbers (empty: none); default: every column named I<number>", default=None
    )
    sparse: list[str] | None = _help(
        "categorical columns, raw values hashed into table rows; default: every column but the label, the dense ones and one named 'id' "
        "(the import lists them)",
        default=None,
    )
    delimiter: str | None = _help(
        "the character between cells; default: read from the first line (a tab if it holds one, else a comma)",
        _one_character,
        default=None,
    )
    header: bool | None = _help(
        "the first line names the columns; default: it does when it holds the label's name, or when `names` is not set",
        default=None,
    )
    names: list[str] | None = _help(
        "the columns in order, for a file without a header (dataset.layout: criteo sets Criteo's)", default=None
    )
    multi_hot: str = _help("separator of several ids in one categorical cell (a bag)", _one_character, default="|")
    weights: bool = _help(
        "categorical cells hold value:weight pairs (a value without :weight weighs 1; per-sample weights, pooled with model.recsys.mode: sum)",
        default=False,
    )
    dense_log: bool = _help(
        "read a dense value x as log(1 + max(x, 0)), as DLRM reads Criteo's counts (false: as it is)", default=True
    )
    holdout: tuple[float, float] = _help(
        "fractions of the file's last lines held out as (valid, test), in file order (a click log is in time order)",
        _split,
        default=(0.05, 0.05),
    )


def _column(v):
    if isinstance(v, int) and v < 0:
        return "must be a column position (0 is the first) or a column name of the header"
    return None if v != "" else "must not be empty"


def _delimiter(v):
    return (
        None
        if len(v) == 1 and v not in '\r\n"'
        else "must be one character (' ' means runs of spaces and tabs; not a line break or a quote)"
    )


@dataclass
class TriplesConfig:
    """tsv: how the split files' lines read."""

    delimiter: str | None = _help(
        "the character between head, relation and tail; default: a tab if the first line holds one, else a comma",
        _one_character,
        default=None,
    )
    header: bool | None = _help(
        "each file's first line names the columns; default: detected (head, relation, tail and such words)",
        default=None,
    )


@dataclass
class EdgeListConfig:
    """edge_list: how the edge-list file's lines read (every value left out is detected from
    the first lines, and the import says what it found); for parquet files, source, target
    and weight name columns (or give positions), and delimiter and header do not apply."""

    delimiter: str | None = _help(
        "one character between the columns; ' ' means runs of spaces and tabs (SNAP); "
        "default: ',' if the first line holds one, else tab if names hold spaces, else runs of spaces and tabs",
        _delimiter,
        default=None,
    )
    comment: str = _help("lines starting with it are skipped (blank lines are too); '' for none", default="#")
    header: bool | None = _help(
        "the first line (after comments) names the columns; default: detected (names such as source, target, or words above numbers)",
        default=None,
    )
    source: int | str = _help(
        "the source column: its position (0 is the first) or its name in the header", _column, default=0
    )
    target: int | str = _help("the target column: position or name", _column, default=1)
    weight: int | str | None = _help(
        "a weight column (position or name), read as numbers; used by min_weight (walks are unweighted)", default=None
    )
    min_weight: float | None = _help("keep only the edges whose weight is at least this (needs weight)", default=None)
    directed: bool = _help(
        "false: an edge joins both ends; true: an edge 'u v' is u -> v only: node2vec's walks follow out-edges "
        "(a node without one ends the walk, as in PyG), held-out edges keep their direction; graphsage reads undirected graphs only",
        default=False,
    )
    ids: Literal["names", "integers"] = _help(
        "names: any text, numbered in fingerprint order (row i is not the i-th name of the file: see export's names file); "
        "integers: ids 0 .. N-1 written as numbers, which are the rows themselves",
        default="names",
    )
    node_split: tuple[float, float] = _help(
        "labels: fractions of the labelled nodes held out for the probe (valid, test), by a seeded hash, "
        "where the labels file has no third column naming each node's split",
        _split,
        default=(0.1, 0.1),
    )

    def problems(self) -> list[tuple[str, str]]:
        if self.min_weight is not None and self.weight is None:
            return [("min_weight", "needs a weight column: set dataset.edges.weight")]
        if self.source == self.target:
            return [("target", f"is the source column too ({self.source!r})")]
        return []


KG_DATASETS = ("tsv", "fb15k237", "wn18rr", "ogbl", "synthetic")
GRAPH_DATASETS = ("planetoid", "karate", "synthetic_graph", "edge_list")
CLICK_DATASETS = ("click_log", "synthetic_clicks")


@dataclass
class DatasetConfig:
    """Where the triples (knowledge graphs) or the graph (node embeddings) come from."""

    kind: Literal[
        "tsv",
        "fb15k237",
        "wn18rr",
        "ogbl",
        "synthetic",
        "planetoid",
        "karate",
        "synthetic_graph",
        "edge_list",
        "click_log",
        "synthetic_clicks",
    ] = _help(
        "knowledge graphs: tsv (a folder of train/valid/test.txt), fb15k237, wn18rr (PyG), ogbl (OGB's ogbl-wikikg2 or "
        "ogbl-biokg, named by dataset.fetch), synthetic; "
        "graphs: planetoid (PyG: Cora, CiteSeer, PubMed), karate (built in), synthetic_graph, edge_list (your own text or parquet file, or folder); "
        "click logs: click_log (a TSV or CSV file, with a header or dataset.columns.names or dataset.layout), synthetic_clicks"
    )
    path: str | None = _help(
        "tsv: the folder; edge_list: the file or a folder of files; click_log: the file (.gz: gzip); "
        "absolute, or relative: from the current folder where it exists there, else under the data root",
        _inside_data_root,
        default=None,
    )
    labels: str | None = _help(
        "edge_list: a file of node<TAB>label lines (a third column train/valid/test may name the node's split) for the probe; "
        "found as dataset.path is",
        _inside_data_root,
        default=None,
    )
    fetch: Literal["umls", "nations", "yago3-10", "wikidata5m", "ogbl-wikikg2", "ogbl-biokg"] | None = _help(
        "tsv: a dataset by name, downloaded into <data root>/<name>/ on first use and checked against its digest "
        "(docs/data.md, datasets by name); read where dataset.path is not set (a set path wins, e.g. --set dataset.path=...); "
        "ogbl: ogbl-wikikg2 or ogbl-biokg (OGB's zip, its splits and fixed negatives)",
        default=None,
    )
    edges: EdgeListConfig = _help("edge_list: how the file's lines read", default_factory=EdgeListConfig)
    triples: TriplesConfig = _help("tsv: how the split files' lines read", default_factory=TriplesConfig)
    name: str | None = _help("planetoid: Cora, CiteSeer or PubMed", default=None)
    root: str | None = _help("data root (default: $DSA_DATA_ROOT, else ./datasets)", default=None)
    synthetic: SyntheticConfig = _help(
        "synthetic: the knowledge-graph generator's settings", default_factory=SyntheticConfig
    )
    graph: GraphSyntheticConfig = _help(
        "synthetic_graph: the graph generator's settings", default_factory=GraphSyntheticConfig
    )
    clicks: ClicksSyntheticConfig = _help(
        "synthetic_clicks: the click-log generator's settings", default_factory=ClicksSyntheticConfig
    )
    columns: ClickColumnsConfig = _help(
        "click_log: the file's columns and held-out lines", default_factory=ClickColumnsConfig
    )
    layout: Literal["criteo"] | None = _help(
        "click_log: a named layout; criteo: Kaggle's train.txt and the Terabyte day_N files (no header, tabs: label, I1..I13, C1..C26)",
        default=None,
    )
    link_split: tuple[float, float] = _help(
        "graphs: fractions of the edges held out for link prediction (valid, test)", _split, default=(0.0, 0.0)
    )

    def problems(self) -> list[tuple[str, str]]:
        ogbl = bool(self.fetch and self.fetch.startswith("ogbl-"))
        if self.kind == "ogbl" and not ogbl:
            return [("fetch", f"names the OGB dataset of kind 'ogbl': ogbl-wikikg2 or ogbl-biokg, got {self.fetch!r}")]
        if self.kind == "tsv" and ogbl:
            return [
                (
                    "fetch",
                    f"{self.fetch!r} is OGB's (splits and fixed negatives, not TSV files): set dataset.kind: ogbl",
                )
            ]
        if self.kind == "tsv" and not self.path and not self.fetch:
            return [
                (
                    "path",
                    "is required for kind 'tsv' (the folder holding train.txt, valid.txt, test.txt), or dataset.fetch",
                )
            ]
        if self.kind == "edge_list" and not self.path:
            return [("path", "is required for kind 'edge_list' (the edge-list file, or a folder of them)")]
        if self.labels and self.kind != "edge_list":
            return [("labels", f"is read for kind 'edge_list' only, not {self.kind!r}; leave it out")]
        if self.kind == "click_log" and not self.path:
            return [("path", "is required for kind 'click_log' (the TSV or CSV file)")]
        if self.layout and self.kind != "click_log":
            return [("layout", f"names a click log's layout, not one of kind {self.kind!r}; leave it out")]
        if self.kind == "planetoid" and self.name not in ("Cora", "CiteSeer", "PubMed"):
            return [("name", f"must be Cora, CiteSeer or PubMed for kind 'planetoid', got {self.name!r}")]
        return []


@dataclass
class Node2VecConfig:
    """node2vec: second-order random walks and skip-gram with negative sampling."""

    walk_length: int = _help("steps per walk", _positive, default=20)
    context_size: int = _help("window of the skip-gram (nodes per positive window)", _positive, default=10)
    walks_per_node: int = _help("walks started from each node per epoch", _positive, default=10)
    p: float = _help("return parameter: 1/p weighs going back to the previous node", _positive, default=1.0)
    q: float = _help("in-out parameter: 1/q weighs moving away from the previous node", _positive, default=1.0)
    negatives: int = _help("negative windows per positive window", _positive, default=1)
    init_std: float = _help(
        "standard deviation of the nodes' normal start: 1.0 is PyG's Node2Vec (dozens of epochs to converge); "
        "word2vec's spread, about 0.5 / dim (0.003 at dim 128), learns as much in one or two",
        _positive,
        default=1.0,
    )

    def problems(self) -> list[tuple[str, str]]:
        if self.context_size > self.walk_length + 1:
            return [("context_size", f"must be at most walk_length + 1 ({self.walk_length + 1})")]
        return []


@dataclass
class SageConfig:
    """GraphSAGE over the learnable node embeddings, trained on sampled neighbourhoods."""

    task: Literal["link", "node"] = _help(
        "link: predict held-out edges; node: classify the labelled nodes", default="link"
    )
    layers: int = _help("SAGE layers", _positive, default=2)
    hidden: int = _help("width of the SAGE layers and of the output", _positive, default=128)
    fanout: list[int] = _help(
        "neighbours sampled per node at each layer, outermost last", default_factory=lambda: [10, 10]
    )
    dropout: float = _help("dropout between layers", _fraction, default=0.0)

    def problems(self) -> list[tuple[str, str]]:
        if len(self.fanout) != self.layers or any(f <= 0 for f in self.fanout):
            return [("fanout", f"must list {self.layers} positive numbers (one per layer), got {self.fanout}")]
        return []


@dataclass
class RecsysConfig:
    r"""dlrm: sparse features pooled from one embedding table, dense features through a
    bottom MLP, their interaction through a top MLP to a click logit."""

    tables: Literal["per_feature", "shared"] = _help(
        "per_feature: each categorical feature owns `rows` rows (one table, features side by side); "
        "shared: every feature hashes into one table of `rows` rows (collisions across features)",
        default="per_feature",
    )
    rows: int = _help(
        "per_feature: rows of each feature (ids beyond it share rows by hashing); shared: rows of the one table",
        _positive,
        default=1_000_000,
    )
    mode: Literal["sum", "mean"] = _help(
        "how a multi-hot bag's rows are pooled (sum with the ids' weights, if any)", default="sum"
    )
    interaction: Literal["dot", "cat"] = _help(
        "dot: pairwise dot products of the pooled features and the bottom MLP's output (DLRM); cat: their concatenation",
        default="dot",
    )
    bottom: list[int] = _help(
        "hidden widths of the bottom MLP on the dense features (its output has model.dim)", default_factory=lambda: [64]
    )
    top: list[int] = _help(
        "hidden widths of the top MLP (its output is the click logit)", default_factory=lambda: [64, 32]
    )

    def problems(self) -> list[tuple[str, str]]:
        found = []
        for key in ("bottom", "top"):
            if any(w <= 0 for w in getattr(self, key)):
                found.append((key, f"widths must be positive, got {getattr(self, key)}"))
        return found


GRAPH_MODELS = ("node2vec", "sage")
RECSYS_MODELS = ("dlrm",)


@functools.cache
def scoring_functions() -> dict[str, dict[str, object]]:
    """The knowledge-graph scoring functions :mod:`dsa_train.models.scoring` registers, by
    ``model.kind``, each with what its class declares (``halves``, ``relation_dropout_unsupported``):
    read from their source, so that reading a recipe imports no torch (:func:`~dsa_train.registry.declared`)."""
    return declared(Path(__file__).resolve().parent.parent / "models" / "scoring", "SCORING_FUNCTIONS")


def model_kinds() -> tuple[str, ...]:
    """Every ``model.kind``: the registered scoring functions, then the graph and click-log models."""
    return (*scoring_functions(), *GRAPH_MODELS, *RECSYS_MODELS)


@dataclass
class ModelConfig:
    """The embedding model."""

    kind: str = _help(
        "knowledge graphs: a scoring function of dsa_train.models.scoring (transe: -||h + r - t||_p, distmult: <h, r, t>, "
        "complex: Re<h, r, conj(t)>, rotate: gamma - ||h o r - t||, ...); graphs: node2vec, sage; click logs: dlrm",
        choices=model_kinds,
    )
    dim: int = _help(
        "embedding dimension, in reals (complex, rotate: dim / 2 complex coordinates, so dim is even)",
        _positive,
        default=128,
    )
    p_norm: Literal[1, 2] = _help("transe: the norm of the distance", default=2)
    gamma: float = _help("rotate: the offset gamma of every score (only the softplus loss sees it)", default=1.0)
    reciprocal: bool = _help("learn an inverse relation per relation and predict heads as tails", default=True)
    init_std: float = _help("standard deviation of the normal initialisation", _positive, default=1e-3)
    dropout: float = _help("dropout on the entity embeddings during training", _fraction, default=0.0)
    relation_dropout: float = _help(
        "knowledge graphs: dropout on the relation embeddings during training, one mask per query shared by its answer "
        "and its candidates (LibKGE's best FB15k-237 models use 0.2-0.4)",
        _fraction,
        default=0.0,
    )
    normalize_entities: bool = _help(
        "knowledge graphs: score entity rows scaled to unit L2 norm (the TransE paper's constraint), in training and evaluation",
        default=False,
    )
    embedding_storage: Literal["memory", "disk"] = _help(
        "memory: the entity/node table is an nn.Embedding in RAM (or VRAM); disk: a DiskEmbedding, "
        "a memory-mapped table file in the run folder holding weights and moments (tables larger than RAM)",
        default="memory",
    )
    init_from: str | None = _help(
        "warm start: a finished run folder whose rows this run starts from, matched by entity, relation or node name "
        "(rows it lacks start as drawn; Adam's moments start at zero); the same kind and dim",
        lambda v: None if v is None or v.strip() else "must name a run folder",
        default=None,
    )
    node2vec: Node2VecConfig = _help("node2vec: walks and skip-gram", default_factory=Node2VecConfig)
    sage: SageConfig = _help("sage: the encoder and its task", default_factory=SageConfig)
    recsys: RecsysConfig = _help("dlrm: the feature table and the MLPs", default_factory=RecsysConfig)


@dataclass
class TrainConfig:
    """The training loop."""

    epochs: int = _help("passes over the training triples", _non_negative, default=10)
    max_steps: int | None = _help("stop after this many steps (default: run all epochs)", _positive, default=None)
    batch_size: int = _help("positive triples per step (each gives a head and a tail query)", _positive, default=1024)
    negatives: int = _help(
        "uniformly sampled negative entities per step, shared by all its queries", _positive, default=1024
    )
    batch_negatives: bool = _help(
        "also use the step's other answers as negatives (popular entities, harder)", default=True
    )
    candidates: Literal["sampled", "all"] = _help(
        "sampled: a step's queries are scored against train.negatives uniform entities (and the step's answers with "
        "batch_negatives); all: against every entity (1-vs-all, as LibKGE trains its best WN18RR models; every entity row "
        "then gets a gradient, and an update, at every step)",
        default="sampled",
    )
    labels: Literal["one", "all"] = _help(
        "one: each training triple asks its tail and head query with its one answer; all: k-vs-all, each distinct query "
        "(h, r, ?) and (?, r, t) of the training split once per epoch, labelled with every answer the split gives it "
        "(needs train.candidates: all; train.batch_size then counts queries)",
        default="one",
    )
    entity_chunk: int = _help(
        "train.candidates all: score this many entities at a time; a step holds one chunk's scores (2 x batch_size x "
        "entity_chunk, batch_size with labels all) and recomputes each chunk in the backward pass when there are several",
        _positive,
        default=16384,
    )
    query_chunk: int | None = _help(
        "train.candidates sampled: score this many of a step's 2 x batch_size queries at a time, each slice's gradient taken "
        "as it is scored, so a step holds one slice's scores (about 8 x query_chunk x candidates floats) and computes nothing "
        "twice (default: as many as make 2,097,152 scores, the fastest size measured on CPU)",
        _positive,
        default=None,
    )
    loss: Literal["cross_entropy", "softplus", "margin"] = _help(
        "cross_entropy: softmax over the positive and the negatives; softplus: logistic; "
        "margin: max(0, margin - f(pos) + f(neg))",
        default="cross_entropy",
    )
    margin: float = _help("margin of the margin loss", _positive, default=1.0)
    label_smoothing: float = _help(
        "cross_entropy: the share of each query's target spread evenly over its candidates (every entity with candidates "
        "all), the rest on its answers; 0: none (ConvE, TuckER and LibKGE's KvsAll use 0.1)",
        _fraction,
        default=0.0,
    )
    regularization: float = _help("weight of the N3 penalty on the step's embeddings", _non_negative, default=0.0)
    seed: int = _help("seed of initialisation, data order, negatives and dropout", _seed, default=0)
    order: Literal["random", "partitioned"] = _help(
        "random: each batch drawn from the whole training split; partitioned: entities in `partitions` partitions, triples "
        "in partitions x partitions buckets, trained while `buffer` partitions are in memory, so a disk table far beyond "
        "RAM is read and written whole partitions at a time (docs/partitioned.md)",
        default="random",
    )
    partitions: int = _help(
        "partitioned order: entity partitions (1: one partition, the random order itself)", _positive, default=16
    )
    buffer: int = _help(
        "partitioned order: partitions in memory at once (at least 2; partitions or more: all of them)",
        _positive,
        default=4,
    )
    negatives_from: Literal["buffer", "table"] = _help(
        "partitioned order: uniform negatives from the buffer's partitions (no disk reads) or from the whole table",
        default="buffer",
    )
    pool_pairs: int = _help(
        "partitioned node2vec: positive walk pairs drawn, bucketed and trained per pool (8 bytes each in memory, 40 while the next pool is drawn); "
        "each pool reads the table about (buffer + swaps) / partitions times, so larger pools read less per pair",
        _positive,
        default=1 << 25,
    )
    device: Literal["auto", "cpu", "cuda"] = _help(
        "where the model computes (the optimizer state stays on disk)", default="auto"
    )
    log_every: int = _help("log the loss to metrics.jsonl every this many steps", _positive, default=50)
    checkpoint_every: int = _help("checkpoint every this many steps (0: at the end only)", _non_negative, default=0)
    keep_checkpoints: int = _help("complete checkpoints to keep (the newest)", _positive, default=2)
    final_checkpoint: bool = _help(
        "checkpoint at the end (false: skip it, for disk tables too large to copy; `eval` then has no checkpoint)",
        default=True,
    )


@dataclass
class OptimizerConfig:
    """The optimizer of the embedding tables."""

    kind: Literal["dsa", "sparse_adam"] = _help(
        "dsa: DiskSparseAdam (moments on disk); sparse_adam: torch.optim.SparseAdam, for comparison", default="dsa"
    )
    lr: float = _help("learning rate", _positive, default=1e-3)
    betas: tuple[float, float] = _help("Adam's betas", _betas, default=(0.9, 0.999))
    eps: float = _help("Adam's epsilon", _positive, default=1e-8)
    schedule: Literal["constant", "cosine", "linear", "step", "plateau"] = _help(
        "learning rate over the run's steps: constant; decayed (cosine or linear) from `lr` to `lr * final_lr_ratio` "
        "over train.epochs; step: `lr`, then `lr * final_lr_ratio` from epoch decay_after_epochs on; or plateau: "
        "multiplied by plateau_factor whenever more than plateau_patience evaluations in a row were no better (torch's "
        "ReduceLROnPlateau on eval.split's MRR, accuracy or AUC; needs eval.every_epochs), never below "
        "`lr * final_lr_ratio`. The dense layers' dense_lr follows the same curve",
        default="constant",
    )
    final_lr_ratio: float = _help(
        "cosine, linear: the rate at the last step as a fraction of `lr`; step: the rate after decay_after_epochs; "
        "plateau: the lowest rate, as a fraction of `lr`",
        _fraction,
        default=0.0,
    )
    plateau_factor: float = _help(
        "plateau: each reduction multiplies the rate by this (LibKGE's configs use 0.5-0.95)",
        _fraction,
        default=0.5,
    )
    plateau_patience: int = _help(
        "plateau: evaluations in a row without a better one that are tolerated; one more lowers the rate",
        _non_negative,
        default=2,
    )
    decay_after_epochs: int = _help(
        "step: the epochs run at `lr`; every later step runs at `lr * final_lr_ratio` (none if train.epochs is not more)",
        _non_negative,
        default=0,
    )
    state_dir: str | None = _help(
        "dsa: state directory (default: <run>/optimizer_state); put it on a local SSD", default=None
    )
    dense_lr: float = _help(
        "sage, dlrm: learning rate of the dense layers (SAGE's, the MLPs), trained with torch's Adam",
        _positive,
        default=0.01,
    )
    nonfinite: Literal["error", "skip"] = _help(
        "dsa: a NaN or Inf gradient stops the run (error) or skips its step (skip); found before anything is written",
        default="error",
    )
    first_moment: Literal["full", "bfloat16"] = _help(
        "dsa: store m in the parameter's dtype (full, exact SparseAdam) or in bfloat16 (half the bytes)", default="full"
    )
    second_moment: Literal["full", "row"] = _help(
        "dsa: one v per element (full, exact SparseAdam) or one per row, the mean of the squared gradient",
        default="full",
    )
    memory_budget: int | str = _help(
        "dsa: memory the rows changed since the last checkpoint may hold (bytes, a size such as 4GiB, or a share of the free "
        "memory at start such as 75%); within it nothing is written to disk between checkpoints, past it the least "
        "recently written rows are written out once and leave memory",
        _memory_budget,
        default=DEFAULT_BUDGET,
    )

    def problems(self) -> list[tuple[str, str]]:
        found = []
        if self.schedule == "plateau" and not self.plateau_factor:
            found.append(("plateau_factor", "schedule 'plateau' multiplies the rate by it: set it above 0, e.g. 0.5"))
        if self.schedule == "constant" and self.final_lr_ratio != 0:
            found.append(
                (
                    "final_lr_ratio",
                    "has no effect with schedule 'constant'; set optimizer.schedule to cosine, linear or step",
                )
            )
        if self.schedule != "step" and self.decay_after_epochs:
            found.append(
                ("decay_after_epochs", f"has no effect with schedule {self.schedule!r}; set optimizer.schedule: step")
            )
        if self.schedule == "step":
            if not self.decay_after_epochs:
                found.append(
                    (
                        "decay_after_epochs",
                        "schedule 'step' lowers the rate after this many epochs at `lr`: set it to 1 or more (e.g. 5 fewer than "
                        "train.epochs); a whole run at the lower rate is optimizer.lr = lr * final_lr_ratio with schedule 'constant'",
                    )
                )
            if not 0 < self.final_lr_ratio < 1:
                found.append(
                    (
                        "final_lr_ratio",
                        f"schedule 'step' runs the epochs after decay_after_epochs at lr * final_lr_ratio, which must be above 0 and below 1, "
                        f"got {self.final_lr_ratio:g}; e.g. 0.1",
                    )
                )
        if self.nonfinite == "skip" and self.kind != "dsa":
            found.append(("nonfinite", "'skip' needs kind 'dsa' (torch's SparseAdam has no such check)"))
        for key in ("first_moment", "second_moment"):
            if getattr(self, key) != "full" and self.kind != "dsa":
                found.append((key, f"{getattr(self, key)!r} needs kind 'dsa' (torch's SparseAdam keeps full moments)"))
        if self.memory_budget != DEFAULT_BUDGET and self.kind != "dsa":
            found.append(("memory_budget", "needs kind 'dsa' (torch's SparseAdam keeps all its state in memory)"))
        return found


@dataclass
class EvalConfig:
    """Filtered link-prediction evaluation (MR, MRR, Hits@1/3/10 for heads and tails)."""

    every_epochs: int = _help(
        "evaluate on `split` every this many epochs (0: never during training)", _non_negative, default=0
    )
    split: Literal["valid", "test"] = _help("the split evaluated during training", default="valid")
    final_splits: list[Literal["valid", "test"]] = _help(
        "splits evaluated when training ends", default_factory=lambda: ["valid", "test"]
    )
    batch_size: int = _help("queries scored at once", _positive, default=256)
    entity_chunk: int = _help("entities scored at once (bounds memory for huge tables)", _positive, default=65_536)
    sampled_negatives: int | None = _help(
        "rank against this many sampled entities instead of all (OGB-style), for huge tables", _positive, default=None
    )
    protocol: Literal["filtered", "ogb", "both"] = _help(
        "filtered: our filtered ranking (MR, MRR, Hits@k; sides tail, head, both); ogb: OGB's protocol, each answer "
        "against the split's fixed negatives, unfiltered, as ogb's Evaluator computes it (group 'ogb'), for "
        "dataset.kind: ogbl only; both: the two side by side",
        default="filtered",
    )
    link_negatives: int = _help(
        "graphs: sampled non-edges each held-out edge is ranked against (MRR)", _positive, default=100
    )
    max_queries: int | None = _help(
        "during training, rank at most this many triples (a seeded sample); final evaluations rank all",
        _positive,
        default=None,
    )
    select_best: bool = _help(
        "the final evaluations score the checkpoint of the best evaluation on `split` during training (its MRR, accuracy "
        "or AUC; the last epoch evaluated too), not the last step's, as LibKGE and PyKEEN report; each new best is "
        "checkpointed and kept. Needs every_epochs",
        default=False,
    )
    patience: int = _help(
        "early stopping: end training after this many evaluations on `split` in a row without a better one (0: never). "
        "Needs every_epochs",
        _non_negative,
        default=0,
    )

    def problems(self) -> list[tuple[str, str]]:
        found = []
        for key in ("select_best", "patience"):
            if getattr(self, key) and not self.every_epochs:
                found.append((key, "compares the evaluations made during training: set eval.every_epochs (e.g. 5)"))
            elif getattr(self, key) and self.split != "valid":
                found.append((key, "chooses by the split evaluated during training, which must be valid, not test"))
        return found


@dataclass
class DistributedConfig:
    """Scale-out under ``torchrun``: read only by a process torchrun started (see docs/distributed.md)."""

    backend: Literal["auto", "gloo", "nccl"] = _help(
        "torch.distributed backend: rows travel as host tensors, so auto is gloo; nccl adds NCCL for CUDA tensors beside it",
        default="auto",
    )
    timeout: float = _help(
        "seconds a rank waits for the others at any exchange before it stops with an error naming the step",
        _positive,
        default=300.0,
    )
    slices: int = _help(
        "a step's batch is cut into this many slices, each computed whole by one rank; the result depends on slices, "
        "never on the number of ranks (at most `slices` ranks compute, the others only hold rows)",
        _positive,
        default=8,
    )
    exact: bool = _help(
        "true: results bit-equal for every number of ranks (each lookup's gradient row sent and summed in batch order); "
        "false: each rank sums its rows per id first and sends one (fewer bytes; equal up to float rounding)",
        default=True,
    )


@dataclass
class OutputConfig:
    """Where runs go."""

    dir: str = _help("parent folder of run folders", default="runs")
    run_name: str | None = _help("run folder name (default: <recipe name>-<timestamp>)", _folder_name, default=None)
    tensorboard: bool = _help(
        "also write every metrics record as TensorBoard events in <run>/tensorboard/ (needs the tensorboard package; "
        "metrics.jsonl stays the record)",
        default=False,
    )
    callbacks: list[str] = _help(
        "extra loop callbacks by name, after the built-in ones: 'log_metrics' (every record of metrics.jsonl also "
        "as one log line), or a callback a Python user registered with "
        "@dsa_train.train.callbacks.CALLBACKS.register_as('name') before dsa_train.run",
        _distinct,
        default_factory=list,
    )


@dataclass
class Recipe:
    """One experiment: dataset, model, training, optimizer, evaluation, output."""

    dataset: DatasetConfig = _help("the knowledge graph")
    model: ModelConfig = _help("the embedding model")
    name: str = _help(
        "the recipe's name (default: its file name), the run folders' prefix", _folder_name, default="recipe"
    )
    description: str = _help("one line saying what the recipe is for", default="")
    train: TrainConfig = _help("the training loop", default_factory=TrainConfig)
    optimizer: OptimizerConfig = _help("the optimizer", default_factory=OptimizerConfig)
    eval: EvalConfig = _help("evaluation", default_factory=EvalConfig)
    output: OutputConfig = _help("outputs", default_factory=OutputConfig)
    distributed: DistributedConfig = _help("scale-out under torchrun", default_factory=DistributedConfig)

    @property
    def is_kge(self) -> bool:
        return self.model.kind in scoring_functions()

    @property
    def is_recsys(self) -> bool:
        return self.model.kind in RECSYS_MODELS

    def problems(self) -> list[tuple[str, str]]:
        if self.is_kge:
            family, kinds = "a knowledge graph", KG_DATASETS
        elif self.is_recsys:
            family, kinds = "a click log", CLICK_DATASETS
        else:
            family, kinds = "a graph", GRAPH_DATASETS
        if self.dataset.kind not in kinds:
            return [
                (
                    "model.kind",
                    f"{self.model.kind!r} trains on {family} ({', '.join(kinds)}), not dataset kind {self.dataset.kind!r}",
                )
            ]
        if self.optimizer.kind == "sparse_adam" and self.model.embedding_storage == "disk":
            return [
                (
                    "optimizer.kind",
                    "'sparse_adam' cannot train a disk table: torch's SparseAdam updates the weight in place, and a disk table's "
                    "weight is a view of its file; use 'dsa' (DiskSparseAdam), or model.embedding_storage: memory",
                )
            ]
        if self.is_recsys and self.model.init_from:
            return [
                (
                    "model.init_from",
                    "starts knowledge-graph and node-embedding models from a run, not 'dlrm' yet; leave it out",
                )
            ]
        if self.is_recsys and self.train.order == "partitioned":
            return [
                ("train.order", "'partitioned' trains knowledge-graph models and node2vec, not 'dlrm'; use 'random'")
            ]
        if self.model.kind == "sage" and self.dataset.kind == "edge_list" and self.dataset.edges.directed:
            return [
                (
                    "dataset.edges.directed",
                    "graphsage aggregates over undirected neighbourhoods here; set it to false, or train node2vec on the directed graph",
                )
            ]
        if self.model.kind == "sage" and self.model.sage.task == "link" and not self.dataset.link_split[1]:
            return [("dataset.link_split", "sage with task 'link' needs held-out test edges, e.g. [0.05, 0.1]")]
        scoring = scoring_functions().get(self.model.kind)
        if scoring is not None and scoring.get("halves") and self.model.dim % 2:
            return [("model.dim", f"must be even for {self.model.kind!r} ({scoring['halves']}), got {self.model.dim}")]
        if self.model.relation_dropout and (scoring is None or scoring.get("relation_dropout_unsupported")):
            dropped = [
                name
                for name, declared in scoring_functions().items()
                if not declared.get("relation_dropout_unsupported")
            ]
            why = (
                scoring["relation_dropout_unsupported"] if scoring is not None else "it is not a knowledge-graph model"
            )
            return [
                (
                    "model.relation_dropout",
                    f"drops coordinates of {', '.join(dropped[:-1])} and {dropped[-1]} relation vectors; {self.model.kind!r} has no relation "
                    f"vectors ({why}): set it to 0",
                )
            ]
        if self.eval.protocol != "filtered" and self.dataset.kind != "ogbl":
            return [
                (
                    "eval.protocol",
                    f"{self.eval.protocol!r} ranks against OGB's fixed negatives, which only dataset.kind: ogbl has "
                    f"(not {self.dataset.kind!r}): use 'filtered'",
                )
            ]
        if self.optimizer.schedule == "plateau" and not self.eval.every_epochs:
            return [
                (
                    "optimizer.schedule",
                    "'plateau' lowers the rate when the evaluations during training stop improving: set eval.every_epochs "
                    "(e.g. 1)",
                )
            ]
        t = self.train
        if t.labels == "all" and t.candidates != "all":
            return [
                ("train.labels", "'all' (k-vs-all) scores each query against every entity: set train.candidates: all")
            ]
        if t.query_chunk is not None and t.candidates == "all":
            return [
                (
                    "train.query_chunk",
                    "slices the queries of train.candidates: sampled; with 'all' a step holds train.entity_chunk entities' scores: lower that",
                )
            ]
        if t.label_smoothing and t.loss != "cross_entropy":
            return [
                (
                    "train.label_smoothing",
                    f"spreads the target of the cross_entropy loss; train.loss is {t.loss!r}: set train.loss: cross_entropy "
                    "or label_smoothing: 0",
                )
            ]
        if t.labels == "all" and t.loss == "margin":
            return [
                (
                    "train.loss",
                    "'margin' compares one answer with the other entities; k-vs-all has several: use cross_entropy or softplus",
                )
            ]
        if t.order == "partitioned":
            if not self.is_kge and self.model.kind != "node2vec":
                return [
                    (
                        "train.order",
                        f"'partitioned' trains knowledge-graph models and node2vec, not {self.model.kind!r}; use 'random'",
                    )
                ]
            if self.model.embedding_storage != "disk":
                return [
                    ("train.order", "'partitioned' moves a disk table's partitions: set model.embedding_storage: disk")
                ]
            if t.candidates == "all":
                return [
                    (
                        "train.candidates",
                        "'all' scores every entity, which partition order keeps out of memory; use 'sampled'",
                    )
                ]
            if t.partitions > 1 and t.buffer < 2:
                return [
                    (
                        "train.buffer",
                        f"must be at least 2 with train.partitions {t.partitions} (a bucket joins two partitions), got {t.buffer}",
                    )
                ]
        return []
