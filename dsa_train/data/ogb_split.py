"""OGB's split files (``split/<name>/{train,valid,test}.pt``) read without arbitrary unpickling.

Each is a ``torch.save``'d dict of NumPy arrays: ``head``, ``relation``, ``tail`` (and for
``ogbl-biokg`` ``head_type``, ``tail_type``: the entity type of each end), plus in valid and
test ``head_neg`` and ``tail_neg``, ``(M, K)`` fixed negatives. A pickle can name any Python
callable, so the file is read with ``torch.load(weights_only=True)``, whose unpickler refuses
every global it has not been told is safe, and the only ones added here are the parts NumPy
pickles an array or a scalar with: ``numpy._core.multiarray._reconstruct`` and ``scalar`` (also
under their NumPy 1 names ``numpy.core.multiarray.*``, which files written before NumPy 2 carry),
``numpy.ndarray``, ``numpy.dtype`` and the concrete dtype classes (``Int64DType``, ``StrDType``,
...). Both of torch's containers (the zip file and the older single pickle stream) go through
it. A file that names anything else (``os.system``, say) is a ``DatasetError`` naming the file
and the global; the result is checked for the keys, shapes and integer dtypes OGB's files have.

Memory: ``torch.load`` holds a whole split at once (for wikikg2's train split, 16.1M triples:
three int64 arrays, 387 MB, plus the pickle's bytes while it reads); :mod:`.ogb_import` writes
it out in chunks and lets it go before reading the next split.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError

# the dtype classes of every kind of array OGB's splits hold (integers, floats, strings, objects)
_DTYPE_CLASSES = sorted({type(np.dtype(c)) for c in "?bBhHiIlLqQefdUSO"}, key=lambda t: t.__name__)
try:
    from numpy._core.multiarray import _reconstruct, scalar  # NumPy 2
except ImportError:  # NumPy 1
    from numpy.core.multiarray import _reconstruct, scalar
SAFE_GLOBALS = [
    (_reconstruct, "numpy.core.multiarray._reconstruct"),  # the name in pickles written by NumPy 1
    (_reconstruct, "numpy._core.multiarray._reconstruct"),  # and by NumPy 2
    (scalar, "numpy.core.multiarray.scalar"),  # a NumPy scalar (a list of np.str_ type names, say)
    (scalar, "numpy._core.multiarray.scalar"),
    np.ndarray,
    np.dtype,
    *_DTYPE_CLASSES,
]

TRIPLE_KEYS = ("head", "relation", "tail")
TYPE_KEYS = ("head_type", "tail_type")
NEGATIVE_KEYS = ("head_neg", "tail_neg")


def load_split(path: Path, *, split: str, typed: bool) -> dict[str, np.ndarray]:
    """A split file's arrays, checked: ``head``, ``relation``, ``tail`` (1-D integers), with
    ``typed`` ``head_type`` and ``tail_type`` (one type name per triple, as a string array),
    and outside ``train`` ``head_neg``, ``tail_neg`` (``(M, K)`` integers). Raises ``DatasetError``."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DatasetError(
            f"'{path}' is not read: it is a pickle that asks for more than NumPy arrays ({_first_line(e)}), "
            "and dsa-train unpickles nothing else",
            hint=f"delete '{path}' (and the zip it came from) and run again to take it out of a fresh download",
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise DatasetError(
            f"'{path}' cannot be read as OGB's {split} split: {_first_line(e)}",
            hint=f"delete '{path}' (and the zip it came from) and run again to take it out of a fresh download",
        ) from None
    return _checked(data, path, split=split, typed=typed)


def _first_line(e: Exception) -> str:
    text = str(e)
    for line in text.splitlines():  # torch's message: the refused global is on a line of its own
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(e).__name__


def _checked(data, path: Path, *, split: str, typed: bool) -> dict[str, np.ndarray]:
    def bad(what: str) -> DatasetError:
        return DatasetError(
            f"'{path}' is not OGB's {split} split: {what}",
            hint=f"delete '{path}' (and the zip it came from) and run again to take it out of a fresh download",
        )

    if not isinstance(data, dict):
        raise bad(f"it holds a {type(data).__name__}, not a dict of arrays")
    wanted = TRIPLE_KEYS + (TYPE_KEYS if typed else ()) + (NEGATIVE_KEYS if split != "train" else ())
    missing = [k for k in wanted if k not in data]
    if missing:
        raise bad(f"no {', '.join(missing)} (it has {', '.join(map(str, data)) or 'nothing'})")
    out = {}
    for key in wanted:
        value = data[key]
        if isinstance(value, torch.Tensor):  # not what OGB's files hold, but as good
            value = value.numpy()
        if key in TYPE_KEYS:
            value = np.asarray(value if isinstance(value, np.ndarray) else list(value))
            if value.dtype.kind == "O" and not all(isinstance(v, str) for v in value[:1000]):
                raise bad(f"{key} holds {type(value[0]).__name__}, not type names")
            value = value.astype(str) if value.dtype.kind != "U" else value
        elif not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
            kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise bad(f"{key} is {kind}, not an array of integer ids")
        out[key] = value
    m = len(out["head"])
    for key in wanted:
        rows = out[key]
        shape_ok = rows.ndim == (2 if key in NEGATIVE_KEYS else 1) and len(rows) == m
        if not shape_ok:
            raise bad(f"{key} has shape {list(rows.shape)}, expected {m:,} rows like head")
    return out
