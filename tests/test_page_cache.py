"""Row files never train on large page-cache folios: a folio is written back whole, so a row
updated in a 2 MiB folio (what a sequential write or read leaves on Linux 6.x file systems)
would write 2 MiB. A new table that fits in memory is written a page at a time and
stays cached; a larger one is written whole and dropped; a row file opened for writing drops
the cached pages whoever wrote it left; a copy drops its source's and its target's
(``dsa_train.fsutil.drop_cached``)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from dsa_train import DiskEmbedding, DiskSparseAdam, StateError
from dsa_train.fsutil import copy_sparse, drop_cached
from dsa_train.storage import table as table_module
from dsa_train.storage.format import HEADER_BYTES
from dsa_train.storage.table import Table

from .helpers import file_system_of

PAGE = mmap.PAGESIZE


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` on a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = (ctypes.c_ubyte * (-(-size // PAGE)))()
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def write_whole(path: Path, size: int) -> None:
    """What a copy or a restore does: the file written in large writes, fsynced."""
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def page_cache(tmp_path):
    """A folder whose file system has a page cache to drop (not tmpfs or ramfs, which keep files
    in memory). The kind of file system is read from /proc/self/mountinfo, not from
    ``drop_cached`` itself: on any other file system a ``drop_cached`` that stopped dropping fails
    here instead of skipping the module."""
    kind = file_system_of(tmp_path)
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind}, which keeps files in memory: there is no page cache to drop")
    probe = tmp_path / "probe"
    write_whole(probe, 16 * PAGE)
    fd = os.open(probe, os.O_RDONLY)
    drop_cached(fd)
    os.close(fd)
    assert cached_pages(probe) == 0, f"drop_cached left pages of a clean file cached on {kind}"
    probe.unlink()
    return tmp_path


def test_a_new_table_is_written_a_page_at_a_time(tmp_path):
    """Every write of a table's creation stays inside one page: the kernel caches single pages."""
    writes = []
    real = os.pwrite

    def recording(fd, data, offset):
        writes.append((offset, len(data)))
        return real(fd, data, offset)

    with mock.patch.object(table_module.os, "pwrite", recording):
        Table.create(tmp_path / "t.table", (3000, 24), torch.float32, name="t")  # rows of 288 bytes: pages split rows
    body = [(offset, size) for offset, size in writes if offset >= HEADER_BYTES]
    assert sum(size for _, size in body) == 3000 * 3 * 24 * 4  # every record written, once
    assert all(offset // PAGE == (offset + size - 1) // PAGE for offset, size in body), "a write spans pages"
    assert max(size for _, size in body) == PAGE  # and not byte by byte


def test_a_new_table_stays_cached_and_a_reopened_one_is_dropped(page_cache):
    path = page_cache / "t.table"
    table = DiskEmbedding(20_000, 16, path=path, std=0.01)
    pages = -(-os.path.getsize(path) // PAGE)
    assert cached_pages(path) == pages  # written a page at a time, kept warm for the first steps
    table.table.close()
    write_whole(page_cache / "other", 4 * PAGE)  # noise: another file's pages are not ours to drop
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, os.path.getsize(path), 0)  # a backup tool reading it whole
    os.close(fd)
    assert cached_pages(path) == pages
    reopened = DiskEmbedding(20_000, 16, path=path, std=0.01)
    assert cached_pages(path) == 0
    assert cached_pages(page_cache / "other") == 4
    # and training still reads every row right from the file
    optimizer = DiskSparseAdam([reopened.weight], lr=0.1, state_dir=page_cache / "state")
    before = reopened.weight[[5, 19_999]].clone()
    reopened(torch.tensor([5, 19_999])).sum().backward()
    optimizer.step()
    assert torch.allclose(reopened.weight[[5, 19_999]], before - 0.1, atol=1e-5)  # Adam's first step: lr * sign(grad)


def test_a_table_larger_than_the_memory_is_written_whole_and_dropped(page_cache):
    """A table the cache could not keep is written in large writes (one system call a page
    costs more once the cache is full), and its pages, large folios, leave the cache."""
    writes = []
    real = os.pwrite

    def recording(fd, data, offset):
        writes.append(len(data))
        return real(fd, data, offset)

    path = page_cache / "t.table"
    with (
        mock.patch.object(table_module, "host_available_bytes", return_value=2 * 1_000_000),
        mock.patch.object(table_module.os, "pwrite", recording),
    ):
        DiskEmbedding(20_000, 16, path=path, std=0.01)  # 3.84 MB: more than "2 MB free"
    assert max(writes) > PAGE
    assert cached_pages(path) == 0
    with mock.patch.object(table_module, "host_available_bytes", return_value=None):  # unknown: by page
        DiskEmbedding(20_000, 16, path=page_cache / "u.table", std=0.01)
    assert cached_pages(page_cache / "u.table") == -(-os.path.getsize(page_cache / "u.table") // PAGE)
    assert (page_cache / "u.table").read_bytes()[HEADER_BYTES:] == path.read_bytes()[
        HEADER_BYTES:
    ]  # the same records either way


def test_a_read_only_row_file_keeps_the_cache(page_cache):
    path = page_cache / "t.table"
    DiskEmbedding(5_000, 8, path=path).table.close()
    Table.open(path, (5_000, 8), torch.float32, writable=False)
    assert cached_pages(path) == -(-os.path.getsize(path) // PAGE)


def test_a_copy_leaves_neither_file_cached(page_cache):
    source, target = page_cache / "source", page_cache / "target"
    write_whole(source, 64 * PAGE)
    copy_sparse(source, target)
    assert target.read_bytes() == source.read_bytes()  # (this read caches them again)
    write_whole(source, 64 * PAGE)
    target.unlink()
    copy_sparse(source, target)
    assert cached_pages(source) == 0 and cached_pages(target) == 0


def test_pages_a_process_has_mapped_stay(page_cache):
    """Dropping never takes the pages under a live mapping (they are the training's working set)."""
    path = page_cache / "t.table"
    table = DiskEmbedding(20_000, 16, path=path, std=0.01)
    touched = table.weight[:100].sum()  # fault the first rows in through the mapping
    assert torch.isfinite(touched)
    fd = os.open(path, os.O_RDONLY)
    drop_cached(fd)
    os.close(fd)
    assert 0 < cached_pages(path) < -(-os.path.getsize(path) // PAGE)


@pytest.mark.parametrize("by_page", [True, False])
def test_a_full_disk_while_a_table_is_written_leaves_nothing(tmp_path, by_page):
    """Either way of writing a new table stops at the first failed write with a clear error,
    and no half-written table (nor its temporary) is left behind."""
    real, calls = os.pwrite, []

    def filling(fd, data, offset):
        calls.append(offset)
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    with (
        mock.patch.object(table_module, "_stays_cached", return_value=by_page),
        mock.patch.object(table_module.os, "pwrite", filling),
        pytest.raises(StateError, match=r"could not write table '.*t\.table' .*No space left on device") as error,
    ):
        Table.create(tmp_path / "t.table", (20_000, 16), torch.float32, name="t")
    assert "free space on that disk" in error.value.hint
    assert len(calls) == 6 and list(tmp_path.iterdir()) == []
