"""The fused row kernel (``sparse_adam_rows.c``): compiled once per machine, loaded with ctypes.

No installable library fuses a gather, an exactly-rounded Adam update and a scatter over
random rows of a memory-mapped file, so this small C file does. It is built with the system's
C compiler (``$CC``, else ``cc``) into a per-user cache on first use (about half a second),
checked bit for bit against the pure-torch update, and used when that check passes.
Without a compiler, or with ``DSA_NATIVE=0``, DiskSparseAdam uses the pure-torch update:
the same results, about half as fast.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from . import functional

SOURCE = Path(__file__).with_name("sparse_adam_rows.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SUFFIX = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}


class RowKernel:
    """Typed entry points of the compiled library (see the C file for the passes)."""

    dtypes = tuple(_SUFFIX)

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        self._moments, self._apply = {}, {}
        for dtype, (suffix, real) in _SUFFIX.items():
            moments = getattr(library, f"dsa_moments_{suffix}")
            moments.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, real, real, ctypes.c_int, _P, _P]
            moments.restype = None
            apply = getattr(library, f"dsa_apply_{suffix}")
            apply.argtypes = [_P, _I, _P, _P, _I, _I, _I, _P, _P, real, real]
            apply.restype = None
            self._moments[dtype], self._apply[dtype] = moments, apply

    def moments(self, dtype, *args) -> None:
        self._moments[dtype](*args)

    def apply(self, dtype, *args) -> None:
        self._apply[dtype](*args)


def cache_dir() -> Path:
    """``$DSA_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsa-train``, else ``~/.cache/dsa-train``."""
    if os.environ.get("DSA_CACHE_DIR"):
        return Path(os.environ["DSA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsa-train"


@functools.lru_cache(maxsize=None)
def load() -> RowKernel | None:
    """The kernel, compiling it if needed; ``None`` (with one warning) when unavailable."""
    if os.environ.get("DSA_NATIVE", "1") == "0":
        return None
    try:
        kernel = RowKernel(ctypes.CDLL(str(build())))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"DiskSparseAdam could not build its fused kernel ({e}); using the pure-torch "
            "update (same results, about half as fast). Install a C compiler (gcc or clang) "
            "to get the fast path.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    mismatch = functional.self_test(kernel)
    if mismatch:
        warnings.warn(
            f"DiskSparseAdam's fused kernel disagrees with torch here ({mismatch}); using the "
            "pure-torch update instead. Please report your compiler and CPU.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return kernel


def build() -> Path:
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, _machine()]).encode()).hexdigest()[:16]
    target = _writable_cache() / f"sparse_adam_rows-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        errors = []
        for flags in (FLAGS + ["-march=native"], FLAGS):  # not every compiler knows -march=native
            result = subprocess.run(
                [compiler, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True, timeout=300
            )
            if result.returncode == 0:
                os.replace(built, target)  # atomic: a concurrent build only replaces it with the same
                return target
            errors.append(result.stderr.strip()[:300])
    raise subprocess.SubprocessError(f"{compiler} failed: {errors[-1]}")


def _writable_cache() -> Path:
    for directory in (cache_dir() / "kernels", Path(tempfile.gettempdir()) / f"dsa-train-{os.getuid()}"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
        except OSError:
            continue
    raise OSError("no writable cache directory for the compiled kernel (set DSA_CACHE_DIR)")


def _machine() -> str:
    """What -march=native depends on, so a cache shared between machines stays correct."""
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            lines += [line for line in f if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines.append(platform.processor())
    return "".join(lines)
