"""What `python -m runner.attribute` reads: a cross-layer transcoder's run (+experiment=clt_lm), or one transcoder's run
per layer (+experiment=transcoder_lm), hooked at every block's MLP input and output of one model: runner's GPT
(blocks.N.mlp_norm, blocks.N.mlp) or a transformers GPT-2 (transformer.h.N.ln_2, transformer.h.N.mlp), Llama
(model.layers.N.post_attention_layernorm, model.layers.N.mlp) or GPT-NeoX (gpt_neox.layers.N.post_attention_layernorm,
gpt_neox.layers.N.mlp); or
circuit-tracer's folders (experiments/sae/formats, read by read_folder: a transcoder set's layer_N files, each layer
N's, or a CLT's), on `source` or the model their config.yaml's model_name names.

A transformers model is read as pretrained.py reads a source (a save_pretrained folder, no code of its own), with its
tokenizer and without text. Its coders skip position 0 at least: the BOS a prompt starts with, whose MLP outputs
circuit-tracer's graphs hold constant (frozen_hf.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from experiments.sae.circuits.coders import CoderSet
from experiments.sae.circuits.frozen_hf import check_model
from experiments.sae.circuits.hf_blocks import LAYOUTS
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.formats import circuit_tracer as ct
from experiments.sae.formats import read_folder
from experiments.sae.sources import pretrained
from runner import ConfigError
from runner.load import load_model, load_trained
from runner.rundir import CONFIG

# each model's MLP input and output modules, as runner's sources name them: runner's GPT, then each transformers
# architecture's (hf_blocks.py: GPT-2's transformer.h.N.ln_2, Llama's and GPT-NeoX's N.post_attention_layernorm)
PAIRS = [
    (re.compile(r"blocks\.(\d+)\.mlp_norm"), re.compile(r"blocks\.(\d+)\.mlp")),
    *((re.compile(read), re.compile(write)) for read, write in (layout.hooks() for layout in LAYOUTS.values())),
]
ONE_PER_LAYER = "give a clt_lm run, or one transcoder_lm run per block (RUN0 RUN1 ...)"


class Loaded(NamedTuple):
    """The source model, its coders, what the graph says it came from, and a transformers model's tokenizer."""

    model: nn.Module
    coders: CoderSet
    meta: dict[str, Any]
    tokenizer: Any  # None for runner's GPT (its prompt is bytes)


@dataclass
class _Part:
    # one coder as read: the layers it replaces, the model it was trained on (None: not said), positions it skips
    coder: nn.Module
    layers: list[int]
    source: str | None
    skip: int


def _names(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _block(read: str, write: str) -> int | None:
    # the block whose MLP input `read` and output `write` are, of one model's names; None if they are no such pair
    for reads, writes in PAIRS:
        a, b = reads.fullmatch(read), writes.fullmatch(write)
        if a and b and a[1] == b[1]:
            return int(a[1])
    return None


def _layers(path: Path, cfg: Any) -> list[int]:
    # the block each hooked (MLP input, MLP output) pair belongs to, or why the hooks are no such pairs
    reads, writes = _names(cfg.data.get("module")), _names(cfg.data.get("target"))
    layers = [_block(read, write) for read, write in zip(reads, writes, strict=False)]
    if not reads or len(reads) != len(writes) or None in layers:
        raise ConfigError(
            f"{path} reads {reads} and writes {writes}: a family of mixed hooks, where the replacement model needs "
            "each block's MLP input (blocks.N.mlp_norm; GPT-2's transformer.h.N.ln_2, Llama's "
            "model.layers.N.post_attention_layernorm, GPT-NeoX's gpt_neox.layers.N.post_attention_layernorm) and "
            f"output (blocks.N.mlp, transformer.h.N.mlp, model.layers.N.mlp, gpt_neox.layers.N.mlp) in pairs; "
            f"{ONE_PER_LAYER}"
        )
    return layers  # type: ignore[return-value]


def _run(path: Path, trusted: Sequence[str]) -> _Part:
    # a runner run's coder
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
    skip = int(cfg.data.get("skip_positions") or 0)
    return _Part(model, _layers(path, cfg), str(cfg.data.checkpoint), skip)


def _folder(path: Path, source: str | None) -> list[_Part]:
    # circuit-tracer's folder: each layer_N file of a transcoder set (layer N), or a CLT (every layer)
    cfg = ct.read_config(path)
    hooks = (cfg.get("feature_input_hook"), cfg.get("feature_output_hook"))
    if hooks != (ct.INPUT_HOOK, ct.OUTPUT_HOOK):
        raise ConfigError(
            f"{path}'s coders read {hooks[0]} and write {hooks[1]}: the replacement model needs each block's MLP "
            f"input ({ct.INPUT_HOOK}; ln2.hook_normalized is TransformerLens's stream before ln2's gain and bias) and "
            f"output ({ct.OUTPUT_HOOK})"
        )
    named = source or cfg.get("model_name")
    if not named or not (pretrained.is_pretrained(named) or (Path(named) / CONFIG).is_file()):
        raise ConfigError(
            f"{path} is circuit-tracer's folder on the model {named!r}, which is no transformers folder nor runner "
            "run here: give source=FOLDER (a save_pretrained folder or a runner run)"
        )
    skip = (cfg.get("runner") or {}).get("skip_positions") or 0  # what runner's export says; 0 from elsewhere
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ConfigError(f"{path}/config.yaml: runner.skip_positions is {skip!r}; give a whole number >= 0")
    if cfg["model_kind"] == ct.KINDS[1]:
        clt, _ = read_folder(path)
        return [_Part(clt, list(range(clt.layers)), str(named), skip)]
    layers = ct.numbered(path, ct.LAYER_FILE)
    return [_Part(read_folder(path, f"layer_{i}")[0], [i], str(named), skip) for i in layers]


def _parts(path: Path, trusted: Sequence[str], source: str | None) -> list[_Part]:
    if (path / ct.CONFIG).exists() and not (path / CONFIG).is_file():  # circuit-tracer's config.yaml, no run's
        return _folder(path, source)
    return [_run(path, trusted)]


def transformers_model(checkpoint: str) -> tuple[nn.Module, Any]:
    """The transformers model `checkpoint` names (a save_pretrained folder, or hf:NAME; GPT-2, Llama or GPT-NeoX),
    frozen in float32, and its tokenizer, checked and loaded as pretrained.load loads a source (no text)."""
    what = f"the source model {checkpoint}"
    model, tokenizer = pretrained.model_and_tokenizer(checkpoint, what, torch_dtype="float32")
    check_model(model, what)
    return model, tokenizer


def _coders(parts: list[_Part], n_layer: int, skip: int, paths: Sequence[Path]) -> CoderSet:
    # the coders of every block, each once, or why not
    layers = [layer for part in parts for layer in part.layers]
    if sorted(layers) != list(range(n_layer)):
        raise ConfigError(
            f"the runs replace the MLPs of blocks {layers}; the replacement model replaces every one of the model's "
            f"{n_layer} blocks, each once: {ONE_PER_LAYER}"
        )
    clts = [part.coder for part in parts if isinstance(part.coder, CrossLayerTranscoder)]
    if clts and len(parts) > 1:
        raise ConfigError(f"a cross-layer transcoder replaces every MLP alone; give its run only, or {ONE_PER_LAYER}")
    if clts and layers != list(range(n_layer)):
        raise ConfigError(
            f"{paths[0]} hooks blocks {layers}: a CLT's layers go first to last (blocks 0 .. {n_layer - 1})"
        )
    if clts:
        return CoderSet.of_clt(clts[0], skip)
    by_layer = {part.layers[0]: part.coder for part in parts}
    return CoderSet.of_transcoders([by_layer[i] for i in range(n_layer)], skip)


def load_coders(
    paths: Sequence[Path], trusted: Sequence[str], device: str = "cpu", source: str | None = None
) -> Loaded:
    """The source model, its coders, what the graph says it came from and a transformers model's tokenizer, of the
    run folders or circuit-tracer folders `paths` (`source`: a circuit-tracer folder's model), on `device`."""
    parts = [part for p in paths for part in _parts(Path(p), trusted, source)]
    sources = {part.source for part in parts}
    if len(sources) > 1:
        raise ConfigError(
            f"the runs read different models ({', '.join(sorted(map(str, sources)))}): {ONE_PER_LAYER} of one model"
        )
    model_name = str(sources.pop())
    skip = max(part.skip for part in parts)
    if pretrained.is_pretrained(model_name):
        model, tokenizer = transformers_model(model_name)
        n_layer, skip = int(model.config.num_hidden_layers), max(skip, 1)
    else:
        (model, _), tokenizer = load_trained(model_name, trusted), None
        n_layer = len(getattr(model, "blocks", []))
    model.to(device).eval()
    for part in parts:  # before the CoderSet, which keeps their scales and skip maps as they are
        part.coder.to(device).eval()
    coders = _coders(parts, n_layer, skip, paths)
    meta = {"coder": [str(p) for p in paths], "model": model_name, "skip_positions": skip}
    return Loaded(model, coders, meta, tokenizer)
