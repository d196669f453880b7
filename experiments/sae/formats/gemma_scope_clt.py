"""Gemma Scope 2's cross-layer transcoders (Google DeepMind's JumpReLU multi-layer SAEs, e.g. the clt/ folders of
google/gemma-scope-2-1b-pt), in: one `params_layer_{i}.safetensors` per layer, read as circuit-tracer 0.5.0 reads them
(transcoder/cross_layer_transcoder.py load_gemma_scope_2_clt, which utils/hf_utils.py load_transcoders calls for a
config.yaml of model_kind cross_layer_transcoder that lists the layers' files under `transcoders`). Layer i's file:
    w_enc [d, n], b_enc [n]    pre = x_i @ w_enc + b_enc, on layer i's raw MLP input x_i
    threshold [n]              codes = pre * (pre > threshold)
    w_dec [n, L, d]            w_dec[:, j]: what the features write to layer j's MLP output; only j >= i is read
    b_dec [d]                  the bias of layer i's output
    affine_skip_connection [d, d], in the "_affine" CLTs: layer i's output gains x_i @ it
runner's CrossLayerTranscoder holds them as they are (scales 1): coder i's W_enc = w_enc, W_dec = w_dec[:, i:]
flattened, b_dec's first block = b_dec and its others 0. runner's CLT has no skip connection, so an affine CLT whose
skip is not zero is refused. A folder is read as YAML and safetensors data only, never with circuit-tracer's code."""

from __future__ import annotations

import functools
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from experiments.sae.formats.circuit_tracer import CONFIG, KINDS, numbered, read_config, regular, tensors_of, width
from experiments.sae.formats.common import CFG
from runner import ConfigError

FILE = "params_layer_{i}.safetensors"  # Google's name of layer i's file
SKIP = "affine_skip_connection"
# each tensor of layer i's file -> its shape in the widths n (features per layer), d (model width), L (layers)
SHAPES = {"w_enc": "dn", "b_enc": "n", "b_dec": "d", "threshold": "n", "w_dec": "nLd", SKIP: "dd"}


def holds(path: Path) -> bool:
    """Whether the folder `path` is Gemma Scope 2's CLT: a config.yaml of a CLT that lists its files (circuit-tracer's
    sign) or params_layer_0.safetensors beside it, or Google's files alone."""
    if (path / CFG).is_file():  # a SAELens folder, whatever else lies in it
        return False
    if (path / CONFIG).exists():
        cfg = read_config(path)
        return cfg["model_kind"] == KINDS[1] and ("transcoders" in cfg or (path / FILE.format(i=0)).exists())
    return (path / FILE.format(i=0)).exists()


def layer_files(path: Path, cfg: dict[str, Any]) -> list[Path]:
    """Layer i's file of the folder `path`, first to last: those config.yaml's `transcoders` lists (by file name, in
    `path`), else params_layer_0 .. L-1."""
    listed = cfg.get("transcoders")
    if listed is None:
        found = numbered(path, FILE)
        if found != list(range(len(found))):
            raise ConfigError(f"{path}: params_layer_N files for layers {found}: a CLT has one for each of 0..L-1")
        return [path / FILE.format(i=i) for i in found]
    if not isinstance(listed, list) or not listed or not all(isinstance(entry, str) for entry in listed):
        raise ConfigError(f"{path / CONFIG}: transcoders is no list of file names; give one per layer, first to last")
    names = [PurePosixPath(urlparse(entry).path).name for entry in listed]
    # circuit-tracer 0.5.0 reads one file fewer than it is given (range(max(paths))): a list that loads there may
    # repeat its last file, read once here
    names = [name for k, name in enumerate(names) if k == 0 or name != names[k - 1]]
    if len(set(names)) != len(names) or not all(name.endswith(".safetensors") for name in names):
        raise ConfigError(f"{path / CONFIG}: transcoders names {names}, where each layer's own .safetensors is due")
    return [path / name for name in names]


def _refuse_skip(file: Path, skip: torch.Tensor) -> None:
    # a zero skip adds nothing; any other needs a term runner's CLT (and its attribution graphs) does not have
    if skip.any():
        raise ConfigError(
            f"{file}: {SKIP} holds an affine skip connection (each layer's output gains x @ it), which runner's "
            "cross-layer transcoder cannot represent (its coders have no skip): read a CLT without one"
        )


def _layer(file: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    # one layer's tensors (float64), each of its shape, the skip zero if there, thresholds >= 0
    tensors = tensors_of(file, shapes, optional=(SKIP,))
    if SKIP in tensors:
        _refuse_skip(file, tensors.pop(SKIP))
    if (tensors["threshold"] < 0).any():
        raise ConfigError(f"{file}: threshold has negative entries; a JumpReLU's thresholds are >= 0")
    return tensors


def read_clt(files: list[Path]) -> nn.Module:
    """runner's CrossLayerTranscoder (JumpReLU coders, scales 1) of Gemma Scope 2's layer files, first to last."""
    from experiments.sae.coders.clt import CrossLayerTranscoder
    from experiments.sae.coders.jumprelu import JumpReLUSAE

    n, layers, d = width(files[0], "w_dec", 3)
    if layers != len(files):
        raise ConfigError(
            f"{files[0]}: w_dec writes to {layers} layers, where the folder holds {len(files)} layers' files: a CLT's "
            "features write to every layer it has; is the folder whole?"
        )
    sizes = {"n": n, "d": d, "L": layers}
    shapes = {name: tuple(sizes[w] for w in widths) for name, widths in SHAPES.items()}
    clt = CrossLayerTranscoder(functools.partial(JumpReLUSAE, n_latents=n), layers, d, d, False, False)
    with torch.no_grad():
        for i, (coder, file) in enumerate(zip(clt.coders, files, strict=True)):
            tensors = _layer(file, shapes)  # one file at a time: a real one is a few GB in float64
            coder.W_enc.copy_(tensors["w_enc"])
            coder.b_enc.copy_(tensors["b_enc"])
            coder.threshold.copy_(tensors["threshold"])
            # writes to earlier layers (j < i) are no CLT's, and circuit-tracer drops them too
            coder.W_dec.copy_(tensors["w_dec"][:, i:].reshape(n, -1))
            coder.b_dec.zero_()[:d] = tensors["b_dec"]
            coder.initialized.fill_(True)
        clt.initialized.fill_(True)
    return clt.eval().requires_grad_(False)


def read(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The runner CLT of Gemma Scope 2's CLT folder `path` (holds(path)), and what the folder says."""
    cfg = read_config(path) if (path / CONFIG).exists() else {}
    files = [regular(file) for file in layer_files(path, cfg)]
    facts = {"format": "gemma_scope_2", "model": cfg.get("model_name"), "architecture": KINDS[1]}
    return read_clt(files), facts | {"hook": None, "hook_out": None}
