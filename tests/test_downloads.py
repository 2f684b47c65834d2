"""Downloading a file: fresh, resumed from a ``.part`` (with and without a server that honours
Range), a wrong digest, offline, a link in the way. Every request goes to a threaded HTTP
server on 127.0.0.1 serving bytes from memory (``$DSA_DOWNLOAD_MIRROR`` points at it): no
network."""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import threading
from pathlib import Path

import pytest

from dsa_train.data.downloads import MIRROR_ENV, DownloadFailed, Expected, download, part_path
from dsa_train.errors import DatasetError


URL = "https://example.org/data/file.bin"
BODY = bytes(range(256)) * 5000  # 1.25 MB: more than one block, so a download is several reads


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_fresh_download_is_checked_and_renamed_into_place(server, tmp_path):
    server.serve(URL, BODY)
    dest = tmp_path / "d" / "file.bin"
    assert download(URL, dest, Expected(sha256=sha(BODY), size=len(BODY)), what="w") == sha(BODY)
    assert dest.read_bytes() == BODY and not part_path(dest).exists()
    assert server.requests == [("/example.org/data/file.bin", None)]


def test_a_git_blob_id_is_checked_too(server, tmp_path):
    server.serve(URL, BODY)
    blob = hashlib.sha1(f"blob {len(BODY)}\0".encode() + BODY).hexdigest()
    download(URL, tmp_path / "ok.bin", Expected(git_blob=blob), what="w")
    with pytest.raises(DatasetError, match=f"git blob id {blob}, expected 0+"):
        download(URL, tmp_path / "bad.bin", Expected(git_blob="0" * 40), what="w")


def test_a_partial_download_is_resumed_with_a_range_request(server, tmp_path):
    server.serve(URL, BODY)
    dest = tmp_path / "file.bin"
    part_path(dest).write_bytes(BODY[:300_001])
    download(URL, dest, Expected(sha256=sha(BODY)), what="w")
    assert server.requests == [("/example.org/data/file.bin", "bytes=300001-")]
    assert dest.read_bytes() == BODY


def test_a_server_that_ignores_range_restarts_the_part(server, tmp_path):
    server.serve(URL, BODY)
    server.honour_range = False
    dest = tmp_path / "file.bin"
    part_path(dest).write_bytes(b"x" * 1000)  # not even a prefix: appending would be wrong
    download(URL, dest, Expected(sha256=sha(BODY)), what="w")
    assert server.requests[0][1] == "bytes=1000-"
    assert dest.read_bytes() == BODY


def test_a_part_longer_than_the_file_starts_again(server, tmp_path):
    server.serve(URL, BODY)
    dest = tmp_path / "file.bin"
    part_path(dest).write_bytes(BODY + b"more")
    download(URL, dest, Expected(sha256=sha(BODY)), what="w")  # 416 for the range, then whole
    assert dest.read_bytes() == BODY and [r for _, r in server.requests] == [f"bytes={len(BODY) + 4}-", None]


def test_a_wrong_digest_deletes_the_part_and_names_both_digests(server, tmp_path):
    server.serve(URL, BODY[:-1] + b"?")
    dest = tmp_path / "file.bin"
    with pytest.raises(DatasetError) as caught:
        download(URL, dest, Expected(sha256=sha(BODY)), what="w")
    message = str(caught.value)
    assert "file.bin" in message and sha(BODY) in message and sha(BODY[:-1] + b"?") in message
    assert not dest.exists() and not part_path(dest).exists()


def test_offline_keeps_the_part_and_says_where_it_tried(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(MIRROR_ENV, f"http://127.0.0.1:{port}")
    dest = tmp_path / "file.bin"
    part_path(dest).write_bytes(b"abc")
    with pytest.raises(DownloadFailed, match=f"http://127.0.0.1:{port}/example.org/data/file.bin could not be reached"):
        download(URL, dest, Expected(), what="w")
    assert part_path(dest).read_bytes() == b"abc" and not dest.exists()
    part_path(dest).unlink()
    with pytest.raises(DownloadFailed):
        download(URL, dest, Expected(), what="w")
    assert not part_path(dest).exists()  # nothing came: no empty .part left behind


def test_links_at_the_destination_are_never_followed(server, tmp_path):
    server.serve(URL, BODY)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    dest = tmp_path / "file.bin"
    os.symlink(victim, part_path(dest))
    with pytest.raises(DatasetError, match=r"file.bin.part.*is a symbolic link"):
        download(URL, dest, Expected(), what="w")
    os.unlink(part_path(dest))
    os.symlink(victim, dest)
    with pytest.raises(DatasetError, match="is already there"):
        download(URL, dest, Expected(), what="w")
    assert victim.read_bytes() == b"mine" and Path(dest).is_symlink()


def test_a_second_process_waits_for_the_first_and_finds_the_file(server, tmp_path):
    server.serve(URL, BODY)
    dest = tmp_path / "file.bin"
    holder = open(part_path(dest), "wb")  # the "other process": holds the .part's lock
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
    result = []
    waiting = threading.Thread(target=lambda: result.append(download(URL, dest, Expected(sha256=sha(BODY)), what="w")))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not server.requests  # it waits, asking nothing
    dest.write_bytes(BODY)  # the other one finishes: its file is in place
    os.unlink(part_path(dest))
    holder.close()
    waiting.join(10)
    assert result == [None] and not server.requests and dest.read_bytes() == BODY


def test_a_connection_dropped_halfway_keeps_the_bytes_and_the_next_attempt_resumes(server, tmp_path):
    server.serve(URL, BODY)
    server.cut_after = 400_000
    dest = tmp_path / "file.bin"
    with pytest.raises(DownloadFailed, match="stopped after"):
        download(URL, dest, Expected(sha256=sha(BODY)), what="w")
    assert part_path(dest).stat().st_size == 400_000 and not dest.exists()
    download(URL, dest, Expected(sha256=sha(BODY)), what="w")
    assert server.requests[-1][1] == "bytes=400000-" and dest.read_bytes() == BODY
