"""EleutherAI sparsify's folder, out and in: `cfg.json` + `sae.safetensors` (encoder.weight [n, d], encoder.bias,
W_dec [n, d], b_dec, W_skip [d, d] with skip_connection); a training run's folder holds one per hook point, named by
it. `sparsify.SparseCoder.load_from_disk(DIR)` loads what is written here, and `forward(x).sae_out` is the
reconstruction (a transcoder's target `y` only enters its losses); a folder is read as JSON and safetensors only.

sparsify has top-k coders only: runner's TopK SAEs (and Matryoshka on TopK codes) are written, anything else is refused
with the format that takes it; sparsify's top-k SAEs and transcoders are read as TopKSAE, its `groupmax` and `signed`
coders refused. Its transcoders (`transcode`, and `skip_connection`) predict a target as wide as their input, so only
runner's transcoders where d_out = d_in are written; their encoders read the input uncentred, as runner's do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.sae.formats.common import (
    CFG,
    build,
    ours,
    raw_unit_weights,
    shaped,
    typed,
    whole,
    write_folder,
    written,
)
from runner import ConfigError

WEIGHTS = "sae.safetensors"
ACTIVATION = "topk"  # the one activation of its coders runner writes and reads
# tensor -> (runner's parameter, shape in runner's widths, stored transposed); W_skip with skip_connection only
TENSORS = {
    "encoder.weight": ("W_enc", ("n_latents", "d_in"), True),
    "encoder.bias": ("b_enc", ("n_latents",), False),
    "W_dec": ("W_dec", ("n_latents", "d_in"), False),
    "b_dec": ("b_dec", ("d_in",), False),
    "W_skip": ("W_skip", ("d_in", "d_in"), True),  # both peers add x @ W_skip.T
}
# runner's settings -> cfg.json's keys
KEYS = {"d_in": "d_in", "n_latents": "num_latents", "k": "k", "transcoder": "transcode", "skip": "skip_connection"}


def held(skip: bool) -> list[str]:
    """The tensors of a sparsify coder (with a skip connection or not), in the order they are checked."""
    return [name for name in TENSORS if skip or name != "W_skip"]


def write(sae: nn.Module, kind: str, out: Path, hook: str | None, model: str | None, target: str | None) -> None:
    """`sae` (top-k) as sparsify's folder `out` of one hook point, on raw inputs (its cfg.json names no hook, model
    or target: a sparsify run names each coder's folder by its hook point)."""
    cfg = {
        "activation": ACTIVATION,
        "expansion_factor": max(1, sae.n_latents // sae.d_in),
        "normalize_decoder": True,
        KEYS["n_latents"]: sae.n_latents,
        KEYS["k"]: sae.k,
        "multi_topk": False,
        KEYS["skip"]: sae.skip,
        KEYS["transcoder"]: sae.transcoder,
        KEYS["d_in"]: sae.d_in,
    }
    write_folder(out, WEIGHTS, written(raw_unit_weights(sae), TENSORS, held(sae.skip)), cfg)


def read(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The runner SAE of a sparsify folder `path` of settings `cfg` and `tensors` (float64), and what it says."""
    typed(cfg, path, signed=bool, **{KEYS["transcoder"]: bool, KEYS["skip"]: bool})
    activation = cfg.get("activation", ACTIVATION)
    if activation != ACTIVATION or cfg.get("signed"):
        what = "signed codes" if cfg.get("signed") else f"activation {activation!r}"
        raise ConfigError(f"{path / CFG}: {what}; runner reads sparsify's top-k coders only")
    d_in, k = whole(cfg, KEYS["d_in"], path), whole(cfg, KEYS["k"], path)
    if cfg.get(KEYS["n_latents"]):
        n = whole(cfg, KEYS["n_latents"], path)
    else:
        n = d_in * whole(cfg, "expansion_factor", path)
    transcoder, skip = bool(cfg.get(KEYS["transcoder"])), bool(cfg.get(KEYS["skip"]))
    if skip and not transcoder:
        raise ConfigError(
            f"{path / CFG}: an SAE with a skip connection (skip_connection without transcode) is not read: "
            "runner's skip connections are transcoders'"
        )
    names = held(skip)
    sizes = {"d_in": d_in, "n_latents": n, "d_out": d_in}  # a transcoder's target is as wide as its input here
    weights = ours(shaped(tensors, TENSORS, names, sizes, path), TENSORS)
    if unknown := sorted(set(tensors) - set(names)):
        raise ConfigError(f"{path}: tensors {unknown} are not of a sparsify coder of this cfg.json")
    if not k <= n:
        raise ConfigError(f"{path / CFG}: k={k} is more than its {n} latents")
    # a transcoder's encoder reads its input uncentred in both tools
    sae = build(ACTIVATION, sizes, transcoder, skip, {"k": k}, weights)
    return sae, {
        "format": "sparsify",
        "architecture": ACTIVATION,
        "hook_out": None,
        "model": None,
        "transcoder": transcoder,
    }
