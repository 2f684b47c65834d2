"""Names as numpy blobs (dsa_train.results.text_blobs) against Python's own str() and f-strings."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_train.results.text_blobs import decimal, encoded, holds_tab_or_line_break, tab_lines


def strings(blob_offsets) -> list[str]:
    blob, offsets = blob_offsets
    return [bytes(blob[offsets[i] : offsets[i + 1]]).decode("utf-8") for i in range(len(offsets) - 1)]


def test_decimal_writes_what_str_writes():
    edges = [0, 1, 9, 10, 11, 99, 100, 101, 999_999, 1_000_000, 2**31 - 1, 2**31, 10**15, 10**18 - 1, 10**18, 2**63 - 1]
    rng = np.random.default_rng(0)
    values = np.array(
        edges + rng.integers(0, 2**62, 500).tolist() + rng.integers(0, 1000, 500).tolist(), dtype=np.int64
    )
    assert strings(decimal(values)) == [str(v) for v in values.tolist()]
    assert strings(decimal(np.array([], dtype=np.int64))) == []


@pytest.mark.parametrize("first", [0, 7, 123_456_789])
def test_tab_lines_are_the_f_string_lines(first):
    names = ["a", "", "Zürich", "/m/027rn", "名前", "x" * 300, "with space", "0"]
    ids = np.arange(first, first + len(names))
    lines = tab_lines(decimal(ids), encoded(names)).tobytes()
    assert lines == "".join(f"{i}\t{n}\n" for i, n in zip(ids.tolist(), names)).encode("utf-8")
    blob, offsets = encoded(names)
    window = (blob, offsets[2:6])  # offsets that do not start at 0: a slice of a stored name column
    assert (
        tab_lines(decimal(ids[2:5]), window).tobytes()
        == "".join(f"{i}\t{n}\n" for i, n in zip(ids[2:5].tolist(), names[2:5])).encode()
    )


def test_tabs_and_line_breaks_are_found():
    assert not holds_tab_or_line_break(encoded(["plain", "with space"])[0])
    for bad in ("a\tb", "a\nb", "a\rb"):
        assert holds_tab_or_line_break(encoded(["ok", bad])[0])
