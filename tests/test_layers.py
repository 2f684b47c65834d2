"""The package's imports point down only and never go round in a circle (DESIGN.md, Layers).

Read from the source (module-level imports; an import inside a function, made on first use,
is not an arrow), so the rule is checked without importing anything."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from module_walk import import_graph  # noqa: E402  (the one reader of the package's imports)

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
