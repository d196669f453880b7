"""What SAELens's and sparsify's folders share, out and in: an SAE's inference in SAELens's names (what both formats
call it), its weights on raw inputs, what neither format takes; a format's tensor table applied both ways; and a
folder's cfg.json and safetensors read as data, checked (a forged number, a float8 file or a wrong shape is refused by
name, never followed). A tensor table maps each of a format's tensor names to (runner's parameter, its shape there in
runner's widths `d_in`, `n_latents`, `d_out`, whether it is stored transposed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from runner import ConfigError
from runner.rundir import write_atomic

CFG = "cfg.json"  # both formats' settings file
# runner's class of each inference (SAELens's architecture names), what a folder is read into
CLASSES = {
    "topk": "experiments.sae.coders.activations.TopKSAE",
    "jumprelu": "experiments.sae.coders.jumprelu.JumpReLUSAE",
    "standard": "experiments.sae.coders.activations.ReLUSAE",
    "gated": "experiments.sae.coders.gated.GatedSAE",
}
# What a coder's float32 parameters take exactly (a float8 file would need its scales, which neither format stores)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_CFG = 1 << 20  # bytes: a cfg.json is a few hundred; more is no folder of SAE settings
MAX_WIDTH = 1 << 48  # no tensor has more rows or columns: a larger width is a forged number, not a size
Table = dict[str, tuple[str, tuple[str, ...], bool]]


# ---- out ----------------------------------------------------------------------------------------------------------
def empty_folder(out: Path) -> Path:
    """`out`, made here if new; refused if it is a file or already holds files (an export never mixes folders)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: give an empty or new folder (nothing was written)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already holds files: give an empty or new folder (nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    return out


def architecture(sae: nn.Module) -> str:
    """What the SAE's inference is, in SAELens's names (its class's `inference`): topk, jumprelu, standard or gated."""
    kind = getattr(sae, "inference", None)
    if kind not in CLASSES:
        raise ConfigError(f"{type(sae).__name__} has no counterpart in SAELens or sparsify to export to")
    return kind


def refuse(sae: nn.Module, fmt: str, kind: str) -> None:
    """What a format has no class for, refused with the format that has one (or that neither has)."""
    name, square = type(sae).__name__, sae.d_out == sae.d_in
    if sae.transcoder and kind == "gated":
        raise ConfigError(
            f"neither format takes {name}, a gated transcoder: SAELens has no gated transcoder (gated SAEs "
            "only), sparsify top-k coders only"
        )
    if fmt == "sparsify" and kind != "topk":
        raise ConfigError(f"sparsify has top-k SAEs only; this is {name} ({kind} at inference): --format saelens")
    if fmt == "sparsify" and not square:  # a top-k transcoder, then: SAELens has none either
        raise ConfigError(
            f"neither format takes {name}, a top-k transcoder from width {sae.d_in} to {sae.d_out}: sparsify's "
            "transcoders predict a target as wide as their input, and SAELens has no top-k transcoder"
        )
    if fmt == "saelens" and sae.transcoder and kind == "topk":
        where = "--format sparsify" if square else f"neither format takes one from width {sae.d_in} to {sae.d_out}"
        raise ConfigError(f"SAELens has no top-k transcoder ({name}): {where}")


@torch.no_grad()
def raw_unit_weights(sae: nn.Module) -> dict[str, torch.Tensor]:
    """W_enc, b_enc, W_dec, b_dec (and threshold; r_mag, b_mag; W_skip [d_in, d_out]) of the same SAE on raw inputs
    and target, by runner's names: codes divided by the target's scale."""
    s_in, s_out = sae.input_scale.double(), sae.out_scale.double()
    ratio = s_in / s_out  # exactly 1 for an SAE: its W_enc is written bit for bit as trained
    weights = {
        "W_enc": sae.W_enc.double() * ratio,
        "b_enc": sae.b_enc.double() / s_out,
        "W_dec": sae.W_dec.double(),
        "b_dec": sae.b_dec.double() / s_out,
    }
    if architecture(sae) == "jumprelu":  # JumpReLU's per latent; BatchTopK's one global threshold for every latent
        weights["threshold"] = sae.threshold.expand(sae.n_latents).double() / s_out
    if architecture(sae) == "gated":  # b_enc is the gate's bias; exp(r_mag) scales W_enc's columns: scale-free
        weights.update(r_mag=sae.r_mag.double(), b_mag=sae.b_mag.double() / s_out)
    if sae.skip:
        weights["W_skip"] = sae.W_skip.double() * ratio
    return {name: tensor.float().contiguous().clone() for name, tensor in weights.items()}


def written(weights: dict[str, torch.Tensor], table: Table, names: list[str]) -> dict[str, torch.Tensor]:
    """runner's `weights` (raw_unit_weights) as a format's tensors `names`, laid out as its `table` says."""
    tensors = {}
    for name in names:
        ours, _, transposed = table[name]
        tensors[name] = weights[ours].t().contiguous() if transposed else weights[ours]
    return tensors


def write_folder(out: Path, weights_file: str, tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
    """The weights and cfg.json of a folder, each renamed into place: a symlink at the name is replaced, never
    written through."""
    write_atomic(out / weights_file, save(tensors))
    write_atomic(out / CFG, (json.dumps(cfg, indent=2) + "\n").encode())


# ---- in -----------------------------------------------------------------------------------------------------------
def read_cfg(path: Path) -> dict[str, Any]:
    """A cfg.json's settings, refused where it is no JSON object of a size and depth settings have."""
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


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors in float64, refused where one is no finite float runner's SAEs read."""
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


def shaped(
    tensors: dict[str, torch.Tensor], table: Table, names: list[str], sizes: dict[str, int], path: Path
) -> dict[str, torch.Tensor]:
    """A format's tensors `names`, each checked (in that order) to have its table's shape in `sizes`."""
    got = {}
    for name in names:
        shape = tuple(sizes[width] for width in table[name][1])
        if name not in tensors:
            have = sorted(tensors)
            raise ConfigError(f"{path}: no tensor {name!r} (it has {have}); the folder is not of that format")
        if tuple(tensors[name].shape) != shape:
            raise ConfigError(
                f"{path}: {name} is {list(tensors[name].shape)}, where its cfg.json makes it {list(shape)}"
            )
        got[name] = tensors[name]
    return got


def ours(got: dict[str, torch.Tensor], table: Table) -> dict[str, torch.Tensor]:
    """A format's tensors as runner's parameters, by runner's names and in its layout."""
    return {table[name][0]: tensor.t() if table[name][2] else tensor for name, tensor in got.items()}


def whole(cfg: dict[str, Any], key: str, path: Path, where: str = "") -> int:
    """cfg[key], refused unless a whole number >= 1 of a size a width has."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MAX_WIDTH:
        raise ConfigError(f"{path / CFG}: {where}{key}={_shown(value)}, where a whole number >= 1 is needed")
    return value


def _shown(value: Any) -> str:
    text = repr(value)  # a forged number may have thousands of digits
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def typed(cfg: dict[str, Any], path: Path, where: str = "", **types: type | tuple[type, ...]) -> None:
    """Each key of `cfg` given as a value of its type, or absent (null)."""
    for key, kind in types.items():
        if cfg.get(key) is not None and not isinstance(cfg[key], kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            need = " or ".join({str: "text", bool: "true/false", dict: "a mapping"}[k] for k in kinds)
            raise ConfigError(
                f"{path / CFG}: {where}{key}={_shown(cfg[key])}, where {need} (or nothing) is needed: the "
                "folder is not one SAELens or sparsify wrote"
            )


def build(
    inference: str,
    sizes: dict[str, int],
    transcoder: bool,
    skip: bool,
    kwargs: dict[str, Any],
    weights: dict[str, torch.Tensor],
) -> nn.Module:
    """A runner SAE of the class of `inference` holding `weights` (float64, runner's layout), ready for inference."""
    from hydra.utils import get_class

    d_in, n, d_out = sizes["d_in"], sizes["n_latents"], sizes["d_out"] if transcoder else None
    cls = get_class(CLASSES[inference])
    sae = cls(d_in=d_in, n_latents=n, d_out=d_out, skip=skip, **kwargs)
    with torch.no_grad():
        for key, value in weights.items():
            getattr(sae, key).copy_(value.to(torch.float32))
        sae.initialized.fill_(True)
    sae.spec = {"_target_": CLASSES[inference], "d_in": d_in, "n_latents": n, "d_out": d_out, "skip": skip, **kwargs}
    return sae
