"""runner.export: SAEs in SAELens's and sparsify's folder layouts, on raw activations, reconstructing as runner does.

The targets' inference is written out here from their sources (SAELens 6.54: topk = ReLU of the top k of
(x - b_dec) W_enc + b_enc, jumprelu = ReLU(pre) where pre > threshold, standard = ReLU(pre); sparsify 1.3: the top k
of ReLU(encoder(x - b_dec))); tests/e2e/test_sae_peers_load.py loads the same folders with the real packages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import finished_run
from safetensors.torch import load_file

from experiments.sae.export import export
from experiments.sae.jumprelu import JumpReLUSAE
from experiments.sae.matryoshka import MatryoshkaSAE
from experiments.sae.model import BatchTopKSAE, ReLUSAE, TopKSAE
from runner import ConfigError
from runner.export import main

D, N = 16, 64


def _trained_like(make: type, **kwargs) -> torch.nn.Module:
    # random weights with every part that the export moves: an input scale far from 1, biases, thresholds
    torch.manual_seed(0)
    sae = make(d_in=D, n_latents=N, **kwargs)
    with torch.no_grad():
        sae.input_scale.fill_(0.37)
        sae.b_enc.copy_(torch.randn(N) * 0.1)
        sae.b_dec.copy_(torch.randn(D))
        if isinstance(sae, JumpReLUSAE):
            sae.threshold.copy_(torch.rand(N) * 0.3)
        if isinstance(sae, BatchTopKSAE):
            sae.threshold.fill_(0.2)
    return sae.eval()


def _saelens_forward(folder: Path, x: torch.Tensor) -> torch.Tensor:
    cfg, w = json.loads((folder / "cfg.json").read_text()), load_file(str(folder / "sae_weights.safetensors"))
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    if cfg["architecture"] == "topk":
        values, indices = pre.topk(cfg["k"], dim=-1)
        codes = torch.zeros_like(pre).scatter(-1, indices, values.relu())
    elif cfg["architecture"] == "jumprelu":
        codes = pre.relu() * (pre > w["threshold"])
    else:
        codes = pre.relu()
    return codes @ w["W_dec"] + w["b_dec"]


def _sparsify_forward(folder: Path, x: torch.Tensor) -> torch.Tensor:
    cfg, w = json.loads((folder / "cfg.json").read_text()), load_file(str(folder / "sae.safetensors"))
    pre = torch.nn.functional.linear(x - w["b_dec"], w["encoder.weight"], w["encoder.bias"]).relu()
    values, indices = pre.topk(cfg["k"], dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, values) @ w["W_dec"] + w["b_dec"]


CASES = {
    "topk": (TopKSAE, {"k": 4}, "topk"),
    "batchtopk": (BatchTopKSAE, {"k": 4}, "jumprelu"),
    "matryoshka-batchtopk": (MatryoshkaSAE, {"k": 4}, "jumprelu"),
    "matryoshka-topk": (MatryoshkaSAE, {"k": 4, "activation": "topk"}, "topk"),
    "jumprelu": (JumpReLUSAE, {}, "jumprelu"),
    "relu": (ReLUSAE, {}, "standard"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_saelens_export_reconstructs_raw_activations_as_runner_does(case: str, tmp_path: Path) -> None:
    make, kwargs, kind = CASES[case]
    sae = _trained_like(make, **kwargs)
    x = torch.randn(256, D) * 3 + 1
    export(sae, "saelens", tmp_path, "blocks.2", "outputs/lm")
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["architecture"] == kind and (cfg["d_in"], cfg["d_sae"]) == (D, N)
    assert cfg["normalize_activations"] == "none" and cfg["metadata"]["hook_name"] == "blocks.2.hook_resid_post"
    with torch.no_grad():
        ours = sae(x)
        assert (sae.encode(x) > 0).sum() > 0  # codes fire: the comparison is not between zeros
    torch.testing.assert_close(_saelens_forward(tmp_path, x), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["topk", "matryoshka-topk"])
def test_the_sparsify_export_reconstructs_raw_activations_as_runner_does(case: str, tmp_path: Path) -> None:
    make, kwargs, _ = CASES[case]
    sae = _trained_like(make, **kwargs)
    x = torch.randn(256, D) * 3 + 1
    export(sae, "sparsify", tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert (cfg["d_in"], cfg["num_latents"], cfg["k"], cfg["activation"]) == (D, N, 4, "topk")
    weights = load_file(str(tmp_path / "sae.safetensors"))
    assert weights["encoder.weight"].shape == (N, D) and weights["W_dec"].shape == (N, D)
    # the decoder rows stay as trained (unit norm): the input scale went into the codes
    torch.testing.assert_close(weights["W_dec"], sae.W_dec.detach())
    with torch.no_grad():
        torch.testing.assert_close(_sparsify_forward(tmp_path, x), sae(x), rtol=1e-4, atol=1e-4)


def test_what_a_format_cannot_hold_is_refused_and_nothing_is_overwritten(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sparsify has top-k SAEs only.*--format saelens"):
        export(_trained_like(ReLUSAE), "sparsify", tmp_path / "relu")
    assert not (tmp_path / "relu").exists()
    with pytest.raises(ConfigError, match="--format onnx: give one of saelens, sparsify"):
        export(_trained_like(TopKSAE, k=4), "onnx", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already holds files"):
        export(_trained_like(TopKSAE, k=4), "saelens", tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["notes.txt"]


def test_the_command_exports_a_finished_run_and_says_why_not_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    small = ["trainer.max_duration=4st", "logger=none", "checkpoint=none"]
    (tmp_path / "sae").mkdir()
    finished_run(tmp_path / "sae", "+experiment=sae", "model.n_latents=64", "data.batch_size=64", *small)
    assert main([str(tmp_path / "sae"), "--format", "sparsify"]) == 0
    assert (tmp_path / "sae" / "export-sparsify" / "sae.safetensors").is_file()
    assert main([str(tmp_path / "sae" / "model.safetensors"), "--format", "saelens", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "cfg.json").read_text())["architecture"] == "topk"
    assert main([str(tmp_path / "sae"), "--format", "saelens", "--out", str(tmp_path / "o")]) == 2
    assert "already holds files" in capsys.readouterr().err
    (tmp_path / "digits").mkdir()
    finished_run(tmp_path / "digits", "+experiment=digits", *small)
    assert main([str(tmp_path / "digits"), "--format", "saelens"]) == 2
    assert "has no export" in capsys.readouterr().err
