"""``dsa-train tune``: search a recipe's settings with Optuna (see :mod:`.study` and :mod:`.space`)."""
