"""Small file-system primitives that keep data on disk whole.

* :func:`atomic_write_bytes` commits a file by writing a temporary name, fsyncing it, renaming
  it over the target and fsyncing the directory, so a reader sees the old or the new content,
  never a mix.
* :class:`DirectoryLock` is an exclusive ``flock`` on ``<dir>/.lock`` that records who holds it,
  so a second writer gets an error naming the first. The kernel drops the lock when its holder
  dies, so a lock left by a killed process never blocks anyone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import StateError


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temporary name, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def this_process() -> dict:
    """Who is writing: pid, host, command line and start time, for locks and manifests."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join(sys.argv)[:500],
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class DirectoryLock:
    """An exclusive, non-blocking lock on a directory, held through ``<dir>/.lock``.

    ``flock`` locks belong to an open file description, so two lock objects conflict even
    inside one process; the kernel releases the lock when the holding process exits or dies.
    """

    FILE_NAME = ".lock"

    def __init__(self, directory: Path, *, purpose: str) -> None:
        self.path = Path(directory) / self.FILE_NAME
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StateError(
                f"{self.purpose} '{self.path.parent}' is locked by {holder}",
                hint="two writers would corrupt it: stop the other process (or close() the "
                "other optimizer in this process), or use another directory",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(this_process()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> str:
    """Describe the process recorded in a lock file, for an error message."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process (it has not recorded itself yet)"
    who = f"pid {info['pid']} on {info.get('host', '?')}"
    if info.get("pid") == os.getpid():
        who += " (this process: another DiskSparseAdam still has it open)"
    if info.get("command"):
        who += f", running '{info['command']}'"
    if info.get("since"):
        who += f", since {info['since']}"
    return who


def data_extents(fd: int, size: int):
    """``(start, end)`` byte ranges of a file that hold data; holes are skipped."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        offset = end


DIGEST_BLOCK = 1 << 16


def file_digest(path: Path) -> str:
    """BLAKE2b of a file's size and of its non-zero 64 KiB blocks (with their numbers).

    Holes are never read, and a block of zeros counts the same whether it is a hole or
    written data, so equal contents give equal digests whatever the file system's extents;
    a torn, truncated or bit-flipped copy gives another.
    """
    digest = hashlib.blake2b(digest_size=20)
    zeros = bytes(DIGEST_BLOCK)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        done = -1  # the last block hashed: extents can share a block
        for start, end in data_extents(f.fileno(), size):
            for block in range(max(start // DIGEST_BLOCK, done + 1), (end - 1) // DIGEST_BLOCK + 1):
                data = os.pread(f.fileno(), DIGEST_BLOCK, block * DIGEST_BLOCK)
                if data != zeros[: len(data)]:
                    digest.update(block.to_bytes(8, "little"))
                    digest.update(data)
                done = block
    return digest.hexdigest()


def copy_sparse(source: Path, target: Path) -> None:
    """Copy a file, skipping its holes (``SEEK_DATA``/``SEEK_HOLE``), then fsync the copy.

    A row file of a 10M-row table is gigabytes apparent but holds only the rows ever
    touched; a plain copy would write every hole out as zeros.
    """
    with open(source, "rb") as src, open(target, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        dst.truncate(size)
        for start, end in data_extents(src.fileno(), size):
            _copy_range(src.fileno(), dst.fileno(), start, end)
        dst.flush()
        os.fsync(dst.fileno())


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    position = start
    while position < end:
        try:
            copied = os.copy_file_range(src, dst, end - position, position, position)
        except OSError:  # not supported across these file systems: copy through memory
            data = os.pread(src, min(end - position, 1 << 24), position)
            copied = os.pwrite(dst, data, position)
        if copied == 0:
            raise OSError(f"copy stopped at byte {position} of {end}")
        position += copied
