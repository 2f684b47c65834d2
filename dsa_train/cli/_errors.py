"""How the CLI ends on an error: one ``Error: ...`` line and a hint on stderr, exit code 1.

The traceback is shown only with ``DSA_DEBUG=1``. Usage errors (bad options) are Typer's
own and exit with 2.
"""

from __future__ import annotations

import functools
import os
import sys

import typer

from ..errors import DsaError


def debug() -> bool:
    return os.environ.get("DSA_DEBUG", "") not in ("", "0")


def handle_errors(command):
    """Decorate a command so known errors end it cleanly."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            typer.echo("Interrupted.", err=True)
            raise typer.Exit(130) from None
        except DsaError as e:
            if debug():
                raise
            typer.echo(f"Error: {e.message}", err=True)
            if e.hint:
                typer.echo(f"Hint: {e.hint}", err=True)
            raise typer.Exit(1) from None
        except Exception as e:  # a bug, or an error from a library: still no traceback by default
            if debug():
                raise
            typer.echo(f"Error: {type(e).__name__}: {e}", err=True)
            typer.echo("Hint: run again with DSA_DEBUG=1 to see the traceback", err=True)
            raise typer.Exit(1) from None

    return wrapper


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()
