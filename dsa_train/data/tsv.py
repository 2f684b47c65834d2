"""Folders of ``train.txt`` / ``valid.txt`` / ``test.txt`` with ``head<TAB>relation<TAB>tail`` lines.

Every line must have exactly three non-empty tab-separated columns and a plain ``\\n`` ending;
anything else (a CRLF ending, a wrong column count, an empty line or column, invalid UTF-8) is
reported with its file and line number, never dropped or mis-parsed. Names are kept as text
(WN18RR's synset ids keep their leading zeros).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import DatasetError
from .kg import SPLITS, KnowledgeGraph

MAX_REPORTED = 10


def load_tsv_folder(folder: Path, *, name: str | None = None) -> KnowledgeGraph:
    files = [folder / f"{split}.txt" for split in SPLITS]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DatasetError(
            f"dataset folder '{folder}' lacks {', '.join(missing)}",
            hint=f"place train.txt, valid.txt and test.txt (head<TAB>relation<TAB>tail lines) in '{folder}'",
        )
    entities: dict[str, int] = {}
    relations: dict[str, int] = {}
    splits = [read_triples(f, entities, relations) for f in files]
    return KnowledgeGraph(name or folder.name, len(entities), len(relations), *splits)


def read_triples(
    path: Path, entities: dict[str, int], relations: dict[str, int], *, final_newline: bool = False
) -> torch.Tensor:
    """Parse one file into an ``(M, 3)`` id tensor, growing the name -> id maps.

    ``final_newline``: also refuse a last line without ``\n`` (PyG's readers drop it).
    """
    rows: list[tuple[int, int, int]] = []
    problems: list[str] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            problem = None
            if raw.endswith(b"\r\n"):
                problem = "has a Windows (CRLF) line ending; convert the file with dos2unix"
            elif final_newline and not raw.endswith(b"\n"):
                problem = "does not end with a newline, and PyG's reader would drop it; add one"
            else:
                try:
                    parts = raw.removesuffix(b"\n").decode("utf-8").split("\t")
                except UnicodeDecodeError as e:
                    parts, problem = [], f"is not valid UTF-8 ({e.reason})"
                if problem is None and len(parts) != 3:
                    problem = f"has {len(parts)} tab-separated columns, expected 3 (head, relation, tail)"
                elif problem is None and not all(parts):
                    problem = "has an empty column"
            if problem:
                problems.append(f"{path}:{number}: line {problem}")
                if len(problems) > MAX_REPORTED:
                    break
                continue
            head, relation, tail = parts
            h = entities.setdefault(head, len(entities))
            r = relations.setdefault(relation, len(relations))
            rows.append((h, r, entities.setdefault(tail, len(entities))))
    if problems:
        shown = problems[:MAX_REPORTED] + (["... (more after these)"] if len(problems) > MAX_REPORTED else [])
        raise DatasetError(
            f"'{path}' has malformed lines:\n" + "\n".join(f"  {p}" for p in shown),
            hint="each line must be head<TAB>relation<TAB>tail ending with a plain newline",
        )
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)
