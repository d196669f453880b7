"""The SAE workbench from Python: the calls a researcher makes in a notebook, each the same code the tools run.

    from experiments.sae import api

    sae = api.load_sae("outputs/2026-11-28/10-00-00")            # a run's SAE; or a SAELens / sparsify folder:
    sae = api.load_sae("my-saelens-sae", source="hf:gpt2")       #   attached to the model it reads
    codes = sae.encode(x)                                        # [rows, n_latents] codes of raw activations
    x_hat = api.decode(sae, codes)                               # the raw activations they reconstruct (= sae(x))
    src = api.source("outputs/2026-11-28/10-00-00")              # the model the SAE reads, hooked at its module
    acts = src.output_of(src.name, tokens[:, :-1])               # that module's activations [B, T, d]
    clean, spliced = api.spliced_loss(sae, src, tokens)          # the loss on [B, T + 1], and with the SAE spliced

`SAE.load_from_disk(path)` is load_sae, as SAELens and sparsify spell it. A run folder is read as data under the same
trust rules as the tools (runner.load); runner.api.load and runner.api.metrics read any run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.sae.formats import read_folder
from experiments.sae.sources.source import hooked_source
from runner import ConfigError
from runner.api import load
from runner.load import is_foreign


def load_sae(path: str | Path, name: str | None = None, **options: Any) -> nn.Module:
    """The SAE (or transcoder) of `path`, as load() reads it: a run's model, an end-to-end run's coder, or with
    `name`, one SAE of a family (model=sae_multi: its names are `family.saes`). A SAELens or sparsify folder needs no
    `source` here: the SAE alone (hook= picks one of a sparsify family's)."""
    if is_foreign(path) and not options.get("source"):
        # what attaches the SAE to a model means nothing without one: said, rather than left unused
        attaching = ("module", "target", "skip_positions", "weights")
        if unused := [f"{key}=" for key in attaching if options.get(key) is not None]:
            raise ConfigError(
                f"{', '.join(unused)}: they attach {path}'s SAE to the model it reads; give source=MODEL with them, or "
                "leave them out for the SAE alone"
            )
        return read_folder(path, options.get("hook"))[0]
    model, _ = load(path, **options)
    model = getattr(model, "coder", model)  # an end-to-end run trains a coder through its source
    saes = getattr(model, "saes", None)
    if saes is not None:
        if name not in saes:
            raise ConfigError(f"{path} holds a family of SAEs: give name=, one of {', '.join(saes)}")
        return saes[name]
    if name is not None:
        raise ConfigError(f"name={name}: {path} holds one SAE, not a family")
    if not hasattr(model, "encode"):
        raise ConfigError(f"{path}'s model ({type(model).__name__}) is no SAE: load it with runner.api.load")
    return model


def decode(sae: nn.Module, codes: torch.Tensor) -> torch.Tensor:
    """The raw activations (a transcoder: its target) that dense codes [rows, n_latents] reconstruct, what
    `sae.encode(x)` gave: sae(x) for an SAE (a skip transcoder adds its skip term of x, which codes do not hold)."""
    with torch.no_grad():
        return sae.decode(codes, None) / sae.out_scale


def source(path: str | Path, device: str | torch.device = "cpu", **options: Any) -> Any:
    """The model an SAE run (or an attached SAE folder) reads, hooked at its module, on `device`: a SourceModel
    (experiments/sae/sources/source.py), whose `output_of(name, tokens)` gives a module's activations and
    `loss(batch)` the model's loss."""
    _, cfg = load(path, **options)
    if cfg.get("data", {}).get("checkpoint") is None:
        raise ConfigError(f"{path} is no run on a model's activations: it reads no source model")
    return hooked_source(cfg.data, torch.device(device))


def spliced_loss(sae: nn.Module, source_model: Any, tokens: torch.Tensor) -> tuple[float, float]:
    """(the source model's loss on `tokens`, the same with `sae`'s reconstruction in place of its module's output):
    what the splice metrics average, for one batch. `tokens` [B, T + 1] are the inputs and their next-token targets,
    as the source's batches hold them (`source.data.val_loader()`); positions the run skipped keep the model's own."""
    batch = {"tokens": tokens.to(source_model.device)}
    through = lambda acts: sae(acts.float()).to(acts.dtype)  # noqa: E731
    with torch.no_grad():
        clean = source_model.loss(batch)[0]
        spliced = source_model.run(batch, (source_model.name, through))[0]
    return float(clean), float(spliced)
