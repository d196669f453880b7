"""finetune=lora: PEFT adapters on a trained tiny GPT; only they train, only they are saved, merge, exact resume."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_LM, assert_resume_is_exact, finished_run
from safetensors import safe_open

from runner import ConfigError
from runner.build import build
from runner.ckpt.files import ADAPTER, ADAPTERS_ONLY
from runner.ckpt.weights import read_weights
from runner.finetune import MERGED, merge
from runner.load import load_trained
from runner.log.console import ConsoleLogger
from runner.log.info import run_info

# find_spec, not importorskip: importing peft (and transformers) costs 2.2 s, paid by every collection otherwise
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the lora extra)")
SHORT = [*TINY_LM, "trainer.max_duration=8st"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny GPT run: the model the adapters fine-tune."""
    directory = tmp_path_factory.mktemp("base")
    finished_run(directory, *SHORT)
    return directory


@pytest.fixture(scope="module")
def lora_run(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A finished finetune=lora run on `base` (a higher learning rate, so the adapters move visibly)."""
    directory = tmp_path_factory.mktemp("lora")
    run = finished_run(directory, *SHORT, f"init_from={base}", "finetune=lora", "finetune.rank=4", "optimizer.lr=1e-2")
    return directory, run.task


def test_only_the_adapters_train_and_the_base_weights_stay_those_of_init_from(lora_run, base: Path) -> None:
    directory, task = lora_run
    trainable = {name for name, p in task.named_parameters() if p.requires_grad}
    assert trainable and all(ADAPTER in name for name in trainable)
    assert any(".qkv." in n for n in trainable) and any(".down." in n for n in trainable)
    base_weights = read_weights(base)
    for name, tensor in task.named_parameters():
        if ADAPTER not in name:  # PEFT renames a wrapped layer's weight to <module>.base_layer.weight
            assert torch.equal(tensor.detach(), base_weights[name.replace(".base_layer.", ".")]), name
    assert any(p.abs().sum() > 0 for n, p in task.named_parameters() if f"{ADAPTER}B" in n)  # B starts at zero


def test_the_optimizer_holds_only_the_adapters(base: Path, compose_cfg: Callable, capsys) -> None:
    cfg = compose_cfg(*SHORT, f"init_from={base}", "finetune=lora")
    run = build(cfg)
    held = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in run.task.named_parameters() if ADAPTER in n}
    # the startup table says how few of the parameters train, as LoRA users expect
    adapters = sum(p.numel() for n, p in run.task.named_parameters() if ADAPTER in n)
    info = run_info(run, cfg)
    assert info["trainable_parameters"] == adapters < info["parameters"]
    ConsoleLogger().start(info)
    assert f"trainable parameters      {adapters}" in capsys.readouterr().err


def test_model_safetensors_holds_only_the_adapters_and_says_so(lora_run) -> None:
    directory, task = lora_run
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        assert file.metadata() == ADAPTERS_ONLY
        keys = set(file.keys())
    assert keys == {n for n, _ in task.named_parameters() if ADAPTER in n}


@pytest.mark.filterwarnings("ignore:'runner.finetune' found in sys.modules:RuntimeWarning")  # runpy, imported here
def test_merge_folds_the_adapters_into_the_base_and_computes_what_the_adapted_model_does(lora_run, monkeypatch) -> None:
    directory, task = lora_run
    monkeypatch.setattr(sys, "argv", ["runner.finetune", "merge", str(directory)])
    with pytest.raises(SystemExit) as done:  # as `python -m runner.finetune merge RUN_DIR` runs it
        runpy.run_module("runner.finetune", run_name="__main__")
    assert done.value.code == 0
    merged, _ = load_trained(directory, weights=directory / MERGED)  # the plain GPT, strict load
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), task.eval()(tokens), atol=1e-5, rtol=1e-5)


def test_merge_refuses_a_run_without_lora(base: Path) -> None:
    with pytest.raises(ConfigError, match="not a finetune=lora run"):
        merge(base)


def test_a_lora_run_resumes_exactly(base: Path, compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*SHORT, f"init_from={base}", "finetune=lora", "finetune.dropout=0.1", "checkpoint=default"]
    whole, second = assert_resume_is_exact(compose_cfg, [*overrides, "logger=jsonl"], tmp_path, stop=4)
    for (name, a), b in zip(whole.task.named_parameters(), second.task.parameters(), strict=True):
        assert torch.equal(a, b), name  # the frozen base too: the resume's adapter-only load left it as init_from's


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["finetune=lora"], "init_from"),
        (["finetune=lora", "finetune.target_modules=[nowhere]"], "target_modules"),
    ],
)
def test_a_lora_run_that_cannot_work_is_refused(overrides, message, base: Path, compose_cfg: Callable) -> None:
    init = [f"init_from={base}"] if "nowhere" in str(overrides) else []
    with pytest.raises(ConfigError, match=message):
        build(compose_cfg(*SHORT, *init, *overrides))


def test_without_peft_the_error_names_the_pip_command(base: Path, compose_cfg, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'runner\[lora\]'"):
        build(compose_cfg(*SHORT, f"init_from={base}", "finetune=lora"))
