"""``dsa-train inspect-state``: what an optimizer state directory holds, without locking it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from rich.table import Table

from ..errors import DsaError
from ..optim.inspect import StateInspector, live_holder
from ._errors import handle_errors
from ._output import stderr, stdout


def parse_rows(spec: str) -> list[int]:
    """``"0:10,42"`` -> ``[0, 1, ..., 9, 42]``."""
    rows: list[int] = []
    try:
        for part in spec.split(","):
            if ":" in part:
                start, stop = part.split(":")
                rows.extend(range(int(start), int(stop)))
            elif part.strip():
                rows.append(int(part))
    except ValueError:
        raise DsaError(f"--rows {spec!r} is not a row list", hint="write it like 0:10,42 (ranges stop before the end)") from None
    return rows


@handle_errors
def inspect_state(
    path: Path = typer.Argument(..., help="A state directory, or a run folder (its optimizer_state/).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    rows: str | None = typer.Option(None, "--rows", help="Print these rows' moments, e.g. 0:10,42.", show_default=False),
    stats: bool = typer.Option(False, "--stats", help="Sampled statistics of m, v and the effective learning rate."),
    param: str | None = typer.Option(None, "--param", help="Only this parameter (default: all).", show_default=False),
) -> None:
    """Show a DiskSparseAdam state directory: parameters, steps, bytes on disk, rows touched.

    Reads the manifest and a sample of rows only, never a whole row file, and takes no lock:
    it works on the directory of a running training.

    Examples:

      dsa-train inspect-state runs/fb15k237-distmult-20261202-150000

      dsa-train inspect-state ./opt_state_cache --stats --rows 0:5,42 --json
    """
    inspector = StateInspector.of(path)
    names = [param] if param else list(inspector.params)
    holder = live_holder(inspector.path)
    document = {
        "path": str(inspector.path),
        "format": inspector.manifest["format"],
        "version": inspector.manifest["version"],
        "clean": inspector.manifest["clean"],
        "held_by": holder,
        "params": {},
    }
    selected = parse_rows(rows) if rows else []
    for name in names:
        entry = dataclasses.asdict(inspector.summary(name))
        if stats:
            entry["stats"] = inspector.statistics(name)
        if selected:
            m, v = inspector.read_rows(name, selected)
            entry["rows"] = {str(r): {"m": m[i].tolist(), "v": v[i].tolist()} for i, r in enumerate(selected)}
        document["params"][name] = entry
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    _print(document, holder)


def _print(document: dict, holder: str | None) -> None:
    stdout.print(
        f"{document['path']}: {document['format']} version {document['version']}", markup=False
    )
    if holder:
        stderr.print(f"held by a live training, {holder}: read without its lock; values may move while read", highlight=False)
    elif not document["clean"]:
        stderr.print("not closed cleanly: its moments may be ahead of its step counters", highlight=False)
    table = Table()
    for column in ("parameter", "shape", "dtype", "layout", "step", "size", "allocated", "rows touched"):
        table.add_column(column, justify="left" if column == "parameter" else "right")
    for name, p in document["params"].items():
        table.add_row(
            name,
            " x ".join(f"{s:,}" for s in p["shape"]),
            p["dtype"],
            p["layout"],
            f"{p['step']:,}",
            _bytes(p["apparent_bytes"]),
            _bytes(p["allocated_bytes"]),
            f"~{100 * p['touched_rows_fraction']:.1f}% of {p['sampled_rows']:,} sampled",
        )
    stdout.print(table)
    for name, p in document["params"].items():
        if p["layout"] == "w|m|v":
            stdout.print(f"{name}: weights and moments in the disk table {p['file']}", highlight=False)
        for key in ("m", "v", "effective_lr"):
            if key in p.get("stats", {}):
                d = p["stats"][key]
                stdout.print(
                    f"{name} {key}: mean {d['mean']:.3g}, std {d['std']:.3g}, min {d['min']:.3g}, p01 {d['p01']:.3g}, "
                    f"median {d['median']:.3g}, p99 {d['p99']:.3g}, max {d['max']:.3g} "
                    f"({p['stats']['sampled_touched_rows']:,} sampled touched rows)",
                    highlight=False,
                )
        for row, values in p.get("rows", {}).items():
            shown = lambda xs: ", ".join(f"{x:.4g}" for x in xs[:6]) + (", ..." if len(xs) > 6 else "")  # noqa: E731
            stdout.print(f"{name}[{row}]  m: [{shown(values['m'])}]  v: [{shown(values['v'])}]", highlight=False)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)
