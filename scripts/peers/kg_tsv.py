"""Reading a TSV knowledge graph (train.txt, valid.txt, test.txt: head<TAB>relation<TAB>tail)
for the peer runners, which run in the peers' own environments (torch, no dsa_train)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SPLITS = ("train", "valid", "test")


def read_graph(folder: Path) -> tuple[dict[str, int], dict[str, int], dict[str, list[tuple[int, int, int]]]]:
    """Entity and relation ids (in order of first appearance over train, valid, test) and each
    split's triples as id tuples."""
    entities: dict[str, int] = {}
    relations: dict[str, int] = {}
    splits = {}
    for split in SPLITS:
        rows = []
        for line in (Path(folder) / f"{split}.txt").read_text().splitlines():
            if not line.strip():
                continue
            h, r, t = line.split("\t")
            rows.append(
                (
                    entities.setdefault(h, len(entities)),
                    relations.setdefault(r, len(relations)),
                    entities.setdefault(t, len(entities)),
                )
            )
        splits[split] = rows
    return entities, relations, splits


class Clock:
    """Training time without the validation passes made along the way."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.excluded = 0.0

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.excluded


def write_result(path: Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


#: steps a scale run (``--max-steps``) trains before its clock starts: allocation, first touches
WARM_STEPS = 10


def add_max_steps_argument(p: argparse.ArgumentParser) -> None:
    """``--max-steps``: a scale run of that many steps, evaluating nothing, timed after :data:`WARM_STEPS`."""

    def steps(text: str) -> int:
        value = int(text)
        if value <= WARM_STEPS:
            raise argparse.ArgumentTypeError(f"must be above {WARM_STEPS} (the untimed first steps), got {value}")
        return value

    p.add_argument("--max-steps", type=steps, help="train this many steps, evaluate nothing (scale runs)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options every peer runner takes besides ``--model`` and ``--setting``."""
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--dim", type=int, default=128, help="real coordinates (ComplEx and RotatE: dim / 2 complex)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--valid-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
