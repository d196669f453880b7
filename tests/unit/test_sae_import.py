"""SAE folders of SAELens and sparsify in runner's tools (experiments/sae/formats/): a runner SAE
written as a SAELens folder and read back with its source model is evaluated to the same metrics as the run itself
(reconstruction and splicing), the hook point names the module in runner GPTs and transformers models alike, and a
corrupt or foreign folder is one clear error (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from experiments.sae.formats import export, module_for, read_folder
from runner import ConfigError
from runner.load import load_model, load_trained
from runner.tools.evaluate import evaluate_run
from runner.tools.evaluate import main as evaluate_main
from runner.tools.features import main as features_main


@pytest.fixture(scope="module")
def exported(sae_lm_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished SAE on the tiny GPT's block 1, and the same SAE written as a SAELens folder."""
    run = sae_lm_run
    sae, _ = load_trained(run)
    folder = tmp_path_factory.mktemp("export") / "saelens"
    export(sae, "saelens", folder, hook="blocks.1", model="tiny-gpt")
    return run, folder


def test_an_exported_sae_read_back_with_its_model_evaluates_as_the_run(exported: tuple[Path, Path], lm_run) -> None:
    run, folder = exported
    sae, cfg = load_model(folder, attach={"source": str(lm_run)})
    assert cfg.source.module == "blocks.1" and cfg.source.skip_positions == 1  # from blocks.1.hook_resid_post
    assert cfg.imported.model == "tiny-gpt" and cfg.imported.architecture == "topk"
    ours, theirs = evaluate_run(run)["metrics"], evaluate_run(folder, attach={"source": str(lm_run)})["metrics"]
    for key in ("val/fve", "val/mse", "val/l0", "val/ce_clean", "val/ce_spliced", "val/kl_spliced"):
        assert theirs[key] == pytest.approx(ours[key], rel=1e-5, abs=1e-6), key
    assert (folder / "eval-val.json").is_file()


def test_features_and_evaluate_take_an_sae_folder_on_the_command_line(exported, lm_run, tmp_path, capsys) -> None:
    _, folder = exported
    assert features_main([str(folder), f"source={lm_run}", "tokens=300", "top=2", f"out={tmp_path / 'pages'}"]) == 0
    assert (tmp_path / "pages" / "index.html").is_file()
    assert evaluate_main([str(folder), f"source={lm_run}", "module=blocks.0"]) == 0  # module= names another
    # without the model it reads: told what the folder says, and what to give
    assert evaluate_main([str(folder)]) == 2
    assert (
        "saelens SAE (hook point blocks.1.hook_resid_post, trained on tiny-gpt): give the model"
        in capsys.readouterr().err
    )
    assert evaluate_main([str(folder), f"source={lm_run}", "module=blocks.9"]) == 2
    err = capsys.readouterr().err  # the nearest names, not the model's whole list
    assert "module=blocks.9 is not a module of the source model: the nearest of its 22 are blocks.1, blocks.0," in err
    assert len(err) < 200


def test_a_runner_run_takes_no_attach_options(exported, lm_run) -> None:
    run, _ = exported
    with pytest.raises(ConfigError, match="source=: for an SAE folder of SAELens or sparsify"):
        load_model(run, attach={"source": str(lm_run)})


GPT = ["", "embed", "blocks", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.mlp", "head"]
HF = ["", "transformer", "transformer.h", "transformer.h.0", "transformer.h.0.mlp", "transformer.h.0.attn"]
HF += ["transformer.h.1", "transformer.h.1.mlp", "transformer.h.1.attn", "lm_head"]
LLAMA = ["", "model", "model.layers", "model.layers.0", "model.layers.0.mlp", "model.layers.0.self_attn"]


@pytest.mark.parametrize(
    ("hook", "modules", "module"),
    [
        ("blocks.1.hook_resid_post", GPT, "blocks.1"),
        ("blocks.1.hook_resid_pre", GPT, "blocks.0"),
        ("blocks.0.hook_resid_pre", GPT, None),  # the embedding's output: no module gives it
        ("blocks.0.hook_mlp_out", GPT, "blocks.0.mlp"),
        ("blocks.1.hook_resid_post", HF, "transformer.h.1"),
        ("blocks.1.hook_attn_out", HF, "transformer.h.1.attn"),
        ("blocks.0.hook_attn_out", LLAMA, "model.layers.0.self_attn"),
        ("h.1", HF, "transformer.h.1"),  # sparsify's names, relative to the model's base
        ("layers.0.mlp", LLAMA, "model.layers.0.mlp"),
        ("model.layers.0", LLAMA, "model.layers.0"),  # SAELens's metadata for a transformers model
        ("mlp", HF, None),  # several fit: none is guessed
        ("blocks.5.hook_resid_post", GPT, None),
    ],
)
def test_hook_points_name_the_module_whose_output_they_are(hook: str, modules: list[str], module: str | None) -> None:
    assert module_for(hook, modules) == module


def _folder(tmp_path: Path, cfg: dict, tensors: dict[str, torch.Tensor], name: str = "sae_weights.safetensors") -> Path:
    folder = tmp_path / "sae"
    folder.mkdir(exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / name))
    return folder


STANDARD = {"W_enc": torch.randn(4, 8), "b_enc": torch.zeros(8), "W_dec": torch.randn(8, 4), "b_dec": torch.zeros(4)}
CFG = {"d_in": 4, "d_sae": 8, "dtype": "float32", "architecture": "standard", "metadata": {"sae_lens_version": "6.0"}}


@pytest.mark.parametrize(
    ("cfg", "tensors", "message"),
    [
        ({**CFG, "architecture": "abstopk"}, STANDARD, "architecture 'abstopk' is not read"),
        ({**CFG, "architecture": "batchtopk"}, STANDARD, "SAELens saves the finished SAE as jumprelu"),
        ({**CFG, "normalize_activations": "layer_norm"}, STANDARD, "rescales each token on its own"),
        ({**CFG, "reshape_activations": "hook_z"}, STANDARD, "attention heads' z"),
        ({**CFG, "d_sae": 9}, STANDARD, "W_enc is \\[4, 8\\], where its cfg.json makes it \\[4, 9\\]"),
        (CFG, {**STANDARD, "extra": torch.zeros(2)}, "tensors \\['extra'\\] are not of a SAELens standard SAE"),
        (CFG, {k: v for k, v in STANDARD.items() if k != "b_enc"}, "no tensor 'b_enc'"),
        (CFG, {**STANDARD, "b_dec": torch.full((4,), float("nan"))}, "non-finite"),
        ({**CFG, "d_in": "4"}, STANDARD, "d_in='4', where a whole number >= 1 is needed"),
    ],
)
def test_a_foreign_or_broken_saelens_folder_is_refused_by_name(tmp_path, cfg, tensors, message) -> None:
    with pytest.raises(ConfigError, match=message):
        read_folder(_folder(tmp_path, cfg, tensors))


def test_a_corrupt_folder_is_one_error_and_exit_2(tmp_path: Path, capsys) -> None:
    folder = _folder(tmp_path, CFG, STANDARD)
    (folder / "sae_weights.safetensors").write_bytes(b"\x00" * 40)
    assert evaluate_main([str(folder), "source=whatever"]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    (folder / "cfg.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        read_folder(folder)
    for name in ("sae_weights.safetensors", "cfg.json"):
        (folder / name).unlink()
    (tmp_path / "sae" / "a").mkdir()
    with pytest.raises(ConfigError, match="has no cfg.json"):
        read_folder(folder)


def test_a_legacy_saelens_cfg_is_read_as_saelens_reads_it(tmp_path: Path) -> None:
    # before SAELens 6: hook_point, activation_fn_str topk with its k in activation_fn_kwargs
    cfg = {"d_in": 4, "d_sae": 8, "hook_point": "blocks.0.hook_resid_post", "activation_fn_str": "topk"}
    cfg |= {"activation_fn_kwargs": {"k": 2}, "model_name": "gpt2", "normalize_activations": False}
    sae, facts = read_folder(_folder(tmp_path, cfg, STANDARD))
    assert type(sae).__name__ == "TopKSAE" and sae.k == 2
    assert facts["hook"] == "blocks.0.hook_resid_post" and facts["model"] == "gpt2"


def test_sparsify_folders_and_runs(tmp_path: Path) -> None:
    cfg = {"activation": "topk", "num_latents": 0, "expansion_factor": 2, "k": 3, "d_in": 4}
    weights = {"encoder.weight": torch.randn(8, 4), "encoder.bias": torch.zeros(8), "W_dec": torch.randn(8, 4)}
    weights["b_dec"] = torch.randn(4)
    run = tmp_path / "run"
    for hook in ("layers.0", "layers.1"):
        (run / hook).mkdir(parents=True)
        (run / hook / "cfg.json").write_text(json.dumps(cfg))
        save_file(weights, str(run / hook / "sae.safetensors"))
    with pytest.raises(ConfigError, match=r"several hook points \['layers.0', 'layers.1'\]: pick one, e.g. hook="):
        read_folder(run)
    sae, facts = read_folder(run, hook="layers.1")
    x = torch.randn(5, 4)
    pre = torch.relu((x - weights["b_dec"]) @ weights["encoder.weight"].T)  # sparsify's: ReLU, then the top k
    values, indices = pre.topk(3, dim=1)
    want = torch.zeros(5, 8).scatter(1, indices, values) @ weights["W_dec"] + weights["b_dec"]
    torch.testing.assert_close(sae(x), want)
    assert facts["hook"] == "layers.1" and sae.n_latents == 8
    (run / "layers.0" / "cfg.json").write_text(json.dumps({**cfg, "activation": "groupmax"}))
    with pytest.raises(ConfigError, match="activation 'groupmax'; runner reads sparsify's top-k coders only"):
        read_folder(run, hook="layers.0")
