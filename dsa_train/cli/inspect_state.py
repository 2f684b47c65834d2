"""``dsa-train inspect-state``: what an optimizer state directory holds, without locking it."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import typer
from rich.table import Table

from ..errors import DsaError, StateError
from ..storage.inspect import PROBLEMS, StateInspector, live_holder
from ..runs.cleanup import job_ranks
from ..runs.run_folder import is_job
from ..storage.format import MANIFEST
from ..runs.checkpoint_store import CheckpointStore
from ..runs.run_folder import JOB_MANIFEST, RANKS, STATE_DIR, RunFolder, job_checkpoints, read_marker
from ..memory import human_bytes
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
        raise DsaError(
            f"--rows {spec!r} is not a row list", hint="write it like 0:10,42 (ranges stop before the end)"
        ) from None
    for start, stop in ranges:
        if start >= stop:
            raise DsaError(
                f"--rows range {start}:{stop} is empty",
                hint="write start:stop with start < stop (stop is not included)",
            )
    if not ranges:
        raise DsaError(f"--rows {spec!r} names no rows", hint="write it like 0:10,42 (ranges stop before the end)")
    return ranges


def count_rows(ranges: list[tuple[int, int]]) -> int:
    return sum(stop - start for start, stop in ranges)


@handle_errors
def inspect_state(
    path: Path = typer.Argument(
        ...,
        help="A state directory, a run folder (its optimizer_state/), or a torchrun job's run folder (every rank's).",
        show_default=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    rows: str | None = typer.Option(
        None,
        "--rows",
        show_default=False,
        help=f"Print these rows' moments, e.g. 0:10,42 (at most {MAX_ROWS:,}); in a torchrun job's folder, each rank's local rows.",
    ),
    stats: bool = typer.Option(False, "--stats", help="Sampled statistics of m, v and the effective learning rate."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Scan every row (of every rank) for NaN/Inf moments, negative v, non-finite table weights; exit 1 if any.",
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

    Given a torchrun job's run folder (ranks/<rank>-of-<world>/ in it), every rank's state on
    this machine, one section per rank labelled "rank R of W": each holds its own block of the
    entity table's rows. --rows, --param, --stats and --check apply to each rank, and row
    numbers are that rank's local rows (its row r is not entity r: ids are shuffled before
    the table is split). Pass one rank's folder (runs/<name>/ranks/00001-of-00002) for that
    rank alone, as a run folder.

    Examples:

      dsa-train inspect-state runs/fb15k237-distmult-20261202-150000

      dsa-train inspect-state ./opt_state_cache --stats --rows 0:5,42 --json

      dsa-train inspect-state ./opt_state_cache --check
    """
    selected = parse_rows(rows) if rows else []
    if is_job(path):
        ok = _inspect_job(path, as_json=as_json, selected=selected, stats=stats, check=check, param=param)
    else:
        inspector, names = _open(path, param, selected)
        document = _document(inspector, names, stats=stats, check=check)
        if as_json:
            _print_json(document, [(document, inspector)], selected)
        else:
            _print(document, inspector, selected)
        ok = not check or document["check"]["ok"]
    if not ok:
        raise typer.Exit(1)


def state_of(path: Path) -> tuple[Path, Path | None]:
    """The state directory ``path`` names, and the checkpoint whose copy it is (or ``None``).

    A run folder names the state its marker records (``optimizer_state/``, or a recipe's own
    ``optimizer.state_dir``); a checkpoint folder names its copy. A run whose live state was
    removed (``dsa-train clean``) points to its newest checkpoint's copy."""
    path = Path(path)
    if CheckpointStore.get_trainer_file(path).is_file():  # a checkpoint folder
        return path / STATE_DIR, path
    if path.name == STATE_DIR and CheckpointStore.get_trainer_file(path.parent).is_file():  # a checkpoint's copy
        return path, path.parent
    if read_marker(path) is None:
        return path, None  # a state directory (StateInspector says if it is not one)
    state = RunFolder(path).live_state_dir
    if not (state / MANIFEST).is_file():
        kept = CheckpointStore.of_run(path).complete()
        if kept:
            raise DsaError(
                f"run '{path}' has no live optimizer state any more (at '{state}': removed by dsa-train clean once the run "
                f"finished, or never made); its checkpoints keep copies, the newest at step {int(kept[-1].name):,}",
                hint=f"dsa-train inspect-state {kept[-1]}",
            )
    return state, None


def _open(path: Path, param: str | None, selected: list[tuple[int, int]]) -> tuple[StateInspector, list[str]]:
    """The inspector of ``path`` and the parameters to show, once every refusal is made (a
    row range out of range, a truncated or swapped row file), before anything is printed."""
    state, checkpoint = state_of(path)
    inspector = StateInspector(state, checkpoint=checkpoint)
    names = [param] if param else list(inspector.params)
    for name in names:
        inspector.check_ranges(name, selected)
    if count_rows(selected) > MAX_ROWS:
        raise DsaError(
            f"--rows asks for {count_rows(selected):,} rows; one call prints at most {MAX_ROWS:,} rows of a parameter",
            hint="ask for fewer rows per call (e.g. --rows 0:100000, then --rows 100000:200000), or --param one parameter",
        )
    for name in names:
        inspector.row_file(name)
    return inspector, names


def _document(inspector: StateInspector, names: list[str], *, stats: bool, check: bool) -> dict:
    holder = live_holder(inspector.path)
    document = {
        "path": str(inspector.path),
        "format": inspector.manifest["format"],
        "version": inspector.manifest["version"],
        "clean": inspector.manifest["clean"],
        "held_by": holder,
        "memory_budget": inspector.manifest.get("memory_budget"),
        "checkpoint": str(inspector.checkpoint) if inspector.checkpoint is not None else None,
        "params": {},
    }
    for name in names:
        entry = dataclasses.asdict(inspector.summary(name))
        if stats:
            entry["stats"] = inspector.statistics(name)
        document["params"][name] = entry
    if check:
        document["check"] = _check(inspector, names)
    return document


def _inspect_job(
    path: Path, *, as_json: bool, selected: list[tuple[int, int]], stats: bool, check: bool, param: str | None
) -> bool:
    """Every rank's state in a torchrun job's folder, one section per rank; whether --check
    found nothing wrong in any."""
    entries = job_ranks(path)
    for entry in entries:
        if entry.problem == "a symbolic link":
            raise StateError(
                f"rank folder '{entry.path}' is a symbolic link; dsa-train never follows links inside a run folder",
                hint="replace it with the real folder, or inspect that rank's folder where it really is",
            )
    ranks = [e for e in entries if e.problem is None]
    listed = job_checkpoints(path)
    if not ranks:
        raise StateError(
            f"'{path}' is a torchrun job's run folder, but its {RANKS}/ holds no rank's run folder",
            hint="each rank's folder is on the machine that ran it (runs/<name>/ranks/<rank>-of-<world>/)",
        )
    opened = []
    for entry in ranks:  # every refusal before anything is printed
        try:
            opened.append((entry, *_open(entry.path, param, selected)))
        except DsaError as e:  # the same refusal, naming the rank
            kind = StateError if isinstance(e, StateError) else DsaError
            raise kind(f"{entry.label} ('{entry.path}'): {e.message}", hint=e.hint) from None
    worlds = sorted({e.world_size for e in ranks})
    job = {
        "path": str(path),
        "kind": "torchrun job",
        "world_size": worlds[0] if len(worlds) == 1 else worlds,
        "complete_checkpoints": listed[1] if listed is not None else None,
        "ranks": [],
    }
    for entry, inspector, names in opened:
        job["ranks"].append(
            {
                "rank": entry.rank,
                "world_size": entry.world_size,
                "folder": str(entry.path),
                **_document(inspector, names, stats=stats, check=check),
            }
        )
    ok = not check or all(r["check"]["ok"] for r in job["ranks"])
    if check:
        job["check"] = {"ok": ok}
    if as_json:
        _print_json(job, [(r, inspector) for r, (_, inspector, _) in zip(job["ranks"], opened)], selected)
        return ok
    here = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}" + (
        f" of {worlds[0]} here (the others' folders are on their own machines)"
        if len(worlds) == 1 and len(ranks) < worlds[0]
        else ""
    )
    complete = (
        f"complete checkpoints (steps): {', '.join(map(str, listed[1])) or 'none yet'}"
        if listed is not None
        else f"no {JOB_MANIFEST} here (rank 0's machine has it, once a checkpoint is complete)"
    )
    stdout.print(
        f"{path}: a torchrun job's run folder, {here}; {complete}", markup=False, highlight=False, soft_wrap=True
    )
    for entry in entries:
        if entry.problem:
            stderr.print(f"skipping {entry.path}: {entry.problem}", markup=False, highlight=False, soft_wrap=True)
    for document, (entry, inspector, _) in zip(job["ranks"], opened):
        stdout.print()
        rows = ", ".join(f"{p['shape'][0]:,} rows of {name}" for name, p in document["params"].items())
        stdout.print(f"{entry.label} ({entry.path}): {rows}", markup=False, highlight=False, soft_wrap=True)
        _print(document, inspector, selected)
    return ok


def _check(inspector: StateInspector, names: list[str]) -> dict:
    reporter = ProgressReporter()
    result = {"ok": True, "rows_scanned": 0, "rows_read": 0, "params": {}}
    for name in names:
        base, _, size, allocated = inspector.row_file(name)
        long_scan = (
            allocated if isinstance(base, Path) else size
        ) > LONG_SCAN_BYTES  # a virtual base is drawn, not read
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


def _print_json(document: dict, parts: list[tuple[dict, StateInspector]], selected: list[tuple[int, int]]) -> None:
    """The document, with each parameter's ``rows`` written as they are read; ``parts``: the
    state documents in it (the document itself, or each rank's) and their inspectors."""
    marks = {}
    if selected:
        for part, inspector in parts:
            for name, entry in part["params"].items():
                mark = f"rows-{uuid.uuid4().hex}"
                entry["rows"] = mark
                marks[mark] = (inspector, name)
    text = json.dumps(document, indent=2)
    for mark, (inspector, name) in marks.items():
        before, text = text.split(json.dumps(mark), 1)
        line = before.rsplit("\n", 1)[-1]
        indent = " " * (len(line) - len(line.lstrip()))
        typer.echo(before + "{", nl=False)
        for i, (row, m, v) in enumerate(_rows(inspector, name, selected)):
            values = json.dumps({"m": m.tolist(), "v": v.tolist()})
            typer.echo(f'{"," if i else ""}\n{indent}  "{row}": {values}', nl=False)
        typer.echo(f"\n{indent}}}", nl=False)
    typer.echo(text)


def _print(document: dict, inspector: StateInspector, selected: list[tuple[int, int]]) -> None:
    holder = document["held_by"]
    stdout.print(f"{document['path']}: {document['format']} version {document['version']}", markup=False)
    if holder:
        stderr.print(
            f"held by a live training, {holder}: read without its lock; values may move while read", highlight=False
        )
    elif not document["clean"]:
        stderr.print("not closed cleanly: its moments may be ahead of its step counters", highlight=False)
    if document["memory_budget"] is not None:
        stdout.print(
            f"memory budget {human_bytes(document['memory_budget'])}: the changed rows its last writer could keep in memory "
            "between flushes, a step's own writes included",
            highlight=False,
        )
    if document["checkpoint"]:
        stdout.print(
            f"the optimizer state of checkpoint {document['checkpoint']}: rows are read as it holds them",
            highlight=False,
        )
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
            human_bytes(p["apparent_bytes"]),
            human_bytes(p["allocated_bytes"]),
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
                f"{name}: base {base['file']} ({human_bytes(base['bytes'])}) + {len(deltas)} delta{'s' if len(deltas) != 1 else ''} "
                f"({human_bytes(sum(d['bytes'] for d in deltas))}): " + ", ".join(d["file"] for d in deltas),
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
