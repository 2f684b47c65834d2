"""The modules a command reaches, by package ("rooms"), and the imports among them that point up
a layer ("climbs"): read from the source, imports inside functions included (those made on
first use, which tests/test_layers.py leaves out). For a layout's before and after:

    python scripts/module_walk.py dsa_train.cli.eval                     # this checkout
    git worktree add /tmp/before <commit>
    python scripts/module_walk.py dsa_train.cli.eval --checkout /tmp/before

The layers, lowest first, are DESIGN.md's: the base modules, storage/, optim/, the parts that
know no run (data/, models/, eval/, nn, recipe/, distributed/), runs/, train/, results/, tune/
and the entries, cli/. A checkout without storage/ or runs/ simply has no module in them.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

LAYERS = {
    "": 0,
    "storage": 1,
    "optim": 2,
    **dict.fromkeys(("data", "models", "eval", "nn", "recipe", "distributed"), 3),
    "runs": 4,
    "train": 5,
    "results": 6,
    **dict.fromkeys(("tune", "plot", "entry"), 7),
    **dict.fromkeys(("cli", "dsa_alias"), 8),
}


def import_graph(package: Path, *, type_only: bool = False, in_functions: bool = False) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports at module level: ``if TYPE_CHECKING:``
    blocks left out unless ``type_only``, imports inside functions and class bodies (made on
    first use) left out unless ``in_functions``. tests/test_layers.py checks its rules on it."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_only:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not in_functions:
                continue
            for item in ast.walk(node):
                if isinstance(item, ast.ImportFrom):
                    base = (
                        ".".join(here[: len(here) - item.level + 1] + ([item.module] if item.module else []))
                        if item.level
                        else item.module
                    )
                    for alias in item.names:
                        target = f"{base}.{alias.name}"
                        found.add(target if target in modules else base)
                elif isinstance(item, ast.Import):
                    found |= {alias.name for alias in item.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("entry", help="the module a command starts in, e.g. dsa_train.cli.eval")
    p.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parent.parent)
    args = p.parse_args(argv)
    graph = import_graph(args.checkout / "dsa_train", type_only=True, in_functions=True)
    if args.entry not in graph:
        raise SystemExit(f"{args.entry}: no such module in {args.checkout / 'dsa_train'}")
    seen, todo, climbs = set(), [args.entry], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for target in graph[module]:
            if LAYERS[part(target)] > LAYERS[part(module)]:
                climbs.append((module, target))
            todo.append(target)
    rooms: dict[str, int] = {}
    for module in seen:
        rooms[part(module) or "base"] = rooms.get(part(module) or "base", 0) + 1
    print(f"{len(seen)} modules in {len(rooms)} packages: " + ", ".join(f"{k} {v}" for k, v in sorted(rooms.items())))
    print(f"{len(climbs)} imports up a layer" + "".join(f"\n  {a} -> {b}" for a, b in sorted(climbs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
