"""Named components that register themselves: ``@REGISTRY.register_as("name")`` on the class.

A registry maps a recipe's name for a component (a scoring function, a task kind) to the class
that implements it; whatever the rest of the package needs to know of a component it reads from
the class the registry returns, never from a list of names kept elsewhere. An unknown name is a
:class:`~dsa_train.errors.ConfigError` that lists the known ones (after PyTorch-BigGraph's
``plugin.py``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
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
