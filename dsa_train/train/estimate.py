"""What a recipe's run will take, before it starts: memory and disk for its embedding tables,
their Adam moments and the checkpoints kept, from the recipe alone (no data is read beyond a
click log's header, nothing is imported). ``validate`` and ``run --dry-run`` print it, with a
warning where it exceeds what the machine has.

The table has ``rows x model.dim`` float32 weights (``T`` bytes); Adam adds two moments per
weight (``2T``). Where each lives:

- ``embedding_storage: memory`` with ``dsa``: ``T`` in RAM, the moments in the optimizer's
  state files on disk (created sparse: only the rows a step touched take space), of which up
  to ``memory_budget`` stays resident;
- ``memory`` with ``sparse_adam``: ``3T`` in RAM (torch keeps dense moments);
- ``disk``: one table file of ``3T`` (weights and moments), in the page cache as far as RAM allows.

A checkpoint holds the model's weights (``T`` for a table in memory) and the optimizer's state
(the moments of the rows touched, up to ``2T``; a disk table's checkpoint is a delta of the rows
written since the previous one, up to ``3T``); the run keeps ``train.keep_checkpoints`` of them
plus the one being written. Rows come from the recipe where
it sets them (a generated dataset, DLRM's ``recsys.rows``) or from OGB's published counts
(``dataset.kind: ogbl``); an edge list's nodes and a click
log's impressions are estimated from the file's size and its first lines
(:mod:`~dsa_train.data.size_guess`), and so is the disk its import takes (the estimate says
so); other datasets read from files have their row count only once imported, and the
estimate says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..memory import free_disk_bytes, host_total_bytes, human_bytes
from ..recipe import Recipe

FLOAT_BYTES = 4

#: OGB's published counts of its link-prediction knowledge graphs (entities, relations), so that
#: a dry run sizes their tables before the zip is downloaded (the import counts them itself).
OGBL_SHAPES = {"ogbl-wikikg2": (2_500_604, 535), "ogbl-biokg": (93_773, 51)}


@dataclass(frozen=True)
class Estimate:
    """Bytes a run takes: ``ram`` resident (tables, SparseAdam's moments), ``disk`` written
    (tables on disk, optimizer state, the checkpoints kept), each with its parts."""

    rows: int | None
    ram: int
    disk: int
    parts: list[tuple[str, int, str]]  # (what, bytes, "RAM" | "disk")
    unknown: str = ""  # why rows are unknown
    guessed: str = ""  # where rows come from a sample of the data: what it was

    def lines(self, *, output: Path | None = None) -> list[str]:
        """The estimate in a few lines, and a warning where it exceeds this machine."""
        if self.rows is None:
            return [f"estimate: not made before the import ({self.unknown}); `dsa-train import RECIPE` imports it"]
        rows = f"{self.rows:,} table rows" + (f", about: {self.guessed}" if self.guessed else "")
        out = [f"estimate: tables in RAM {human_bytes(self.ram)}, disk up to {human_bytes(self.disk)} ({rows})"]
        out += [f"  {where}: {human_bytes(size)}  {what}" for what, size, where in self.parts if size]
        total = host_total_bytes()
        if total is not None and self.ram > total:
            out.append(
                f"warning: the tables need {human_bytes(self.ram)} of RAM and this machine has {human_bytes(total)}; "
                "lower the rows or model.dim, or set model.embedding_storage: disk"
            )
        free = free_disk_bytes(_existing(output)) if output is not None else None
        if free is not None and self.disk > free:
            out.append(
                f"warning: the run may write up to {human_bytes(self.disk)} and '{_existing(output)}' has {human_bytes(free)} free; "
                "lower train.keep_checkpoints or the table's size, or write the run (-o) elsewhere"
            )
        return out


def _existing(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def table_rows(recipe: Recipe) -> tuple[int | None, str]:
    """The rows of every embedding table the recipe trains, or ``None`` and why unknown (an
    edge list's are estimated by :func:`_imports`)."""
    data, model = recipe.dataset, recipe.model
    if recipe.is_recsys:
        if model.recsys.tables == "shared":
            return model.recsys.rows, ""
        features = _click_features(recipe)
        if features is None:
            return None, "the click log's categorical columns are unknown until its header is read"
        return model.recsys.rows * features, ""
    if data.kind == "synthetic":
        reciprocal = 2 if model.reciprocal else 1
        return data.synthetic.entities + reciprocal * data.synthetic.relations, ""
    if data.kind == "ogbl" and data.fetch in OGBL_SHAPES:
        entities, relations = OGBL_SHAPES[data.fetch]
        return entities + (2 if model.reciprocal else 1) * relations, ""
    if data.kind == "synthetic_graph":
        return data.graph.nodes, ""
    if data.kind == "karate":
        return 34, ""
    return None, f"the {data.kind} dataset's row count is known once it is imported"


def _click_features(recipe: Recipe) -> int | None:
    data = recipe.dataset
    if data.kind == "synthetic_clicks":
        return data.clicks.features
    if data.columns.sparse is not None:
        return len(data.columns.sparse)
    columns = _click_columns(recipe)
    return columns[0] if columns is not None else None


def _imports(recipe: Recipe) -> tuple[int | None, str, list[tuple[str, int, str]], str]:
    """For an edge list or a click log not yet imported: the table rows (edge lists; else
    ``None``), what the guess was made from, the import's estimated disk as a part, and why
    no guess was made (a file that cannot be sampled)."""
    from ..data import size_guess
    from ..data.graph_import import id_dtype
    from ..data.paths import dataset_path
    from ..errors import DsaError

    data = recipe.dataset
    try:
        if data.kind == "edge_list":
            guess = size_guess.edge_list_guess(data)
            ids = id_dtype(guess.nodes).itemsize
            bytes_ = (
                8 * (guess.nodes + 1) + ids * guess.items * (1 if data.edges.directed else 2) + 3 * ids * guess.nodes
            )
            if data.edges.ids == "names":
                bytes_ += guess.nodes * (16 + 8 + 12)  # a fingerprint, an offset, the name's bytes (about 12)
            what = f"the imported graph (about {guess.items:,} edges, {guess.nodes:,} nodes; written once, reused)"
            return guess.nodes, guess.how, [(what, bytes_, "disk")], ""
        if data.kind == "click_log":
            columns = _click_columns(recipe)
            if columns is None:
                return None, "", [], ""
            guess = size_guess.click_log_guess(dataset_path(data, data.path))
            features, dense = columns
            what = f"the imported click log (about {guess.items:,} impressions, {guess.how}; written once, reused)"
            return None, guess.how, [(what, guess.items * (1 + 4 * dense + 16 * features) + 8, "disk")], ""
    except (DsaError, OSError, ValueError, StopIteration) as e:
        return None, "", [], f"the {data.kind} could not be sampled: {e}".splitlines()[0]
    return None, "", [], ""


def _click_columns(recipe: Recipe) -> tuple[int, int] | None:
    """A click log's categorical and dense column counts, from the recipe or its header."""
    data = recipe.dataset
    if data.layout == "criteo" and data.columns.dense is None:
        return len(data.columns.sparse) if data.columns.sparse is not None else 26, 13
    from ..data.clicks_import import click_columns, click_log_file, read_click_chunks
    from ..data.paths import dataset_path
    from ..errors import DsaError

    try:
        features, dense = next(read_click_chunks(click_log_file(dataset_path(data, data.path)), click_columns(data)))
    except (DsaError, OSError, StopIteration):
        return None
    return len(features), len(dense)


def estimate(recipe: Recipe) -> Estimate:
    """The run's memory and disk (see the module docstring)."""
    rows, why = table_rows(recipe)
    guessed_rows, guessed, imports, unsampled = _imports(recipe)
    if rows is None and guessed_rows is not None:
        rows, why = guessed_rows, ""
    if rows is None:
        return Estimate(None, 0, 0, [], unsampled or why)
    table = rows * recipe.model.dim * FLOAT_BYTES
    on_disk, sparse_adam = recipe.model.embedding_storage == "disk", recipe.optimizer.kind == "sparse_adam"
    shape = f"{rows:,} x {recipe.model.dim} float32"
    parts: list[tuple[str, int, str]] = list(imports)
    if on_disk:
        parts.append(
            (
                f"the table file ({shape}: weights and Adam moments, in the page cache as far as RAM allows)",
                3 * table,
                "disk",
            )
        )
    else:
        parts.append((f"the table ({shape})", table, "RAM"))
        if sparse_adam:
            parts.append(("SparseAdam's dense moments", 2 * table, "RAM"))
        else:
            parts.append(("the optimizer's moments (sparse files: only touched rows take space)", 2 * table, "disk"))
    kept = recipe.train.keep_checkpoints + 1
    if on_disk:
        parts.append(
            (
                f"checkpoints: {kept} (keep_checkpoints + the one being written) of at most {human_bytes(3 * table)} each "
                "(a delta holds only the rows written since the previous one)",
                kept * 3 * table,
                "disk",
            )
        )
    else:
        parts.append(
            (
                f"checkpoints: {kept} (keep_checkpoints + the one being written) of {human_bytes(table)} of weights each, "
                "plus the moments of the rows touched (up to twice that)",
                kept * table,
                "disk",
            )
        )
    ram = sum(size for _, size, where in parts if where == "RAM")
    disk = sum(size for _, size, where in parts if where == "disk")
    return Estimate(rows, ram, disk, parts, guessed=guessed if guessed_rows is not None else "")
