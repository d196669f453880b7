"""Forged inputs, as an attacker or a broken download would hand them to runner: SAE folders of SAELens and sparsify
whose cfg.json or weights no tool wrote, a run folder whose config names a key its class does not take, and optimizer
settings that torch fails on mid-step or never finishes. Each is one paragraph and exit 2 (from Python: a
ConfigError), never a traceback, and leaves what it was given as it was and nothing behind. Text in a foreign
cfg.json is data: a resolver in it is never resolved into what the tools write."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import refused
from safetensors.torch import save_file

from experiments.sae.coders.base import SAE
from experiments.sae.evals.cli import main as sae_eval_main
from experiments.sae.formats import read_folder
from runner import ConfigError
from runner.load import load_model, load_trained
from runner.optimizers import Muon
from runner.tools.evaluate import main as evaluate_main
from runner.tools.export import main as export_main
from runner.tools.features import main as features_main
from runner.train import train

D, N = 32, 64  # the tiny GPT's width (helpers.TINY_LM), and the forged SAEs' latents
HOOK = "blocks.1.hook_resid_post"
CFG = {"d_in": D, "d_sae": N, "dtype": "float32", "architecture": "standard"}
CFG |= {"metadata": {"sae_lens_version": "6.0.0", "hook_name": HOOK, "model_name": "tiny-gpt"}}
LEGACY = {"d_in": D, "d_sae": N, "hook_point": HOOK, "model_name": "tiny-gpt"}  # before SAELens 6


def _weights(dtype: torch.dtype = torch.float32, **replaced: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "W_enc": torch.randn(D, N, generator=g),
        "b_enc": torch.zeros(N),
        "W_dec": torch.randn(N, D, generator=g),
    }
    tensors |= {"b_dec": torch.zeros(D), **replaced}
    return {name: t.to(dtype) for name, t in tensors.items()}


def _saelens(folder: Path, cfg: dict[str, Any] | str, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    save_file(tensors if tensors is not None else _weights(), str(folder / "sae_weights.safetensors"))
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _with(key: str, value: Any) -> dict[str, Any]:
    return {**CFG, "metadata": {**CFG["metadata"], key: value}}


# id: (cfg.json as a mapping or as text, tensors (None: a standard SAE's), what the message says)
FOLDERS: dict[str, tuple[Any, dict[str, torch.Tensor] | None, str]] = {
    "5000-digit-integer": ('{"d_in": 1' + "0" * 4999 + "}", None, r"a number of over 4300 digits is no SAE setting"),
    "json-nested-200k-deep": ('{"metadata": ' + "[" * 200_000 + "]" * 200_000 + "}", None, r"JSON nested too deep"),
    "float8-weights": (CFG, _weights(torch.float8_e4m3fn), r"W_\w+ is float8_e4m3fn, which runner's SAEs do not read"),
    "architecture-a-list": ({**CFG, "architecture": ["standard"]}, None, r"architecture=\['standard'\], where text"),
    "metadata-a-list": ({**CFG, "metadata": [HOOK]}, None, r"metadata=\['blocks.1.hook_resid_post'\], where a mapping"),
    "old-hook-point-a-list": ({**LEGACY, "hook_point": [HOOK]}, None, r": hook_point=\[.*\], where text"),
    "old-activation-kwargs-a-list": (
        {**LEGACY, "activation_fn_str": "topk", "activation_fn_kwargs": [4]},
        None,
        r"activation_fn_kwargs=\[4\], where a mapping",
    ),
    "old-normalize-a-list": ({**LEGACY, "normalize_activations": [True]}, None, r"normalize_activations=\[True\]"),
    "old-activation-not-relu-or-topk": (
        {**LEGACY, "activation_fn_str": "tanh-relu"},
        None,
        r"activation 'tanh-relu' is not read \(runner reads relu, topk\)",
    ),
    "transcoder-scalar-W_dec": (
        {**CFG, "architecture": "transcoder", "apply_b_dec_to_input": False},
        _weights(W_dec=torch.tensor(1.0)),
        r"W_dec is \[\], where a transcoder's is a matrix \[d_sae, d_out\]",
    ),
    "hook_name-a-number": (_with("hook_name", 6), None, r"metadata.hook_name=6, where text \(or nothing\) is needed"),
    "hook_name-a-list": (_with("hook_name", [HOOK]), None, r"metadata.hook_name=\['blocks.1.hook_resid_post'\]"),
    "context_size-text": (_with("context_size", "128"), None, r"metadata.context_size='128', where a whole number"),
    "flag-as-text": ({**CFG, "apply_b_dec_to_input": "false"}, None, r"apply_b_dec_to_input='false', where true/false"),
    "cfg-json-of-2-MB": ({**CFG, "pad": "x" * (2 << 20)}, None, r"2,09\d,\d{3} bytes, no cfg.json of SAE settings"),
    "jumprelu-negative-thresholds": (
        {**CFG, "architecture": "jumprelu"},
        _weights(threshold=-torch.ones(N)),
        r"threshold has negative entries; a JumpReLU's thresholds are >= 0",
    ),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_forged_saelens_folder_is_a_config_error_naming_the_file(case: str, tmp_path: Path) -> None:
    cfg, tensors, message = FOLDERS[case]
    folder = _saelens(tmp_path / "sae", cfg, tensors)
    before = _files(folder)
    with pytest.raises(ConfigError, match=message) as caught:
        read_folder(folder)
    assert str(folder) in str(caught.value) and len(str(caught.value).splitlines()) == 1
    with pytest.raises(ConfigError, match=message):
        SAE.load_from_disk(folder)  # as SAELens and sparsify spell it
    assert _files(folder) == before  # read, never written


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"transcode": "yes"}, r"transcode='yes', where true/false"),
        ({"num_latents": -8}, r"num_latents=-8, where a whole number >= 1"),
        ({"d_in": 10**400}, r"d_in=1000000000000000000000000000000000000000\.\.\. \(401 characters\)"),
    ],
)
def test_a_forged_sparsify_folder_is_a_config_error(cfg: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        read_folder(_sparsify(tmp_path / "layers.1", cfg))


def _sparsify(folder: Path, cfg: dict[str, Any]) -> Path:
    folder.mkdir()
    (folder / "cfg.json").write_text(json.dumps({"activation": "topk", "num_latents": N, "k": 4, "d_in": D, **cfg}))
    w = _weights()
    tensors = {"encoder.weight": w["W_enc"].T.contiguous(), "encoder.bias": w["b_enc"], "W_dec": w["W_dec"]}
    save_file({**tensors, "b_dec": w["b_dec"]}, str(folder / "sae.safetensors"))
    return folder


def test_an_old_standard_sae_with_a_topk_activation_is_read_as_topk(tmp_path: Path) -> None:
    # SAELens before 6 kept "standard" and applied activation_fn_str: read as ReLU it would give other codes
    cfg = {**LEGACY, "architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3}}
    sae, facts = read_folder(_saelens(tmp_path / "sae", cfg))
    assert type(sae).__name__ == "TopKSAE" and sae.k == 3 and facts["hook"] == HOOK
    assert int((sae.encode(torch.randn(5, D)) > 0).sum(1).max()) <= 3


# ---- through the tools: one paragraph, exit 2, nothing written --------------------------------------------------
@pytest.mark.parametrize("case", ["5000-digit-integer", "float8-weights", "hook_name-a-list", "context_size-text"])
@pytest.mark.parametrize("tool", ["sae_eval", "features", "evaluate"])
def test_the_tools_refuse_a_forged_folder_in_one_paragraph(
    case: str, tool: str, lm_run: Path, tmp_path, capsys
) -> None:
    cfg, tensors, message = FOLDERS[case]
    folder = _saelens(tmp_path / "sae", cfg, tensors)
    before = _files(folder)
    main = {"sae_eval": sae_eval_main, "features": features_main, "evaluate": evaluate_main}[tool]
    refused(main, [str(folder), f"source={lm_run}"], capsys, message)
    assert _files(folder) == before  # no evals/, features/ or eval-val.json


def test_hook_on_a_folder_of_one_sae_is_refused_unless_it_is_that_sae_s(lm_run: Path, tmp_path: Path, capsys) -> None:
    folder = _saelens(tmp_path / "sae", CFG)
    before = _files(folder)
    err = refused(sae_eval_main, [str(folder), f"source={lm_run}", "hook=blocks.0.hook_resid_post"], capsys, "hook=")
    assert f"holds one SAE, of the hook point '{HOOK}'" in err and "leave hook= out (module=MODULE" in err
    assert _files(folder) == before
    sae, cfg = load_model(folder, attach={"source": str(lm_run), "hook": HOOK})  # its own: the same SAE
    assert cfg.source.module == "blocks.1"
    with pytest.raises(ConfigError, match="whose folder names no hook point"):
        read_folder(_saelens(tmp_path / "nameless", {**CFG, "metadata": {"sae_lens_version": "6"}}), hook="x")
    # one folder of a sparsify run, named by its hook point: hook= may say that name, no other
    one = _sparsify(tmp_path / "layers.1", {})
    assert read_folder(one, hook="layers.1")[1]["hook"] == "layers.1"
    with pytest.raises(ConfigError, match=r"hook=layers.0: .* holds one SAE, of the hook point 'layers.1'"):
        read_folder(one, hook="layers.0")


def _found(node: Any, text: str) -> bool:
    if isinstance(node, dict):
        return any(_found(v, text) for v in node.values())
    if isinstance(node, list):
        return any(_found(v, text) for v in node)
    return node == text


def test_a_resolver_in_a_foreign_cfg_json_is_never_resolved_into_the_outputs(
    lm_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    secret = "hf_SECRET-not-for-any-output-31337"
    monkeypatch.setenv("RUNNER_TEST_SECRET", secret)
    # an unknown resolver, and a backslash that OmegaConf would read as escaping itself before an interpolation
    model, unknown = "${oc.env:RUNNER_TEST_SECRET}", "${nope:x} \\${oc.env:RUNNER_TEST_SECRET}"
    meta = {**CFG["metadata"], "model_name": model, "model_class_name": unknown}
    folder = _saelens(tmp_path / "sae", {**CFG, "metadata": meta})
    _, cfg = load_model(folder, attach={"source": str(lm_run)})
    assert cfg.imported.model == model and cfg.imported.model_class == unknown  # the folder's text, as written
    out = tmp_path / "outputs"
    assert sae_eval_main([str(folder), f"source={lm_run}", "evals=[core]", "--limit", f"out={out / 'evals'}"]) == 0
    assert features_main([str(folder), f"source={lm_run}", "tokens=300", "top=2", f"out={out / 'pages'}"]) == 0
    assert evaluate_main([str(folder), f"source={lm_run}"]) == 0
    capsys.readouterr()
    written = {**_files(out), "eval-val.json": (folder / "eval-val.json").read_bytes()}
    assert len(written) >= 5
    for name, data in written.items():
        assert secret.encode() not in data, name
    assert _found(json.loads((out / "evals" / "eval.json").read_text()), model)  # quoted as plain data


# ---- a forged run folder: a key its class does not take ---------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "where"), [("data", "experiments.sae.sources.hooked.LiveActivations"), ("model", "TopKSAE")]
)
def test_a_run_whose_config_has_a_key_its_class_does_not_take_is_refused(
    key: str, where: str, sae_lm_run: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "forged"
    shutil.copytree(sae_lm_run, run)
    config = run / ".hydra" / "config.yaml"
    text = ("\n" + config.read_text()).replace(f"\n{key}:\n", f"\n{key}:\n  planted: 1\n", 1)
    config.write_text(text[1:])
    before = _files(run)
    message = rf"config.yaml cannot be rebuilt: {key}.planted is not a parameter of \S*{where}"
    with pytest.raises(ConfigError, match=message):
        load_trained(run)
    refused(export_main, [str(run), "format=saelens"], capsys, message)
    refused(evaluate_main, [str(run)], capsys, message)
    refused(features_main, [str(run), "tokens=300"], capsys, message)
    assert _files(run) == before  # no export-saelens/, eval-val.json or features/


# ---- optimizer settings: refused before the run folder is made ---------------------------------------------------
DIGITS = ["+experiment=digits", "logger=none", "trainer.max_duration=2st"]
OPTIMIZERS = {
    "lr_scale-a-list": (["+optimizer.lr_scale=[1,2]"], "optimizer.lr_scale must map parameter names to multiples"),
    "lr_scale-text": (["+optimizer.lr_scale=abc"], "optimizer.lr_scale must map parameter names"),
    "lr_scale-a-number-key": (["+optimizer.lr_scale={1:0.5}"], "optimizer.lr_scale must map parameter names"),
    "adam_betas-above-one": (
        ["optimizer=muon", "optimizer.adam_betas=[2,3]"],
        "optimizer.adam_betas must be two numbers in [0, 1) (the moving averages' decay rates), got [2,3]",
    ),
    "adam_beta-of-one": (["optimizer=muon", "optimizer.adam_betas=[0.9,1.0]"], "optimizer.adam_betas must be two"),
    "adam_eps-negative": (["optimizer=muon", "+optimizer.adam_eps=-1"], "optimizer.adam_eps must be a finite number"),
    "adam_eps-zero": (["optimizer=muon", "+optimizer.adam_eps=0"], "optimizer.adam_eps must be > 0: with 0, every"),
    "eps-zero": (["+optimizer.eps=0"], "optimizer.eps must be > 0: with 0, every weight whose gradient is 0 becomes"),
    "ns_steps-a-million": (
        ["optimizer=muon", "optimizer.ns_steps=1000000"],
        "optimizer.ns_steps must be a whole number in [1, 99] (Newton-Schulz steps per update; 5 orthogonalise well, "
        "and torch's Muon refuses 100 or more), got 1000000: e.g. optimizer.ns_steps=5",
    ),
    "ns_steps-100": (["optimizer=muon", "optimizer.ns_steps=100"], "optimizer.ns_steps must be a whole number in"),
    "ns_steps-0": (["optimizer=muon", "optimizer.ns_steps=0"], "optimizer.ns_steps must be a whole number in [1, 99]"),
    "ns_coefficient-nan": (
        ["optimizer=muon", "+optimizer.ns_coefficients=[nan,-4.775,2.0315]"],
        "optimizer.ns_coefficients must be three finite numbers",
    ),
    "muon-momentum-of-one": (["optimizer=muon", "optimizer.momentum=1"], "optimizer.momentum must be a finite number"),
}


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_an_optimizer_setting_torch_fails_on_is_refused_at_config_time(
    case: str, compose_cfg: Callable, tmp_path: Path
) -> None:
    overrides, message = OPTIMIZERS[case]
    with pytest.raises(ConfigError) as caught:
        train(compose_cfg(*DIGITS, *overrides))
    assert message in str(caught.value) and len(str(caught.value).splitlines()) == 1, caught.value
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps", [1, 99])
def test_muon_takes_every_ns_steps_from_1_to_99(steps: int) -> None:
    p = torch.randn(4, 3, requires_grad=True)
    p.grad = torch.randn(4, 3)
    before = p.detach().clone()
    Muon([p], lr=0.1, ns_steps=steps).step()
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), before)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ns_steps": 0}, r"ns_steps must be a whole number in \[1, 99\], got 0"),
        ({"ns_steps": 10**6}, r"ns_steps must be a whole number in \[1, 99\], got 1000000"),
        ({"ns_coefficients": (float("nan"), 1.0, 1.0)}, r"3 finite ns_coefficients"),
        ({"adam_betas": (2.0, 3.0)}, r"two adam_betas in \[0, 1\).*adam_betas=\(2.0, 3.0\)"),
        ({"adam_eps": -1.0}, r"adam_eps=-1.0"),
        ({"eps": 0.0}, r"0 < eps <= 1; got .*eps=0.0"),
    ],
)
def test_muon_refuses_what_it_cannot_step_with(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Muon([torch.zeros(2, 2, requires_grad=True)], lr=0.1, **options)


@pytest.mark.parametrize("case", ["ns_steps-a-million", "lr_scale-a-list", "adam_betas-above-one"])
def test_the_command_exits_2_and_leaves_no_run_folder(
    case: str, run_cli: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "earlier").mkdir(parents=True)  # an earlier run's: kept
    overrides, message = OPTIMIZERS[case]
    code, err = run_cli(*DIGITS, *overrides)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["outputs", "outputs/earlier"]
