"""Training from Python: ``dsa_train.run(...)``, what ``dsa-train run`` does, in this process.

A notebook user (Colab is where many of this project's users are) trains a recipe and gets the
trained run back, the object :func:`dsa_train.open_run` returns::

    import dsa_train
    trained = dsa_train.run("quickstart", overrides={"train.epochs": 2})
    trained.predict(...)

Messages go through the ``dsa_train`` logger (``logging.basicConfig(level=logging.INFO)``
shows them), progress through :mod:`dsa_train.progress`'s reporter (silent unless one is
installed). It is named ``run``, as the command is: ``dsa_train.train`` is the package of the
training loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .recipe import Recipe, load_recipe, parse_recipe, recipe_to_yaml, with_data_root
from .recipe.find import find_recipe

if TYPE_CHECKING:
    from .results import TrainedRun
    from .train.callbacks import Callback


def run(
    recipe: str | Path | Recipe,
    *,
    overrides: Mapping[str, Any] | Sequence[str] = (),
    output: str | Path | None = None,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
) -> TrainedRun:
    """Train ``recipe`` in this process and return the trained run (:func:`dsa_train.open_run`'s
    object, at its newest checkpoint).

    Args:
        recipe: a shipped recipe's name (``"quickstart"``; ``dsa-train recipes`` lists them), the
            path of a YAML file, or a :class:`~dsa_train.recipe.Recipe`.
        overrides: recipe keys to change, as ``--set`` does: ``{"train.epochs": 5}`` or
            ``["train.epochs=5"]``.
        output: the run folder. Default: ``<output.dir>/<recipe name>-<timestamp>``.
        resume: continue the run in ``output`` (default: the recipe's newest run) from its newest
            checkpoint; a finished run is returned as it is.
        callbacks: :class:`~dsa_train.train.callbacks.Callback` objects whose hooks run after the
            built-in ones' (``logged(training, record)`` sees every record of metrics.jsonl: a
            metric logger's hook). A callback the recipe should name (``output.callbacks``) is
            registered instead: ``@CALLBACKS.register_as("name")`` from the same module.

    Raises a :class:`~dsa_train.DsaError` (``ConfigError`` for a bad recipe or override) naming
    the problem and its fix. An error inside training closes the run first: its checkpoints stay,
    and ``run(..., output=folder, resume=True)`` continues it (a new run that failed before its
    first step leaves no folder). ``KeyboardInterrupt`` comes as
    :class:`~dsa_train.train.lifecycle.RunInterrupted`, which says the folder to resume.
    """
    from .results import open_run
    from .results.warm_start import carry_over
    from .train.callbacks import default_callbacks
    from .train.lifecycle import train_run

    if isinstance(overrides, str):
        raise TypeError("overrides: a mapping ({'train.epochs': 5}) or a list of 'key=value' strings, not one string")
    pairs = [_override(k, v) for k, v in overrides.items()] if isinstance(overrides, Mapping) else list(overrides)
    if isinstance(recipe, Recipe):
        config = parse_recipe(recipe_to_yaml(recipe), source=f"recipe '{recipe.name}'", overrides=pairs)
    else:
        config = load_recipe(find_recipe(Path(recipe)), pairs)
    config = with_data_root(config)  # stored resolved: eval needs no environment
    where = Path(output) if output is not None else None
    extra = list(callbacks)
    result = train_run(
        config,
        output=where,
        resume=resume,
        overrides=pairs,
        callbacks=default_callbacks() + extra if extra else None,
        warm_start=carry_over,
    )
    return open_run(result.folder)


def _override(key: str, value: Any) -> str:
    """``key=value`` as ``--set`` takes it: YAML's flow form for lists and mappings (JSON is YAML)."""
    if isinstance(value, str):
        return f"{key}={value}"
    return f"{key}={json.dumps(value)}"
