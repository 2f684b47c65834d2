"""Training: run folders, checkpoints, and the training loops."""
