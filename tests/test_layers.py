"""The package's imports point down only and never go round in a circle (DESIGN.md, Layers).

Read from the source (module-level imports; an import inside a function, made on first use,
is not an arrow), so the rule is checked without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dsa_train"
OPTIM_MAY_NOT = {
    "data",
    "models",
    "eval",
    "nn",
    "recipe",
    "runs",
    "train",
    "cli",
    "tune",
    "results",
    "distributed",
    "plot",
}
ABOVE = {  # each part, and what it may never import
    "storage": {"optim", *OPTIM_MAY_NOT},  # row storage knows no optimizer
    "optim": OPTIM_MAY_NOT,
    **{
        part: {"runs", "train", "cli", "tune", "results", "plot"}
        for part in ("data", "models", "eval", "nn", "recipe", "distributed")
    },
    "runs": {"train", "cli", "tune", "results", "plot"},  # run folders and checkpoints: below train/ and results/
    "train": {"cli", "tune", "results", "plot"},
}


def import_graph(package: Path, *, type_only: bool = False) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports at module level (``if TYPE_CHECKING:``
    blocks left out, unless ``type_only``)."""
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
            for item in (
                ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else ()
            ):
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


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    part = lambda module: module.split(".")[1] if module.count(".") else ""  # noqa: E731
    return sorted((a, b) for a, targets in graph.items() for b in targets if part(b) in ABOVE.get(part(a), ()))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_and_never_go_round():
    graph = import_graph(PACKAGE)
    assert (
        len(graph) > 100
        and "dsa_train.runs.checkpoint_store" in graph["dsa_train.train.loop"]
        and "dsa_train.storage.row_file" in graph["dsa_train.optim.disk_sparse_adam"]
    )  # it read the package
    assert upward(graph) == []
    assert circles(graph) == []


def test_no_circle_even_through_type_only_imports():
    """A circle closed only under ``if TYPE_CHECKING:`` is still two modules that each need
    the other to be read (results/ann.py and results/reader.py were one)."""
    assert circles(import_graph(PACKAGE, type_only=True)) == []


def test_the_check_finds_an_upward_import_and_a_circle(tmp_path):
    """On a hand-made package: optim importing train, and a -> b -> a, are both found; an
    import inside a function or under TYPE_CHECKING is not an arrow."""
    package = tmp_path / "dsa_train"
    for folder in ("optim", "train"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "optim" / "rows.py").write_text("from ..train import loop\n")
    (package / "train" / "loop.py").write_text("from . import store\n\n\ndef later():\n    from ..optim import rows\n")
    (package / "train" / "store.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom .loop import later\n\nif TYPE_CHECKING:\n    from ..optim import rows\n"
    )
    graph = import_graph(package)
    assert upward(graph) == [("dsa_train.optim.rows", "dsa_train.train.loop")]
    assert circles(graph) == [["dsa_train.train.loop", "dsa_train.train.store"]]
    assert "dsa_train.optim.rows" not in graph["dsa_train.train.loop"] | graph["dsa_train.train.store"]
    with_types = import_graph(package, type_only=True)  # the TYPE_CHECKING import closes optim -> train -> optim
    assert circles(with_types) == [["dsa_train.optim.rows", "dsa_train.train.loop", "dsa_train.train.store"]]
