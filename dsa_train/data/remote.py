"""Datasets by name: where each one's files come from, what they must be, and :func:`fetch`,
which puts them in place under the data root on first use.

A named dataset (:data:`DATASETS`) is a folder under the data root and the files it holds:
each downloaded from its address (:mod:`.downloads`: resumable, checked, renamed into place),
or taken out of a downloaded archive. A file already in place is checked, never replaced:
against the digest known here, else against the one recorded when it arrived
(``<folder>/digests.json``); one that does not match is an error naming it. Where no digest is
known here (Wikidata5M, OGB's zips), the first download's SHA-256 is recorded there and every later use is
checked against it (trust on first use). The record also keeps each file's size and mtime, so
an unchanged file is not read again.

Offline, or on an HTTP error, the ``DatasetError`` names every file still missing, its
address and the path to place it at by hand.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DatasetError
from ..fsutil import atomic_write_bytes, atomic_write_pieces
from ..progress import work
from .downloads import MIRROR_ENV, DownloadFailed, Expected, address, download, file_digests, part_path

logger = logging.getLogger(__name__)

RECORD = "digests.json"
RECORD_FORMAT = "dsa-train/fetched"


@dataclass(frozen=True)
class RemoteFile:
    """A file downloaded from ``url`` to ``<folder>/<name>``."""

    name: str
    url: str
    expected: Expected = Expected()


@dataclass(frozen=True)
class Member:
    """A file taken out of the archive ``archive`` (a :class:`RemoteFile`'s name): its
    ``member`` (the name inside the archive) becomes ``<folder>/<name>``."""

    name: str
    archive: str
    member: str


@dataclass(frozen=True)
class RemoteDataset:
    """A dataset by name: its folder under the data root, its files, where it comes from."""

    name: str
    folder: str
    files: tuple[RemoteFile, ...]
    members: tuple[Member, ...] = field(default=())
    source: str = ""


def _pykeen(name: str, sums: dict[str, tuple[str, int]]) -> RemoteDataset:
    base = f"https://raw.githubusercontent.com/pykeen/pykeen/master/src/pykeen/datasets/{name}"
    files = tuple(RemoteFile(f, f"{base}/{f}", Expected(sha256=s, size=n)) for f, (s, n) in sums.items())
    return RemoteDataset(name, name, files, source="the files PyKEEN ships (PyKEEN 1.11.1's, MIT licence)")


def _pyg(name: str, folder: str, base: str, sums: dict[str, tuple[str, int]]) -> RemoteDataset:
    files = tuple(RemoteFile(f"raw/{f}", f"{base}/{f}", Expected(sha256=s, size=n)) for f, (s, n) in sums.items())
    return RemoteDataset(
        name, folder, files, source="the files PyG's class downloads (villmow/datasets_knowledge_embedding)"
    )


def _ogb(name: str, download_name: str, split: str, raw: tuple[str, ...]) -> RemoteDataset:
    """An OGB link-prediction dataset: its zip (top folder ``download_name``), and the files
    dsa-train reads taken out of it: the counts of nodes, and the split's three ``.pt`` files."""
    archive = f"{download_name}.zip"
    members = tuple(Member(f.split("/")[-1], archive, f"{download_name}/{f}") for f in raw) + tuple(
        Member(f"{s}.pt", archive, f"{download_name}/split/{split}/{s}.pt") for s in ("train", "valid", "test")
    )
    return RemoteDataset(
        name,
        name,
        (RemoteFile(archive, f"http://snap.stanford.edu/ogb/data/linkproppred/{archive}"),),
        members,
        source=f"OGB's {name} (ogb.stanford.edu), the zip ogb 1.3.6 downloads",
    )


_VILLMOW = "https://raw.githubusercontent.com/villmow/datasets_knowledge_embedding/master"

#: Every dataset known by name. Digests: see docs/data.md, "Datasets by name", for how each was
#: established; ``None`` is unknown (the first download's is recorded and trusted).
DATASETS: dict[str, RemoteDataset] = {
    "umls": _pykeen(
        "umls",
        {
            "train.txt": ("873ef4925516b83e7f6f8cc02b4be51d848828710a7f65a956f0ac4a9e452f35", 260013),
            "valid.txt": ("025c98f8a4891e2a6582ec5b40ee0d904031edad9c52554522f4b7904820c98e", 32963),
            "test.txt": ("a7eb529a3d2810fcc96341ccc97c625a5e202f8389673aa6bd317eeebbb79014", 32968),
        },
    ),
    "nations": _pykeen(
        "nations",
        {
            "train.txt": ("0830fa9da8e5bba2ccdaa45b7bdc9130451ba66b09ff2708f35fccaf82473e57", 39101),
            "valid.txt": ("2b337a62e51a2f45c283eac98a70d21b7e0e102136be1539b2a52c652a7b0530", 4851),
            "test.txt": ("3971085165b47b6aeaec68058c6d8d98b3005e929db81268410b95ae4db770ab", 4951),
        },
    ),
    "fb15k237": _pyg(
        "fb15k237",
        "FB15k-237",
        f"{_VILLMOW}/FB15k-237",
        {
            "train.txt": ("61099230e4439f90885ca9767739e31e8e32f54736fa1c35952b27997bc7c08a", 21005177),
            "valid.txt": ("749cbe9d923bac7b9354da5614ecfed2e0220256d442c3e04a6b303db1f273d9", 1285566),
            "test.txt": ("e2e35e8e6113de220140b6f44dc71a5207b0fc6872d575e874aefe13259b655b", 1499033),
        },
    ),
    "wn18rr": _pyg(
        "wn18rr",
        "WN18RR",
        f"{_VILLMOW}/WN18RR/original",
        {
            "train.txt": ("038612e783c215ee5f3ca9fbfca27b8d0739be1028fe4ee7c174aecf0b83d5df", 3135377),
            "valid.txt": ("453ce7202afa58094a04d2b1560ee2b02660f1c260b32ce6651c8ccedd1028ab", 110415),
            "test.txt": ("0383bceaaa1096cf3c03ec021ed0048068e2355dbfc0239b292cefdac821cec5", 113180),
        },
    ),
    # The ConvE release, as PyKEEN fetches it, at the commit PyKEEN pins (f3c0eb28): that tree names
    # the archive's git blob id; its SHA-256 is not published anywhere we could read, so the first
    # download's is recorded (and the blob id checked) like any other.
    "yago3-10": RemoteDataset(
        "yago3-10",
        "yago3-10",
        (
            RemoteFile(
                "YAGO3-10.tar.gz",
                "https://raw.githubusercontent.com/TimDettmers/ConvE/f3c0eb286025410fa5b4c04696c918264163d0ca/YAGO3-10.tar.gz",
                Expected(git_blob="be63d16955e1951cb6539710204af43cb38da7d9"),
            ),
        ),
        tuple(Member(f"{s}.txt", "YAGO3-10.tar.gz", f"{s}.txt") for s in ("train", "valid", "test")),
        source="the ConvE release of YAGO3-10 (github.com/TimDettmers/ConvE), as PyKEEN fetches it",
    ),
    # The transductive split from the Zenodo record PyKEEN downloads. No digest or size of it
    # could be read from here: trust on first use (docs/data.md says so).
    "wikidata5m": RemoteDataset(
        "wikidata5m",
        "wikidata5m",
        (
            RemoteFile(
                "wikidata5m_transductive.tar.gz",
                "https://zenodo.org/record/5546383/files/wikidata5m_transductive.tar.gz",
            ),
        ),
        tuple(
            Member(f"{s}.txt", "wikidata5m_transductive.tar.gz", f"wikidata5m_transductive_{s}.txt")
            for s in ("train", "valid", "test")
        ),
        source="Wikidata5M's transductive split (Wang et al. 2021) from Zenodo record 5546383, as PyKEEN fetches it",
    ),
    # OGB's zips, from the address ogb 1.3.6's master.csv names. OGB publishes no digest of them
    # (ogb checks none): trust on first use, like Wikidata5M.
    "ogbl-wikikg2": _ogb("ogbl-wikikg2", "wikikg-v2", "time", ("raw/num-node-list.csv.gz",)),
    "ogbl-biokg": _ogb("ogbl-biokg", "biokg", "random", ("raw/num-node-dict.csv.gz",)),
}


def fetch(name: str, root: Path) -> Path:
    """The folder of the dataset ``name`` under ``root``, its files downloaded (or taken out of
    their archive) where missing, every file checked. Raises ``DatasetError``."""
    dataset = known(name)
    folder = root / dataset.folder
    record = _read_record(folder)
    changed = False
    needed = []
    for remote in dataset.files:
        members = [m for m in dataset.members if m.archive == remote.name]
        if members and all(os.path.lexists(folder / m.name) for m in members):
            continue  # taken out already: the archive is not needed (it may have been deleted)
        if os.path.lexists(folder / remote.name):
            changed |= _check_present(folder, remote.name, remote.expected, record, dataset)
        else:
            needed.append(remote)
    for i, remote in enumerate(needed):
        expected = remote.expected
        pinned = (record.get(remote.name) or {}).get("sha256")
        if expected.sha256 is None and pinned:  # downloaded before: the same file again, or an error
            expected = Expected(sha256=pinned, size=expected.size, git_blob=expected.git_blob)
        try:
            sha256 = download(remote.url, folder / remote.name, expected, what=f"downloading {remote.name}")
        except DownloadFailed as e:
            _save_record(folder, record, changed)
            raise _offline(dataset, folder, needed[i:], str(e)) from None
        if sha256 is None:  # another process downloaded it meanwhile
            changed |= _check_present(folder, remote.name, expected, record, dataset)
            continue
        trusted = expected.sha256 is not None or expected.git_blob is not None
        if not trusted:
            logger.warning(
                f"{dataset.name}: no digest of '{remote.name}' is known to dsa-train; the one downloaded now "
                f"(sha256 {sha256}) is recorded in '{folder / RECORD}' and every later use is checked against it"
            )
        _remember(record, folder, remote.name, sha256, remote.url if trusted else f"{remote.url} (first download)")
        changed = True
    for member in dataset.members:
        if os.path.lexists(folder / member.name):
            changed |= _check_present(folder, member.name, Expected(), record, dataset)
    missing = [m for m in dataset.members if not os.path.lexists(folder / m.name)]
    if missing:
        _extract(folder, missing, record)
        changed = True
    _save_record(folder, record, changed)
    return folder


def known(name: str) -> RemoteDataset:
    """The dataset called ``name``; an unknown name is a ``DatasetError`` listing the known ones."""
    if name not in DATASETS:
        raise DatasetError(
            f"no dataset is known by the name {name!r}", hint=f"known names: {', '.join(sorted(DATASETS))}"
        )
    return DATASETS[name]


def _check_present(folder: Path, name: str, expected: Expected, record: dict, dataset: RemoteDataset) -> bool:
    """Check a file already in place; returns whether the record changed. A link is refused,
    a file that is not the expected one is an error naming it (it is left where it is)."""
    path = folder / name
    if path.is_symlink():
        raise DatasetError(
            f"'{path}' is a symbolic link: dsa-train does not read or replace a dataset file through a link",
            hint=f"put the file itself at '{path}' (or point DSA_DATA_ROOT at the folder that holds {dataset.folder}/)",
        )
    info = path.stat()
    kept = record.get(name)
    known_sha = expected.sha256 or (kept or {}).get("sha256")
    if (
        kept
        and kept.get("size") == info.st_size
        and kept.get("mtime_ns") == info.st_mtime_ns
        and kept.get("sha256") == known_sha
    ):
        return False  # checked before, unchanged since
    size, sha256, blob = file_digests(path, git_blob=expected.git_blob is not None)
    wrong = []
    if expected.size is not None and size != expected.size:
        wrong.append(f"{size:,} bytes, expected {expected.size:,}")
    if known_sha is not None and sha256 != known_sha:
        source = "known to dsa-train" if expected.sha256 else f"recorded in '{folder / RECORD}'"
        wrong.append(f"sha256 {sha256}, expected {known_sha} ({source})")
    if expected.git_blob is not None and blob != expected.git_blob:
        wrong.append(f"git blob id {blob}, expected {expected.git_blob}")
    if wrong:
        raise DatasetError(
            f"'{path}' is not {dataset.name}'s {name}: " + "; ".join(wrong),
            hint=f"move '{path}' aside and run again to download {dataset.name} ({dataset.source}); "
            "for a dataset of your own, use dataset.kind: tsv with dataset.path naming its folder",
        )
    how = (
        "known" if expected.sha256 or expected.git_blob else ("recorded" if known_sha else "placed by hand, first use")
    )
    _remember(record, folder, name, sha256, how)
    return True


def _offline(dataset: RemoteDataset, folder: Path, missing: list[RemoteFile], reason: str) -> DatasetError:
    lines = [f"  {folder / r.name}  <-  {address(r.url)}" for r in missing]
    members = {m.archive for m in dataset.members}
    parts = [part_path(folder / r.name) for r in missing if part_path(folder / r.name).is_file()]
    taken = [m for m in dataset.members if m.archive in {r.name for r in missing}]
    return DatasetError(
        f"dataset '{dataset.name}' could not be downloaded: {reason}\nfiles missing (path  <-  address):\n"
        + "\n".join(lines),
        hint="download each address to the path beside it by hand (any machine with network will do), then run "
        "again: the files are checked against their digests"
        + (f"; the archive's files ({', '.join(m.name for m in taken)}) are taken out of it here" if members else "")
        + "".join(f"; '{p.name}' (a partial download) is resumed on the next run" for p in parts)
        + f"; ${MIRROR_ENV} sends the requests to a mirror",
    )


def _extract(folder: Path, members: list[Member], record: dict) -> None:
    """Take ``members`` out of their archives (a tar, or a zip by its name), each written under
    a temporary name, fsynced and renamed; the archive's own entries never choose a path."""
    for archive in sorted({m.archive for m in members}):
        wanted = {m.member: m for m in members if m.archive == archive}
        path = folder / archive
        try:
            if archive.endswith(".zip"):
                _extract_zip(path, folder, wanted, record)
            else:
                _extract_tar(path, folder, wanted, record)
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
            raise DatasetError(
                f"cannot read the archive '{path}': {e}", hint=f"delete '{path}' and run again to download it afresh"
            ) from None
        if wanted:
            raise DatasetError(
                f"the archive '{path}' lacks {', '.join(sorted(wanted))}",
                hint=f"delete '{path}' and run again to download it afresh",
            )


def _extract_tar(path: Path, folder: Path, wanted: dict[str, Member], record: dict) -> None:
    with tarfile.open(path, "r:*") as tar:
        for info in tar:
            member = wanted.pop(info.name.removeprefix("./"), None)
            if member is None:
                continue
            if not info.isreg():
                raise DatasetError(f"'{info.name}' in '{path}' is not a regular file", hint="the archive is damaged")
            sha256 = _write_member(tar.extractfile(info), info.size, folder / member.name)
            _remember(record, folder, member.name, sha256, f"taken out of {path.name}")
            if not wanted:
                break


def _extract_zip(path: Path, folder: Path, wanted: dict[str, Member], record: dict) -> None:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            member = wanted.pop(info.filename.removeprefix("./"), None)
            if member is None:
                continue
            if info.is_dir():
                raise DatasetError(
                    f"'{info.filename}' in '{path}' is a folder, not a file", hint="the archive is damaged"
                )
            with zf.open(info) as source:  # checks the member's CRC-32 as it is read
                sha256 = _write_member(source, info.file_size, folder / member.name)
            _remember(record, folder, member.name, sha256, f"taken out of {path.name}")
            if not wanted:
                break


def _write_member(source, size: int, dest: Path) -> str:
    """Write an archive member's bytes from ``source`` to ``dest`` atomically; its SHA-256."""
    import hashlib

    digest = hashlib.sha256()

    def blocks():
        done = 0
        while block := source.read(1 << 20):
            digest.update(block)
            done += len(block)
            work(f"taking {dest.name} out of the archive", done, max(size, done + 1))
            yield block
        work(f"taking {dest.name} out of the archive", done, done)

    atomic_write_pieces(dest, blocks())
    return digest.hexdigest()


def _read_record(folder: Path) -> dict:
    """``{file name: {sha256, size, mtime_ns, how}}`` as recorded in ``<folder>/digests.json``."""
    try:
        data = json.loads((folder / RECORD).read_bytes())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("format") == RECORD_FORMAT else None
    return {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}


def _remember(record: dict, folder: Path, name: str, sha256: str, how: str) -> None:
    info = os.stat(folder / name, follow_symlinks=False)
    record[name] = {"sha256": sha256, "size": info.st_size, "mtime_ns": info.st_mtime_ns, "how": how}


def _save_record(folder: Path, record: dict, changed: bool) -> None:
    """Write the record; a folder that cannot be written (a read-only copy of the files) keeps
    none, and its files are read and checked again next time."""
    if changed:
        body = {"format": RECORD_FORMAT, "version": 1, "files": record}
        try:
            atomic_write_bytes(folder / RECORD, json.dumps(body, indent=1, sort_keys=True).encode() + b"\n")
        except OSError as e:
            logger.info(
                f"could not record the digests in '{folder / RECORD}' ({e.strerror}): they are checked again next time"
            )
