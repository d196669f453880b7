"""Foreign SAE formats, out and in: SAELens's folder (saelens.py), EleutherAI sparsify's (sparsify.py), each one
table of its names that its writer and its reader share; a Hugging Face repository of SAELens folders and its model
card (hf.py); a folder of either, written and read (folders.py), and attached to the model it reads (attach.py).

runner reads foreign folders through FOLDERS (the `runner.folders` entry point, pyproject.toml), never by importing
this package."""

from __future__ import annotations

from types import SimpleNamespace

from experiments.sae.formats.attach import attached, load, module_for
from experiments.sae.formats.common import architecture, raw_unit_weights
from experiments.sae.formats.folders import FORMATS, export, read_folder, recognizes, solo
from experiments.sae.formats.hf import hub_card, sae_id

# runner.load's reader of SAE folders: recognizes(path), load(path, trusted, attach) -> (model, cfg), solo(path, hook)
FOLDERS = SimpleNamespace(recognizes=recognizes, load=load, solo=solo)

__all__ = [
    "FOLDERS",
    "FORMATS",
    "architecture",
    "attached",
    "export",
    "hub_card",
    "module_for",
    "raw_unit_weights",
    "read_folder",
    "sae_id",
]
