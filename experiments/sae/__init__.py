"""Sparse autoencoders on activations: models, data sources, metrics and callbacks.

Imported first for any experiments.sae module: it binds the tools' hooks onto the coders (tools.py), which import
nothing above them."""

from experiments.sae import tools  # noqa: F401 - binds export, features and load_from_disk (tools.HOOKS)
