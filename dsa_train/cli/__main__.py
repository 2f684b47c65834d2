"""``python -m dsa_train.cli``: the same as the ``dsa-train`` command."""

from .app import main

main()
