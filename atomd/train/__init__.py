"""Local training: the training loop, metrics and checkpoints."""
