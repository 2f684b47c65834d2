"""Downloading one file over HTTP(S) whole, resumably, and checked: :func:`download`.

The bytes go to ``<dest>.part`` (created without following a link, locked with ``flock``: a
second process downloading the same file waits, then finds it in place); a ``.part`` left by an interrupted download is
continued with an HTTP ``Range`` request (a server that ignores it sends the whole file again,
and the ``.part`` is restarted). The finished ``.part`` is checked (size, SHA-256, and a git
blob id where that is what is known), fsynced and renamed onto ``dest``; a digest that does not
match removes the ``.part`` and raises a :class:`~dsa_train.errors.DatasetError` naming the
file, the expected and the received digest. Nothing here ever writes ``dest`` itself, so a
file already there is never overwritten (:mod:`.remote` decides what a present file means).

Only the standard library (``urllib``) is used. ``$DSA_DOWNLOAD_MIRROR`` (see :func:`address`)
sends every request to another server, e.g. a local copy of the files, or a test's server.
Progress is reported in bytes through :func:`dsa_train.progress.work`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import http.client
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import DatasetError
from ..fsutil import fsync_directory
from ..progress import work

BLOCK = 1 << 20  # bytes read from the network (and hashed) at once
TIMEOUT_S = 60.0  # per connection attempt and per read
MIRROR_ENV = "DSA_DOWNLOAD_MIRROR"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expected:
    """What a downloaded file must be; ``None`` where it is not known."""

    sha256: str | None = None
    size: int | None = None
    git_blob: str | None = None  # git's blob id (SHA-1 of "blob <size>\\0" + bytes): a repository tree names it


class DownloadFailed(Exception):
    """The network or the server failed (offline, a refused connection, an HTTP error); the
    ``.part`` is kept for the next attempt. :mod:`.remote` turns it into a ``DatasetError``
    naming every file still missing."""


def address(url: str) -> str:
    """Where ``url`` is fetched from: itself, or under ``$DSA_DOWNLOAD_MIRROR`` as
    ``<mirror>/<host>/<path>`` (``https://host/a/b.txt`` -> ``http://127.0.0.1:8000/host/a/b.txt``)."""
    mirror = os.environ.get(MIRROR_ENV)
    if not mirror:
        return url
    parts = urllib.parse.urlsplit(url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def part_path(dest: Path) -> Path:
    """Where the bytes of ``dest`` collect while they are downloaded."""
    return dest.with_name(dest.name + ".part")


def download(url: str, dest: Path, expected: Expected, *, what: str) -> str | None:
    """Download ``url`` (through :func:`address`) to ``dest``, continuing a ``.part`` left by
    an earlier attempt, check it against ``expected`` and rename it into place. Returns the
    file's SHA-256, or ``None`` when another process put ``dest`` in place while this one
    waited for it (the caller checks that file). ``dest`` must not exist. Raises
    :class:`DownloadFailed` (network, HTTP) or ``DatasetError`` (a wrong digest or size, a link
    in the way)."""
    if os.path.lexists(dest):
        raise DatasetError(
            f"'{dest}' is already there: it is not downloaded again", hint="move it aside to download it"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = part_path(dest)
    f = _open_part(part, dest)
    if f is None:
        return None
    with f:
        try:
            _fetch_into(f, address(url), expected, what=what)
        except DownloadFailed:
            if f.seek(0, os.SEEK_END) == 0:  # nothing came: leave no empty .part behind
                part.unlink(missing_ok=True)
            raise
        f.flush()
        os.fsync(f.fileno())
        digest = _check(f, part, expected, url=url, dest=dest)
        os.replace(part, dest)  # still under our lock: nobody else wrote the part meanwhile
    fsync_directory(dest.parent)
    return digest


def _open_part(part: Path, dest: Path):
    """The ``.part`` of ``dest``, open and locked (``flock``), never through a link; ``None``
    when another process, which held the lock, put ``dest`` in place meanwhile. Two processes
    (the ranks of a job) that start the same download take turns."""
    while True:
        try:
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise DatasetError(
                    f"'{part}' (where '{dest.name}' is downloaded) is a symbolic link: it is never written through",
                    hint=f"remove the link '{part}' and run again",
                ) from None
            raise DatasetError(f"cannot write '{part}': {e.strerror}", hint="the data root must be writable") from None
        f = os.fdopen(fd, "r+b")
        try:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info(f"another process is downloading '{dest}': waiting for it")
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            if os.path.lexists(dest):
                f.close()
                return None
            try:  # the name still holds the file we locked (not renamed or deleted meanwhile)
                if os.stat(part, follow_symlinks=False).st_ino == os.fstat(f.fileno()).st_ino:
                    return f
            except FileNotFoundError:
                pass
        except BaseException:
            f.close()
            raise
        f.close()


def _fetch_into(f, url: str, expected: Expected, *, what: str) -> None:
    """Write the file at ``url`` into the open ``.part`` ``f``: from its end with a Range
    request when it holds bytes already, from the start when the server ignores the range."""
    have = f.seek(0, os.SEEK_END)
    if expected.size is not None and have > expected.size:  # not a prefix of this file
        f.truncate(0)
        have = 0
    if expected.size is not None and have == expected.size:
        return  # complete already (the check says whether it is right)
    headers = {"User-Agent": "dsa-train", "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the range starts at or past the end: start again
            f.truncate(0)
            return _fetch_into(f, url, expected, what=what)
        raise DownloadFailed(f"HTTP {e.code} {e.reason} from {url}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        raise DownloadFailed(f"{url} could not be reached ({reason})") from None
    with response:
        if have and response.status == 206 and _range_start(response.headers.get("Content-Range")) == have:
            f.seek(have)
        else:  # 200: the server sent the whole file, whatever we asked
            f.seek(0)
            f.truncate(0)
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length and length.isdigit() else expected.size
        done = have
        try:
            while block := response.read(BLOCK):
                f.write(block)
                done += len(block)
                work(what, done, max(total or 0, done + 1))
        except (
            OSError,
            http.client.HTTPException,
        ) as e:  # a reset, a timeout, a short body halfway: the bytes so far stay for the next attempt
            raise DownloadFailed(f"the download from {url} stopped after {done:,} bytes ({e})") from None
        work(what, done, done)
        if total is not None and done < total:
            raise DownloadFailed(f"the download from {url} stopped after {done:,} of {total:,} bytes")


def _range_start(content_range: str | None) -> int | None:
    """The first byte a ``Content-Range: bytes a-b/n`` header says the body starts at."""
    try:
        unit, _, rest = (content_range or "").partition(" ")
        return int(rest.split("-", 1)[0]) if unit == "bytes" else None
    except ValueError:
        return None


def _check(f, part: Path, expected: Expected, *, url: str, dest: Path) -> str:
    """The file's SHA-256, once its size and digests match ``expected``; else the ``.part`` is
    removed and a ``DatasetError`` names the file, what was expected and what came."""
    size = f.seek(0, os.SEEK_END)
    sha256, blob = digests(f, size, git_blob=expected.git_blob is not None)
    wrong = []
    if expected.size is not None and size != expected.size:
        wrong.append(f"{size:,} bytes, expected {expected.size:,}")
    if expected.sha256 is not None and sha256 != expected.sha256:
        wrong.append(f"sha256 {sha256}, expected {expected.sha256}")
    if expected.git_blob is not None and blob != expected.git_blob:
        wrong.append(f"git blob id {blob}, expected {expected.git_blob}")
    if wrong:
        part.unlink(missing_ok=True)
        raise DatasetError(
            f"the download of '{dest.name}' from {url} is not the expected file: got " + "; ".join(wrong),
            hint=f"the download was damaged or the file at that address changed; it was deleted: run again to "
            f"download it afresh, or place a copy of the expected file at '{dest}' by hand",
        )
    return sha256


def digests(f, size: int, *, git_blob: bool = False) -> tuple[str, str | None]:
    """The SHA-256 of the open file ``f`` of ``size`` bytes, and its git blob id if asked."""
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False) if git_blob else None
    f.seek(0)
    while block := f.read(BLOCK):
        sha256.update(block)
        if blob is not None:
            blob.update(block)
    return sha256.hexdigest(), blob.hexdigest() if blob is not None else None


def file_digests(path: Path, *, git_blob: bool = False) -> tuple[int, str, str | None]:
    """A present file's size, SHA-256 and (if asked) git blob id, read without following a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return (size, *digests(f, size, git_blob=git_blob))
