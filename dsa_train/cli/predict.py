"""``dsa-train predict`` and ``dsa-train neighbors``: answers from a trained run, by name."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path

import typer
from rich.table import Table

from ..errors import DsaError
from ._errors import handle_errors
from ._output import command_output, stderr, stdout

UNKNOWN = "?"


class IndexType(str, Enum):
    flat = "flat"
    ivf = "ivf"
    hnsw = "hnsw"


class Metric(str, Enum):
    cosine = "cosine"
    dot = "dot"
    l1 = "l1"
    l2 = "l2"


@handle_errors
@command_output()  # the run's warnings as it opens, and the index's recall, on stderr
def predict(
    run_dir: Path = typer.Argument(..., help="A run folder of a knowledge-graph model.", show_default=False),
    head: str | None = typer.Option(None, "--head", help="Ask for tails of (HEAD, RELATION, ?).", show_default=False),
    relation: str | None = typer.Option(None, "--relation", help="The relation's name.", show_default=False),
    tail: str | None = typer.Option(None, "--tail", help="Ask for heads of (?, RELATION, TAIL).", show_default=False),
    queries: Path | None = typer.Option(
        None,
        "--queries",
        metavar="FILE",
        help="Many queries at once: TSV lines head<TAB>relation<TAB>? or ?<TAB>relation<TAB>tail.",
        show_default=False,
    ),
    k: int = typer.Option(10, "-k", min=1, help="Answers per query."),
    filter_known: bool = typer.Option(False, "--filter", help="Leave out answers known in train, valid or test."),
    mark_known: bool = typer.Option(False, "--mark-known", help="Keep known answers, marked (instead of --filter)."),
    clicks: Path | None = typer.Option(
        None,
        "--clicks",
        metavar="FILE",
        help="A click model's run: the click probability of each impression of FILE, a click log "
        "in the run's format (the label column may be left out), one a line.",
        show_default=False,
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="With --clicks: write the probabilities to this new file instead of stdout.",
        show_default=False,
    ),
    checkpoint: int | None = typer.Option(
        None, "--checkpoint", help="The step of the checkpoint. Default: the newest intact one.", show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """The best answers to (head, relation, ?) or (?, relation, tail) queries, by name, exact.

    Every entity is scored with the model's own score function, the table read a chunk at a
    time (one pass answers all the queries of a --queries file). Names are as in the dataset;
    an unknown name is an error that suggests the closest known ones.

    Examples:

      dsa-train predict runs/fb15k237-complex-20261202-141500 --head /m/027rn --relation /location/country/form_of_government

      dsa-train predict runs/umls-transe-20261202-141500 --tail virus --relation causes -k 5 --filter

      dsa-train predict runs/umls-transe-20261202-141500 --queries questions.tsv --json

      dsa-train predict runs/recsys-quickstart-20261202-141500 --clicks today.tsv -o today.probabilities
    """
    from ..results import open_run  # torch and PyG: imported only when predicting

    if clicks is not None:
        if head or tail or relation or queries:
            raise DsaError(
                "--clicks scores a click log; it takes no --head, --tail, --relation or --queries",
                hint="give one kind of query",
            )
        _predict_clicks(open_run(run_dir, checkpoint), clicks, output)
        return
    if output is not None:
        raise DsaError(
            "--output writes the probabilities of --clicks", hint="use --json and a shell redirection for queries"
        )

    if filter_known and mark_known:
        raise DsaError(
            "--filter and --mark-known exclude each other",
            hint="--filter drops known answers, --mark-known keeps them marked",
        )
    asked = _read_queries(queries) if queries is not None else []
    if head is not None or tail is not None or relation is not None:
        if relation is None or (head is None) == (tail is None):
            raise DsaError(
                "a query needs --relation and exactly one of --head and --tail", hint="e.g. --head NAME --relation NAME"
            )
        asked.append((head, relation, tail))
    if not asked:
        raise DsaError("no query given", hint="pass --head/--tail with --relation, or --queries FILE")
    trained = open_run(run_dir, checkpoint)
    answers = trained.predict_many(asked, k=k, filter="mark" if mark_known else filter_known)
    if as_json:
        document = {
            "run": str(trained.run.path),
            "checkpoint": trained.step,
            "filter": "mark" if mark_known else filter_known,
            "queries": [
                {
                    "head": h,
                    "relation": r,
                    "tail": t,
                    "answers": [{"name": a.name, "id": a.id, "score": a.score, "known": a.known} for a in found],
                }
                for (h, r, t), found in zip(asked, answers)
            ],
        }
        typer.echo(json.dumps(document, indent=2, ensure_ascii=False))
        return
    for (h, r, t), found in zip(asked, answers):
        title = f"({h}, {r}, ?)" if t is None else f"(?, {r}, {t})"
        stdout.print(_answers_table(title, found, mark_known))


@handle_errors
@command_output()
def neighbors(
    run_dir: Path = typer.Argument(..., help="A run folder that `dsa-train run` made.", show_default=False),
    name: str = typer.Argument(
        ..., help="The entity's or node's name (a node's id where the graph has no names).", show_default=False
    ),
    k: int = typer.Option(10, "-k", min=1, help="How many neighbours."),
    metric: Metric | None = typer.Option(
        None,
        "--metric",
        help="cosine, dot, l1 or l2. Default: the model's own (l1/l2 for TransE and RotatE, dot otherwise).",
        show_default=False,
    ),
    table: str | None = typer.Option(
        None, "--table", help="entities, relations or nodes. Default: entities or nodes.", show_default=False
    ),
    checkpoint: int | None = typer.Option(
        None, "--checkpoint", help="The step of the checkpoint. Default: the newest intact one.", show_default=False
    ),
    approximate: bool = typer.Option(
        False,
        "--approximate",
        help='Search a faiss index (pip install "dsa-train[faiss]"), built and saved by the first such call, '
        "its recall@10 against the exact answer printed. Metrics: cosine, dot, l2.",
    ),
    index_type: IndexType | None = typer.Option(
        None,
        "--index-type",
        help="With --approximate: flat (exact), ivf or hnsw. Default: flat below 20,000 rows, hnsw above.",
        show_default=False,
    ),
    index_dir: Path | None = typer.Option(
        None,
        "--index-dir",
        help="With --approximate: the folder that keeps the index. Default: the run folder's ann/.",
        show_default=False,
    ),
    effort: int | None = typer.Option(
        None,
        "--effort",
        min=1,
        help="With --approximate: how hard a search looks: hnsw's efSearch (default 128) or the lists ivf probes "
        "(default 1/16, at least 16). Higher: more of the true neighbours, slower; the recall is measured again at it.",
        show_default=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """The rows nearest to NAME's vector, exact (the table read a chunk at a time) or, with
    --approximate, from a saved faiss index.

    Examples:

      dsa-train neighbors runs/cora-node2vec-20261202-141500 42 -k 5

      dsa-train neighbors runs/fb15k237-distmult-20261202-141500 /m/027rn --metric cosine --json

      dsa-train neighbors runs/synthetic-10m-transe-20261202-141500 42 --approximate --index-type hnsw
    """
    from ..results import open_run

    if not approximate and (index_type is not None or index_dir is not None or effort is not None):
        raise DsaError(
            "--index-type, --index-dir and --effort choose the index of --approximate",
            hint="add --approximate, or leave them out for the exact search",
        )
    trained = open_run(run_dir, checkpoint)
    chosen = metric.value if metric else trained.default_metric
    index = None
    if approximate:
        index = trained.ann_index(
            table, chosen, kind=index_type.value if index_type else None, folder=index_dir, effort=effort
        )
    found = trained.neighbors(name, k=k, metric=chosen, table=table, approximate=index or False)
    if as_json:
        document = {
            "run": str(trained.run.path),
            "checkpoint": trained.step,
            "name": name,
            "metric": chosen,
            "neighbors": [{"name": a.name, "id": a.id, "score": a.score} for a in found],
        }
        if index is not None:
            document["index"] = {key: index.manifest[key] for key in ("kind", "recall_at_10", "recall_queries")} | {
                "path": str(index.path)
            }
        typer.echo(json.dumps(document, indent=2, ensure_ascii=False))
        return
    how = (
        f"{chosen}, approximate: {index.manifest['kind']} index, recall@10 {index.recall:.3f}"
        if index is not None
        else chosen
    )
    stdout.print(_answers_table(f"nearest to {name} ({how})", found, False))
    if chosen in ("l1", "l2"):
        stdout.print(f"scores are negative {chosen.upper()} distances: higher is nearer", highlight=False)


def _predict_clicks(trained, clicks: Path, output: Path | None) -> None:
    """One probability a line, to stdout or to a new file written under a temporary name."""
    if output is None:
        for probabilities in trained.click_probabilities(clicks):
            typer.echo("".join(f"{p:.9g}\n" for p in probabilities.tolist()), nl=False)
        return
    if os.path.lexists(output):
        raise DsaError(f"--output '{output}' already exists", hint="give a new file name; nothing was written")
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    lines = 0
    try:
        with open(partial, "x", encoding="utf-8") as f:
            for probabilities in trained.click_probabilities(clicks):
                f.write("".join(f"{p:.9g}\n" for p in probabilities.tolist()))
                lines += len(probabilities)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    stderr.print(f"{lines:,} click probabilities written to {output}", highlight=False)


def _answers_table(title: str, answers, mark: bool) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("name")
    table.add_column("score", justify="right")
    if mark:
        table.add_column("known")
    for number, answer in enumerate(answers, 1):
        cells = [str(number), answer.name, f"{answer.score:.4f}"] + (["yes" if answer.known else ""] if mark else [])
        table.add_row(*cells)
    return table


def _read_queries(path: Path) -> list[tuple]:
    """``(head, relation, None)`` or ``(None, relation, tail)`` from a TSV file of queries."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DsaError(
            f"--queries: cannot read '{path}': {e}", hint="give a UTF-8 text file of head<TAB>relation<TAB>? lines"
        ) from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = line.split("\t")
        if (
            len(cells) != 3
            or (cells[0] == UNKNOWN) == (cells[2] == UNKNOWN)
            or UNKNOWN in (cells[1],)
            or not all(cells)
        ):
            raise DsaError(
                f"--queries: line {number} of '{path}' is {line!r}",
                hint="each line is head<TAB>relation<TAB>? or ?<TAB>relation<TAB>tail, with exactly one ?",
            )
        found.append((None if cells[0] == UNKNOWN else cells[0], cells[1], None if cells[2] == UNKNOWN else cells[2]))
    return found
