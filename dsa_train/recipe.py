"""Recipes: YAML files parsed into typed, validated configuration.

A recipe has the sections ``dataset``, ``model``, ``train``, ``optimizer``, ``eval``,
``output`` and ``distributed`` (all optional but ``dataset`` and ``model``); each maps onto a dataclass below,
whose fields carry their help text and checks. :func:`load_recipe` reports every problem at
once in one :class:`~dsa_train.errors.ConfigError`, each with its dotted path, the YAML line
and, for a misspelt key, the closest valid one. ``key=value`` overrides (``--set``) are
applied before validation, so they are checked the same way.

Hostile or careless input ends in a ``ConfigError`` too, never a crash, a hang or a blown-up
process: the file must be UTF-8 and at most ``MAX_RECIPE_BYTES``; YAML is composed by a
loader that refuses an alias inside its own anchor, nesting deeper than ``MAX_DEPTH`` and
more than ``MAX_VALUES`` values once aliases are expanded (a "billion laughs" bomb), before
anything walks the values; duplicate keys are reported; seeds, names and paths are checked
against what torch and the file system accept.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import os
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few dozen lines: this refuses a wrong file or a generated one
MAX_DEPTH = 32  # nesting of sections and lists; a recipe needs 4 (model.sage.fanout.0)
MAX_VALUES = 10_000  # values once aliases are expanded; a 400-byte "billion laughs" expands to 9**9
MAX_NAME_BYTES = 200  # the run folder <name>-<YYYYmmdd-HHMMSS> stays under NAME_MAX (255 bytes)
SEED_MAX = 2**63 - 1  # torch and numpy take seeds as 64-bit integers


def _help(text: str, check=None, **kwargs):
    """A dataclass field with help text and an optional check (value -> problem or None)."""
    return field(metadata={"help": text, "check": check}, **kwargs)


def _positive(v):
    return None if v > 0 else "must be > 0"


def _non_negative(v):
    return None if v >= 0 else "must be >= 0"


def _fraction(v):
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _betas(v):
    return None if all(0 <= b < 1 for b in v) else "each beta must be in [0, 1)"


def _seed(v):
    return None if 0 <= v <= SEED_MAX else "must be a whole number in [0, 2**63 - 1] (torch and numpy take 64-bit seeds)"


def _folder_name(v):
    """A name that becomes one folder: nothing that climbs out of, or hides in, its parent."""
    if not v or v.startswith(".") or any(c in "/\\" or c < " " for c in v):
        return "must be a plain folder name (no '/', '\\', NUL or control characters; not '.', '..' or starting with '.')"
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
        "climbs out of the data root (a relative path is read under dataset.root, $DSA_DATA_ROOT or ./datasets); "
        "write an absolute path if a folder outside it is really meant"
    )


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
            found.append(("relations", f"times entities must stay below 2^63 (at most {(2**63 - 1) // self.entities:,})"))
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


KG_DATASETS = ("tsv", "fb15k237", "wn18rr", "synthetic")
GRAPH_DATASETS = ("planetoid", "karate", "synthetic_graph")


def _split(v):
    return None if all(0 <= f < 1 for f in v) and sum(v) < 1 else "fractions must be in [0, 1) and sum below 1"


@dataclass
class DatasetConfig:
    """Where the triples (knowledge graphs) or the graph (node embeddings) come from."""

    kind: Literal["tsv", "fb15k237", "wn18rr", "synthetic", "planetoid", "karate", "synthetic_graph"] = _help(
        "knowledge graphs: tsv (a folder of train/valid/test.txt), fb15k237, wn18rr (PyG), synthetic; "
        "graphs: planetoid (PyG: Cora, CiteSeer, PubMed), karate (built in), synthetic_graph"
    )
    path: str | None = _help("tsv: the folder, relative to the data root or absolute", _inside_data_root, default=None)
    name: str | None = _help("planetoid: Cora, CiteSeer or PubMed", default=None)
    root: str | None = _help("data root (default: $DSA_DATA_ROOT, else ./datasets)", default=None)
    synthetic: SyntheticConfig = _help("synthetic: the knowledge-graph generator's settings", default_factory=SyntheticConfig)
    graph: GraphSyntheticConfig = _help("synthetic_graph: the graph generator's settings", default_factory=GraphSyntheticConfig)
    link_split: tuple[float, float] = _help(
        "graphs: fractions of the edges held out for link prediction (valid, test)", _split, default=(0.0, 0.0)
    )

    def problems(self) -> list[tuple[str, str]]:
        if self.kind == "tsv" and not self.path:
            return [("path", "is required for kind 'tsv' (the folder holding train.txt, valid.txt, test.txt)")]
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

    def problems(self) -> list[tuple[str, str]]:
        if self.context_size > self.walk_length + 1:
            return [("context_size", f"must be at most walk_length + 1 ({self.walk_length + 1})")]
        return []


@dataclass
class SageConfig:
    """GraphSAGE over the learnable node embeddings, trained on sampled neighbourhoods."""

    task: Literal["link", "node"] = _help("link: predict held-out edges; node: classify the labelled nodes", default="link")
    layers: int = _help("SAGE layers", _positive, default=2)
    hidden: int = _help("width of the SAGE layers and of the output", _positive, default=128)
    fanout: list[int] = _help("neighbours sampled per node at each layer, outermost last", default_factory=lambda: [10, 10])
    dropout: float = _help("dropout between layers", _fraction, default=0.0)

    def problems(self) -> list[tuple[str, str]]:
        if len(self.fanout) != self.layers or any(f <= 0 for f in self.fanout):
            return [("fanout", f"must list {self.layers} positive numbers (one per layer), got {self.fanout}")]
        return []


KG_MODELS = ("transe", "distmult")


@dataclass
class ModelConfig:
    """The embedding model."""

    kind: Literal["transe", "distmult", "node2vec", "sage"] = _help(
        "knowledge graphs: transe (-||h + r - t||_p), distmult (<h, r, t>); graphs: node2vec, sage"
    )
    dim: int = _help("embedding dimension", _positive, default=128)
    p_norm: Literal[1, 2] = _help("transe: the norm of the distance", default=2)
    reciprocal: bool = _help("learn an inverse relation per relation and predict heads as tails", default=True)
    init_std: float = _help("standard deviation of the normal initialisation", _positive, default=1e-3)
    dropout: float = _help("dropout on the embeddings during training", _fraction, default=0.0)
    embedding_storage: Literal["memory", "disk"] = _help(
        "memory: the entity/node table is an nn.Embedding in RAM (or VRAM); disk: a DiskEmbedding, "
        "a memory-mapped table file in the run folder holding weights and moments (tables larger than RAM)",
        default="memory",
    )
    node2vec: Node2VecConfig = _help("node2vec: walks and skip-gram", default_factory=Node2VecConfig)
    sage: SageConfig = _help("sage: the encoder and its task", default_factory=SageConfig)


@dataclass
class TrainConfig:
    """The training loop."""

    epochs: int = _help("passes over the training triples", _non_negative, default=10)
    max_steps: int | None = _help("stop after this many steps (default: run all epochs)", _positive, default=None)
    batch_size: int = _help("positive triples per step (each gives a head and a tail query)", _positive, default=1024)
    negatives: int = _help("uniformly sampled negative entities per step, shared by all its queries", _positive, default=1024)
    batch_negatives: bool = _help("also use the step's other answers as negatives (popular entities, harder)", default=True)
    loss: Literal["cross_entropy", "softplus", "margin"] = _help(
        "cross_entropy: softmax over the positive and the negatives; softplus: logistic; "
        "margin: max(0, margin - f(pos) + f(neg))",
        default="cross_entropy",
    )
    margin: float = _help("margin of the margin loss", _positive, default=1.0)
    regularization: float = _help("weight of the N3 penalty on the step's embeddings", _non_negative, default=0.0)
    seed: int = _help("seed of initialisation, data order, negatives and dropout", _seed, default=0)
    device: Literal["auto", "cpu", "cuda"] = _help("where the model computes (the optimizer state stays on disk)", default="auto")
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
    state_dir: str | None = _help("dsa: state directory (default: <run>/optimizer_state); put it on a local SSD", default=None)
    dense_lr: float = _help("sage: learning rate of the (dense) SAGE layers, trained with torch's Adam", _positive, default=0.01)
    nonfinite: Literal["error", "skip"] = _help(
        "dsa: a NaN or Inf gradient stops the run (error) or skips its step (skip); found before anything is written",
        default="error",
    )
    first_moment: Literal["full", "bfloat16"] = _help(
        "dsa: store m in the parameter's dtype (full, exact SparseAdam) or in bfloat16 (half the bytes)", default="full"
    )
    second_moment: Literal["full", "row"] = _help(
        "dsa: one v per element (full, exact SparseAdam) or one per row, the mean of the squared gradient", default="full"
    )

    def problems(self) -> list[tuple[str, str]]:
        found = []
        if self.nonfinite == "skip" and self.kind != "dsa":
            found.append(("nonfinite", "'skip' needs kind 'dsa' (torch's SparseAdam has no such check)"))
        for key in ("first_moment", "second_moment"):
            if getattr(self, key) != "full" and self.kind != "dsa":
                found.append((key, f"{getattr(self, key)!r} needs kind 'dsa' (torch's SparseAdam keeps full moments)"))
        return found


@dataclass
class EvalConfig:
    """Filtered link-prediction evaluation (MR, MRR, Hits@1/3/10 for heads and tails)."""

    every_epochs: int = _help("evaluate on `split` every this many epochs (0: never during training)", _non_negative, default=0)
    split: Literal["valid", "test"] = _help("the split evaluated during training", default="valid")
    final_splits: list[Literal["valid", "test"]] = _help("splits evaluated when training ends", default_factory=lambda: ["valid", "test"])
    batch_size: int = _help("queries scored at once", _positive, default=256)
    entity_chunk: int = _help("entities scored at once (bounds memory for huge tables)", _positive, default=65_536)
    sampled_negatives: int | None = _help(
        "rank against this many sampled entities instead of all (OGB-style), for huge tables", _positive, default=None
    )
    link_negatives: int = _help("graphs: sampled non-edges each held-out edge is ranked against (MRR)", _positive, default=100)
    max_queries: int | None = _help(
        "during training, rank at most this many triples (a seeded sample); final evaluations rank all", _positive, default=None
    )


@dataclass
class DistributedConfig:
    """Scale-out under ``torchrun``: read only by a process torchrun started (see docs/distributed.md)."""

    backend: Literal["auto", "gloo", "nccl"] = _help(
        "torch.distributed backend: rows travel as host tensors, so auto is gloo; nccl adds NCCL for CUDA tensors beside it", default="auto"
    )
    timeout: float = _help(
        "seconds a rank waits for the others at any exchange before it stops with an error naming the step", _positive, default=300.0
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


@dataclass
class Recipe:
    """One experiment: dataset, model, training, optimizer, evaluation, output."""

    dataset: DatasetConfig = _help("the knowledge graph")
    model: ModelConfig = _help("the embedding model")
    name: str = _help("the recipe's name (default: its file name), the run folders' prefix", _folder_name, default="recipe")
    description: str = _help("one line saying what the recipe is for", default="")
    train: TrainConfig = _help("the training loop", default_factory=TrainConfig)
    optimizer: OptimizerConfig = _help("the optimizer", default_factory=OptimizerConfig)
    eval: EvalConfig = _help("evaluation", default_factory=EvalConfig)
    output: OutputConfig = _help("outputs", default_factory=OutputConfig)
    distributed: DistributedConfig = _help("scale-out under torchrun", default_factory=DistributedConfig)

    @property
    def is_kge(self) -> bool:
        return self.model.kind in KG_MODELS

    def problems(self) -> list[tuple[str, str]]:
        if self.is_kge != (self.dataset.kind in KG_DATASETS):
            family = "a knowledge graph (" + ", ".join(KG_DATASETS) if self.is_kge else "a graph (" + ", ".join(GRAPH_DATASETS)
            return [("model.kind", f"{self.model.kind!r} trains on {family}), not dataset kind {self.dataset.kind!r}")]
        if self.model.kind == "sage" and self.model.sage.task == "link" and not self.dataset.link_split[1]:
            return [("dataset.link_split", "sage with task 'link' needs held-out test edges, e.g. [0.05, 0.1]")]
        return []


_MISSING = object()


# -- loading -------------------------------------------------------------------------------
def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe file; a :class:`ConfigError` lists every problem."""
    path = Path(path)
    source = f"recipe '{path}'"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)  # never more: the path may be /dev/zero or a huge file
            if len(raw) > MAX_RECIPE_BYTES:
                st = os.fstat(f.fileno())
                size = f"{st.st_size:,} bytes, over the limit of" if stat.S_ISREG(st.st_mode) else "more than"
                raise ConfigError(
                    [f"the file is {size} {MAX_RECIPE_BYTES:,} bytes ({MAX_RECIPE_BYTES >> 20} MiB)"],
                    source=source,
                    hint="a recipe is a short YAML file; check that this is the right one",
                )
    except OSError as e:
        raise ConfigError(
            [f"cannot read '{path}': {e.strerror}"],
            source=source,
            hint="check the path; the shipped recipes are in recipes/, for example recipes/quickstart.yaml",
        ) from None
    return parse_recipe(_decode(raw, source), source=source, overrides=overrides, default_name=path.stem)


def _decode(raw: bytes, source: str) -> str:
    """The file's text: UTF-8 (a byte-order mark is fine), else a ConfigError saying where it is not."""
    hint = "save it as UTF-8 (in most editors: File > Save with Encoding > UTF-8)"
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):  # fmt: skip
        if raw.startswith(bom):
            problem = f"the file is {name} (it starts with a {name} byte-order mark), not UTF-8; save it as UTF-8"
            raise ConfigError([problem], source=source, hint=hint)
    nul = raw.find(b"\0")
    if nul >= 0:  # valid UTF-8, but YAML refuses it: a binary file, or UTF-16 without a byte-order mark
        line = raw.count(b"\n", 0, nul) + 1
        problem = f"NUL byte at offset {nul} (line {line}): the file is binary or UTF-16, not UTF-8 text; save it as UTF-8"
        raise ConfigError([problem], source=source, hint=hint)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        offset = e.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)
        line = raw.count(b"\n", 0, offset) + 1
        problem = f"not UTF-8: byte 0x{raw[offset]:02x} at offset {offset} (line {line}) cannot be decoded; save it as UTF-8"
        raise ConfigError([problem], source=source, hint=hint) from None


def parse_recipe(
    text: str, *, source: str = "recipe", overrides: list[str] | tuple[str, ...] = (), default_name: str = "recipe"
) -> Recipe:
    """Parse YAML text into a :class:`Recipe` (see :func:`load_recipe`)."""
    data, lines, problems = _parse_yaml(text, source)
    for override in overrides:
        _apply_override(data, lines, override, problems)
    if "name" not in data:
        data["name"] = default_name
        lines[("name",)] = "the file name"
    recipe = _build(Recipe, data, (), lines, problems)
    if problems:
        raise ConfigError(problems, source=source)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what a run folder's config.yaml holds)."""
    data = _plain(dataclasses.asdict(recipe))
    ordered = {"name": data.pop("name"), "description": data.pop("description"), **data}
    return yaml.safe_dump(ordered, sort_keys=False)


def recipe_differences(a: Recipe, b: Recipe) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every key where two recipes differ."""
    flat_a, flat_b = _flatten(dataclasses.asdict(a)), _flatten(dataclasses.asdict(b))
    return [(key, flat_a[key], flat_b[key]) for key in flat_a if flat_a[key] != flat_b[key]]


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _size_problem(text: str, what: str) -> str | None:
    size = len(text) if len(text) > MAX_RECIPE_BYTES else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_RECIPE_BYTES:
        return f"{what} is {size:,} bytes, over the limit of {MAX_RECIPE_BYTES:,} bytes ({MAX_RECIPE_BYTES >> 20} MiB)"
    return None


def _parse_yaml(text: str, source: str) -> tuple[dict, dict[tuple, Any], list[str]]:
    """The data, the line of every key, and the problems of the YAML itself (duplicate keys)."""
    too_big = _size_problem(text, "the recipe")
    if too_big:
        raise ConfigError([too_big], source=source, hint="a recipe is a short YAML file; check that this is the right one")
    try:
        data, lines, duplicates = _load_bounded(text)
    except _Refused as e:
        raise ConfigError([f"{_dotted(e.path)} (line {e.line}): {e.problem}"], source=source) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML{_yaml_where(e, text)}: {_yaml_problem(e)}"], source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {_kind(data)}"], source=source)
    problems = [f"{_dotted(key)} (line {line}): duplicate key, first at line {first}; keep one" for key, line, first in duplicates]
    return data, lines, problems


def _yaml_where(e: yaml.YAMLError, text: str) -> str:
    mark = getattr(e, "problem_mark", None)
    if mark:
        return f" (line {mark.line + 1})"
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.position, int):
        return f" (line {text.count(chr(10), 0, e.position) + 1})"
    return ""


def _yaml_problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.character, int):
        reason = f"character #x{e.character:04x} is not allowed in YAML ({e.reason})"
        return f"{reason}; remove it, or write it as an escape inside double quotes"
    return str(getattr(e, "problem", None) or e)


class _Refused(Exception):
    """YAML the loader will not build: ``problem`` at ``path`` (line ``line``)."""

    def __init__(self, path: tuple, line: int, problem: str) -> None:
        super().__init__(problem)
        self.path, self.line, self.problem = path, line, problem


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _guarded(construct):
    """A constructor whose ValueError & co. (``2020-13-45``, 5000 digits, ``!!bool maybe``) is a YAML error."""

    def guarded(loader, node):
        try:
            return construct(loader, node)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, KeyError, OverflowError) as e:
            kind = node.tag.rpartition(":")[2] or "a value"
            article = "an" if kind[:1] in "aeiou" else "a"
            value = repr(_short(node.value)) if isinstance(node.value, str) else "this value"
            reason = str(e).partition("; use sys.set_int_max_str_digits")[0]
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {value} as {article} {kind} ({reason})", node.start_mark
            ) from None

    return guarded


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing while it composes what would blow up whatever walks the
    result: an alias inside its own anchor (a cycle), nesting deeper than ``MAX_DEPTH`` (also
    through aliases) and more than ``MAX_VALUES`` values once aliases are expanded (a bomb;
    merge keys ``<<`` count the same, PyYAML copies the pairs they merge). Composing stays
    linear in the text: an alias adds its anchor's precomputed size and depth."""

    yaml_constructors = {tag: _guarded(f) for tag, f in yaml.SafeLoader.yaml_constructors.items()}

    def __init__(self, stream, what: str) -> None:
        super().__init__(stream)
        self._what = what  # "the recipe", "the value" (of --set)
        self._path: list = []  # where the composer is, for messages
        self._level = 0  # collections open around it
        self._shape: dict[int, tuple[int, int]] = {}  # id(complete node) -> (values, depth) it expands to
        self._values = 0  # values composed so far, aliases expanded

    def _refuse(self, problem: str, event) -> None:
        raise _Refused(tuple(self._path), event.start_mark.line + 1, problem)

    def _count(self, values: int, event) -> None:
        self._values += values
        if self._values > MAX_VALUES:
            self._refuse(
                f"{self._what} has more than {MAX_VALUES} values once aliases are expanded (each use of an alias "
                "counts its anchor's values again); a recipe needs a few dozen: write fewer values or aliases",
                event,
            )

    def compose_node(self, parent, index):
        if parent is not None:  # a mapping's key (index None) or value (index: the key), or a list item
            part = index if isinstance(index, int) else index.value if isinstance(index, yaml.ScalarNode) else "?"
            self._path.append(part)
        try:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                target = self.anchors.get(event.anchor)
                if target is not None and id(target) not in self._shape:
                    self._refuse(f"an alias refers to itself: *{event.anchor} is inside &{event.anchor}; write the values out", event)
                node = super().compose_node(parent, index)  # the anchored node (or PyYAML's error)
                values, depth = self._shape[id(node)]
                if self._level + depth > MAX_DEPTH:
                    self._refuse(f"nested deeper than {MAX_DEPTH} levels (counting what aliases bring in); a recipe needs 4", event)
                self._count(values, event)
                return node
            collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
            if collection:
                if self._level >= MAX_DEPTH:
                    self._refuse(f"nested deeper than {MAX_DEPTH} levels; a recipe needs 4", event)
                self._level += 1
            self._count(1, event)
            try:
                node = super().compose_node(parent, index)
            finally:
                self._level -= collection
            if isinstance(node, yaml.MappingNode):
                children = [self._shape[id(n)] for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = [self._shape[id(n)] for n in node.value]
            else:
                children = []
            self._shape[id(node)] = (1 + sum(v for v, _ in children), collection + max((d for _, d in children), default=0))
            return node
        finally:
            if parent is not None:
                self._path.pop()


def _load_bounded(text: str, what: str = "the recipe") -> tuple[Any, dict[tuple, Any], list[tuple[tuple, int, int]]]:
    """``text``'s data, the line of each key and the duplicate keys (path, line, first line);
    raises ``yaml.YAMLError`` for invalid YAML and ``_Refused`` past the loader's bounds."""
    loader = _BoundedLoader(text, what)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}, []
        lines: dict[tuple, Any] = {}
        duplicates = _collect_lines(node, lines)  # before constructing: that rewrites merge keys
        return loader.construct_document(node), lines, duplicates
    except RecursionError:  # cannot happen within MAX_DEPTH; kept so it can never be a crash
        raise _Refused((), 1, f"nested too deeply to read (more than {MAX_DEPTH} levels)") from None
    finally:
        loader.dispose()


class _Alias(int):
    """The line of a key whose value is an alias: also where the aliased values were first seen."""

    target: tuple

    def __new__(cls, line: int, target: tuple):
        obj = super().__new__(cls, line)
        obj.target = target
        return obj


_MERGE = "tag:yaml.org,2002:merge"


def _collect_lines(root, lines: dict[tuple, Any]) -> list[tuple[tuple, int, int]]:
    """Record the line of every key and list item; return the duplicate keys (path, line, first line).

    Walks each node once (an alias is the same node object as its anchor: under the alias's
    path it is recorded as an :class:`_Alias` to where it was first seen), without recursion."""
    duplicates = []
    first_path: dict[int, tuple] = {id(root): ()}
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        children = []
        if isinstance(node, yaml.MappingNode):
            first_line: dict[tuple, int] = {}
            for key_node, value_node in node.value:
                scalar = isinstance(key_node, yaml.ScalarNode)
                key, line = (*path, key_node.value if scalar else "?"), key_node.start_mark.line + 1
                if scalar and key_node.tag != _MERGE:
                    name = (key_node.tag, key_node.value)
                    if name in first_line:
                        duplicates.append((key, line, first_line[name]))
                    else:
                        first_line[name] = line
                children.append((key, line, value_node))
        elif isinstance(node, yaml.SequenceNode):
            children = [((*path, i), item.start_mark.line + 1, item) for i, item in enumerate(node.value)]
        walk = []
        for key, line, child in children:
            if not isinstance(child, yaml.CollectionNode):
                lines[key] = line
            elif id(child) in first_path:  # met before: an alias
                lines[key] = _Alias(line, first_path[id(child)])
            else:
                lines[key], first_path[id(child)] = line, key
                walk.append((child, key))
        stack.extend(reversed(walk))
    return duplicates


def _apply_override(data: dict, lines: dict, override: str, problems: list[str]) -> None:
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        problems.append(f"--set {_short(override)!r}: expected key=value, for example train.epochs=5")
        return
    too_big = _size_problem(override, "the override")
    if too_big:
        problems.append(f"--set {_short(key)}: {too_big}")
        return
    parts = key.split(".")
    if len(parts) > MAX_DEPTH:
        problems.append(f"--set {_short(key)}: a key of {len(parts)} parts is deeper than any recipe key (at most {MAX_DEPTH})")
        return
    try:
        value, _, duplicates = _load_bounded(raw, "the value") if raw.strip() else ("", {}, [])
    except _Refused as e:
        problems.append(f"--set {key}: {e.problem}")
        return
    except yaml.YAMLError:
        value, duplicates = raw, []
    for path, _, _ in duplicates:
        problems.append(f"--set {key}: duplicate key '{_dotted(path)}' in the value; keep one")
    target = data
    for i, part in enumerate(parts[:-1]):
        existing = target.get(part)
        if existing is None:
            existing = target[part] = {}
        if not isinstance(existing, dict):
            problems.append(f"--set {key}: '{'.'.join(parts[: i + 1])}' is not a section")
            return
        target = existing
    target[parts[-1]] = value
    lines[tuple(parts)] = "--set"


# -- validation ------------------------------------------------------------------------------
def _part(part) -> str:
    """A path part as written in a message: plain names bare, anything else quoted."""
    return part if isinstance(part, str) and part.isidentifier() else repr(part)


def _dotted(path: tuple) -> str:
    return ".".join(_part(p) if not isinstance(p, int) or isinstance(p, bool) else str(p) for p in path) or "(top level)"


def _line(path: tuple, lines: dict):
    """The line of ``path``; inside an alias, the line where the aliased values are written."""
    for _ in range(MAX_DEPTH):  # each round follows one alias
        line = lines.get(path)
        if line is not None:
            return line
        for depth in range(len(path) - 1, 0, -1):
            ref = lines.get(path[:depth])
            if isinstance(ref, _Alias):
                path = ref.target + path[depth:]
                break
        else:
            return None
    return None


def _where(path: tuple, lines: dict) -> str:
    dotted = _dotted(path)
    line = _line(path, lines)
    if isinstance(line, str):  # "--set", "the file name"
        return f"{dotted} (from {line})"
    if line:
        return f"{dotted} (line {line})"
    for depth in range(len(path) - 1, 0, -1):  # a missing key: point at its section
        if isinstance(lines.get(path[:depth]), int):
            return f"{dotted} (in the section at line {lines[path[:depth]]})"
    return dotted


def _build(cls, data, path: tuple, lines: dict, problems: list[str]):
    """Instantiate dataclass ``cls`` from ``data``, appending every problem found."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{_where(path, lines)}: expected a section (key: value lines), got {_kind(data)}")
        data = {}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            problems.append(f"{_where((*path, key), lines)}: unknown key{hint}")
    kwargs = {}
    found_before = len(problems)  # cross-field checks only make sense when every field is valid
    for name, f in fields.items():
        here, tp = (*path, name), hints[name]
        if name in data:
            value = _convert(tp, data[name], here, lines, problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            choices = f" (required; one of {_show(_choices(tp))})" if _choices(tp) else " (required)"
            problems.append(f"{_where(here, lines)}: missing{choices}")
            value = _MISSING
        else:
            continue
        if value is _MISSING:
            kwargs[name] = _placeholder(tp)
            continue
        check = f.metadata.get("check")
        message = check(value) if check is not None and value is not None else None
        if message:
            problems.append(f"{_where(here, lines)}: {message}, got {data[name]!r}")
        kwargs[name] = value
    obj = cls(**kwargs)
    if len(problems) == found_before and hasattr(obj, "problems"):
        for name, message in obj.problems():
            problems.append(f"{_where((*path, *name.split('.')), lines)}: {message}")
    return obj


def _placeholder(tp):
    """A stand-in for an invalid or missing value, so validation can go on to the next one."""
    if not dataclasses.is_dataclass(tp):
        return None
    required = [f for f in dataclasses.fields(tp) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    hints = typing.get_type_hints(tp)
    return tp(**{f.name: _placeholder(hints[f.name]) for f in required})


def _choices(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _show(choices) -> str:
    return ", ".join(repr(c) for c in choices)


def _kind(value) -> str:
    if value is None:
        return "nothing (an empty value or null)"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"text ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a section"
    return type(value).__name__


def _convert(tp, value, path: tuple, lines: dict, problems: list[str]) -> Any:
    """``value`` as type ``tp``, or ``_MISSING`` after recording why it cannot be."""
    where = _where(path, lines)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, lines, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, lines, problems)
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"{where}: must be one of {_show(args)}, got {value!r}{hint}")
        return _MISSING
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{where}: expected true or false, got {_kind(value)}")
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        problems.append(f"{where}: expected a whole number, got {_kind(value)}")
        return _MISSING
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{where}: expected a number, got {_kind(value)}")
        return _MISSING
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{where}: expected text, got {_kind(value)}")
        return _MISSING
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {_kind(value)}")
            return _MISSING
        items = [_convert(args[0], item, (*path, i), lines, problems) for i, item in enumerate(value)]
        return _MISSING if any(item is _MISSING for item in items) else items
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            problems.append(f"{where}: expected a list of {len(args)} numbers, got {_kind(value)}")
            return _MISSING
        items = [_convert(a, item, (*path, i), lines, problems) for i, (a, item) in enumerate(zip(args, value))]
        return _MISSING if any(item is _MISSING for item in items) else tuple(items)
    raise TypeError(f"recipe field type {tp} is not supported")  # a bug in this file, not user input


def with_data_root(recipe: Recipe, *, stored: bool = False, note=None) -> Recipe:
    """``recipe`` with ``dataset.root`` resolved to the absolute data root it reads (its own,
    else ``$DSA_DATA_ROOT``, else ``./datasets``), as a new run stores it, so that ``eval``
    and ``--resume`` find the data without the environment the run was started in.
    ``stored``: the recipe is a run's; a set ``$DSA_DATA_ROOT`` other than its root wins (the
    data moved), and ``note(text)`` is told so."""
    root, env = recipe.dataset.root, os.environ.get("DSA_DATA_ROOT")
    if stored and root and env and Path(env).resolve() != Path(root).resolve():
        if note is not None:
            note(f"data root: $DSA_DATA_ROOT ({Path(env).resolve()}) instead of the run's {root}")
        root = env
    resolved = Path(root or env or "datasets").resolve()
    return dataclasses.replace(recipe, dataset=dataclasses.replace(recipe.dataset, root=str(resolved)))
