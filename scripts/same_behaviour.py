"""Does a refactoring change what training does? Run the small shipped recipes at two git
revisions and compare their metrics.jsonl line for line, timing fields aside.

Each revision is checked out in a temporary git worktree and every recipe runs there
(``python -m dsa_train run``, the tree's own package), one after the other; a field whose name
says time, rate, memory or place (``seconds``, ``items_per_s``, ``peak_rss_mib``, ...) is left
out of the comparison, everything else (losses, learning rates, metrics, steps) must be equal.
UMLS and Nations are read from ``$DSA_DATA_ROOT`` (a writable copy of PyG's folders)::

    DSA_DATA_ROOT=/tmp/peerdata python scripts/same_behaviour.py 6aee573~1 234af91

Exit status 1 when a recipe's lines differ (the first differing line and keys are printed).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: recipe name and overrides: every kind of training, seconds to a minute each on 2 cores
RECIPES = (
    ("quickstart", ()),
    ("recsys-quickstart", ()),
    ("karate-node2vec", ()),
    ("umls-distmult", ("train.epochs=5",)),
    ("nations-transe", ("train.epochs=5",)),
    ("umls-rotate", ("train.epochs=3",)),
    ("umls-complex", ("train.epochs=3",)),
)
#: key names that measure time, rate, memory or where things are, not what training computed
MEASURED = re.compile(r"second|per_s|rss|mib|bytes|time|wall|_s$|budget|started|finished|path|folder|pid|version", re.I)


def behaviour(value):
    """A metrics record without its measured fields (recursively)."""
    if isinstance(value, dict):
        return {k: behaviour(v) for k, v in value.items() if not MEASURED.search(k)}
    if isinstance(value, list):
        return [behaviour(v) for v in value]
    return value


def first_difference(before: list[dict], after: list[dict]) -> str | None:
    """``None`` when the records agree; else where and in which keys they first differ."""
    before, after = [behaviour(r) for r in before], [behaviour(r) for r in after]
    for i, (a, b) in enumerate(zip(before, after), 1):
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            return f"line {i} ({a.get('kind', b.get('kind'))}): {', '.join(keys)}"
    if len(before) != len(after):
        return f"{len(before)} lines before, {len(after)} after"
    return None


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_all(tree: Path, out: Path) -> None:
    for name, overrides in RECIPES:
        sets = [arg for o in overrides for arg in ("--set", o)]
        done = subprocess.run(
            [sys.executable, "-m", "dsa_train", "run", f"recipes/{name}.yaml", "--output", str(out / name), *sets],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"{name} failed in {tree}:\n{done.stderr[-2000:]}")
        print(f"  {name}: {len(records(out / name / 'metrics.jsonl'))} lines", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="a git revision")
    p.add_argument("after", help="a git revision (default: the working tree)", nargs="?")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="same-behaviour-") as tmp:
        tmp = Path(tmp)
        trees = {}
        try:
            for label, revision in (("before", args.before), ("after", args.after)):
                if revision is None:
                    trees[label] = ROOT
                    continue
                trees[label] = tmp / f"tree-{label}"
                subprocess.run(
                    ["git", "worktree", "add", "-q", "--detach", str(trees[label]), revision], cwd=ROOT, check=True
                )
            for label, tree in trees.items():
                print(f"{label}: {tree}", flush=True)
                run_all(tree, tmp / f"runs-{label}")
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        differ = 0
        for name, _ in RECIPES:
            found = first_difference(
                records(tmp / "runs-before" / name / "metrics.jsonl"),
                records(tmp / "runs-after" / name / "metrics.jsonl"),
            )
            differ += found is not None
            print(f"{name}: {'identical' if found is None else 'differs at ' + found}")
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
