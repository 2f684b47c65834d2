"""Run folders, job folders and the checkpoint store: what the training loop writes and the
readers of finished runs (results/, eval, inspect-state, clean) read.

Below ``train/`` and ``results/``, so that neither reaches into the other for them; above
``storage/``, ``optim/``, ``nn`` and ``recipe/`` (a checkpoint holds a recipe, tables and an
optimizer's state)."""
