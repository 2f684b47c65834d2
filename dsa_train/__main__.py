"""``python -m dsa_train``: the ``dsa-train`` command, also as ``torchrun -m dsa_train run RECIPE``."""

from .cli.app import main

main()
