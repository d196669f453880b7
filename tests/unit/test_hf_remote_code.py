"""A transformers folder is data: its own code never runs. A config.json or tokenizer_config.json with `auto_map`, or a
model_type transformers does not implement itself, is refused before transformers reads the folder, every load passes
trust_remote_code=False (and local_files_only for a folder), and standard input is closed while it loads, so
transformers' "run the custom code? [y/N]" prompt can never be answered yes, not even by a patched input()."""

from __future__ import annotations

import builtins
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import hf_text, tiny_hf_model

from runner import ConfigError
from runner.build import build

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf)")

EVIL = "open({marker!r}, 'w').close()\nclass Evil: pass\nclass EvilConfig: pass\nclass EvilTokenizerFast: pass\n"
# (what is forged: config.json's changes, tokenizer_config.json's, the module placed beside them) -> what the error says
FORGED = {
    "config_auto_map": (
        {"auto_map": {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}},
        {},
        r"config.json has auto_map .*modeling_evil.*trust_remote_code",
    ),
    "tokenizer_auto_map": (
        {},
        {"auto_map": {"AutoTokenizer": [None, "modeling_evil.EvilTokenizerFast"]}},
        r"tokenizer_config.json has auto_map .*modeling_evil.*trust_remote_code",
    ),
    "unknown_model_type": ({"model_type": "evil"}, {}, r"model_type='evil'.*trust_remote_code"),
    # each of these reaches further into transformers than a folder should
    "a hub attention kernel": (
        {"attn_implementation": "kernels-community/flash-attn2"},
        {},
        r"attention implementation 'kernels-community/flash-attn2'",
    ),
    "a quantization config": ({"quantization_config": {"quant_method": "hqq"}}, {}, r"holds a quantization_config"),
    "a model class as the tokenizer": (
        {},
        {"tokenizer_class": "GPT2LMHeadModel"},
        r"tokenizer_class 'GPT2LMHeadModel', which is no tokenizer",
    ),
    "a loader as the tokenizer": ({"tokenizer_class": "AutoTokenizer"}, {}, r"tokenizer_class 'AutoTokenizer'"),
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny GPT-2 folder written by save_pretrained, and source.inputs that read a few small text files."""
    root = tmp_path_factory.mktemp("hf")
    inputs = {"paths": hf_text(root / "text", copies=2), "val_every": 2, "context": 8, "batch_size": 2}
    return {"model": tiny_hf_model(root / "gpt2", "gpt2"), "inputs": {**inputs, "cache_dir": str(root / "tokens")}}


@pytest.fixture
def answer_yes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """input() answers "y" to any prompt (what a user at a terminal might type): the prompts it was asked."""
    asked: list[str] = []

    def yes(prompt: object = "") -> str:
        asked.append(str(prompt))
        return "y"

    monkeypatch.setattr(builtins, "input", yes)
    return asked


def _forge(source: Path, folder: Path, case: str, marker: Path) -> Path:
    # a copy of the honest folder with the case's JSON changes and a module whose import touches `marker`
    config, tokenizer, _ = FORGED[case]
    shutil.copytree(source, folder)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        path = folder / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    (folder / "modeling_evil.py").write_text(EVIL.format(marker=str(marker)))
    return folder


@pytest.mark.parametrize("case", FORGED)
def test_a_folder_that_asks_for_its_own_code_is_refused_and_nothing_runs(
    hf: dict, tmp_path: Path, case: str, answer_yes: list[str]
) -> None:
    from experiments.sae.sources.pretrained import load

    marker = tmp_path / "ran"
    folder = _forge(hf["model"], tmp_path / "forged", case, marker)
    with pytest.raises(ConfigError, match=FORGED[case][2]) as refused:
        load(str(folder), hf["inputs"])
    assert "a model folder is data" in str(refused.value)
    assert not marker.exists() and answer_yes == []
    assert "modeling_evil" not in sys.modules


def test_a_forged_folder_is_refused_through_the_sae_hf_preset(
    compose_cfg: Callable, hf: dict, tmp_path: Path, answer_yes: list[str]
) -> None:
    marker = tmp_path / "ran"
    folder = _forge(hf["model"], tmp_path / "forged", "config_auto_map", marker)
    cfg = compose_cfg(
        "+experiment=sae_hf",
        f"source.checkpoint={folder}",
        "source.module=transformer.h.1",
        f"source.inputs.paths=[{','.join(hf['inputs']['paths'])}]",
        "source.inputs.val_every=2",
        "logger=none",
        "checkpoint=none",
    )
    with pytest.raises(ConfigError, match="config.json has auto_map"):
        build(cfg)
    assert not marker.exists() and answer_yes == []


def test_a_hub_name_s_cached_config_is_checked_and_its_loads_are_pinned_to_that_commit(
    hf: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer_yes: list[str]
) -> None:
    # hf:NAME read offline from a hub cache laid out as huggingface_hub writes it: forged, refused; honest, loaded
    from huggingface_hub import constants

    from experiments.sae.sources.pretrained import load

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    for repo, case in (("honest", None), ("forged", "config_auto_map")):
        cached = tmp_path / "hub" / f"models--local--{repo}"
        if case is None:
            shutil.copytree(hf["model"], cached / "snapshots" / commit)
        else:
            _forge(hf["model"], cached / "snapshots" / commit, case, tmp_path / "ran")
        (cached / "refs").mkdir()
        (cached / "refs" / "main").write_text(commit)
    with pytest.raises(ConfigError, match="config.json has auto_map"):
        load("hf:local/forged", hf["inputs"])
    assert not (tmp_path / "ran").exists()
    loaded = load("hf:local/honest", hf["inputs"])
    assert loaded.folder == tmp_path / "hub" / "models--local--honest" / "snapshots" / commit
    assert answer_yes == []


def test_an_honest_folder_loads_and_standard_input_is_given_back(hf: dict) -> None:
    from experiments.sae.sources.pretrained import load

    stdin, ask = sys.stdin, builtins.input
    loaded = load(str(hf["model"]), hf["inputs"])
    assert type(loaded.model).__name__ == "GPT2LMHeadModel" and loaded.tokenizer.bos_token_id is not None
    assert sys.stdin is stdin and builtins.input is ask


def test_no_prompt_is_answered_while_a_model_loads_even_by_a_transformers_that_ignores_the_flag(
    monkeypatch: pytest.MonkeyPatch, answer_yes: list[str]
) -> None:
    # trust_remote_code=None is what a transformers that drops the flag would resolve: it prompts, and gets no yes
    from transformers import dynamic_module_utils

    from experiments.sae.sources.hf_code import no_prompt

    monkeypatch.setattr(dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 15)
    ask = dynamic_module_utils.resolve_trust_remote_code
    assert ask(None, "local/forged", has_local_code=False, has_remote_code=True) is True  # the danger is real
    assert len(answer_yes) == 1
    with no_prompt(), pytest.raises(ValueError, match="trust_remote_code=True"):
        ask(None, "local/forged", has_local_code=False, has_remote_code=True)
    assert len(answer_yes) == 1  # not asked again: input() is closed inside
    assert builtins.input("?") == "y"  # and given back after


def _shards(folder: Path, weight_map: dict[str, str]) -> Path:
    # the honest weights moved out of the folder, and an index that names where they went
    outside = folder.parent / "outside"
    outside.mkdir()
    (folder / "model.safetensors").rename(outside / "w.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return outside


@pytest.mark.parametrize("how", ["an absolute path", "a relative path out", "a symlink out"])
def test_weights_outside_the_folder_are_refused_before_they_are_read(hf: dict, tmp_path: Path, how: str) -> None:
    from experiments.sae.sources.pretrained import load

    folder = tmp_path / "model"
    shutil.copytree(hf["model"], folder)
    if how == "a symlink out":
        (tmp_path / "outside").mkdir()
        (folder / "model.safetensors").rename(tmp_path / "outside" / "w.safetensors")
        (folder / "model.safetensors").symlink_to(tmp_path / "outside" / "w.safetensors")
        error = r"model.safetensors leads to .*outside/w.safetensors, which is not a file in the model's folder"
    else:
        name = str(tmp_path / "outside" / "w.safetensors") if how == "an absolute path" else "../outside/w.safetensors"
        _shards(folder, {"transformer.wte.weight": name})
        error = r"model.safetensors.index.json's weight_map names .*outside/w.safetensors.*named without a path"
    with pytest.raises(ConfigError, match=error):
        load(str(folder), hf["inputs"])


def test_a_folder_loads_with_no_request_and_names_only_the_weights_it_loads(
    hf: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers asked the hub for an adapter of a cached model, and the hub for its agent registry (writing it
    # under HF_HOME), with local_files_only set; a file beside the weights (here one that never ends) is no weight
    import socket

    from huggingface_hub import constants

    from experiments.sae.sources.pretrained import load

    calls: list[object] = []

    def connect(self: socket.socket, address: object) -> None:
        calls.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    folder = tmp_path / "model"
    shutil.copytree(hf["model"], folder)
    (folder / "junk.safetensors").symlink_to("/dev/zero")
    loaded = load(str(folder), hf["inputs"])
    assert loaded.weight_files() == [folder / "model.safetensors"]
    assert calls == [] and constants.HF_HUB_OFFLINE is False  # offline inside the load only
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "attacker/base"}))
    with pytest.raises(ConfigError, match="holds a peft adapter"):
        load(str(folder), hf["inputs"])
    assert calls == []
