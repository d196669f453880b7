"""Sparse autoencoders on activations: models, data sources, metrics and callbacks."""
