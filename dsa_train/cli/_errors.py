"""How the CLI ends on an error: one ``Error: ...`` line and a hint on stderr, exit code 1.

The traceback is shown only with ``DSA_DEBUG=1``. Usage errors (bad options) are Typer's
own and exit with 2. Running out of memory (``MemoryError``, ``torch.OutOfMemoryError``, or
torch's allocator refusing with a ``RuntimeError``) ends with ``Error: ran out of memory ...``
and a hint on what to make smaller; sizes known to be too big are refused earlier, before
anything is allocated (:func:`dsa_train.memory.require_memory`).
"""

from __future__ import annotations

import functools
import os
import sys

import typer

from ..errors import DsaError


def debug() -> bool:
    return os.environ.get("DSA_DEBUG", "") not in ("", "0")


#: What torch's allocators say when a RuntimeError means "out of memory".
OUT_OF_MEMORY_TEXT = ("can't allocate memory", "DefaultCPUAllocator", "out of memory")

OUT_OF_MEMORY_HINT = (
    "lower train.batch_size, train.negatives or model.dim (or eval.batch_size and eval.entity_chunk "
    "when it ran out while evaluating), or keep the tables on disk with `model.embedding_storage: disk`; "
    "DSA_DEBUG=1 shows the traceback"
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says that memory (host or device) ran out. Never imports torch: a
    torch error can only exist where torch is imported already."""
    if isinstance(error, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(error, oom):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in OUT_OF_MEMORY_TEXT)


def out_of_memory_line(error: BaseException) -> str:
    """``Error: ran out of memory (...)``: one line, with the first line of the library's words."""
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    said = said if len(said) <= 300 else said[:297] + "..."
    return f"Error: ran out of memory ({type(error).__name__}{': ' + said if said else ''})"


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
            if is_out_of_memory(e):
                typer.echo(out_of_memory_line(e), err=True)
                typer.echo(f"Hint: {OUT_OF_MEMORY_HINT}", err=True)
                raise typer.Exit(1) from None
            typer.echo(f"Error: {type(e).__name__}: {e}", err=True)
            typer.echo("Hint: run again with DSA_DEBUG=1 to see the traceback", err=True)
            raise typer.Exit(1) from None

    return wrapper


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()
