"""What `python -m runner.attribute` reads: a cross-layer transcoder's run (+experiment=clt_lm), or one transcoder's run
per layer (+experiment=transcoder_lm), hooked at every block's MLP input and output of one runner GPT."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from experiments.sae.circuits.coders import CoderSet
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.sources import pretrained
from runner import ConfigError
from runner.load import load_model, load_trained

READS, WRITES = re.compile(r"blocks\.(\d+)\.mlp_norm"), re.compile(r"blocks\.(\d+)\.mlp")
ONE_PER_LAYER = "give a clt_lm run, or one transcoder_lm run per block (RUN0 RUN1 ...)"


def _names(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _layers(path: Path, cfg: Any) -> list[int]:
    # the block each hooked (MLP input, MLP output) pair belongs to, or why the hooks are no such pairs
    reads, writes = _names(cfg.data.get("module")), _names(cfg.data.get("target"))
    pairs = [(READS.fullmatch(read), WRITES.fullmatch(write)) for read, write in zip(reads, writes, strict=False)]
    if not reads or len(reads) != len(writes) or not all(a and b and a[1] == b[1] for a, b in pairs):
        raise ConfigError(
            f"{path} reads {reads} and writes {writes}: a family of mixed hooks, where the replacement model needs "
            f"each block's MLP input (blocks.N.mlp_norm) and output (blocks.N.mlp) in pairs; {ONE_PER_LAYER}"
        )
    layers = [int(a[1]) for a, _ in pairs]
    return layers


def _one(path: Path, trusted: Sequence[str]) -> tuple[nn.Module, Any, list[int]]:
    model, cfg = load_model(path, trusted)
    model = getattr(model, "coder", model)  # an end-to-end run's coder (experiments/sae/end_to_end.py)
    if hasattr(model, "saes"):
        raise ConfigError(
            f"{path} holds a family of SAEs (model=sae_multi), no replacement of the MLPs; {ONE_PER_LAYER}"
        )
    if not isinstance(model, CrossLayerTranscoder) and not getattr(model, "transcoder", False):
        raise ConfigError(
            f"{path}'s coder ({type(model).__name__}) is no transcoder: an SAE reconstructs its input, and the "
            f"replacement model needs each MLP's output predicted from its input; {ONE_PER_LAYER}"
        )
    if cfg.get("data", {}).get("checkpoint") is None:
        raise ConfigError(f"{path} is no run on a model's activations: it reads no source model")
    return model, cfg, _layers(path, cfg)


def load_coders(
    paths: Sequence[Path], trusted: Sequence[str], device: str = "cpu"
) -> tuple[nn.Module, CoderSet, dict[str, Any]]:
    """(the source GPT, its coders, what the graph says it came from) of the run folders `paths`, on `device`."""
    loaded = [_one(Path(p), trusted) for p in paths]
    sources = {str(cfg.data.checkpoint) for _, cfg, _ in loaded}
    skips = {int(cfg.data.get("skip_positions") or 0) for _, cfg, _ in loaded}
    if len(sources) > 1:
        raise ConfigError(
            f"the runs read different models ({', '.join(sorted(sources))}): {ONE_PER_LAYER} of one model"
        )
    source = sources.pop()
    if pretrained.is_pretrained(source):
        raise ConfigError(
            f"{source}: attribution graphs read runner's GPT (+experiment=lm) for now, no transformers model"
        )
    gpt, _ = load_trained(source, trusted)
    n_layer = len(getattr(gpt, "blocks", []))
    layers = [layer for _, _, own in loaded for layer in own]
    if sorted(layers) != list(range(n_layer)):
        raise ConfigError(
            f"the runs replace the MLPs of blocks {layers}; the replacement model replaces every one of the model's "
            f"{n_layer} blocks, each once: {ONE_PER_LAYER}"
        )
    clts = [model for model, _, _ in loaded if isinstance(model, CrossLayerTranscoder)]
    if clts and len(loaded) > 1:
        raise ConfigError(f"a cross-layer transcoder replaces every MLP alone; give its run only, or {ONE_PER_LAYER}")
    if clts and layers != list(range(n_layer)):
        raise ConfigError(
            f"{paths[0]} hooks blocks {layers}: a CLT's layers go first to last (blocks 0 .. {n_layer - 1})"
        )
    skip = max(skips)
    gpt.to(device).eval()
    for model, _, _ in loaded:
        model.to(device).eval()
    if clts:
        coders = CoderSet.of_clt(clts[0], skip)
    else:
        by_layer = {own[0]: model for model, _, own in loaded}
        coders = CoderSet.of_transcoders([by_layer[i] for i in range(n_layer)], skip)
    meta = {"coder": [str(p) for p in paths], "model": source, "skip_positions": skip}
    return gpt, coders, meta
