"""Edge-list files as people have them (SNAP's ``# comment`` lines and ``src dst`` pairs, a
database's CSV export with a header, a weights column, names or numbers): their format,
detected from the first lines or declared (``dataset.edges``), and their lines split into
fields chunk by chunk, vectorised, every line checked.

A line is a comment when it starts with ``comment`` (``#`` by default) and skipped, as is a
blank line; a CRLF ending is read as a plain one; a field's surrounding spaces and one pair
of surrounding double quotes are dropped (a quoted field cannot hold the delimiter). Every
other line must have the same number of fields as the first; anything else (a field count
that differs, an empty field, bytes that are not UTF-8, a number that is not one) is a
``DatasetError`` naming the file and the line, never dropped or mis-read.
:mod:`.edge_import` turns the fields into an imported graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DatasetError
from .tsv import MAX_REPORTED, _chunks

WHITESPACE = " "  # the delimiter that means runs of spaces and tabs
#: Header words that mark a first line as a header even above names.
HEADER_WORDS = {
    "source",
    "target",
    "src",
    "dst",
    "from",
    "to",
    "node1",
    "node2",
    "node_1",
    "node_2",
    "u",
    "v",
    "head",
    "tail",
    "weight",
    "id1",
    "id2",
    "source_id",
    "target_id",
    "src_id",
    "dst_id",
    "start",
    "end",
    "from_id",
    "to_id",
}
SNIFF_BYTES = 1 << 16


@dataclass(frozen=True)
class EdgeFormat:
    """How an edge-list file reads: what each setting is, and which were detected."""

    delimiter: str  # one character; WHITESPACE: runs of spaces and tabs
    comment: str
    header: bool
    width: int  # fields on every line
    columns: tuple[int, ...]  # positions of source, target and (if any) weight
    names: tuple[str, ...] = ()  # the header's column names
    detected: tuple[str, ...] = ()  # settings found in the file rather than the recipe

    def describe(self) -> str:
        """One line for the user: what was read, what was detected, how to change it."""
        delimiter = {WHITESPACE: "runs of spaces and tabs", "\t": "tab", ",": "comma"}.get(
            self.delimiter, repr(self.delimiter)
        )
        what = {0: "source", 1: "target", 2: "weight"}
        columns = ", ".join(
            f"{what[i]} = {self.names[c] if self.names else f'column {c}'}" for i, c in enumerate(self.columns)
        )
        header = f"a header ({', '.join(self.names)})" if self.header else "no header"
        found = (
            f"; detected: {', '.join(self.detected)} (set dataset.edges.<setting> to change it)"
            if self.detected
            else ""
        )
        return f"{delimiter} between {self.width} columns, {header}, {columns}{found}"


def edge_format(path: Path, *, delimiter, comment: str, header, source, target, weight) -> EdgeFormat:
    """The format of ``path`` (the first file), its undeclared settings detected from its first
    data lines. Raises ``DatasetError`` (an empty file) or ``ConfigError`` (a named column
    the header lacks)."""
    numbered = _first_lines(path, comment)
    numbers, lines = [n for n, _ in numbered], [line for _, line in numbered]
    if not lines:
        raise DatasetError(
            f"edge list '{path}' has no edges (only comments or blank lines, or nothing)",
            hint="check the file, or point dataset.path at another",
        )
    detected = []
    if delimiter is None:
        delimiter, _ = _sniff_delimiter(lines[0]), detected.append("delimiter")
    fields = [split_line(line, delimiter) for line in lines]
    named = any(isinstance(c, str) for c in (source, target, weight))
    if header is None:
        header = named or _looks_like_header(fields, [c for c in (source, target) if isinstance(c, int)])
        detected.append("header")
    elif named and not header:
        raise ConfigError(
            [
                f"dataset.edges: columns named {[c for c in (source, target, weight) if isinstance(c, str)]} need a header; set header: true or give positions"
            ]
        )
    names = tuple(fields[0]) if header else ()
    width = len(fields[0])
    if width < 2:
        raise DatasetError(
            f"edge list {path}:{numbers[0]}: line {lines[0][:200]!r} has one column; an edge needs two (source and target)",
            hint="check the file, or set dataset.edges.delimiter to the character between the columns",
        )
    columns = []
    for what, column in (("source", source), ("target", target), ("weight", weight)):
        if column is None:
            continue
        if isinstance(column, str):
            if column not in names:
                raise ConfigError(
                    [f"dataset.edges.{what}: '{path}' has no column {column!r} (its header: {', '.join(names)})"],
                    hint="name a column of the header, or give its position (0 is the first)",
                )
            column = names.index(column)
        elif column >= width:
            raise ConfigError(
                [
                    f"dataset.edges.{what}: column {column} is past the {width} columns of {path}:{numbers[0]} ({lines[0][:200]!r})"
                ],
                hint="positions count from 0; check dataset.edges.delimiter",
            )
        columns.append(column)
    return EdgeFormat(delimiter, comment, bool(header), width, tuple(columns), names, tuple(detected))


def _first_lines(path: Path, comment: str, count: int = 2) -> list[tuple[int, str]]:
    """The first ``count`` data lines (not comments, not blank), decoded leniently, with their line numbers."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    out = []
    for number, raw in enumerate(head.split(b"\n")[:-1] if len(head) == SNIFF_BYTES else head.split(b"\n"), 1):
        line = raw.removesuffix(b"\r").decode("utf-8", errors="replace")
        if line.strip() and not (comment and line.startswith(comment)):
            out.append((number, line))
            if len(out) == count:
                break
    return out


def _sniff_delimiter(line: str) -> str:
    """',' if the line holds one; a tab where the fields hold spaces; else runs of whitespace."""
    if "," in line:
        return ","
    if "\t" in line and " " in line.strip(" \t"):
        return "\t"
    return WHITESPACE


def split_line(line: str, delimiter: str) -> list[str]:
    """One line's fields, as :func:`split_chunk` reads them (for detection and messages)."""
    parts = line.split() if delimiter == WHITESPACE else line.split(delimiter)
    return [_unquote(p.strip(" ")) for p in parts]


def _unquote(field: str) -> str:
    return field[1:-1] if len(field) >= 2 and field[0] == field[-1] == '"' else field


def _looks_like_header(fields: list[list[str]], columns: list[int]) -> bool:
    """A first line is a header when it holds a known column word, or words where the next
    line holds numbers."""
    first = fields[0]
    if any(f.lower() in HEADER_WORDS for f in first):
        return True
    if len(fields) < 2 or not columns:
        return False
    second = fields[1]
    return all(c < len(first) and c < len(second) and not first[c].isdigit() and second[c].isdigit() for c in columns)


# -- reading chunks ------------------------------------------------------------------------------
def file_chunks(files: list[Path]) -> Iterator[tuple[Path, bytes, int, bool]]:
    """Every file's chunks of whole lines as ``(path, data, lines before it in its file, first
    chunk of its file)``."""
    for path in files:
        first = True
        for data, before, _ in _chunks(path):
            yield path, data, before, first
            first = False


def split_chunk(
    data: bytes, fmt: EdgeFormat, columns: tuple[int, ...], *, skip_header: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, str]]]:
    """The chunk's bytes, the ``(lines, len(columns), 2)`` ``(start, length)`` of the wanted
    fields of each data line, each data line's index in the chunk, and ``(line index,
    problem)`` for each bad line (then no fields). ``skip_header``: the chunk's first data
    line is the header."""
    text = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(text == 10)
    ends = newlines if data.endswith(b"\n") else np.append(newlines, len(text))
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    ends = ends - ((ends > starts) & (text[np.maximum(ends - 1, 0)] == 13))  # a CRLF ending reads as LF
    if fmt.delimiter == WHITESPACE:
        counts, first, field_starts, field_ends = _whitespace_fields(text, starts, ends)
    else:
        counts, first, field_starts, field_ends = _char_fields(text, starts, ends, ord(fmt.delimiter))
    skipped = counts == 0  # blank lines
    if fmt.comment:
        skipped |= _starts_with(text, starts, ends, fmt.comment.encode())
    data_lines = np.flatnonzero(~skipped)
    if skip_header and len(data_lines):
        data_lines = data_lines[1:]
    problems = []
    bad = data_lines[counts[data_lines] != fmt.width]
    for index in bad[: MAX_REPORTED + 1].tolist():
        problems.append(
            (
                index,
                f"has {counts[index]} fields, expected {fmt.width} ({_delimiter_words(fmt.delimiter)}; the first line had {fmt.width})",
            )
        )
    if len(bad):
        data_lines = data_lines[counts[data_lines] == fmt.width]
    cells = first[data_lines][:, None] + np.asarray(columns, np.int64)[None, :]
    s, e = _strip(text, field_starts[cells], field_ends[cells], spaces=fmt.delimiter != WHITESPACE)
    empty = (e <= s).any(1)
    for index in data_lines[empty][: MAX_REPORTED + 1].tolist():
        problems.append((index, "has an empty field"))
    if not data.isascii():
        problems += _utf8_problems(data, newlines)
    if problems:
        problems.sort()
        return text, np.empty((0, len(columns), 2), np.int64), data_lines[:0], problems
    fields = np.stack([s, e - s], -1)
    return text, fields, data_lines, []


def _delimiter_words(delimiter: str) -> str:
    return "split at runs of spaces and tabs" if delimiter == WHITESPACE else f"split at {delimiter!r}"


def _whitespace_fields(text: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """Fields as runs of bytes other than space, tab, CR and LF: per line their count and first
    field's number, and every field's start and end."""
    separator = (text == 32) | (text == 9) | (text == 10) | (text == 13)
    inside = ~separator
    before = np.concatenate([[True], separator[:-1]])
    after = np.concatenate([separator[1:], [True]])
    field_starts = np.flatnonzero(inside & before)
    field_ends = np.flatnonzero(inside & after) + 1
    line = np.searchsorted(ends, field_starts, side="right")  # a field belongs to the line whose end follows it
    line = np.minimum(line, len(starts) - 1)
    counts = np.bincount(line, minlength=len(starts))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return counts, first, field_starts, field_ends


def _char_fields(text: np.ndarray, starts: np.ndarray, ends: np.ndarray, delimiter: int):
    """Fields between one delimiter byte: per line their count (0 for a blank line) and first
    field's number, and every field's start and end (a line's fields numbered in a row)."""
    marks = np.flatnonzero(text == delimiter)
    line = np.searchsorted(ends, marks, side="right")
    keep = line < len(starts)
    marks, line = marks[keep], line[keep]
    counts = np.bincount(line, minlength=len(starts)) + 1
    counts[(ends == starts) & (counts == 1)] = 0  # blank
    total = np.maximum(counts, 1)
    first = np.concatenate([[0], np.cumsum(total)[:-1]])
    field_starts = np.empty(int(total.sum()), np.int64)
    field_ends = np.empty_like(field_starts)
    field_starts[first] = starts
    field_ends[first + total - 1] = ends
    # the k-th delimiter of a line ends field k and starts field k + 1
    before_marks = np.concatenate([[0], np.cumsum(np.maximum(counts - 1, 0))[:-1]])
    rank = np.arange(len(marks)) - before_marks[line]
    field_ends[first[line] + rank] = marks
    field_starts[first[line] + rank + 1] = marks + 1
    return counts, first, field_starts, field_ends


def _starts_with(text: np.ndarray, starts: np.ndarray, ends: np.ndarray, prefix: bytes) -> np.ndarray:
    hit = ends - starts >= len(prefix)
    for i, byte in enumerate(prefix):
        hit &= text[np.minimum(starts + i, len(text) - 1)] == byte
    return hit


def _strip(text: np.ndarray, s: np.ndarray, e: np.ndarray, *, spaces: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Fields without surrounding spaces and one pair of surrounding double quotes
    (``spaces=False``: fields split at whitespace, which hold none)."""
    s, e = s.copy(), e.copy()
    if not len(s):
        return s, e
    for _ in range(2 if spaces else 1):  # spaces, quotes, spaces inside the quotes
        while spaces and (lead := (e > s) & (text[np.minimum(s, len(text) - 1)] == 32)).any():
            s += lead
        while spaces and (trail := (e > s) & (text[np.maximum(e - 1, 0)] == 32)).any():
            e -= trail
        quoted = (e - s >= 2) & (text[np.minimum(s, len(text) - 1)] == 34) & (text[np.maximum(e - 1, 0)] == 34)
        s, e = s + quoted, e - quoted
    return s, e


def _utf8_problems(data: bytes, newlines: np.ndarray) -> list[tuple[int, str]]:
    """Lines holding bytes that are not UTF-8 (names are text: the names file and lookups
    decode them)."""
    problems, at = [], 0
    while len(problems) <= MAX_REPORTED:
        try:
            data[at:].decode("utf-8")
            break
        except UnicodeDecodeError as e:
            line = int(np.searchsorted(newlines, at + e.start))
            problems.append(
                (
                    line,
                    f"is not valid UTF-8 ({e.reason} at byte {at + e.start - (int(newlines[line - 1]) + 1 if line else 0) + 1})",
                )
            )
            at = int(newlines[line]) + 1 if line < len(newlines) else len(data)
    return problems


def raise_line_problems(path: Path, problems: list[str], fmt: EdgeFormat | None = None) -> None:
    """A ``DatasetError`` listing (up to :data:`MAX_REPORTED`) ``path:line: problem`` lines
    (``fmt``: the edge list's format; ``None``: a labels file's lines)."""
    shown = problems[:MAX_REPORTED] + (["... (more after these)"] if len(problems) > MAX_REPORTED else [])
    if fmt is not None:
        what, hint = (
            "edges",
            f"the file was read as: {fmt.describe()}; fix those lines, or declare the format under dataset.edges",
        )
    else:
        what, hint = (
            "labels",
            "each line must be node<TAB>label, with an optional third column train, valid or test on every line",
        )
    raise DatasetError(
        f"'{path}' has lines that cannot be read as {what}:\n" + "\n".join(f"  {p}" for p in shown), hint=hint
    )


# -- numbers -------------------------------------------------------------------------------------
def parse_integers(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The non-negative integers written in these fields (int64), and a mask of the fields
    that are not one (digits only, at most 18 of them)."""
    value = np.zeros(len(starts), np.int64)
    bad = (lengths > 18) | (lengths < 1)
    for i in range(int(lengths.max(initial=0)) if not bad.all() else 0):
        active = (lengths > i) & ~bad
        digit = text[np.minimum(starts + i, len(text) - 1)].astype(np.int64) - 48
        bad |= active & ((digit < 0) | (digit > 9))
        value = np.where(active & ~bad, value * 10 + digit, value)
    return value, bad


def parse_floats(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The numbers written in these fields (float64; NaN where a field is not one), and a mask
    of the fields that are not one."""
    width = max(1, int(lengths.max(initial=1)))
    padded = np.zeros((len(starts), width), np.uint8)
    for i in range(width):
        active = lengths > i
        padded[active, i] = text[starts[active] + i]
    strings = padded.view(f"S{width}").ravel()
    try:
        values = strings.astype(np.float64)
        return values, np.isnan(values)
    except ValueError:  # one is not a number: find which, one by one (an error path only)
        values = np.array([_float_or_nan(s) for s in strings])
        return values, np.isnan(values)


def _float_or_nan(s: bytes) -> float:
    try:
        return float(s)
    except ValueError:
        return float("nan")
