"""Named components that register themselves: ``@REGISTRY.register_as("name")`` on the class.

A registry maps a recipe's name for a component (a scoring function, a task kind) to the class
that implements it; whatever the rest of the package needs to know of a component it reads from
the class the registry returns, never from a list of names kept elsewhere. An unknown name is a
:class:`~dsa_train.errors.ConfigError` that lists the known ones (after PyTorch-BigGraph's
``plugin.py``).
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes by name, in the order they registered.

    Args:
        what: what a registered class is, as an error names it ("scoring function").
        key: the recipe key whose value names one ("model.kind").
    """

    def __init__(self, what: str, key: str) -> None:
        self.what, self.key = what, key
        self._classes: dict[str, T] = {}

    def register_as(self, name: str) -> Callable[[T], T]:
        """A class decorator that registers the class under ``name`` (and gives it ``name``)."""

        def register(cls: T) -> T:
            self.add(name, cls)
            cls.name = name
            return cls

        return register

    def add(self, name: str, entry: T) -> None:
        """Register ``entry`` under ``name`` (a name registered twice is a programming error)."""
        if self._classes.get(name, entry) is not entry:
            raise ValueError(f"{self.what} {name!r} is registered twice: {self._classes[name]!r} and {entry!r}")
        self._classes[name] = entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[T]:
        return iter(self._classes.values())

    def get(self, name: str) -> T:
        """The class registered as ``name``; an unknown name is a ConfigError listing the known ones."""
        try:
            return self._classes[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._classes, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = ", ".join(repr(n) for n in self._classes)
            raise ConfigError([f"{self.key}: {name!r} is not a known {self.what} (known: {known}){hint}"]) from None


def declared(package: Path, registry: str, *, first: str = "SHIPPED") -> dict[str, dict[str, object]]:
    """What the modules of the package folder ``package`` register, read from their source
    without importing them: each class decorated ``@<registry>.register_as("name")``, by name,
    with the class attributes its body assigns a literal (``halves = "..."``). The package's
    ``__init__.py`` may name in ``first`` (a literal tuple) the modules that come first.

    Reading a recipe must not import torch (``dsa-train validate`` answers in a fraction of a
    second); a scoring function's module does. So the recipe's checks read its declarations
    here, and a test holds them equal to the imported classes' attributes."""
    order = _literal(ast.parse((package / "__init__.py").read_text(encoding="utf-8")), first) or ()
    modules = sorted(
        (p for p in package.glob("*.py") if p.name != "__init__.py"),
        key=lambda p: (p.stem not in order, order.index(p.stem) if p.stem in order else 0, p.stem),
    )
    found: dict[str, dict[str, object]] = {}
    for path in modules:
        for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
            name = _registered_name(node, registry) if isinstance(node, ast.ClassDef) else None
            if name is not None:
                found[name] = {key: value for key in _assigned(node) if (value := _literal(node, key)) is not None}
    return found


def _registered_name(node: ast.ClassDef, registry: str) -> str | None:
    for d in node.decorator_list:
        if (
            isinstance(d, ast.Call)
            and isinstance(d.func, ast.Attribute)
            and d.func.attr == "register_as"
            and isinstance(d.func.value, ast.Name)
            and d.func.value.id == registry
            and d.args
            and isinstance(d.args[0], ast.Constant)
            and isinstance(d.args[0].value, str)
        ):
            return d.args[0].value
    return None


def _assigned(node) -> list[str]:
    return [
        s.targets[0].id
        for s in node.body
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
    ]


def _literal(node, key: str):
    """The literal a body (a module's, a class's) assigns to ``key``, or ``None``."""
    for s in node.body:
        if (
            isinstance(s, ast.Assign)
            and len(s.targets) == 1
            and isinstance(s.targets[0], ast.Name)
            and s.targets[0].id == key
        ):
            try:
                return ast.literal_eval(s.value)
            except ValueError:
                return None
    return None
