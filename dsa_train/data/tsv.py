"""Folders of ``train.txt`` / ``valid.txt`` / ``test.txt`` with ``head<TAB>relation<TAB>tail`` lines
(or ``.tsv``, or the CSV form ``train.csv`` ... with ``head,relation,tail``; an optional header
line, detected or declared): reading them in chunks of whole lines and checking every line, vectorised.

Every line must have exactly three non-empty tab-separated columns and a plain ``\\n`` ending;
anything else (a CRLF ending, a wrong column count, an empty line or column, invalid UTF-8) is
reported with its file and line number, never dropped or mis-parsed. Names are kept as bytes
(WN18RR's synset ids keep their leading zeros). :mod:`.tsv_import` turns the checked chunks
into an imported dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from .store import SPLITS

MAX_REPORTED = 10
CHUNK_BYTES = 8 << 20  # text read and parsed at once
SUFFIXES = ("txt", "tsv", "csv")  # a split's file: train.txt, else train.tsv, else train.csv
#: Words that make a first line a header (``head<TAB>relation<TAB>tail``, RDF's names, ...).
HEADER_WORDS = {
    "head",
    "relation",
    "tail",
    "h",
    "r",
    "t",
    "subject",
    "predicate",
    "object",
    "s",
    "p",
    "o",
    "source",
    "target",
    "head_id",
    "tail_id",
    "relation_id",
    "rel",
    "src",
    "dst",
    "from",
    "to",
    "edge",
    "type",
}


def triple_format(path: Path, *, delimiter: str | None, header: bool | None) -> tuple[str, bool]:
    """The delimiter (declared, else a tab if the first line holds one, else a comma) and
    whether the first line is a header (declared, else: all three of its fields are column
    words such as head, relation, tail)."""
    with open(path, "rb") as f:
        first = f.readline(1 << 16).rstrip(b"\r\n")
    if delimiter is None:
        delimiter = "\t" if b"\t" in first or b"," not in first else ","
    if header is None:
        fields = [x.strip().lower() for x in first.decode("utf-8", errors="replace").split(delimiter)]
        header = len(fields) == 3 and all(x in HEADER_WORDS for x in fields)
    return delimiter, header


def tsv_files(folder: Path, looked: str | None = None) -> list[Path]:
    """The folder's three split files; a ``DatasetError`` names the missing ones (``looked``:
    where a missing folder was looked for)."""
    files = [
        next((p for p in (folder / f"{split}.{ext}" for ext in SUFFIXES) if p.is_file()), folder / f"{split}.txt")
        for split in SPLITS
    ]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        source = KNOWN_SOURCES.get(folder.name.lower())
        raise DatasetError(
            f"dataset folder '{folder}' lacks {', '.join(missing)}"
            + (f" (it does not exist: looked in {looked})" if looked and not folder.is_dir() else ""),
            hint=f"place train.txt, valid.txt and test.txt (head<TAB>relation<TAB>tail lines) in '{folder}'"
            + (f" ({source})" if source else "")
            + f", or set DSA_DATA_ROOT (or dataset.root) to the folder that holds '{folder.name}/'",
        )
    return files


#: Where the TSV datasets the shipped recipes name come from.
KNOWN_SOURCES = {
    name: f"or set dataset.fetch: {name} (and leave dataset.path out) to download it on first use"
    for name in ("umls", "nations", "yago3-10", "wikidata5m")
}


# -- checking lines ---------------------------------------------------------------------------
def line_problem(raw: bytes, *, final_newline: bool, delimiter: str = "\t") -> str | None:
    """What is wrong with one line (with its ending, if any), or ``None``."""
    if raw.endswith(b"\r\n"):
        return "has a Windows (CRLF) line ending; convert the file with dos2unix"
    if final_newline and not raw.endswith(b"\n"):
        return "does not end with a newline, and PyG's reader would drop it; add one"
    try:
        parts = raw.removesuffix(b"\n").decode("utf-8").split(delimiter)
    except UnicodeDecodeError as e:
        return f"is not valid UTF-8 ({e.reason})"
    if len(parts) != 3:
        return f"has {len(parts)} {'tab' if delimiter == chr(9) else repr(delimiter)}-separated columns, expected 3 (head, relation, tail)"
    if not all(parts):
        return "has an empty column"
    return None


def raise_problems(path: Path, problems: list[str], delimiter: str = "\t") -> None:
    shown = problems[:MAX_REPORTED] + (["... (more after these)"] if len(problems) > MAX_REPORTED else [])
    between = "<TAB>" if delimiter == "\t" else delimiter
    raise DatasetError(
        f"'{path}' has malformed lines:\n" + "\n".join(f"  {p}" for p in shown),
        hint=f"each line must be head{between}relation{between}tail ending with a plain newline"
        + ("" if delimiter == "\t" else " (no quotes: a name cannot hold the delimiter)")
        + "; a header line is detected (head, relation, tail) or declared with dataset.triples.header",
    )


def all_chunks(files: list[Path], *, header: bool = False) -> Iterator[tuple[Path, bytes, int, int]]:
    """Every file's chunks as ``(path, data, lines before it in its file, rows before it in all
    files)``; ``header``: each file's first line is left out (its line still counted)."""
    row = 0
    for path in files:
        for data, before, lines in _chunks(path):
            if header and before == 0:
                cut = data.find(b"\n") + 1 or len(data)
                data, before, lines = data[cut:], 1, lines - 1
                if not data:
                    continue
            yield path, data, before, row
            row += lines


def _chunks(path: Path) -> Iterator[tuple[bytes, int, int]]:
    """The file in pieces of whole lines (the last may lack its newline), each with the number
    of lines before it and in it."""
    lines_before, rest = 0, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK_BYTES)
            if not block:
                break
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a chunk: keep reading
                rest = data
                continue
            lines = data.count(b"\n", 0, cut)
            yield data[:cut], lines_before, lines
            lines_before += lines
            rest = data[cut:]
    if rest:
        yield rest, lines_before, 1


def parse_chunk(
    data: bytes, *, final_newline: bool, delimiter: str = "\t"
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, str]]]:
    """The chunk's bytes and its ``(lines, 3, 2)`` column ``(start, length)`` pairs; or, when
    any line is malformed, ``(line index, problem)`` for each bad line (and no columns).
    ``delimiter``: the character between the columns (a tab, or a comma for the CSV form)."""
    text = np.frombuffer(data, dtype=np.uint8)
    mark = ord(delimiter)
    found = text <= 10 if mark <= 10 else (text <= 10) | (text == mark)
    marks = np.flatnonzero(found)  # one pass finds delimiters and newlines (and rarer control bytes)
    kinds = text[marks]
    newlines, tabs = marks[kinds == 10], marks[kinds == mark]
    ends = newlines if data.endswith(b"\n") else np.append(newlines, len(text))
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    if len(tabs) == 2 * len(starts) and len(starts):  # the usual case: two tabs per line, in order
        t1, t2 = tabs[0::2], tabs[1::2]
        bad = (t1 < starts) | (t2 >= ends)  # each line holds its own pair, so exactly two
    else:
        first = np.searchsorted(tabs, starts)
        bad = np.searchsorted(tabs, ends) - first != 2
        t1 = tabs[np.minimum(first, len(tabs) - 1)] if len(tabs) else np.zeros_like(starts)
        t2 = tabs[np.minimum(first + 1, len(tabs) - 1)] if len(tabs) else np.zeros_like(starts)
    bad |= (t1 == starts) | (t2 == t1 + 1) | (ends == t2 + 1)
    bad |= (ends > starts) & (text[np.maximum(ends - 1, 0)] == 13)
    if final_newline and not data.endswith(b"\n"):
        bad[-1] = True
    if not bad.any() and not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            bad[:] = True  # let the line-by-line check find which
    if bad.any():
        problems = []
        for index in np.flatnonzero(bad).tolist():
            raw = data[starts[index] : ends[index] + 1]
            problem = line_problem(raw, final_newline=final_newline, delimiter=delimiter)
            if problem is not None:
                problems.append((index, problem))
        return text, np.empty((0, 3, 2), np.int64), problems
    columns = np.stack(
        [np.stack([starts, t1 - starts], 1), np.stack([t1 + 1, t2 - t1 - 1], 1), np.stack([t2 + 1, ends - t2 - 1], 1)],
        1,
    )
    return text, columns, []


def check_tsv_file(path: Path, *, final_newline: bool = False) -> int:
    """Check every line of a file (as the import does); returns the number of lines."""
    problems, lines = [], 0
    for data, before, _ in _chunks(path):
        _, columns, found = parse_chunk(data, final_newline=final_newline)
        problems += [f"{path}:{before + index + 1}: line {problem}" for index, problem in found]
        if len(problems) > MAX_REPORTED:
            break
        lines += len(columns)
    if problems:
        raise_problems(path, problems)
    return lines


# -- the import -------------------------------------------------------------------------------
