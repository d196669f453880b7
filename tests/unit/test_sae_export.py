"""runner.tools.export: SAEs and transcoders in SAELens's and sparsify's folder layouts, on raw activations,
reconstructing (predicting) as runner does.

The targets' inference is written out here from their sources (SAELens 6.54: topk = ReLU of the top k of
(x - b_dec) W_enc + b_enc, jumprelu = ReLU(pre) where pre > threshold, standard = ReLU(pre), then codes @ W_dec + b_dec;
its transcoders leave b_dec out of pre (apply_b_dec_to_input false) and the skip ones add x @ W_skip.T; sparsify 1.3:
the top k of ReLU(encoder(x - b_dec)), a transcoder's of ReLU(encoder(x)), plus x @ W_skip.mT with skip_connection);
tests/e2e/test_sae_peers_load.py loads the same folders with the real packages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SAE_LM, finished_run
from safetensors.torch import load_file

from experiments.sae.coders.activations import BatchTopKSAE, ReLUSAE, TopKSAE
from experiments.sae.coders.base import SAE
from experiments.sae.coders.jumprelu import JumpReLUSAE
from experiments.sae.coders.matryoshka import MatryoshkaSAE
from experiments.sae.formats import export
from runner import ConfigError
from runner.tools.export import main

D, N = 16, 64


def _trained_like(make: type, **kwargs) -> torch.nn.Module:
    # random weights with every part that the export moves: an input scale far from 1 (a transcoder's target scale
    # another), biases, thresholds, a skip connection
    torch.manual_seed(0)
    sae = make(d_in=D, n_latents=N, **kwargs)
    with torch.no_grad():
        sae.input_scale.fill_(0.37)
        sae.b_enc.copy_(torch.randn(N) * 0.1)
        sae.b_dec.copy_(torch.randn(sae.d_out))
        if isinstance(sae, JumpReLUSAE):
            sae.threshold.copy_(torch.rand(N) * 0.3)
        if isinstance(sae, BatchTopKSAE):
            sae.threshold.fill_(0.2)
        if sae.transcoder:
            sae.target_scale.fill_(1.9)
        if sae.skip:
            sae.W_skip.copy_(torch.randn(D, sae.d_out) * 0.2)
    return sae.eval()


def _saelens_forward(folder: Path, x: torch.Tensor) -> torch.Tensor:
    cfg, w = json.loads((folder / "cfg.json").read_text()), load_file(str(folder / "sae_weights.safetensors"))
    centred = x - w["b_dec"] if cfg["apply_b_dec_to_input"] else x  # a transcoder's b_dec is the target's
    pre = centred @ w["W_enc"] + w["b_enc"]
    if cfg["architecture"] == "topk":
        values, indices = pre.topk(cfg["k"], dim=-1)
        codes = torch.zeros_like(pre).scatter(-1, indices, values.relu())
    elif cfg["architecture"].startswith("jumprelu"):
        codes = pre.relu() * (pre > w["threshold"])
    else:
        codes = pre.relu()
    skip = x @ w["W_skip"].T if "skip_transcoder" in cfg["architecture"] else 0.0
    return codes @ w["W_dec"] + w["b_dec"] + skip


def _sparsify_forward(folder: Path, x: torch.Tensor) -> torch.Tensor:
    cfg, w = json.loads((folder / "cfg.json").read_text()), load_file(str(folder / "sae.safetensors"))
    centred = x if cfg["transcode"] else x - w["b_dec"]
    pre = torch.nn.functional.linear(centred, w["encoder.weight"], w["encoder.bias"]).relu()
    values, indices = pre.topk(cfg["k"], dim=-1)
    skip = x @ w["W_skip"].mT if cfg["skip_connection"] else 0.0
    return torch.zeros_like(pre).scatter(-1, indices, values) @ w["W_dec"] + w["b_dec"] + skip


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


# SAELens's transcoders: every architecture but top-k, from width D to 24, with and without a skip connection
TRANSCODERS = [(case, skip) for case in CASES if CASES[case][2] != "topk" for skip in (False, True)]


@pytest.mark.parametrize(("case", "skip"), TRANSCODERS)
def test_the_saelens_export_of_a_transcoder_predicts_the_raw_target_as_runner_does(
    case: str, skip: bool, tmp_path: Path
) -> None:
    make, kwargs, kind = CASES[case]
    sae = _trained_like(make, d_out=24, skip=skip, **kwargs)
    x = torch.randn(256, D) * 3 + 1
    export(sae, "saelens", tmp_path, "blocks.2.mlp_norm", "outputs/lm", target="blocks.2.mlp")
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    expected = {"standard": "transcoder", "jumprelu": "jumprelu_transcoder"}[kind]
    assert cfg["architecture"] == (expected.replace("transcoder", "skip_transcoder") if skip else expected)
    assert (cfg["d_in"], cfg["d_sae"], cfg["d_out"], cfg["apply_b_dec_to_input"]) == (D, N, 24, False)
    assert cfg["metadata"]["hook_name"] == "blocks.2.mlp_norm" and cfg["metadata"]["hook_name_out"] == "blocks.2.mlp"
    weights = load_file(str(tmp_path / "sae_weights.safetensors"))
    assert weights["W_enc"].shape == (D, N) and weights["W_dec"].shape == (N, 24) and weights["b_dec"].shape == (24,)
    assert ("W_skip" in weights) == skip and (not skip or weights["W_skip"].shape == (24, D))
    with torch.no_grad():
        ours = sae(x)
        assert (sae.encode(x) > 0).sum() > 0
    torch.testing.assert_close(_saelens_forward(tmp_path, x), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["topk", "matryoshka-topk"])
@pytest.mark.parametrize("skip", [False, True])
def test_the_sparsify_export_of_a_transcoder_predicts_the_raw_target_as_runner_does(
    case: str, skip: bool, tmp_path: Path
) -> None:
    make, kwargs, _ = CASES[case]
    sae = _trained_like(make, d_out=D, skip=skip, **kwargs)  # sparsify's coders write their input's width
    x = torch.randn(256, D) * 3 + 1
    export(sae, "sparsify", tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert (cfg["transcode"], cfg["skip_connection"], cfg["d_in"], cfg["num_latents"]) == (True, skip, D, N)
    weights = load_file(str(tmp_path / "sae.safetensors"))
    assert ("W_skip" in weights) == skip and (not skip or weights["W_skip"].shape == (D, D))
    torch.testing.assert_close(weights["W_dec"], sae.W_dec.detach())  # unit norm: the codes took the target scale
    with torch.no_grad():
        torch.testing.assert_close(_sparsify_forward(tmp_path, x), sae(x), rtol=1e-4, atol=1e-4)


def test_a_transcoder_neither_format_has_a_class_for_is_refused_naming_the_one_that_has(tmp_path: Path) -> None:
    square, wide = _trained_like(TopKSAE, k=4, d_out=D), _trained_like(TopKSAE, k=4, d_out=24)
    with pytest.raises(ConfigError, match=r"SAELens has no top-k transcoder \(TopKSAE\): --format sparsify$"):
        export(square, "saelens", tmp_path / "a")
    with pytest.raises(ConfigError, match="SAELens has no top-k transcoder .*neither format takes one from width 16"):
        export(wide, "saelens", tmp_path / "b")
    with pytest.raises(ConfigError, match="neither format takes TopKSAE, a top-k transcoder from width 16 to 24"):
        export(wide, "sparsify", tmp_path / "c")
    with pytest.raises(ConfigError, match="sparsify has top-k SAEs only.*--format saelens"):
        export(_trained_like(JumpReLUSAE, d_out=D, skip=True), "sparsify", tmp_path / "d")
    assert not any(tmp_path.iterdir())


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


def test_an_exported_run_names_its_hook_point_and_model_as_saelens_and_sparsify_read_them(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path
) -> None:
    # runner.tools.export rebuilds the run (load_trained), whose config keeps the source inside its data: the metadata
    # must still name the hooked module and the source model, so that a user can attach the export to the model
    assert main([str(sae_lm_run), "--format", "saelens", "--out", str(tmp_path / "one")]) == 0
    metadata = json.loads((tmp_path / "one" / "cfg.json").read_text())["metadata"]
    # the source named by its folder's name, never a local path (tests/unit/test_publish_names.py)
    assert (metadata["hook_name"], metadata["model_name"]) == ("blocks.1.hook_resid_post", lm_run.name)
    # several hooked modules (model=sae_multi): each SAE's folder names its own
    family = tmp_path / "family"
    family.mkdir()
    overrides = [o for o in SAE_LM if not o.startswith("model.")] + ["model=sae_multi", "model.ks=[4]"]
    overrides += ["model.base.n_latents=32", "source.module=[blocks.0,blocks.1]"]
    finished_run(family, "+experiment=sae_lm", f"source.checkpoint={lm_run}", *overrides)
    assert main([str(family), "--format", "saelens", "--out", str(tmp_path / "many")]) == 0
    hooks = {
        folder.name: json.loads((folder / "cfg.json").read_text())["metadata"]["hook_name"]
        for folder in (tmp_path / "many").iterdir()
    }
    assert sorted(hooks.values()) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"], hooks


def test_a_hugging_face_repository_folder_holds_saelens_folders_and_a_model_card(
    sae_lm_run: Path, lm_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(sae_lm_run, run)
    summary = {"progress": {"step": 8, "samples": 512}, "metrics": {"val/fve": 0.8123, "val/l0": 4.0}}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main([str(run), "format=hf", f"out={tmp_path / 'repo'}"]) == 0
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "blocks.1.hook_resid_post"]
    card = (repo / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: saelens\ntags:\n- sparse-autoencoder\n")
    assert f"# run: sparse autoencoders of {lm_run.name}" in card and "(8 steps, 512 samples)" in card
    assert f"Data: activations of `blocks.1` of `{lm_run.name}`" in card
    row = "| `blocks.1.hook_resid_post` | topk | `blocks.1.hook_resid_post` | 32 | 64 | 4 | 0.8123 | 4 | - | - | - |"
    assert row in card, card
    sae = SAE.load_from_disk(repo / "blocks.1.hook_resid_post")  # as a clone of the repository is loaded
    assert (sae.d_in, sae.n_latents, sae.k) == (32, 64, 4)
    # a family: one repository, a folder per SAE named by its hook point, one card over them all
    family = tmp_path / "family"
    family.mkdir()
    overrides = [o for o in SAE_LM if not o.startswith("model.")] + ["model=sae_multi", "model.ks=[4]"]
    overrides += ["model.base.n_latents=32", "source.module=[blocks.0,blocks.1]"]
    finished_run(family, "+experiment=sae_lm", f"source.checkpoint={lm_run}", *overrides)
    assert main([str(family), "format=hf", f"out={tmp_path / 'many'}"]) == 0
    folders = sorted(p.name for p in (tmp_path / "many").iterdir())
    assert folders == ["README.md", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"], folders
    card = (tmp_path / "many" / "README.md").read_text()
    assert [line.split(" | ")[0] for line in card.splitlines() if line.startswith("| `blocks.")] == [
        "| `blocks.0.hook_resid_post`",
        "| `blocks.1.hook_resid_post`",
    ]
