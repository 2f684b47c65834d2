"""The rows a DiskSparseAdam wrote since a known point: what a checkpoint's deltas hold.

The optimizer knows nothing of checkpoints: it announces, through its write hook
(:meth:`~dsa_train.DiskSparseAdam.register_write_hook`), the rows it is about to write. The
checkpoint store attaches a :class:`ChangedRows` to it (:func:`count_from`) the first time it
learns what the files are known to be (as made, or a checkpoint's); from then on every
announced row is set in a :class:`DirtyRows` bitmap of its file, and each checkpoint clears
them and names itself as the new starting point.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its ChangedRows


class DirtyRows:
    """The set of rows of an ``N``-row file written since :meth:`clear`: ``N`` bits (12.5 MB
    for 10^8 rows)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._bits = np.zeros((num_rows + 7) // 8, dtype=np.uint8)

    def mark(self, rows) -> None:
        """Add the row indices ``rows`` (a tensor or array, duplicates allowed)."""
        rows = np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows, dtype=np.int64).reshape(-1)
        np.bitwise_or.at(self._bits, rows >> 3, np.left_shift(1, rows & 7).astype(np.uint8))

    def rows(self) -> np.ndarray:
        """The marked rows, sorted, as int64 (memory grows with their number, not with ``N``)."""
        bytes_ = np.flatnonzero(self._bits).astype(np.int64)
        bits = np.flatnonzero(np.unpackbits(self._bits[bytes_], bitorder="little"))  # of those bytes' bits
        return bytes_[bits >> 3] * 8 + (bits & 7)

    def clear(self) -> None:
        self._bits[:] = 0


class ChangedRows:
    """The rows one optimizer wrote, per row file, since the point named :attr:`since`.

    Args:
        optimizer: a :class:`~dsa_train.DiskSparseAdam`; its write hook marks the rows.
    """

    def __init__(self, optimizer) -> None:
        self._files = {path: DirtyRows(rows) for path, rows in optimizer.row_files().items()}
        self.since: str | None = None  # what the files were when the rows were last cleared
        self._handle = optimizer.register_write_hook(self._mark)

    def _mark(self, path: Path, rows) -> None:
        self._files[path].mark(rows)

    def rows(self, path: str | Path) -> np.ndarray | None:
        """The rows (sorted int64) of the row file ``path`` written since :attr:`since`;
        ``None`` when the optimizer does not write that file."""
        wanted = Path(path).resolve()
        for own, dirty in self._files.items():
            if own.resolve() == wanted:
                return dirty.rows()
        return None

    def reset(self, label: str | None) -> None:
        """Forget the rows written so far and remember ``label`` (an opaque name of the point
        the files are known to be at: ``"<folder>:<checkpoint id>"``, or ``"initial"``)."""
        for dirty in self._files.values():
            dirty.clear()
        self.since = label


def changed_rows(optimizer) -> ChangedRows | None:
    """The :class:`ChangedRows` attached to ``optimizer``, or ``None``."""
    return _ATTACHED.get(optimizer)


def count_from(optimizer, label: str | None) -> ChangedRows:
    """Count the rows ``optimizer`` (a DiskSparseAdam) writes from ``label`` on, attaching a
    :class:`ChangedRows` to it the first time."""
    tracker = _ATTACHED.get(optimizer)
    if tracker is None:
        tracker = _ATTACHED[optimizer] = ChangedRows(optimizer)
    tracker.reset(label)
    return tracker
