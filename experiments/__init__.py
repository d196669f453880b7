"""Task code: one module or package per experiment (models, datasets, losses, metrics)."""
