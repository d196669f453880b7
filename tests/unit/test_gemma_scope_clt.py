"""Gemma Scope 2's CLT files read as runner's CrossLayerTranscoder (experiments/sae/formats/gemma_scope_clt.py): what
circuit-tracer 0.5.0's load_gemma_scope_2_clt reads (params_layer_{i}.safetensors with w_enc [d, n], b_enc [n],
threshold [n], w_dec [n, L, d], b_dec [d], optional affine_skip_connection [d, d]; config.yaml's `transcoders` for a
cross_layer_transcoder) gives, per layer, the codes and outputs of circuit-tracer's formulas computed from the tensors;
what runner's CLT cannot hold and forged folders are refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers import gemma_scope_clt, gemma_scope_forward
from safetensors.torch import load_file, save_file

from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.coders.jumprelu import JumpReLUSAE
from experiments.sae.formats import read_folder, recognizes
from runner import ConfigError

L, N, D = 3, 16, 8


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 weights against a float64 reference, to 1e-5 of the outputs' scale
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max().clamp_min(1)


def inputs() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(64, D) * 1.5 for _ in range(L)]


def check(clt: torch.nn.Module, tensors: list[dict[str, torch.Tensor]]) -> None:
    xs = inputs()
    codes, outputs = gemma_scope_forward(tensors, xs)
    assert isinstance(clt, CrossLayerTranscoder) and not clt.training
    assert all(isinstance(c, JumpReLUSAE) for c in clt.coders)
    assert clt.input_scale.eq(1).all() and clt.target_scale.eq(1).all()  # raw units
    for i, x in enumerate(xs):  # each layer's encode
        got = clt.decoded(x, i)[1]
        assert torch.equal(got > 0, codes[i] > 0) and 0 < (codes[i] > 0).float().mean() < 1
        close(got, codes[i])
    for got, want in zip(clt(xs), outputs, strict=True):  # each layer's decode: the writes of layers <= it
        close(got, want)


@pytest.mark.parametrize("config", [True, False])  # with circuit-tracer's config.yaml, or Google's files alone
def test_the_files_read_give_circuit_tracer_s_codes_and_outputs(tmp_path: Path, config: bool) -> None:
    tensors = gemma_scope_clt(tmp_path, L, N, D, config=config)
    assert recognizes(tmp_path)
    clt, facts = read_folder(tmp_path)
    check(clt, tensors)
    assert facts["format"] == "gemma_scope_2" and facts["architecture"] == "cross_layer_transcoder"
    for i, coder in enumerate(clt.coders):  # the tensors as they are; writes to earlier layers dropped
        assert torch.equal(coder.W_enc, tensors[i]["w_enc"]) and torch.equal(coder.threshold, tensors[i]["threshold"])
        assert torch.equal(coder.W_dec, tensors[i]["w_dec"][:, i:].reshape(N, -1))
        assert torch.equal(coder.b_dec[:D], tensors[i]["b_dec"]) and not coder.b_dec[D:].any()


def test_bfloat16_files_a_padded_list_and_a_zero_skip_read_the_same(tmp_path: Path) -> None:
    tensors = gemma_scope_clt(tmp_path, L, N, D, pad=True, affine_skip_connection=torch.zeros(D, D))
    for i, layer in enumerate(tensors):
        save_file({k: v.bfloat16() for k, v in layer.items()}, tmp_path / f"params_layer_{i}.safetensors")
        tensors[i] = {k: v.bfloat16().float() for k, v in layer.items()}
    check(read_folder(tmp_path)[0], tensors)


def test_the_files_config_yaml_lists_are_read_in_its_order(tmp_path: Path) -> None:
    tensors = gemma_scope_clt(tmp_path, L, N, D)
    for i in range(L):  # renamed in reverse: the list decides which file is which layer
        (tmp_path / f"params_layer_{i}.safetensors").rename(tmp_path / f"part_{L - 1 - i}.safetensors")
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    cfg["transcoders"] = [f"hf://someone/gemma-scope-2-x/part_{L - 1 - i}.safetensors?revision=main" for i in range(L)]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    check(read_folder(tmp_path)[0], tensors)


def test_an_affine_skip_connection_is_refused_with_the_reason(tmp_path: Path) -> None:
    gemma_scope_clt(tmp_path, L, N, D, affine_skip_connection=torch.randn(D, D) * 0.1)
    with pytest.raises(ConfigError, match="affine skip connection .* cannot represent") as error:
        read_folder(tmp_path)
    assert "\n" not in str(error.value)


def _layer(p: Path, i: int = 1, **change: torch.Tensor | None) -> None:
    # layer i's file with tensors replaced (None: removed)
    tensors = {**load_file(p / f"params_layer_{i}.safetensors"), **change}
    save_file({k: v for k, v in tensors.items() if v is not None}, p / f"params_layer_{i}.safetensors")


def _fifo(file: Path) -> None:
    file.unlink()
    os.mkfifo(file)


def _config(p: Path, **change: object) -> None:
    cfg = {**yaml.safe_load((p / "config.yaml").read_text()), **change}
    (p / "config.yaml").write_text(yaml.safe_dump(cfg))


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (lambda p: _layer(p, threshold=None), "no tensor 'threshold'"),
        (lambda p: _layer(p, w_enc=torch.zeros(N, D)), r"w_enc is \[16, 8\], where the folder makes it \[8, 16\]"),
        (lambda p: _layer(p, w_dec=torch.zeros(N, L - 1, D)), r"w_dec is \[16, 2, 8\]"),
        (lambda p: _layer(p, threshold=-torch.rand(N)), "negative entries"),
        (lambda p: _layer(p, pre_bias=torch.zeros(D)), r"tensors \['pre_bias'\]"),
        (lambda p: _layer(p, 0, w_dec=torch.zeros(N, L + 1, D)), "w_dec writes to 4 layers, where the folder holds 3"),
        (lambda p: (p / "params_layer_2.safetensors").unlink(), "not readable"),
        (lambda p: _config(p, transcoders="params_layer_0.safetensors"), "no list of file names"),
        (lambda p: _config(p, transcoders=["a.safetensors", "b.npz", "c.safetensors"]), "own .safetensors is due"),
        (lambda p: _fifo(p / "params_layer_1.safetensors"), "no regular file"),
    ],
)
def test_a_forged_folder_is_refused_in_one_paragraph(tmp_path: Path, forge, message: str) -> None:
    gemma_scope_clt(tmp_path, L, N, D)
    forge(tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        read_folder(tmp_path)
    assert "\n" not in str(error.value)


def test_google_s_files_alone_must_number_every_layer(tmp_path: Path) -> None:
    gemma_scope_clt(tmp_path, L, N, D, config=False)
    (tmp_path / "params_layer_1.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"params_layer_N files for layers \[0, 2\]") as error:
        read_folder(tmp_path)
    assert "\n" not in str(error.value)


def test_the_attribution_graph_reads_the_folder_as_a_clt_of_its_model(lm_run: Path, tmp_path: Path) -> None:
    from experiments.sae.circuits.load import load_coders
    from runner.load import TRUSTED_TARGETS, load_trained

    gpt, _ = load_trained(lm_run)
    d, layers = gpt.head.weight.shape[1], len(gpt.blocks)
    tensors = gemma_scope_clt(tmp_path / "gs", layers, N, d)
    _config(tmp_path / "gs", model_name=str(lm_run))
    loaded = load_coders([tmp_path / "gs"], TRUSTED_TARGETS)
    assert loaded.meta["model"] == str(lm_run) and len(loaded.coders.layers) == layers
    for i, layer in enumerate(loaded.coders.layers):
        assert torch.equal(layer.coder.W_enc, tensors[i]["w_enc"]) and not layer.skip
        assert list(loaded.coders.writes_to(i)) == list(range(i, layers))
