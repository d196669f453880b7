"""circuit-tracer's cross-layer transcoder folder (circuit_tracer.py's CLT table), out and in, and the calibration of a
TopK coder's JumpReLU threshold.

runner's CLT scales layer i's input by s_i and its target by t_i inside (coders/clt.py); circuit-tracer's reads and
writes raw activations. Layer i's codes are written divided by t_i (so its own-layer decoder rows stay as trained):
W_enc_i = (W_enc s_i / t_i)^T, b_enc_i and threshold_i / t_i, W_dec_i[:, j] = W_dec block j * t_i / t_{i+j}, and
b_dec_i (the bias of layer i's output) the sum over layers m <= i of their decoders' block for i, / t_i. Read back,
each coder holds its file's weights with scales 1 and the output bias in its own block.

A TopK coder (or Matryoshka on TopK codes) becomes a JumpReLU with one threshold per layer, chosen on held-out rows so
that its mean L0 there is the TopK's (the BatchTopK rule: the value of the (L0 x rows)-th largest pre-activation); the
FVE and L0 of both on those rows are printed and written into config.yaml (`runner.conversion`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import nn

from experiments.sae.formats.calibration import cost, fve, need, threshold_for
from experiments.sae.formats.circuit_tracer import (
    CLT,
    DEC_FILE,
    ENC_FILE,
    INPUT_HOOK,
    KINDS,
    OUTPUT_HOOK,
    block_hook,
    checked_coder,
    numbered,
    read_config,
    read_set,
    tensors_of,
    width,
    write_config,
)
from experiments.sae.formats.common import empty_folder
from runner import ConfigError
from runner.rundir import write_atomic


# ---- out ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def fold(clt: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Each layer's tensors by circuit-tracer's names (float64, {i} not yet filled in) on raw activations."""
    n_layers, d = clt.layers, clt.d_out
    s, t = clt.input_scale.double(), clt.target_scale.double()
    out_bias = [torch.zeros(d, dtype=torch.float64) for _ in range(n_layers)]
    layers = []
    for i, coder in enumerate(clt.coders):
        n, later = coder.n_latents, n_layers - i
        dec = coder.W_dec.double().view(n, later, d) * t[i] / t[i:].view(1, later, 1)
        for j in range(later):
            out_bias[i + j] += coder.b_dec.double()[j * d : (j + 1) * d] / t[i + j]
        layer = {"W_enc_{i}": (coder.W_enc.double() * s[i] / t[i]).t(), "b_enc_{i}": coder.b_enc.double() / t[i],
                 "W_dec_{i}": dec}  # fmt: skip
        if coder.inference == "jumprelu":  # JumpReLU's per latent, BatchTopK's global (-1 unset: 0 at inference)
            layer["threshold_{i}"] = coder.threshold.double().clamp_min(0).expand(n) / t[i]
        layers.append(layer)
    for i, layer in enumerate(layers):
        layer["b_dec_{i}"] = out_bias[i]
    return layers


@torch.no_grad()
def calibrate_clt(clt: nn.Module, layers: list[dict[str, torch.Tensor]], rows: Any) -> dict[str, Any]:
    """Each layer's JumpReLU threshold (into `layers`) for a TopK CLT, and what the conversion costs on `rows`."""
    inputs, targets = clt.split(need(rows, "the cross-layer transcoder"))
    was = next(clt.parameters()).dtype
    clt.double().eval()
    l0 = [float((clt.decoded(x * clt.input_scale[i], i)[1] > 0).sum(1).double().mean()) for i, x in enumerate(inputs)]
    for i, layer in enumerate(layers):
        pre = inputs[i] @ layer["W_enc_{i}"].t() + layer["b_enc_{i}"]
        layer["threshold_{i}"] = torch.full_like(layer["b_enc_{i}"], threshold_for(pre, l0[i]))
    converted = build_clt(layers).double()
    pred, got = clt(inputs), converted(inputs)
    clt.to(was)
    l0_jr = [float((converted.decoded(x, i)[1] > 0).sum(1).double().mean()) for i, x in enumerate(inputs)]
    before = [fve(p, y) for p, y in zip(pred, targets, strict=True)]
    return cost(before, [fve(p, y) for p, y in zip(got, targets, strict=True)], l0, l0_jr, len(targets[0]))


def write_clt(
    clt: nn.Module,
    out: Path,
    modules: list,
    model: str | None,
    targets: list,
    rows: Any = None,
    skip_positions: int = 0,
) -> None:
    """`clt` as circuit-tracer's CLT folder `out`, reading `modules` and writing `targets` (one per layer), trained
    past its first `skip_positions` positions."""
    codes = {checked_coder(coder, f"the CLT's layer {i} coder", clt.d_out) for i, coder in enumerate(clt.coders)}
    layers = fold(clt)
    empty_folder(out)
    ours: dict[str, Any] = {"code": "jumprelu" if codes & {"topk", "jumprelu"} else "relu"}
    if "topk" in codes:
        ours["converted_from"], ours["conversion"] = "topk", calibrate_clt(clt, layers, rows)
    for i, layer in enumerate(layers):
        enc = {
            name.format(i=i): layer[name].float().contiguous() for name in CLT if name != "W_dec_{i}" and name in layer
        }
        write_atomic(out / ENC_FILE.format(i=i), save(enc))
        write_atomic(out / DEC_FILE.format(i=i), save({f"W_dec_{i}": layer["W_dec_{i}"].float().contiguous()}))
    first = lambda names, default: block_hook(names[0] if names else None, default)[1]  # noqa: E731
    ours.update(modules=modules or None, targets=targets or None, skip_positions=skip_positions)
    write_config(out, KINDS[1], (first(modules, INPUT_HOOK), first(targets, OUTPUT_HOOK)), model, ours)


# ---- in -----------------------------------------------------------------------------------------------------------
def build_clt(layers: list[dict[str, torch.Tensor]]) -> nn.Module:
    """runner's CrossLayerTranscoder (scales 1) of circuit-tracer's per-layer tensors (names with {i})."""
    from experiments.sae.coders.activations import ReLUSAE
    from experiments.sae.coders.clt import CrossLayerTranscoder
    from experiments.sae.coders.jumprelu import JumpReLUSAE

    n, d = layers[0]["W_enc_{i}"].shape
    cls = JumpReLUSAE if "threshold_{i}" in layers[0] else ReLUSAE
    clt = CrossLayerTranscoder(functools.partial(cls, n_latents=n), len(layers), d, d, False, False)
    with torch.no_grad():
        for coder, layer in zip(clt.coders, layers, strict=True):
            coder.W_enc.copy_(layer["W_enc_{i}"].t())
            coder.b_enc.copy_(layer["b_enc_{i}"])
            coder.W_dec.copy_(layer["W_dec_{i}"].reshape(n, -1))
            coder.b_dec.zero_()[:d] = layer["b_dec_{i}"]
            if "threshold_{i}" in layer:
                coder.threshold.copy_(layer["threshold_{i}"])
            coder.initialized.fill_(True)
        clt.initialized.fill_(True)
    return clt.eval().requires_grad_(False)


def read_clt(path: Path, cfg: dict[str, Any]) -> nn.Module:
    """The runner CLT of circuit-tracer's CLT folder `path`: every layer's files, each tensor of its shape."""
    found = numbered(path, ENC_FILE)
    if found != list(range(len(found))) or numbered(path, DEC_FILE) != found:
        raise ConfigError(f"{path}: W_enc_N and W_dec_N files for layers {found}: a CLT has both for 0..L-1 each")
    n, d = width(path / ENC_FILE.format(i=0), "W_enc_0", 2)
    layers = []
    for i in found:
        shapes = {"n_latents": n, "d_model": d, "later": len(found) - i}
        want = {name.format(i=i): tuple(shapes[w] for w in row[1]) for name, row in CLT.items()}
        dec = want.pop(f"W_dec_{i}")
        enc = tensors_of(path / ENC_FILE.format(i=i), want, optional=(f"threshold_{i}",))
        enc |= tensors_of(path / DEC_FILE.format(i=i), {f"W_dec_{i}": dec})
        layers.append({name: enc[name.format(i=i)] for name in CLT if name.format(i=i) in enc})
    if len({"threshold_{i}" in layer for layer in layers}) > 1:
        raise ConfigError(f"{path}: threshold_N in some layers' files only: a CLT is JumpReLU or ReLU throughout")
    if any((layer.get("threshold_{i}", torch.zeros(1)) < 0).any() for layer in layers):
        raise ConfigError(f"{path}: negative thresholds; a JumpReLU's thresholds are >= 0")
    return build_clt(layers)


def read(path: Path, hook: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The runner coder of circuit-tracer's folder `path` (a transcoder set of several layers: `hook` = layer_N picks
    one; a CLT: CrossLayerTranscoder), and what the folder says."""
    cfg = read_config(path)
    if cfg["model_kind"] == KINDS[0]:
        return read_set(path, cfg, hook)
    facts = {"format": "circuit_tracer", "model": cfg.get("model_name"), "architecture": cfg["model_kind"]}
    return read_clt(path, cfg), facts | {"hook": None, "hook_out": None}
