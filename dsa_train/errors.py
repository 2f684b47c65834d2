"""Errors dsa-train raises for bad input or bad state.

Every error carries a message that names the thing and the value, and a hint that says how
to fix it. The CLI prints ``Error: <message>`` and the hint; library users catch
:class:`DsaError` (or one of its kinds) and read ``.message`` and ``.hint``.
"""

from __future__ import annotations


class DsaError(Exception):
    """Base class of dsa-train's errors: a message plus an optional hint."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class StateError(DsaError):
    """An optimizer state directory is missing, locked, corrupt or does not match the model."""


class ConfigError(DsaError):
    """A recipe or override is invalid. ``problems`` lists every one, each with its dotted path."""

    def __init__(self, problems: list[str], *, source: str = "recipe", hint: str | None = None) -> None:
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        message = f"{source} has {count}:\n" + "\n".join(f"  {p}" for p in problems)
        super().__init__(message, hint=hint or "fix these and run again; `--set key=value` overrides a key")


class DatasetError(DsaError):
    """A dataset is missing, incomplete or malformed."""


class TrainingError(DsaError):
    """Training cannot go on safely (for example a non-finite gradient)."""
