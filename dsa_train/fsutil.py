"""Small file-system primitives that keep data on disk whole.

* :func:`fsync_all` makes many files and folders durable at once (a checkpoint's, a dataset's).
* :func:`atomic_write_bytes` commits a file by writing a temporary name, fsyncing it, renaming
  it over the target and fsyncing the directory, so a reader sees the old or the new content,
  never a mix.
* :class:`DirectoryLock` is an exclusive ``flock`` on a directory itself that records who holds
  it in ``<dir>/.lock``, so a second writer gets an error naming the first. The kernel drops
  the lock when its holder dies, so a lock left by a killed process never blocks anyone.
* :func:`create_owned_folder` makes a new folder (absent or empty, never a link) and holds its
  lock before anything is written into it: a run folder's, a tune folder's.
* :func:`file_digest` digests a file (BLAKE2b of its size and non-zero 64 KiB blocks);
  :func:`write_digested` writes a new file and computes the same digest from the bytes as they
  are written (:class:`StreamDigest`, on a second thread), so the file is never read back.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import functools
import hashlib
import json
import os
import queue
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import DsaError, StateError


def require_linux(what: str) -> None:
    """Refuse to start on a system other than Linux, where dsa-train's state would not be safe:
    its locks are ``flock``, its copies ``copy_file_range`` and reflink clones, its memory
    figures ``/proc``. A clear error at start instead of an ``AttributeError`` mid-run."""
    if not sys.platform.startswith("linux"):
        raise DsaError(
            f"{what} runs on Linux only (its file locks, copies and memory figures are Linux's), and this is {sys.platform}",
            hint="run it on Linux: a Linux machine, WSL2 on Windows, a Linux container, or Colab",
        )


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync a file or folder by its path, never through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: list[Path]) -> None:
    """fsync files and folders at once, each on its own thread: the file system commits them
    together (one journal commit for all, on ext4) instead of one after the other. Returns
    when every one is durable; raises the first error."""
    if not paths:
        return
    with ThreadPoolExecutor(max_workers=min(len(paths), 16), thread_name_prefix="dsa-train fsync") as pool:
        for done in [pool.submit(fsync_path, path) for path in paths]:
            done.result()


def temporary_prefix(name: str) -> str:
    """How :func:`atomic_write_bytes` names its temporary for ``name`` (a kill between its
    creation and the rename leaves one behind: a caller that owns ``name`` owns these too)."""
    return f".{name}.tmp-"


def atomic_write_bytes(path: Path, *data: bytes | memoryview) -> None:
    """Replace ``path`` with ``data`` (one or more pieces, written in order) atomically and
    durably: :func:`atomic_write_pieces`."""
    atomic_write_pieces(path, data)


def atomic_write_pieces(path: Path, data: Iterable[bytes | memoryview]) -> None:
    """Replace ``path`` with the pieces ``data`` yields, written in order as they come (a
    stream never held whole), atomically and durably (temporary name, fsync, rename).

    The temporary file is created exclusively (``O_EXCL | O_NOFOLLOW``, a fresh random name),
    so a link planted under a predictable name is never written through; the rename replaces
    whatever entry ``path`` is (a link is replaced, its target is never touched).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path.name))
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            for piece in data:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
    """An exclusive, non-blocking ``flock`` on a directory itself.

    The lock is taken on the directory's own inode (a directory file descriptor), not on a
    file inside it, so deleting or replacing any file in the directory cannot let a second
    writer in. Who holds it is recorded in ``<dir>/.lock`` for error messages only; that
    record is written under a fresh temporary name and renamed, never opened through a link,
    never truncated. ``flock`` locks belong to an open file description, so two lock objects
    conflict even inside one process; the kernel releases the lock when its holder exits or
    dies, so a lock left by a killed process never blocks anyone.
    """

    FILE_NAME = ".lock"

    def __init__(self, directory: Path, *, purpose: str, follow_link: bool = True) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.FILE_NAME
        self.purpose = purpose
        self._flags = os.O_RDONLY | os.O_DIRECTORY | (0 if follow_link else os.O_NOFOLLOW)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.directory, self._flags)
        except OSError as e:
            raise StateError(
                f"cannot open {self.purpose} '{self.directory}' to lock it: {e.strerror}",
                hint="pass an existing directory that you can read",
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateError(
                f"{self.purpose} '{self.directory}' is locked by {lock_holder(self.directory) or 'another process'}",
                hint="two writers would corrupt it: stop the other process (or close() the "
                "other optimizer in this process), or use another directory",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:
            _record_holder(fd, self.directory)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the last descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def fd(self) -> int:
        """The locked directory's descriptor, for ``dir_fd`` operations inside it."""
        if self._fd is None:
            raise RuntimeError("the lock is not held")
        return self._fd


def create_owned_folder(path: Path, what: str, *, link_hint: str, busy_hint: str) -> DirectoryLock:
    """Make the folder ``path`` (a ``what``, e.g. ``"run folder"``) this process's own and
    return its lock, held, before anything is written into it. A link is refused
    (``link_hint``), and so is a folder that holds anything but our lock record
    (``busy_hint``), before the lock and again once it is held: a second process started at
    the same instant stops at the lock or there."""
    path = Path(path)
    if path.is_symlink():
        raise StateError(f"{what} '{path}' is a symbolic link", hint=link_hint)
    _refuse_non_empty(path, what, busy_hint)
    path.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(path, purpose=what)
    lock.acquire()
    try:
        _refuse_non_empty(path, what, busy_hint)
    except BaseException:
        lock.release()
        raise
    return lock


def _refuse_non_empty(path: Path, what: str, hint: str) -> None:
    """A ``StateError`` if the folder ``path`` holds anything but a lock record."""
    if not path.is_dir():
        return
    name = DirectoryLock.FILE_NAME
    if any(p.name != name and not p.name.startswith(name + ".tmp-") for p in path.iterdir()):
        raise StateError(f"{what} '{path}' already exists and is not empty", hint=hint)


def _record_holder(directory_fd: int, directory: Path) -> None:
    """Write who holds the lock into ``.lock``, never through a link or onto a foreign file."""
    name = DirectoryLock.FILE_NAME
    try:
        info = os.lstat(name, dir_fd=directory_fd)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise StateError(
            f"'{directory / name}' is not a regular file (a symbolic link or a folder); dsa-train "
            "records its lock holder there and never writes through a link it did not create",
            hint=f"remove '{directory / name}' (it is only a record; the lock is on the directory) and run again",
        )
    tmp = f"{name}.tmp-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=directory_fd)
    try:
        os.write(fd, json.dumps(this_process()).encode())
    finally:
        os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=directory_fd)
        raise


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s :class:`DirectoryLock`, or ``None``; takes no lock.

    Reads ``/proc/locks`` for an ``FLOCK`` on the directory's inode (without it, probes with a
    shared lock that is dropped at once), then describes the holder from ``.lock``.
    """
    try:
        info = os.stat(directory)
    except OSError:
        return None
    pids = _flock_pids(info)
    if pids is None:  # no /proc/locks here: probe
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pids = []
        finally:
            os.close(fd)
    if not pids:
        return None
    record = _read_record(Path(directory))
    if record.get("pid") in pids:
        return _describe(record)
    return f"pid {pids[0]}" if pids[0] else "another process"


def _flock_pids(info: os.stat_result) -> list[int] | None:
    """Pids holding an ``flock`` on the file ``info`` describes (``None``: cannot tell)."""
    # Matched on the inode alone: overlay and network file systems can show another device
    # number there, and a false "held" only makes callers more careful.
    wanted = f":{info.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = []
    for line in lines:
        fields = line.split()
        if "FLOCK" not in fields or "->" in fields:
            continue
        for position, field in enumerate(fields):
            if position and field.endswith(wanted) and field.count(":") == 2:
                pids.append(int(fields[position - 1]) if fields[position - 1].isdigit() else 0)
    return pids


def _read_record(directory: Path) -> dict:
    return read_json_object(Path(directory) / DirectoryLock.FILE_NAME) or {}


def _describe(info: dict) -> str:
    """Describe the process recorded in a lock record, for an error message."""
    who = f"pid {info['pid']} on {info.get('host', '?')}"
    if info.get("pid") == os.getpid():
        who += " (this process: another DiskSparseAdam still has it open)"
    if info.get("command"):
        who += f", running '{info['command']}'"
    if info.get("since"):
        who += f", since {info['since']}"
    return who


def is_regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_json_object(path: Path | str, *, dir_fd: int | None = None) -> dict | None:
    """The JSON object in the regular file ``path`` (relative to ``dir_fd`` if given), else
    ``None``; opened with ``O_NOFOLLOW``, so never read through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return value if isinstance(value, dict) else None


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
_ZEROS = bytes(DIGEST_BLOCK)


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


class StreamDigest:
    """:func:`file_digest` of a file of ``size`` bytes, computed from its bytes as they are
    written instead of reading the file back: the same BLAKE2b of the size and of the
    non-zero 64 KiB blocks with their numbers. Feed every byte once, in order, in pieces of
    any length (:meth:`update`); :meth:`hexdigest` once all ``size`` bytes were fed."""

    def __init__(self, size: int) -> None:
        self.size, self.fed = size, 0
        self._digest = hashlib.blake2b(digest_size=20)
        self._digest.update(size.to_bytes(8, "little"))
        self._carry = bytearray()  # the start of a block not yet whole: always fed % DIGEST_BLOCK bytes

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        at, length, done = self.fed, len(view), 0
        if at + length > self.size:
            raise ValueError(f"{at + length} bytes fed to the digest of a {self.size}-byte file")
        if self._carry:
            done = min(DIGEST_BLOCK - len(self._carry), length)
            self._carry += view[:done]
            if len(self._carry) == DIGEST_BLOCK:
                self._block((at + done) // DIGEST_BLOCK - 1, self._carry)
                self._carry = bytearray()
        while length - done >= DIGEST_BLOCK:  # whole blocks straight from the caller's buffer
            self._block((at + done) // DIGEST_BLOCK, view[done : done + DIGEST_BLOCK])
            done += DIGEST_BLOCK
        if done < length:
            self._carry += view[done:]
        self.fed = at + length

    def hexdigest(self) -> str:
        if self.fed != self.size:
            raise ValueError(f"{self.fed} bytes fed to the digest of a {self.size}-byte file")
        if self._carry:
            self._block(self.fed // DIGEST_BLOCK, self._carry)
            self._carry = bytearray()
        return self._digest.hexdigest()

    def _block(self, number: int, data) -> None:
        if any(bytes(data[:64])) or bytes(data) != _ZEROS[: len(data)]:  # most blocks: their first bytes tell
            self._digest.update(number.to_bytes(8, "little"))
            self._digest.update(data)  # the GIL is released while it hashes


def write_digested(fd: int, size: int, chunks, *, depth: int) -> str:
    """Write ``chunks`` (buffers, ``size`` bytes in all) one after the other at the start of
    the new file ``fd``, fsync it, and return its :func:`file_digest`, computed from the
    bytes as they are written, on a second thread, while the next chunk is made and
    written; the file is never read back.

    ``chunks`` is an iterator that may reuse a buffer once ``depth`` more chunks were asked
    of it (a ring of ``depth`` buffers): a chunk is hashed before the one ``depth`` places
    after it is asked for. Writeback of each chunk starts as soon as it is written
    (``sync_file_range``, where there is one), so the final fsync waits for little.
    """
    digest, queue_ = StreamDigest(size), queue.SimpleQueue()
    free = threading.Semaphore(depth)  # buffers the iterator may fill: released as chunks are hashed
    failed: list[BaseException] = []

    def hash_chunks() -> None:
        while (chunk := queue_.get()) is not None:
            try:
                if not failed:
                    digest.update(chunk)
            except BaseException as e:  # handed to the writer  # noqa: BLE001
                failed.append(e)
            finally:
                chunk = None
                free.release()

    hasher = threading.Thread(target=hash_chunks, name="dsa-train digest", daemon=True)
    hasher.start()
    written, iterator = 0, iter(chunks)
    try:
        while not failed:
            free.acquire()
            chunk = next(iterator, None)
            if chunk is None:
                break
            view = memoryview(chunk).cast("B")
            if written + view.nbytes > size:
                raise ValueError(f"more than the {size} bytes announced were written")
            start = written
            while view.nbytes:
                done = os.write(fd, view)
                view, written = view[done:], written + done
            queue_.put(chunk)
            _start_writeback(fd, start, written - start)
        if not failed:
            if written != size:
                raise ValueError(f"{written} bytes were written, {size} announced")
            os.fsync(fd)  # while the last chunks are hashed
    finally:
        queue_.put(None)
        hasher.join()
    if failed:
        raise failed[0]
    return digest.hexdigest()


SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library of this process, with ``errno`` kept for ``ctypes.get_errno``."""
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def _sync_file_range_function():
    try:
        function = libc().sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def _sync_file_range(fd: int, offset: int, length: int, flags: int) -> bool:
    """Linux ``sync_file_range``; ``False`` where libc has none."""
    function = _sync_file_range_function()
    if function is None:
        return False
    if length and function(fd, offset, length, flags) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return True


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these bytes to the disk now, without waiting for them
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``). Durability is still the fsync's: this only
    lets the disk work while the next chunk is made."""
    try:
        _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)
    except OSError:
        pass  # only a head start: the fsync writes it anyway


def write_back(fd: int, offset: int, length: int) -> None:
    """Write these bytes' dirty pages to the disk and wait for them, in file order (one
    sequential write-out), so the pages are clean and can be dropped from the cache. Not a
    durability point (no metadata, no disk cache flush): that stays the fsync's."""
    if not _sync_file_range(
        fd, offset, length, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
    ):
        os.fdatasync(fd)


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop these bytes' clean, unmapped pages from the page cache (the whole file for
    ``length`` 0); pages a process has mapped, and dirty ones, stay.

    Call it once a row file was written or read sequentially (created, copied, restored) and
    before its rows are written one by one through a mapping. A sequential ``write`` or
    ``read`` fills the cache with large folios (Linux 6.x: up to 2 MiB on ext4 from 6.16,
    XFS, btrfs), and a folio is written back whole: a 192-byte row update would then write
    megabytes (measured on ext4, Linux 6.18: 138x the 4 KiB pages touched, 1.6 TB written in
    200 steps of a 10^8-row table). Pages faulted in through a ``MADV_RANDOM`` mapping are
    single pages, so after this a row's update writes back one page."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def copy_sparse(
    source: Path, target: Path, *, replaced: list[tuple[int, int]] = (), fill: Callable[[int], object] | None = None
) -> None:
    """Copy a file, skipping its holes (``SEEK_DATA``/``SEEK_HOLE``), then fsync the copy.

    A row file of a 10M-row table is gigabytes apparent but holds only the rows ever
    touched; a plain copy would write every hole out as zeros.
    The target must not exist: it is created exclusively and never through a link.
    ``replaced``: sorted, disjoint byte ranges not copied from ``source``, which ``fill(fd)``
    writes into the copy (before its fsync) from elsewhere: a live file's changed pages
    from the memory that holds them.
    """
    starts = [start for start, _ in replaced]
    with open(source, "rb") as src:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as dst:
            size = os.fstat(src.fileno()).st_size
            dst.truncate(size)
            for start, end in data_extents(src.fileno(), size):
                for a, b in _outside(start, end, replaced, starts):
                    _copy_range(src.fileno(), dst.fileno(), a, b)
            dst.flush()
            if fill is not None:
                fill(dst.fileno())
            os.fsync(dst.fileno())
            drop_cached(dst.fileno())  # a restored copy is trained next, row by row
        drop_cached(src.fileno())  # the source may be a live table: its next row writes stay one page each


def _outside(start: int, end: int, ranges: list[tuple[int, int]], starts: list[int]):
    """The parts of ``[start, end)`` that none of the sorted, disjoint ``ranges`` covers."""
    i = max(0, bisect.bisect_right(starts, start) - 1)
    position = start
    while i < len(ranges) and ranges[i][0] < end:
        a, b = ranges[i]
        if a > position:
            yield position, a
        position = max(position, b)
        i += 1
    if position < end:
        yield position, end


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


def allocated_bytes(path: Path) -> int:
    """Bytes a file or folder really occupies (sparse holes excluded); links are not followed."""
    try:
        info = path.lstat()
    except OSError:
        return 0
    total = info.st_blocks * 512
    if stat.S_ISDIR(info.st_mode):
        for root, dirs, files in os.walk(path, followlinks=False):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total
