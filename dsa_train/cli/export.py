"""``dsa-train export``: a run's tables as files other tools read."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from ._errors import handle_errors
from ._output import ProgressReporter, command_output, stdout


class Format(str, Enum):
    npy = "npy"
    tsv = "tsv"
    word2vec = "word2vec"
    parquet = "parquet"


@handle_errors
def export(
    run_dir: Path = typer.Argument(..., help="A run folder that `dsa-train run` made.", show_default=False),
    out: Path = typer.Option(
        ..., "--output", "-o", help="The folder to create; it must not exist (see --force).", show_default=False
    ),
    fmt: Format = typer.Option(
        Format.npy,
        "--format",
        help="npy: numpy arrays; tsv: one row a line; word2vec: text gensim loads; parquet: id, name, vector columns (needs pyarrow).",
    ),
    checkpoint: int | None = typer.Option(
        None, "--checkpoint", help="The step of the checkpoint. Default: the newest intact one.", show_default=False
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUTPUT if it is an earlier export (never anything else)."
    ),
) -> None:
    """Write every table of a run's checkpoint to a folder: weights, a names file and export.json.

    Each table (entities and relations for knowledge graphs, nodes for node embeddings)
    becomes TABLE.npy (or TABLE.tsv, TABLE.w2v.txt) with TABLE.names.tsv (id<TAB>name, in row
    order); export.json names the model, its settings, the checkpoint and what each table's
    columns mean (ComplEx's real and imaginary halves, RotatE's phases). Tables stream a chunk
    at a time, so one larger than RAM exports in bounded memory; nothing appears under OUTPUT
    until it is complete.

    Examples:

      dsa-train export runs/quickstart-20261202-141500 -o quickstart-vectors

      dsa-train export runs/fb15k237-complex-20261202-141500 --format word2vec -o fb-w2v

      python -c "import numpy; print(numpy.load('quickstart-vectors/entities.npy').shape)"
    """
    from ..results import export_run, open_run  # torch and PyG: imported only when exporting

    with command_output(ProgressReporter()):  # the run's warnings as it opens, then a bar per table
        trained = open_run(run_dir, checkpoint)
        manifest = export_run(trained, out, fmt.value, force=force)
    for table, entry in manifest["tables"].items():
        stdout.print(
            f"{table}: {entry['rows']:,} x {entry['dim']} -> {out / entry['weights']}, names in {out / entry['names']}",
            highlight=False,
        )
    stdout.print(
        f"checkpoint {manifest['checkpoint']} of {trained.run.path}; what each file holds: {out / 'export.json'}",
        highlight=False,
    )
