"""A trained SAE in the folder layout that SAELens or EleutherAI's sparsify loads (`python -m runner.export`).

- SAELens: `cfg.json` + `sae_weights.safetensors` (W_enc [d, n], b_enc, W_dec [n, d], b_dec, and `threshold` for
  jumprelu); `sae_lens.SAE.load_from_disk(DIR)` loads it.
- sparsify: `cfg.json` + `sae.safetensors` (encoder.weight [n, d], encoder.bias, W_dec, b_dec);
  `sparsify.SparseCoder.load_from_disk(DIR)` loads it.

runner's SAE scales its inputs by `input_scale` s inside (E||x|| = sqrt(d)); the export takes and returns raw
activations instead. Its codes are runner's divided by s, so the decoder rows stay as trained (unit norm) and b_enc,
b_dec and any threshold are divided by s. The top-k picks the same latents, and the reconstruction is runner's to float
rounding (tests/unit/test_sae_export.py; with the real packages, tests/e2e/test_sae_peers_load.py).

Which architecture becomes which:
- TopK, and Matryoshka on TopK codes: `topk` in both tools.
- BatchTopK, and Matryoshka on BatchTopK codes: SAELens `jumprelu`, every latent at the learned global threshold (what
  their inference is).
- JumpReLU: `jumprelu`. ReLU: SAELens `standard`.
- sparsify has top-k only: anything else is refused, with the format that takes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from runner import ConfigError
from runner.rundir import write_atomic

FORMATS = ("saelens", "sparsify")


def architecture(sae: nn.Module) -> str:
    """What the SAE's inference is, in SAELens's names (its class's `inference`): topk, jumprelu or standard."""
    kind = getattr(sae, "inference", None)
    if kind not in ("topk", "jumprelu", "standard"):
        raise ConfigError(f"{type(sae).__name__} has no counterpart in SAELens or sparsify to export to")
    return kind


@torch.no_grad()
def raw_unit_weights(sae: nn.Module) -> dict[str, torch.Tensor]:
    """W_enc, b_enc, W_dec, b_dec (and threshold) of the same SAE on raw activations: codes divided by input_scale."""
    s = sae.input_scale.double()
    weights = {
        "W_enc": sae.W_enc.double(),
        "b_enc": sae.b_enc.double() / s,
        "W_dec": sae.W_dec.double(),
        "b_dec": sae.b_dec.double() / s,
    }
    if architecture(sae) == "jumprelu":  # JumpReLU's per latent; BatchTopK's one global threshold for every latent
        weights["threshold"] = sae.threshold.expand(sae.n_latents).double() / s
    return {name: tensor.float().contiguous().clone() for name, tensor in weights.items()}


def export(sae: nn.Module, fmt: str, out: Path, hook: str | None = None, model: str | None = None) -> Path:
    """Write `sae` in format `fmt` to the folder `out` (made here; refused if it holds files); returns `out`."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: give one of {', '.join(FORMATS)}")
    kind = architecture(sae)
    if fmt == "sparsify" and kind != "topk":
        raise ConfigError(
            f"sparsify has top-k SAEs only; this is {type(sae).__name__} ({kind} at inference): --format saelens"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: give an empty or new folder (nothing was written)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already holds files: give an empty or new folder (nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    weights = raw_unit_weights(sae)
    if fmt == "saelens":
        write_atomic(out / "sae_weights.safetensors", save(weights))
        _write(out / "cfg.json", _saelens_cfg(sae, kind, hook, model))
    else:
        names = {"W_enc": "encoder.weight", "b_enc": "encoder.bias", "W_dec": "W_dec", "b_dec": "b_dec"}
        tensors = {names[k]: (v.t().contiguous() if k == "W_enc" else v) for k, v in weights.items()}
        write_atomic(out / "sae.safetensors", save(tensors))
        _write(out / "cfg.json", _sparsify_cfg(sae))
    return out


def _saelens_cfg(sae: nn.Module, kind: str, hook: str | None, model: str | None) -> dict[str, Any]:
    # the residual stream after a block is what TransformerLens names blocks.N.hook_resid_post
    hook_name = f"{hook}.hook_resid_post" if hook and hook.startswith("blocks.") and hook.count(".") == 1 else hook
    cfg: dict[str, Any] = {
        "d_in": sae.d_in,
        "d_sae": sae.n_latents,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",  # runner's input scale is folded into the weights
        "reshape_activations": "none",
        "metadata": {"hook_name": hook_name, "model_name": model},
        "architecture": kind,
    }
    if kind == "topk":
        cfg.update(k=sae.k, rescale_acts_by_decoder_norm=False)
    return cfg


def _sparsify_cfg(sae: nn.Module) -> dict[str, Any]:
    return {
        "activation": "topk",
        "expansion_factor": max(1, sae.n_latents // sae.d_in),
        "normalize_decoder": True,
        "num_latents": sae.n_latents,
        "k": sae.k,
        "multi_topk": False,
        "skip_connection": False,
        "transcode": False,
        "d_in": sae.d_in,
    }


def _write(path: Path, data: dict[str, Any]) -> None:
    # renamed into place (as the weights): a symlink at the name is replaced, never written through
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())
