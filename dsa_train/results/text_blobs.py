"""Text made with numpy a chunk at a time rather than a Python string per row: a run of
strings is one ``uint8`` blob plus ``n + 1`` offsets into it (string ``i`` is
``blob[offsets[i]:offsets[i + 1]]``), the layout the datasets store names in and Arrow's.
At 10^7 rows a Python f-string per name line cost more than writing the table's weights."""

from __future__ import annotations

import numpy as np

TAB, NEWLINE, RETURN = ord("\t"), ord("\n"), ord("\r")
FOUR_DIGITS = np.frombuffer(
    b"".join(b"%04d" % i for i in range(10_000)), dtype=np.uint32
)  # "0000" .. "9999", 4 bytes each


def decimal(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative integers written in decimal, as ``str(v)`` writes them: ``(blob, offsets)``.
    Values of one width are written together, four digits at a time from a table of the
    10,000 four-digit strings (integer division is the slow part; this does a quarter of it)."""
    values = np.asarray(values, dtype=np.int64)
    widths = np.ones(len(values), dtype=np.int64)
    top, power = (int(values.max()) if len(values) else 0), 10
    while power <= top:
        widths += values >= power
        power *= 10
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(widths, out=offsets[1:])
    blob = np.empty(int(offsets[-1]), dtype=np.uint8)
    for width in np.unique(widths).tolist():
        rows = np.flatnonzero(widths == width)
        groups = -(-width // 4)
        quads, rest = np.empty((len(rows), groups), dtype=np.uint32), values[rows]
        for group in range(groups - 1, -1, -1):
            rest, quads[:, group] = np.divmod(rest, 10_000)[0], FOUR_DIGITS[rest % 10_000]
        digits = quads.view(np.uint8).reshape(len(rows), 4 * groups)[:, 4 * groups - width :]
        if rows[-1] - rows[0] + 1 == len(rows):  # consecutive values (ids): one slice
            blob[offsets[rows[0]] : offsets[rows[-1] + 1]] = digits.reshape(-1)
        else:
            blob[(offsets[rows, None] + np.arange(width)).reshape(-1)] = digits.reshape(-1)
    return blob, offsets


def encoded(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Python strings as a UTF-8 ``(blob, offsets)``."""
    pieces = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    return np.frombuffer(b"".join(pieces), dtype=np.uint8), offsets


def holds_tab_or_line_break(blob: np.ndarray) -> bool:
    return bool(((blob == TAB) | (blob == NEWLINE) | (blob == RETURN)).any())


def tab_lines(left: tuple[np.ndarray, np.ndarray], right: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The lines ``left[i] <TAB> right[i] <LF>``, one blob."""
    (left_blob, left_offsets), (right_blob, right_offsets) = left, right
    left_lengths, right_lengths = np.diff(left_offsets), np.diff(right_offsets)
    lengths = left_lengths + right_lengths + 2
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    lines = np.empty(int(lengths.sum()), dtype=np.uint8)
    lines[_spread(starts, left_lengths)] = left_blob[left_offsets[0] : left_offsets[-1]]
    lines[starts + left_lengths] = TAB
    lines[_spread(starts + left_lengths + 1, right_lengths)] = right_blob[right_offsets[0] : right_offsets[-1]]
    lines[starts + lengths - 1] = NEWLINE
    return lines


def _spread(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[i] + j`` for ``j < lengths[i]``, for every ``i`` in order."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))
