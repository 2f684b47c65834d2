"""The compiled kernel's cache folders: only a private folder and a library of our own are loaded.

Another local user must not be able to plant a library that DiskSparseAdam then loads: a cache
folder that is a symlink, writable by others, or owned by someone else is skipped, and so is
a cached library that is not a regular file of ours writable by us alone. A cached library
that no longer loads (truncated, corrupt) is built again, once.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import warnings

import pytest

from dsa_train.optim import native

from .helpers import require_compiler

JUNK = b"#!/bin/sh\necho this is not a shared library\n"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A kernel built once into a scratch cache: its file name and its bytes."""
    require_compiler("the kernel's cache is tested with one")
    old = os.environ.get("DSA_CACHE_DIR")
    os.environ["DSA_CACHE_DIR"] = str(tmp_path_factory.mktemp("scratch-cache"))
    try:
        library = native.build()
    finally:
        if old is None:
            del os.environ["DSA_CACHE_DIR"]
        else:
            os.environ["DSA_CACHE_DIR"] = old
    return library.name, library.read_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch, compiled):
    """Both cache candidates under tmp_path (nothing created yet); every CDLL call recorded."""
    monkeypatch.setenv("DSA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DSA_NATIVE", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    loaded = []
    real = native.ctypes.CDLL

    def recording_cdll(name, *args, **kwargs):
        loaded.append(os.path.realpath(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(native.ctypes, "CDLL", recording_cdll)
    native.load.cache_clear()

    class Cache:
        name = compiled[0]
        good = compiled[1]
        primary = tmp_path / "cache" / "kernels"
        fallback = tmp_path / "tmp" / f"dsa-train-{os.getuid()}"
        calls = loaded

    yield Cache
    native.load.cache_clear()


def plant(folder, name, data=JUNK, mode=0o700):
    path = folder / name
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def load_quietly():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = native.load()
    return kernel, [str(w.message) for w in caught]


def test_a_fresh_cache_folder_is_made_private_and_used(cache):
    kernel, warned = load_quietly()
    assert kernel is not None and not warned
    assert stat.S_IMODE(os.lstat(cache.primary).st_mode) == 0o700
    library = cache.primary / cache.name
    assert cache.calls == [str(library)]
    assert stat.S_IMODE(os.lstat(library).st_mode) & 0o022 == 0


def test_a_symlinked_cache_folder_is_not_used(cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    planted = plant(elsewhere, cache.name)
    cache.primary.parent.mkdir()
    cache.primary.symlink_to(elsewhere)
    kernel, warned = load_quietly()
    assert kernel is not None and not warned  # built in the fallback folder instead
    assert str(planted) not in cache.calls
    assert cache.calls == [str(cache.fallback / cache.name)]
    assert planted.read_bytes() == JUNK


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o757])
def test_a_cache_folder_others_may_write_is_not_used(cache, mode):
    cache.primary.mkdir(parents=True)
    os.chmod(cache.primary, mode)
    planted = plant(cache.primary, cache.name, mode=0o755)
    cache.fallback.parent.mkdir(exist_ok=True)
    cache.fallback.mkdir()
    os.chmod(cache.fallback, mode)
    plant(cache.fallback, cache.name, mode=0o755)
    kernel, warned = load_quietly()
    assert kernel is None and cache.calls == []  # nothing loaded, not even tried
    assert len(warned) == 1 and "could not use a cache folder" in warned[0] and "writable by" in warned[0]
    assert str(cache.primary) in warned[0] and str(cache.fallback) in warned[0]
    assert native.load() is None  # the warning is given once
    assert planted.read_bytes() == JUNK


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_folder_owned_by_another_user_is_not_used(cache):
    cache.primary.mkdir(parents=True, mode=0o700)
    planted = plant(cache.primary, cache.name)
    os.chown(planted, 4242, 4242)
    os.chown(cache.primary, 4242, 4242)
    kernel, warned = load_quietly()
    assert kernel is not None and not warned
    assert str(planted) not in cache.calls and cache.calls == [str(cache.fallback / cache.name)]


@pytest.mark.parametrize("how", ["group-writable", "symlink"])
def test_a_planted_library_in_our_folder_is_replaced_by_a_build_not_loaded(cache, tmp_path, how):
    cache.primary.mkdir(parents=True, mode=0o700)
    library = cache.primary / cache.name
    if how == "symlink":
        planted = plant(tmp_path, "planted.so")
        library.symlink_to(planted)
    else:
        planted = plant(cache.primary, cache.name, mode=0o666)
    kernel, warned = load_quietly()
    assert kernel is not None and not warned
    assert cache.calls == [str(library)]  # loaded once: the fresh build, never the planted file
    assert not library.is_symlink() and library.read_bytes() != JUNK
    if how == "symlink":
        assert planted.read_bytes() == JUNK  # the link was replaced, its target never written


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(cache, damage):
    """dlopen of a truncated library dies of SIGBUS, so it must be caught before loading: the
    library's SHA-256 must match the one recorded when it was built (run in a child process,
    so a crash is a failed test, not a dead test session)."""
    cache.primary.mkdir(parents=True, mode=0o700)
    data = {"truncated": cache.good[: len(cache.good) // 2], "garbage": JUNK, "empty": b""}[damage]
    library = plant(cache.primary, cache.name, data=data)
    plant(cache.primary, cache.name + ".sha256", data=(hashlib.sha256(cache.good).hexdigest() + "\n").encode())
    child = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::RuntimeWarning",
            "-c",
            "from dsa_train.optim import native; assert native.load() is not None; print('loaded')",
        ],
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0 and "loaded" in child.stdout, (child.returncode, child.stderr[-2000:])
    assert library.read_bytes()[:4] == b"\x7fELF" and len(library.read_bytes()) > len(data)


def test_a_cached_library_that_fails_to_load_is_removed_and_rebuilt_once(cache):
    """Intact as recorded but not loadable (here: not a library at all): removed, built again."""
    cache.primary.mkdir(parents=True, mode=0o700)
    library = plant(cache.primary, cache.name)
    plant(cache.primary, cache.name + ".sha256", data=(hashlib.sha256(JUNK).hexdigest() + "\n").encode())
    kernel, warned = load_quietly()
    assert kernel is not None and not warned
    assert cache.calls == [str(library), str(library)]  # the broken one, then the rebuilt one
    assert library.read_bytes()[:4] == b"\x7fELF"


def test_a_library_that_cannot_be_rebuilt_falls_back_with_a_warning(cache, monkeypatch):
    cache.primary.mkdir(parents=True, mode=0o700)
    library = plant(cache.primary, cache.name)
    plant(cache.primary, cache.name + ".sha256", data=(hashlib.sha256(JUNK).hexdigest() + "\n").encode())
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "library_name", lambda: cache.name)  # the name the compiler would give
    kernel, warned = load_quietly()
    assert kernel is None and len(warned) == 1 and "could not build its fused kernel" in warned[0]
    assert cache.calls == [str(library)] and not library.exists()  # the broken file is gone
