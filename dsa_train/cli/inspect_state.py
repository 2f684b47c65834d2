"""``dsa-train inspect-state``: what an optimizer state directory holds, without locking it."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import typer
from rich.table import Table

from ..errors import DsaError
from ..optim.inspect import PROBLEMS, StateInspector, live_holder
from ._errors import handle_errors
from ._output import ProgressReporter, stderr, stdout

#: Most rows one ``--rows`` may ask for (per parameter): a table is printed, not dumped.
MAX_ROWS = 100_000
#: A ``--check`` scan shows a progress bar (on a terminal) when it reads more than this.
LONG_SCAN_BYTES = 256 << 20


def parse_rows(spec: str) -> list[tuple[int, int]]:
    """``"0:10,42"`` -> ``[(0, 10), (42, 43)]``: ``[start, stop)`` ranges, never the row list
    (``0:2000000000`` is two numbers, not two billion)."""
    ranges: list[tuple[int, int]] = []
    try:
        for part in spec.split(","):
            if ":" in part:
                start, stop = part.split(":")
                ranges.append((int(start), int(stop)))
            elif part.strip():
                ranges.append((int(part), int(part) + 1))
    except ValueError:
        raise DsaError(f"--rows {spec!r} is not a row list", hint="write it like 0:10,42 (ranges stop before the end)") from None
    for start, stop in ranges:
        if start >= stop:
            raise DsaError(f"--rows range {start}:{stop} is empty", hint="write start:stop with start < stop (stop is not included)")
    if not ranges:
        raise DsaError(f"--rows {spec!r} names no rows", hint="write it like 0:10,42 (ranges stop before the end)")
    return ranges


def count_rows(ranges: list[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in ranges)


@handle_errors
def inspect_state(
    path: Path = typer.Argument(..., help="A state directory, or a run folder (its optimizer_state/).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    rows: str | None = typer.Option(
        None, "--rows", help=f"Print these rows' moments, e.g. 0:10,42 (at most {MAX_ROWS:,}).", show_default=False
    ),
    stats: bool = typer.Option(False, "--stats", help="Sampled statistics of m, v and the effective learning rate."),
    check: bool = typer.Option(
        False, "--check", help="Scan every row for NaN/Inf moments, negative v, non-finite table weights; exit 1 if any."
    ),
    param: str | None = typer.Option(None, "--param", help="Only this parameter (default: all).", show_default=False),
) -> None:
    """Show a DiskSparseAdam state directory: parameters, steps, bytes on disk, rows touched.

    Reads the manifest and a sample of rows only (--check: every row, in chunks), and takes no lock:
    it works on the directory of a running training. Each row file must have the size its
    shape needs: a truncated one is reported (restore it from a checkpoint).

    --check reads every row that holds data (holes, rows never touched, are zeros and are
    skipped), a few thousand rows at a time, and reports rows whose m or v is NaN or
    infinite, whose v is negative (Adam's v is a mean of squares), or, in a disk table, whose
    weight is not finite; it exits with 1 when it finds any. A flipped bit that leaves a value
    finite and plausible cannot be told apart row by row: checkpoints carry digests for that.
    On a running training's directory, a row being written may read as torn.

    Given a checkpoint's optimizer_state/, rows are read as that checkpoint holds them: a
    row file (or disk table) kept as a delta is read through its chain (base, then deltas),
    and the chain's files and bytes are listed. A chain may start from the file as it was
    made, which no file holds: zeros, or a table's initial weights, drawn again from its seed.

    Examples:

      dsa-train inspect-state runs/fb15k237-distmult-20261202-150000

      dsa-train inspect-state ./opt_state_cache --stats --rows 0:5,42 --json

      dsa-train inspect-state ./opt_state_cache --check
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
        "checkpoint": str(inspector.checkpoint) if inspector.checkpoint is not None else None,
        "params": {},
    }
    selected = parse_rows(rows) if rows else []
    for name in names:  # every refusal before anything is read
        inspector.check_ranges(name, selected)
    if count_rows(selected) > MAX_ROWS:
        raise DsaError(
            f"--rows asks for {count_rows(selected):,} rows; one call prints at most {MAX_ROWS:,} rows of a parameter",
            hint="ask for fewer rows per call (e.g. --rows 0:100000, then --rows 100000:200000), or --param one parameter",
        )
    for name in names:
        inspector.row_file(name)  # a truncated or swapped file is refused before any output
    for name in names:
        entry = dataclasses.asdict(inspector.summary(name))
        if stats:
            entry["stats"] = inspector.statistics(name)
        document["params"][name] = entry
    if check:
        document["check"] = _check(inspector, names)
    if as_json:
        _print_json(document, inspector, selected)
    else:
        _print(document, holder, inspector, selected)
    if check and not document["check"]["ok"]:
        raise typer.Exit(1)


def _check(inspector: StateInspector, names: list[str]) -> dict:
    reporter = ProgressReporter()
    result = {"ok": True, "rows_scanned": 0, "rows_read": 0, "params": {}}
    for name in names:
        base, _, size, allocated = inspector.row_file(name)
        long_scan = (allocated if isinstance(base, Path) else size) > LONG_SCAN_BYTES  # a virtual base is drawn, not read
        if long_scan:
            reporter.work_start(f"checking {name}", inspector.spec(name).num_rows)
        try:
            found = inspector.check(name, progress=reporter.work_advance if long_scan else None)
        finally:
            if long_scan:
                reporter.work_done()
        result["params"][name] = found
        result["rows_scanned"] += found["rows"]
        result["rows_read"] += found["rows_read"]
        result["ok"] = result["ok"] and found["bad_rows"] == 0
    return result


def _rows(inspector: StateInspector, name: str, selected: list[tuple[int, int]]):
    """``(row, m, v)`` of the selected rows, streamed chunk by chunk."""
    for chunk, m, v in inspector.iter_rows(name, selected):
        for i, row in enumerate(chunk):
            yield row, m[i], v[i]


def _print_json(document: dict, inspector: StateInspector, selected: list[tuple[int, int]]) -> None:
    """The document, with each parameter's ``rows`` written as they are read."""
    marks = {}
    if selected:
        for name, entry in document["params"].items():
            marks[name] = f"rows-{uuid.uuid4().hex}"
            entry["rows"] = marks[name]
    text = json.dumps(document, indent=2)
    for name, mark in marks.items():
        before, text = text.split(json.dumps(mark), 1)
        typer.echo(before + "{", nl=False)
        for i, (row, m, v) in enumerate(_rows(inspector, name, selected)):
            line = json.dumps({"m": m.tolist(), "v": v.tolist()})
            typer.echo(f'{"," if i else ""}\n        "{row}": {line}', nl=False)
        typer.echo("\n      }", nl=False)
    typer.echo(text)


def _print(document: dict, holder: str | None, inspector: StateInspector, selected: list[tuple[int, int]]) -> None:
    stdout.print(
        f"{document['path']}: {document['format']} version {document['version']}", markup=False
    )
    if holder:
        stderr.print(f"held by a live training, {holder}: read without its lock; values may move while read", highlight=False)
    elif not document["clean"]:
        stderr.print("not closed cleanly: its moments may be ahead of its step counters", highlight=False)
    if document["checkpoint"]:
        stdout.print(f"the optimizer state of checkpoint {document['checkpoint']}: rows are read as it holds them", highlight=False)
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
    shown = lambda xs: ", ".join(f"{x:.4g}" for x in xs[:6]) + (", ..." if len(xs) > 6 else "")  # noqa: E731
    for name, p in document["params"].items():
        if p["layout"] == "w|m|v":
            where = inspector.chain(name)[-1] if document["checkpoint"] else p["file"]
            stdout.print(f"{name}: weights and moments in the disk table {where}", highlight=False)
        if p.get("chain"):
            base, *deltas = p["chain"]
            stdout.print(
                f"{name}: base {base['file']} ({_bytes(base['bytes'])}) + {len(deltas)} delta{'s' if len(deltas) != 1 else ''} "
                f"({_bytes(sum(d['bytes'] for d in deltas))}): " + ", ".join(d["file"] for d in deltas),
                highlight=False,
            )
        for key in ("m", "v", "effective_lr"):
            if key in p.get("stats", {}):
                d = p["stats"][key]
                stdout.print(
                    f"{name} {key}: mean {d['mean']:.3g}, std {d['std']:.3g}, min {d['min']:.3g}, p01 {d['p01']:.3g}, "
                    f"median {d['median']:.3g}, p99 {d['p99']:.3g}, max {d['max']:.3g} "
                    f"({p['stats']['sampled_touched_rows']:,} sampled touched rows)",
                    highlight=False,
                )
        if selected:
            for row, m, v in _rows(inspector, name, selected):
                typer.echo(f"{name}[{row}]  m: [{shown(m)}]  v: [{shown(v)}]")
    if "check" in document:
        _print_check(document["check"])


def _print_check(check: dict) -> None:
    params = check["params"]
    scanned = (
        f"{check['rows_scanned']:,} rows of {len(params)} parameter{'s' if len(params) != 1 else ''} "
        f"({check['rows_read']:,} read, the rest never touched)"
    )
    if check["ok"]:
        stdout.print(f"check: no problems in {scanned}", highlight=False)
        return
    bad = sum(p["bad_rows"] for p in params.values())
    stdout.print(f"check: {bad:,} bad row{'s' if bad != 1 else ''} in {scanned}", highlight=False)
    for name, p in params.items():
        for kind, found in p["problems"].items():
            more = ", ..." if found["rows"] > len(found["first"]) else ""
            stdout.print(
                f"  {name}: {found['rows']:,} row{'s' if found['rows'] != 1 else ''} where {PROBLEMS[kind]} "
                f"({'rows' if len(found['first']) > 1 else 'row'} {', '.join(map(str, found['first']))}{more})",
                highlight=False,
            )


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)
