"""Row storage on disk: memory-mapped row files, their formats, the state directory, residency
under a memory budget, disk tables, checkpoint deltas and partition buffers.

Below the optimizer (``optim/``), which keeps its update and kernel: this package knows no
optimizer, model, recipe or CLI, and imports only the base modules (errors, fsutil, memory)."""
