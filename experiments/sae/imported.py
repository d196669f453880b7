"""SAEs trained elsewhere, read into runner's own classes: a folder of SAELens (`cfg.json` + `sae_weights.safetensors`)
or of EleutherAI's sparsify (`cfg.json` + `sae.safetensors`; a training run's folder holds one per hook point). Read
as JSON and safetensors only, never with their packages' code: a folder is data.

Each becomes the runner class whose inference is the same (experiments/sae/formats.py writes the other way):
SAELens `standard` -> ReLUSAE, `topk` -> TopKSAE, `jumprelu` (also what SAELens saves a BatchTopK or Matryoshka SAE
as) -> JumpReLUSAE, `gated` -> GatedSAE, `transcoder` / `skip_transcoder` / `jumprelu_transcoder` /
`jumprelu_skip_transcoder` -> ReLUSAE or JumpReLUSAE with `d_out` (and `skip`); sparsify's top-k SAEs and transcoders
-> TopKSAE. The weights are folded so that runner's forward gives theirs: SAELens's `rescale_acts_by_decoder_norm`
into unit decoder rows (the codes are what SAELens's `encode` gives), an encoder that reads its input uncentred
(`apply_b_dec_to_input: false`) into b_enc. Input scales stay 1: runner's forward takes raw activations as theirs do.
What has no exact counterpart is refused by name: per-token normalisation (`constant_norm_rescale`, `layer_norm`),
attention-head reshapes (`hook_z`), `abstopk`, matching pursuit, temporal SAEs, sparsify's `groupmax` and `signed`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from runner import ConfigError

SAELENS, SPARSIFY = "sae_weights.safetensors", "sae.safetensors"
# SAELens's architecture -> (runner class, reads the input uncentred as a transcoder, skip connection)
ARCHITECTURES = {
    "standard": ("ReLUSAE", False, False),
    "topk": ("TopKSAE", False, False),
    "jumprelu": ("JumpReLUSAE", False, False),
    "gated": ("GatedSAE", False, False),
    "transcoder": ("ReLUSAE", True, False),
    "skip_transcoder": ("ReLUSAE", True, True),
    "jumprelu_transcoder": ("JumpReLUSAE", True, False),
    "jumprelu_skip_transcoder": ("JumpReLUSAE", True, True),
}
CLASSES = {
    "ReLUSAE": "experiments.sae.coders.activations.ReLUSAE",
    "TopKSAE": "experiments.sae.coders.activations.TopKSAE",
    "JumpReLUSAE": "experiments.sae.coders.jumprelu.JumpReLUSAE",
    "GatedSAE": "experiments.sae.coders.gated.GatedSAE",
}
# what SAELens does at inference with these: nothing (folded into the weights when training ended)
SCALE_FREE = ("none", "expected_average_only_in", "covariance_whitening")
LEGACY_METADATA = ("model_name", "hook_name", "hook_name_out", "prepend_bos", "context_size", "dataset_path")
NAMES = ("hook_name", "hook_name_out", "model_name", "model_class_name")  # the metadata runner reads: text or null
# What a coder's float32 parameters take exactly (a float8 file would need its scales, which neither format stores)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_CFG = 1 << 20  # bytes: a cfg.json is a few hundred; more is no folder of SAE settings
MAX_WIDTH = 1 << 48  # no tensor has more rows or columns: a larger width is a forged number, not a size


def _hook_folders(path: Path) -> list[str]:
    # a sparsify training run: one folder per hook point, each with its cfg.json and sae.safetensors
    return sorted(
        p.name for p in path.iterdir() if p.is_dir() and (p / "cfg.json").is_file() and (p / SPARSIFY).is_file()
    )


def read_folder(path: str | Path, hook: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The SAE in `path` as a runner SAE in eval mode, and what its folder says: {"format", "architecture",
    "hook" (the hook point it names, or None), "hook_out" (a transcoder's target), "model" (the model's name)}.
    A sparsify run of several hook points takes `hook`, the name of one of its folders."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is no folder: give an SAE folder of SAELens or sparsify (cfg.json and its weights)")
    single = (path / "cfg.json").is_file()
    if not single:
        hooks = _hook_folders(path)
        if not hooks:
            raise ConfigError(f"{path} has no cfg.json: give an SAE folder of SAELens or sparsify, or a runner run")
        if hook not in hooks:
            raise ConfigError(f"{path} holds the SAEs of several hook points {hooks}: pick one, e.g. hook={hooks[0]}")
        path = path / hook
    cfg = _json(path / "cfg.json")
    if (path / SAELENS).is_file():
        sae, facts = _saelens(cfg, _tensors(path / SAELENS), path)
        facts["weights"] = str(path / SAELENS)
    elif (path / SPARSIFY).is_file():
        sae, facts = _sparsify(cfg, _tensors(path / SPARSIFY), path)
        facts["hook"] = path.name  # sparsify names each SAE's folder by its hook point
        facts["weights"] = str(path / SPARSIFY)
    else:
        raise ConfigError(f"{path} has a cfg.json but neither {SAELENS} (SAELens) nor {SPARSIFY} (sparsify)")
    if single and hook is not None and hook != facts["hook"]:
        # the folder's SAE was trained at its own hook point: reading it at another is module=, checked on the model
        own = f"of the hook point {facts['hook']!r}" if facts["hook"] else "whose folder names no hook point"
        raise ConfigError(
            f"hook={hook}: {path} holds one SAE, {own}, and hook= picks one SAE of a sparsify run of several: leave "
            "hook= out (module=MODULE reads the SAE at a module of the source model you name)"
        )
    return sae.eval().requires_grad_(False), facts


def _json(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        data = json.loads(path.read_text()) if size <= MAX_CFG else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not readable JSON ({error}); is the folder whole?") from None
    except ValueError:  # Python's int-string conversion limit: no width or count has that many digits
        most = sys.get_int_max_str_digits()
        raise ConfigError(f"{path}: a number of over {most} digits is no SAE setting; is the folder whole?") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deep to be SAE settings; is the folder whole?") from None
    if size > MAX_CFG:
        raise ConfigError(f"{path}: {size:,} bytes, no cfg.json of SAE settings (those are a few KB)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object of SAE settings")
    return data


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable safetensors file ({error}); is the folder whole?") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dtype not in DTYPES:
            raise ConfigError(
                f"{path}: {name} is {str(tensor.dtype).removeprefix('torch.')}, which runner's SAEs do not read: save "
                "the weights as float32, bfloat16 or float16"
            )
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise ConfigError(f"{path}: {name} holds non-finite or non-float values; the file is corrupt")
    return {name: tensor.double() for name, tensor in tensors.items()}


def _shape(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(f"{path}: no tensor {name!r} (it has {sorted(tensors)}); the folder is not of that format")
    if tuple(tensors[name].shape) != shape:
        raise ConfigError(f"{path}: {name} is {list(tensors[name].shape)}, where its cfg.json makes it {list(shape)}")
    return tensors[name]


def _whole(cfg: dict[str, Any], key: str, path: Path, where: str = "") -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MAX_WIDTH:
        raise ConfigError(f"{path / 'cfg.json'}: {where}{key}={_shown(value)}, where a whole number >= 1 is needed")
    return value


def _shown(value: Any) -> str:
    text = repr(value)  # a forged number may have thousands of digits
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _typed(cfg: dict[str, Any], path: Path, where: str = "", **types: type | tuple[type, ...]) -> None:
    # each key of `cfg` given as a value of its type, or absent (null)
    for key, kind in types.items():
        if cfg.get(key) is not None and not isinstance(cfg[key], kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            need = " or ".join({str: "text", bool: "true/false", dict: "a mapping"}[k] for k in kinds)
            raise ConfigError(
                f"{path / 'cfg.json'}: {where}{key}={_shown(cfg[key])}, where {need} (or nothing) is needed: the "
                "folder is not one SAELens or sparsify wrote"
            )


def _legacy(cfg: dict[str, Any], path: Path) -> tuple[dict[str, Any], str]:
    # A cfg older than SAELens 6 (no sae_lens_version): its keys as SAELens's own loader renames them; and where in
    # the file the metadata runner reads is
    _typed(cfg, path, architecture=str, metadata=dict, activation_fn_kwargs=dict, hook_point=str)
    _typed(cfg, path, activation_fn_str=str, activation_fn=str, normalize_activations=(str, bool))
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
            raise ConfigError(f"{path / 'cfg.json'}: activation {activation!r} is not read (runner reads relu, topk)")
        cfg["architecture"] = "topk"
    if cfg["architecture"] == "topk" and "k" not in cfg:
        cfg["k"] = (cfg.get("activation_fn_kwargs") or {}).get("k")  # checked as k
    normalize = cfg.get("normalize_activations")
    cfg["normalize_activations"] = {True: "expected_average_only_in", False: "none", None: "none"}.get(
        normalize, normalize
    )
    cfg["metadata"] = {key: cfg[key] for key in LEGACY_METADATA if key in cfg}
    return cfg, ""


def _saelens(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> tuple[nn.Module, dict[str, Any]]:
    cfg, where = _legacy(cfg, path)
    meta = cfg.get("metadata") or {}
    _typed(meta, path, where, **dict.fromkeys(NAMES, str))
    _typed(cfg, path, apply_b_dec_to_input=bool, rescale_acts_by_decoder_norm=bool)
    if meta.get("context_size") is not None:
        _whole(meta, "context_size", path, where)
    arch = cfg.get("architecture")
    if arch not in ARCHITECTURES:
        why = {
            "batchtopk": "a BatchTopK training checkpoint: SAELens saves the finished SAE as jumprelu; give that",
            "matryoshka_batchtopk": "a training checkpoint: SAELens saves the finished SAE as jumprelu; give that",
        }.get(arch, f"runner reads {', '.join(ARCHITECTURES)}")
        raise ConfigError(f"{path / 'cfg.json'}: architecture {arch!r} is not read ({why})")
    name, transcoder, skip = ARCHITECTURES[arch]
    norm = cfg.get("normalize_activations", "none")
    if norm not in SCALE_FREE:
        raise ConfigError(
            f"{path / 'cfg.json'}: normalize_activations={norm!r} rescales each token on its own at inference, "
            f"which runner's SAEs do not (they read raw activations): only {', '.join(SCALE_FREE)} are read"
        )
    if cfg.get("reshape_activations", "none") != "none":
        raise ConfigError(
            f"{path / 'cfg.json'}: reshape_activations={cfg['reshape_activations']!r} (attention heads' z): runner "
            "hooks whole module outputs, so an SAE on hook_z has no place to read from"
        )
    d_in, n = _whole(cfg, "d_in", path), _whole(cfg, "d_sae", path)
    d_out, dec = d_in, tensors.get("W_dec")
    if transcoder and cfg.get("d_out") is not None:  # its target's width: SAELens 6 writes it, older ones do not
        d_out = _whole(cfg, "d_out", path)
    elif transcoder and dec is not None:
        if dec.ndim != 2:
            raise ConfigError(f"{path}: W_dec is {list(dec.shape)}, where a transcoder's is a matrix [d_sae, d_out]")
        d_out = dec.shape[1]
    W_enc = _shape(tensors, "W_enc", (d_in, n), path)
    W_dec = _shape(tensors, "W_dec", (n, d_out), path)
    b_dec = _shape(tensors, "b_dec", (d_out,), path)
    extra = {"threshold": (n,)} if "jumprelu" in arch else {}
    extra |= {"b_gate": (n,), "r_mag": (n,), "b_mag": (n,)} if arch == "gated" else {"b_enc": (n,)}
    extra |= {"W_skip": (d_out, d_in)} if skip else {}
    got = {key: _shape(tensors, key, shape, path) for key, shape in extra.items()}
    if unknown := sorted(set(tensors) - {"W_enc", "W_dec", "b_dec", *extra}):
        raise ConfigError(f"{path}: tensors {unknown} are not of a SAELens {arch} SAE (it loads none of them)")
    b_enc = got.get("b_enc", got.get("b_gate"))
    kwargs: dict[str, Any] = {}
    if arch == "topk":
        kwargs["k"] = _whole(cfg, "k", path)
        if not kwargs["k"] <= n:
            raise ConfigError(f"{path / 'cfg.json'}: k={kwargs['k']} is more than its d_sae={n} latents")
        if cfg.get("rescale_acts_by_decoder_norm"):
            # topk picks from pre-activations times decoder norms, and decodes through unit rows: folded so
            scale = torch.linalg.vector_norm(W_dec, dim=1).clamp_min(1e-12)
            W_enc, b_enc, W_dec = W_enc * scale, b_enc * scale, W_dec / scale[:, None]
    if transcoder and cfg.get("apply_b_dec_to_input", False):
        raise ConfigError(f"{path / 'cfg.json'}: a transcoder with apply_b_dec_to_input true (SAELens refuses it too)")
    centre = torch.zeros(d_in, dtype=torch.float64)
    if not transcoder and not cfg.get("apply_b_dec_to_input", True):
        centre = b_dec  # runner's encoder subtracts b_dec: added back through its bias
    weights = {"W_enc": W_enc, "W_dec": W_dec, "b_dec": b_dec, "b_enc": b_enc + centre @ W_enc}
    if arch == "gated":
        weights["r_mag"], weights["b_mag"] = got["r_mag"], got["b_mag"] + (centre @ W_enc) * got["r_mag"].exp()
    if "threshold" in got:
        if (got["threshold"] < 0).any():  # codes would go negative, which every count and decode here assumes not
            raise ConfigError(f"{path}: threshold has negative entries; a JumpReLU's thresholds are >= 0")
        weights["threshold"] = got["threshold"]
    if skip:
        weights["W_skip"] = got["W_skip"].t()
    sae = _build(name, d_in, n, d_out if transcoder else None, skip, kwargs, weights)
    facts = {
        "format": "saelens",
        "architecture": arch,
        "hook": meta.get("hook_name"),
        "hook_out": meta.get("hook_name_out"),
        "model": meta.get("model_name"),
        "model_class": meta.get("model_class_name"),
        "context_size": meta.get("context_size"),
    }
    return sae, facts


def _sparsify(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> tuple[nn.Module, dict[str, Any]]:
    _typed(cfg, path, signed=bool, transcode=bool, skip_connection=bool)
    activation = cfg.get("activation", "topk")
    if activation != "topk" or cfg.get("signed"):
        what = "signed codes" if cfg.get("signed") else f"activation {activation!r}"
        raise ConfigError(f"{path / 'cfg.json'}: {what}; runner reads sparsify's top-k coders only")
    d_in, k = _whole(cfg, "d_in", path), _whole(cfg, "k", path)
    n = _whole(cfg, "num_latents", path) if cfg.get("num_latents") else d_in * _whole(cfg, "expansion_factor", path)
    transcoder, skip = bool(cfg.get("transcode")), bool(cfg.get("skip_connection"))
    if skip and not transcoder:
        raise ConfigError(
            f"{path / 'cfg.json'}: an SAE with a skip connection (skip_connection without transcode) is not read: "
            "runner's skip connections are transcoders'"
        )
    names = {"encoder.weight": (n, d_in), "encoder.bias": (n,), "W_dec": (n, d_in), "b_dec": (d_in,)}
    names |= {"W_skip": (d_in, d_in)} if skip else {}
    got = {key: _shape(tensors, key, shape, path) for key, shape in names.items()}
    if unknown := sorted(set(tensors) - set(names)):
        raise ConfigError(f"{path}: tensors {unknown} are not of a sparsify coder of this cfg.json")
    if not k <= n:
        raise ConfigError(f"{path / 'cfg.json'}: k={k} is more than its {n} latents")
    W_enc = got["encoder.weight"].t()
    weights = {"W_enc": W_enc, "b_enc": got["encoder.bias"], "W_dec": got["W_dec"], "b_dec": got["b_dec"]}
    if skip:  # sparsify adds x @ W_skip.T, on the raw input
        weights["W_skip"] = got["W_skip"].t()
    # a transcoder's encoder reads its input uncentred in both tools; its target is as wide as its input in sparsify
    sae = _build("TopKSAE", d_in, n, d_in if transcoder else None, skip, {"k": k}, weights)
    return sae, {
        "format": "sparsify",
        "architecture": "topk",
        "hook_out": None,
        "model": None,
        "transcoder": transcoder,
    }


def _build(
    name: str,
    d_in: int,
    n: int,
    d_out: int | None,
    skip: bool,
    kwargs: dict[str, Any],
    weights: dict[str, torch.Tensor],
) -> nn.Module:
    """A runner SAE of class `name` holding `weights` (float64, runner's layout), ready for inference."""
    from hydra.utils import get_class

    cls = get_class(CLASSES[name])
    sae = cls(d_in=d_in, n_latents=n, d_out=d_out, skip=skip, **kwargs)
    with torch.no_grad():
        for key, value in weights.items():
            getattr(sae, key).copy_(value.to(torch.float32))
        sae.initialized.fill_(True)
    sae.spec = {"_target_": CLASSES[name], "d_in": d_in, "n_latents": n, "d_out": d_out, "skip": skip, **kwargs}
    return sae
