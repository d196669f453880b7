"""Checkpoints, layered one way: files (write, verify, read, load_weights) <- state (what a checkpoint holds) <-
callback (when to save)."""
