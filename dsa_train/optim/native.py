"""The fused row kernel (``sparse_adam_rows.c``): compiled once per machine, loaded with ctypes.

No installable library fuses a gather, an exactly-rounded Adam update and a scatter over
random rows of a memory-mapped file, so this small C file does. It is built with the system's
C compiler (``$CC``, else ``cc``) into a per-user cache on first use (about half a second),
checked bit for bit against the pure-torch update, and used when that check passes.
The cache folders are made with mode 0700, and a folder or a library in it is used only when
it is ours and no one else may write it (see :func:`build`), so no other local user can plant
a library that we load; a cached library whose SHA-256 differs from the one recorded when it
was built, or that no longer loads, is built again once.
Without a compiler, or with ``DSA_NATIVE=0``, DiskSparseAdam uses the pure-torch update:
the same results, about half as fast.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import stat
import subprocess
import tempfile
import threading
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
        self._touch = library.dsa_touch_rows
        self._touch.argtypes = [_P, _P, _I, _I, _I, _I, ctypes.c_int]
        self._touch.restype = _I

    def moments(self, dtype, *args) -> None:
        self._moments[dtype](*args)

    def apply(self, dtype, *args) -> None:
        self._apply[dtype](*args)

    def touch_rows(
        self, base: int, rows: torch.Tensor, record_stride: int, record_bytes: int, page_bytes: int, claim: bool
    ) -> None:
        """Fault in the pages of the records at ``rows`` (int64, contiguous) of the mapping at
        ``base``: read, or with ``claim`` made writable without changing a byte."""
        self._touch(base, rows.data_ptr(), rows.numel(), record_stride, record_bytes, page_bytes, int(claim))


def cache_dir() -> Path:
    """``$DSA_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsa-train``, else ``~/.cache/dsa-train``."""
    if os.environ.get("DSA_CACHE_DIR"):
        return Path(os.environ["DSA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsa-train"


class CacheError(OSError):
    """No kernel cache folder is safe to load a library from (each one's reason is given)."""


_LOADING = threading.Lock()
#: Tries of the self-test before the kernel is refused: a kernel that computes other bits
#: fails every time; one mismatch in a prefetch thread under load was seen once and never
#: reproduced, and it turned the fast path off for the whole process.
SELF_TEST_TRIES = 3


def load() -> RowKernel | None:
    """The kernel, compiling it if needed; ``None`` (with one warning) when unavailable.
    Built and tested once per process, whichever thread asks first (the others wait)."""
    with _LOADING:
        return _load()


@functools.cache
def _load() -> RowKernel | None:
    if os.environ.get("DSA_NATIVE", "1") == "0":
        return None
    try:
        kernel = _open(build())
    except CacheError as e:
        warnings.warn(
            f"DiskSparseAdam could not use a cache folder for its fused kernel ({e}); using the "
            "pure-torch update (same results, about half as fast). Set DSA_CACHE_DIR to a folder "
            "that only you can write.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"DiskSparseAdam could not build its fused kernel ({e}); using the pure-torch "
            "update (same results, about half as fast). Install a C compiler (gcc or clang) "
            "to get the fast path.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    mismatch = ""
    for _ in range(SELF_TEST_TRIES):
        mismatch = functional.self_test(kernel)
        if not mismatch:
            break
    if mismatch:
        warnings.warn(
            f"DiskSparseAdam's fused kernel disagrees with torch here ({mismatch}, {SELF_TEST_TRIES} tries); using the "
            "pure-torch update instead. Please report your compiler and CPU.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return kernel


load.cache_clear = _load.cache_clear  # type: ignore[attr-defined]  (as functools.cache's)


def _open(library: Path) -> RowKernel:
    """Load a library from :func:`build`; one that does not load (corrupt) is removed and
    built again, once."""
    try:
        return RowKernel(ctypes.CDLL(str(library)))
    except (OSError, AttributeError):
        if _unsafe_file(library) is not None:  # build() checked it; refuse anything that changed since
            raise
        library.unlink(missing_ok=True)
        _digest_file(library).unlink(missing_ok=True)
    return RowKernel(ctypes.CDLL(str(build())))


def library_name() -> str:
    """The cached library's file name: a digest of the source, compiler, flags and CPU."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS, _machine()]).encode()).hexdigest()[:16]
    return f"sparse_adam_rows-{key}.so"


def build() -> Path:
    """The compiled library in a private cache folder, compiled there if it is not yet.

    A cache folder is used only if it is a real directory (not a symlink) owned by this user
    and writable by no one else, and a cached library only if it is a regular file with the
    same owner and modes: nobody else can plant a library that this process then loads. A
    cached library is used only if its SHA-256 is the one recorded next to it when it was
    built (``<name>.sha256``): a truncated library would crash ``dlopen`` with SIGBUS, not
    fail it, so a damaged one is built again instead of loaded.
    """
    compiler = os.environ.get("CC", "cc")
    name = library_name()
    reasons = []
    for directory in _cache_candidates():
        problem = _prepare_directory(directory)
        if problem is None:
            target = directory / name
            if _unsafe_file(target) is None and _intact(target):
                return target
            return _compile(compiler, target)  # missing, or not safe to load: replaced by a fresh build
        reasons.append(f"{directory}: {problem}")
    raise CacheError("no usable cache folder for the compiled kernel: " + "; ".join(reasons))


def _compile(compiler: str, target: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        errors = []
        for flags in (FLAGS + ["-march=native"], FLAGS):  # not every compiler knows -march=native
            result = subprocess.run(
                [compiler, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True, timeout=300
            )
            if result.returncode == 0:
                os.chmod(built, 0o700)  # whatever the umask: loaded only if no one else may write it
                record = Path(tmp) / _digest_file(target).name
                record.write_text(_sha256(built) + "\n")
                os.chmod(record, 0o600)
                # Atomic renames: a concurrent build replaces both with its own; a reader between
                # the two sees a mismatch and builds again, it never loads an unrecorded file.
                os.replace(record, _digest_file(target))
                os.replace(built, target)
                return target
            errors.append(result.stderr.strip()[:300])
    raise subprocess.SubprocessError(f"{compiler} failed: {errors[-1]}")


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(library: Path) -> bool:
    """Whether ``library`` is the file this cache built: its SHA-256 matches the record."""
    record = _digest_file(library)
    if _unsafe_file(record) is not None:
        return False
    try:
        return record.read_text().strip() == _sha256(library)
    except OSError:
        return False


def _cache_candidates() -> list[Path]:
    return [cache_dir() / "kernels", Path(tempfile.gettempdir()) / f"dsa-train-{os.getuid()}"]


def _prepare_directory(directory: Path) -> str | None:
    """Create ``directory`` (mode 0700) if it is missing; then why it is unsafe, or ``None``."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # ours, just made: owner bits whatever the umask
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create it ({e.strerror})"
    try:
        info = os.lstat(directory)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    problem = _unsafe(info, stat.S_ISDIR, "a directory")
    if problem is None and not os.access(directory, os.W_OK | os.X_OK):
        problem = "not writable"
    return problem


def _unsafe_file(path: Path) -> str | None:
    """Why the library at ``path`` must not be loaded, ``"missing"``, or ``None`` (safe)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot stat {path.name} ({e.strerror})"
    problem = _unsafe(info, stat.S_ISREG, "a regular file")
    return None if problem is None else f"{path.name} is {problem}"


def _unsafe(info: os.stat_result, is_kind, kind: str) -> str | None:
    if stat.S_ISLNK(info.st_mode):
        return "a symlink"
    if not is_kind(info.st_mode):
        return f"not {kind}"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & 0o022:
        return (
            f"writable by {'others' if info.st_mode & 0o002 else 'its group'} (mode {stat.S_IMODE(info.st_mode):04o})"
        )
    return None


def _machine() -> str:
    """What -march=native depends on, so a cache shared between machines stays correct."""
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            lines += [line for line in f if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines.append(platform.processor())
    return "".join(lines)
