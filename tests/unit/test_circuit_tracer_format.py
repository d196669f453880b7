"""circuit-tracer's folder out and in (experiments/sae/formats/circuit_tracer.py, circuit_tracer_clt.py): a written
folder read back gives the same reconstruction on raw rows; its files, tensors, shapes and config keys are what
circuit-tracer 0.5.0's loaders read (single_layer_transcoder.py load_relu_transcoder: layer_{i}.safetensors with W_enc
[n, d], W_dec [n, d], b_enc [n], b_dec [d], activation_function.threshold [n], W_skip [d, d];
cross_layer_transcoder.py _load_state_dict: W_enc_{i}.safetensors with W_enc_{i} [n, d], b_enc_{i}, b_dec_{i},
threshold_{i}, W_dec_{i}.safetensors with W_dec_{i} [n, L - i, d]; utils/caching.py load_transcoders_from_cache:
config.yaml's model_kind, feature_input_hook, feature_output_hook); forged folders are refused in one line."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers import random_transcoder
from safetensors.torch import load_file, save_file

from experiments.sae.coders.activations import BatchTopKSAE, ReLUSAE, TopKSAE
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.coders.gated import GatedSAE
from experiments.sae.coders.jumprelu import JumpReLUSAE
from experiments.sae.formats import export, read_folder
from experiments.sae.formats.circuit_tracer_clt import write_clt
from runner import ConfigError

D, N = 8, 32


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    # to 1e-6 of the outputs' scale (float32 weights, folded scales)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max().clamp_min(1)


def transcoder(cls: type, skip: bool = False, **kwargs) -> tuple[torch.nn.Module, torch.Tensor]:
    return random_transcoder(cls, D, N, skip, **kwargs)


def clt(cls: type, **kwargs) -> tuple[CrossLayerTranscoder, torch.Tensor]:
    torch.manual_seed(0)
    model = CrossLayerTranscoder(functools.partial(cls, n_latents=16, **kwargs), layers=3, d_in=D, d_out=D)
    rows = torch.cat([torch.randn(512, 3 * D) * 2 + 0.5, torch.randn(512, 3 * D) * 0.3], dim=1)
    model.initialize_from(rows)
    with torch.no_grad():
        for coder in model.coders:
            coder.W_dec.normal_(std=0.3)
    return model.eval(), rows


@pytest.mark.parametrize(
    ("cls", "skip", "kwargs"), [(TopKSAE, False, {"k": 3}), (ReLUSAE, True, {}), (JumpReLUSAE, False, {})]
)
def test_a_transcoder_written_and_read_back_reconstructs_the_same(tmp_path: Path, cls, skip, kwargs) -> None:
    sae, rows = transcoder(cls, skip, **kwargs)
    export(sae, "circuit_tracer", tmp_path / "ct", "blocks.2.mlp_norm", "gpt2", "blocks.2.mlp", rows=rows)
    back, facts = read_folder(tmp_path / "ct")
    x = rows[:, :D]
    close(back(x), sae(x))
    assert type(back) is cls and back.skip == skip and facts["hook"] == "blocks.2.mlp_norm"
    tensors = load_file(tmp_path / "ct" / "layer_2.safetensors")  # the layer's file is named by its block
    want = {"W_enc": [N, D], "W_dec": [N, D], "b_enc": [N], "b_dec": [D]}
    want |= {"W_skip": [D, D]} if skip else {}
    want |= {"activation_function.threshold": [N]} if cls is not ReLUSAE else {}  # TopK: its calibrated JumpReLU
    assert {name: list(t.shape) for name, t in tensors.items()} == want
    cfg = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert cfg["model_kind"] == "transcoder_set" and cfg["model_name"] == "gpt2"
    assert (cfg["feature_input_hook"], cfg["feature_output_hook"]) == ("mlp.hook_in", "hook_mlp_out")
    if cls is TopKSAE:
        assert cfg["runner"]["k"] == 3 and cfg["runner"]["conversion"]["l0_jumprelu"][0] == pytest.approx(3, abs=0.1)


def test_circuit_tracer_s_view_of_a_topk_transcoder_is_its_calibrated_jumprelu(tmp_path: Path) -> None:
    sae, rows = transcoder(TopKSAE, k=4)
    export(sae, "circuit_tracer", tmp_path / "ct", "blocks.0.mlp_norm", None, "blocks.0.mlp", rows=rows)
    t = load_file(tmp_path / "ct" / "layer_0.safetensors")
    pre = rows[:, :D] @ t["W_enc"].t() + t["b_enc"]
    codes = pre * (pre > t["activation_function.threshold"])
    cost = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())["runner"]["conversion"]
    assert (codes > 0).sum(1).float().mean() == pytest.approx(cost["l0_jumprelu"][0], abs=1e-4)
    assert cost["l0_topk"] == [4.0] and cost["fve_jumprelu"][0] <= cost["fve_topk"][0] + 0.05


@pytest.mark.parametrize("cls", [ReLUSAE, JumpReLUSAE, BatchTopKSAE])
def test_a_relu_or_jumprelu_clt_is_written_exactly(tmp_path: Path, cls: type) -> None:
    model, rows = clt(cls, **({"k": 2} if cls is BatchTopKSAE else {}))
    if cls is BatchTopKSAE:
        for coder in model.coders:
            coder.threshold.fill_(0.4)
    write_clt(model, tmp_path, ["blocks.0.mlp_norm"], None, ["blocks.0.mlp"])
    back, _ = read_folder(tmp_path)
    inputs, _ = model.split(rows)
    for got, want in zip(back(inputs), model(inputs), strict=True):
        close(got, want)
    for i in range(3):
        enc, dec = load_file(tmp_path / f"W_enc_{i}.safetensors"), load_file(tmp_path / f"W_dec_{i}.safetensors")
        want = {f"W_enc_{i}": [16, D], f"b_enc_{i}": [16], f"b_dec_{i}": [D]}
        assert {k: list(v.shape) for k, v in enc.items()} == want | ({} if cls is ReLUSAE else {f"threshold_{i}": [16]})
        assert {k: list(v.shape) for k, v in dec.items()} == {f"W_dec_{i}": [16, 3 - i, D]}
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model_kind"] == "cross_layer_transcoder"


def test_a_topk_clt_becomes_a_jumprelu_at_the_topk_s_l0_with_its_cost_stated(tmp_path: Path, capsys) -> None:
    model, rows = clt(TopKSAE, k=2)
    write_clt(model, tmp_path, [], None, [], rows)
    cost = yaml.safe_load((tmp_path / "config.yaml").read_text())["runner"]["conversion"]
    assert "TopK -> JumpReLU on 512 held-out rows" in capsys.readouterr().out
    assert cost["l0_jumprelu"] == pytest.approx(cost["l0_topk"], abs=0.05) and max(cost["l0_topk"]) <= 2
    back, _ = read_folder(tmp_path)
    assert type(back.coders[0]) is JumpReLUSAE
    inputs, targets = model.split(rows)
    got = back(inputs)  # the folder's own FVE is what its config says
    fve = [float(1 - (p - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()) for p, y in zip(got, targets, strict=True)]
    assert fve == pytest.approx(cost["fve_jumprelu"], rel=1e-3)  # float32 weights against the float64 fold


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (
            lambda p: save_file(
                {"W_enc": torch.zeros(N, D), "b_enc": torch.zeros(N), "b_dec": torch.zeros(D)},
                p / "layer_0.safetensors",
            ),
            "no tensor 'W_dec'",
        ),  # fmt: skip
        (
            lambda p: save_file(
                {**load_file(p / "layer_0.safetensors"), "b_dec": torch.zeros(D + 1)}, p / "layer_0.safetensors"
            ),
            r"b_dec is \[9\]",
        ),  # fmt: skip
        (lambda p: (p / "config.yaml").write_text("a: &a [1, 2]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n"), "aliases"),
        (lambda p: ((p / "layer_0.safetensors").unlink(), os.mkfifo(p / "layer_0.safetensors")), "no regular file"),
        (lambda p: (p / "config.yaml").write_text("model_kind: something_else\n"), "model_kind"),
    ],
)
def test_a_forged_folder_is_refused_in_one_paragraph(tmp_path: Path, forge, message: str) -> None:
    sae, rows = transcoder(ReLUSAE)
    export(sae, "circuit_tracer", tmp_path / "ct", "blocks.0.mlp_norm", None, "blocks.0.mlp")
    forge(tmp_path / "ct")
    with pytest.raises(ConfigError, match=message) as error:
        read_folder(tmp_path / "ct")
    assert "\n" not in str(error.value)


def test_a_forged_clt_decoder_shape_is_refused(tmp_path: Path) -> None:
    model, _ = clt(ReLUSAE)
    write_clt(model, tmp_path, [], None, [])
    save_file({"W_dec_1": torch.zeros(16, 3, D)}, tmp_path / "W_dec_1.safetensors")  # layer 1 writes to 2 layers
    with pytest.raises(ConfigError, match=r"W_dec_1 is \[16, 3, 8\], where the folder makes it \[16, 2, 8\]"):
        read_folder(tmp_path)


@pytest.mark.parametrize(
    ("coder", "message"),
    [
        (lambda: GatedSAE(d_in=D, n_latents=N, d_out=D), "GatedSAE, whose codes circuit-tracer has no way to express"),
        (lambda: ReLUSAE(d_in=D, n_latents=N), "an SAE"),
        (lambda: ReLUSAE(d_in=D, n_latents=N, d_out=2 * D), "from width 8 to 16"),
    ],
)
def test_what_circuit_tracer_cannot_hold_is_refused_with_the_reason(tmp_path: Path, coder, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        export(coder(), "circuit_tracer", tmp_path / "ct")
    gated = CrossLayerTranscoder(functools.partial(GatedSAE, n_latents=16), layers=2, d_in=D, d_out=D)
    with pytest.raises(ConfigError, match="layer 0 coder is GatedSAE"):
        write_clt(gated, tmp_path / "clt", [], None, [])


def test_a_topk_coder_without_held_out_rows_is_refused(tmp_path: Path) -> None:
    sae, _ = transcoder(TopKSAE, k=2)
    with pytest.raises(ConfigError, match="no validation rows were given"):
        export(sae, "circuit_tracer", tmp_path / "ct", "blocks.0.mlp_norm")
