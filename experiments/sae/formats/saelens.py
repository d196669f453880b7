"""SAELens's folder, out and in: `cfg.json` + `sae_weights.safetensors` (W_enc [d_in, n], b_enc, W_dec [n, d_out],
b_dec [d_out], `threshold` for jumprelu, W_skip [d_out, d_in] for a skip transcoder). `sae_lens.SAE.load_from_disk(DIR)`
loads what is written here, and its forward(x) is the reconstruction (a transcoder's: the predicted target); a folder
is read as JSON and safetensors only, never with SAELens's code: a folder is data.

Which architecture becomes which, out: TopK, and Matryoshka on TopK codes: `topk`. BatchTopK, and Matryoshka on
BatchTopK codes: `jumprelu`, every latent at the learned global threshold (what their inference is). JumpReLU:
`jumprelu`. ReLU: `standard`. Gated: `gated` (b_enc written as b_gate, with r_mag and b_mag; SAELens has no gated
transcoder, so a gated transcoder is refused). Transcoders: `transcoder` (ReLU) and `jumprelu_transcoder` (JumpReLU,
BatchTopK), with a skip connection `skip_transcoder` and `jumprelu_skip_transcoder`; their encoders read the input
uncentred (`apply_b_dec_to_input` false), as runner's do. SAELens has no top-k transcoder (sparsify takes one).

In: each architecture becomes the runner class whose inference is the same (ARCHITECTURES; `jumprelu` is also what
SAELens saves a BatchTopK or Matryoshka SAE as). The weights are folded so that runner's forward gives theirs:
`rescale_acts_by_decoder_norm` into unit decoder rows (the codes are what SAELens's `encode` gives), an encoder that
reads its input uncentred (`apply_b_dec_to_input: false`) into b_enc. Input scales stay 1: runner's forward takes raw
activations as theirs do. What has no exact counterpart is refused by name: per-token normalisation
(`constant_norm_rescale`, `layer_norm`), attention-head reshapes (`hook_z`), `abstopk`, matching pursuit, temporal SAEs.
"""

from __future__ import annotations

import re
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

WEIGHTS = "sae_weights.safetensors"
VERSION = "6.0.0"  # the layout written: SAELens 6's
# architecture -> (runner's inference, a transcoder: its encoder reads the input uncentred, skip connection)
ARCHITECTURES = {
    "standard": ("standard", False, False),
    "topk": ("topk", False, False),
    "jumprelu": ("jumprelu", False, False),
    "gated": ("gated", False, False),
    "transcoder": ("standard", True, False),
    "skip_transcoder": ("standard", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
# tensor -> (runner's parameter, shape in runner's widths, stored transposed); an architecture's: `held`
TENSORS = {
    "W_enc": ("W_enc", ("d_in", "n_latents"), False),
    "W_dec": ("W_dec", ("n_latents", "d_out"), False),
    "b_dec": ("b_dec", ("d_out",), False),
    "threshold": ("threshold", ("n_latents",), False),
    "b_gate": ("b_enc", ("n_latents",), False),  # a gated SAE's encoder bias is its gate's
    "r_mag": ("r_mag", ("n_latents",), False),
    "b_mag": ("b_mag", ("n_latents",), False),
    "b_enc": ("b_enc", ("n_latents",), False),
    "W_skip": ("W_skip", ("d_out", "d_in"), True),  # both peers add x @ W_skip.T
}
WIDTHS = {"d_in": "d_in", "n_latents": "d_sae", "d_out": "d_out", "k": "k"}  # runner's widths -> cfg.json's keys
# what a folder says -> its key in cfg.json's metadata (the first four: text or null)
METADATA = {
    "hook": "hook_name",
    "hook_out": "hook_name_out",
    "model": "model_name",
    "model_class": "model_class_name",
    "context_size": "context_size",
}
# TransformerLens's hook points (what the metadata names): a block's output, its input (the one before's output), and
# its parts' outputs -> the names of that part in transformers models
RESID_POST, RESID_PRE = "hook_resid_post", "hook_resid_pre"
PARTS = {"hook_mlp_out": ("mlp", "feed_forward"), "hook_attn_out": ("attn", "self_attn", "attention")}
TL_HOOK = re.compile(rf"blocks\.(\d+)\.({'|'.join([RESID_POST, RESID_PRE, *PARTS])})")
# what SAELens does at inference with these: nothing (folded into the weights when training ended)
SCALE_FREE = ("none", "expected_average_only_in", "covariance_whitening")
LEGACY_METADATA = ("model_name", "hook_name", "hook_name_out", "prepend_bos", "context_size", "dataset_path")


def held(inference: str, skip: bool) -> list[str]:
    """The tensors of a SAELens SAE of this inference (and skip connection), in the order they are checked."""
    middle = {"jumprelu": ["threshold", "b_enc"], "gated": ["b_gate", "r_mag", "b_mag"]}.get(inference, ["b_enc"])
    return ["W_enc", "W_dec", "b_dec", *middle, *(["W_skip"] if skip else [])]


def hook_name(hook: str | None) -> str | None:
    """A module's hook point as SAELens names it: a block's output is TransformerLens's blocks.N.hook_resid_post."""
    return f"{hook}.{RESID_POST}" if hook and hook.startswith("blocks.") and hook.count(".") == 1 else hook


# ---- out ----------------------------------------------------------------------------------------------------------
def write(sae: nn.Module, kind: str, out: Path, hook: str | None, model: str | None, target: str | None) -> None:
    """`sae`, of inference `kind`, as SAELens's folder `out`: on raw inputs, reading `hook` of `model` (a
    transcoder: predicting `target`'s output)."""
    tensors = written(raw_unit_weights(sae), TENSORS, held(kind, sae.skip))
    write_folder(out, WEIGHTS, tensors, _cfg(sae, kind, hook, model, target))


def _cfg(sae: nn.Module, kind: str, hook: str | None, model: str | None, target: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        WIDTHS["d_in"]: sae.d_in,
        WIDTHS["n_latents"]: sae.n_latents,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",  # runner's input scale is folded into the weights
        "reshape_activations": "none",
        # Without a version a cfg counts as older than SAELens 6, whose loader then keeps none of the metadata
        # (hook_name and model_name came back None): the layout written here is SAELens 6's
        "metadata": {METADATA["hook"]: hook_name(hook), METADATA["model"]: model, "sae_lens_version": VERSION},
        "architecture": kind,
    }
    if kind == "topk":
        cfg.update({WIDTHS["k"]: sae.k, "rescale_acts_by_decoder_norm": False})
    if sae.transcoder:
        # its encoder reads the input uncentred (b_dec is the target's); SAELens refuses a transcoder that says
        # otherwise. hook_name_out is where SAELens's hooked models put the prediction.
        name = next(name for name, row in ARCHITECTURES.items() if row == (kind, True, sae.skip))
        cfg.update({"apply_b_dec_to_input": False, WIDTHS["d_out"]: sae.d_out, "architecture": name})
        cfg["metadata"][METADATA["hook_out"]] = hook_name(target)
    return cfg


# ---- in -----------------------------------------------------------------------------------------------------------
def read(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The runner SAE of a SAELens folder `path` of settings `cfg` and `tensors` (float64), and what it says."""
    cfg, meta, arch = _settings(cfg, path)
    inference, transcoder, skip = ARCHITECTURES[arch]
    sizes = _widths(cfg, tensors, transcoder, path)
    names = held(inference, skip)
    weights = ours(shaped(tensors, TENSORS, names, sizes, path), TENSORS)
    if unknown := sorted(set(tensors) - set(names)):
        raise ConfigError(f"{path}: tensors {unknown} are not of a SAELens {arch} SAE (it loads none of them)")
    kwargs: dict[str, Any] = {}
    if arch == "topk":
        kwargs["k"] = whole(cfg, WIDTHS["k"], path)
        if not kwargs["k"] <= sizes["n_latents"]:
            raise ConfigError(f"{path / CFG}: k={kwargs['k']} is more than its d_sae={sizes['n_latents']} latents")
        if cfg.get("rescale_acts_by_decoder_norm"):
            # topk picks from pre-activations times decoder norms, and decodes through unit rows: folded so
            scale = torch.linalg.vector_norm(weights["W_dec"], dim=1).clamp_min(1e-12)
            weights["W_enc"], weights["b_enc"] = weights["W_enc"] * scale, weights["b_enc"] * scale
            weights["W_dec"] = weights["W_dec"] / scale[:, None]
    if transcoder and cfg.get("apply_b_dec_to_input", False):
        raise ConfigError(f"{path / CFG}: a transcoder with apply_b_dec_to_input true (SAELens refuses it too)")
    if not transcoder and not cfg.get("apply_b_dec_to_input", True):
        centre = weights["b_dec"] @ weights["W_enc"]  # runner's encoder subtracts b_dec: added back through its bias
        weights["b_enc"] = weights["b_enc"] + centre
        if arch == "gated":
            weights["b_mag"] = weights["b_mag"] + centre * weights["r_mag"].exp()
    if "threshold" in weights and (weights["threshold"] < 0).any():
        # codes would go negative, which every count and decode here assumes not
        raise ConfigError(f"{path}: threshold has negative entries; a JumpReLU's thresholds are >= 0")
    sae = build(inference, sizes, transcoder, skip, kwargs, weights)
    return sae, {"format": "saelens", "architecture": arch, **{fact: meta.get(key) for fact, key in METADATA.items()}}


def _settings(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    # the settings (as SAELens 6 names them), their metadata and the architecture, each checked as runner reads it
    cfg, where = _legacy(cfg, path)
    meta = cfg.get("metadata") or {}
    typed(meta, path, where, **dict.fromkeys(list(METADATA.values())[:4], str))
    typed(cfg, path, apply_b_dec_to_input=bool, rescale_acts_by_decoder_norm=bool)
    if meta.get(METADATA["context_size"]) is not None:
        whole(meta, METADATA["context_size"], path, where)
    arch = cfg.get("architecture")
    if arch not in ARCHITECTURES:
        why = {
            "batchtopk": "a BatchTopK training checkpoint: SAELens saves the finished SAE as jumprelu; give that",
            "matryoshka_batchtopk": "a training checkpoint: SAELens saves the finished SAE as jumprelu; give that",
        }.get(arch, f"runner reads {', '.join(ARCHITECTURES)}")
        raise ConfigError(f"{path / CFG}: architecture {arch!r} is not read ({why})")
    norm = cfg.get("normalize_activations", "none")
    if norm not in SCALE_FREE:
        raise ConfigError(
            f"{path / CFG}: normalize_activations={norm!r} rescales each token on its own at inference, "
            f"which runner's SAEs do not (they read raw activations): only {', '.join(SCALE_FREE)} are read"
        )
    if cfg.get("reshape_activations", "none") != "none":
        raise ConfigError(
            f"{path / CFG}: reshape_activations={cfg['reshape_activations']!r} (attention heads' z): runner "
            "hooks whole module outputs, so an SAE on hook_z has no place to read from"
        )
    return cfg, meta, arch


def _widths(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], transcoder: bool, path: Path) -> dict[str, int]:
    # d_in, n_latents and d_out: a transcoder's target's width, which SAELens 6 writes and older ones do not
    d_in, n = whole(cfg, WIDTHS["d_in"], path), whole(cfg, WIDTHS["n_latents"], path)
    d_out, dec = d_in, tensors.get("W_dec")
    if transcoder and cfg.get(WIDTHS["d_out"]) is not None:
        d_out = whole(cfg, WIDTHS["d_out"], path)
    elif transcoder and dec is not None:
        if dec.ndim != 2:
            raise ConfigError(f"{path}: W_dec is {list(dec.shape)}, where a transcoder's is a matrix [d_sae, d_out]")
        d_out = dec.shape[1]
    return {"d_in": d_in, "n_latents": n, "d_out": d_out}


def _legacy(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], str]:
    # A cfg older than SAELens 6 (no sae_lens_version): its keys as SAELens's own loader renames them; and where in
    # the file the metadata runner reads is
    typed(cfg, path, architecture=str, metadata=dict, activation_fn_kwargs=dict, hook_point=str)
    typed(cfg, path, activation_fn_str=str, activation_fn=str, normalize_activations=(str, bool))
    version = cfg.get("sae_lens_version") or (cfg.get("metadata") or {}).get("sae_lens_version")
    if version:
        return cfg, "metadata."
    cfg = dict(cfg)
    if "hook_point" in cfg:
        cfg["hook_name"] = cfg.pop("hook_point")
    # a "standard" SAE of these versions applies its activation_fn: a top-k one is a topk SAE, another is not read
    activation = cfg.get("activation_fn_str", cfg.get("activation_fn")) or "relu"
    if cfg.setdefault("architecture", "standard") == "standard" and activation != "relu":
        if activation != "topk":
            raise ConfigError(f"{path / CFG}: activation {activation!r} is not read (runner reads relu, topk)")
        cfg["architecture"] = "topk"
    if cfg["architecture"] == "topk" and "k" not in cfg:
        cfg["k"] = (cfg.get("activation_fn_kwargs") or {}).get("k")  # checked as k
    normalize = cfg.get("normalize_activations")
    cfg["normalize_activations"] = {True: "expected_average_only_in", False: "none", None: "none"}.get(
        normalize, normalize
    )
    cfg["metadata"] = {key: cfg[key] for key in LEGACY_METADATA if key in cfg}
    return cfg, ""
