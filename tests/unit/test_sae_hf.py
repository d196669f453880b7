"""+experiment=sae_hf: an SAE on a transformers causal LM's residual stream (GPT-2, Llama and GPT-NeoX shapes, tiny,
random, written by save_pretrained: no download), hooked by the model's own module names, on text tokenized with its
tokenizer in BOS-first windows, its special tokens masked out of training and splicing."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import HF_ARCHS, assert_resume_is_exact, hf_text, tiny_hf_model

from experiments.sae.sources.source import SourceModel
from runner import ConfigError
from runner.build import build
from runner.loop import fit
from runner.train import train

# find_spec, not importorskip: transformers is imported by the tests that use it, not by every collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf)")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny model folder per architecture, text files for them, and source.inputs that read those files."""
    root = tmp_path_factory.mktemp("hf")
    models = {arch: tiny_hf_model(root / arch, arch) for arch in HF_ARCHS}
    paths = hf_text(root / "text")
    inputs = {"paths": paths, "val_every": 2, "context": 16, "batch_size": 4, "cache_dir": str(root / "tokens")}
    return {"models": models, "inputs": inputs, "root": root}


def _source(hf: dict, arch: str, layer: int = 0, **inputs) -> SourceModel:
    return SourceModel(str(hf["models"][arch]), f"{HF_ARCHS[arch]}.{layer}", inputs={**hf["inputs"], **inputs})


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_the_rows_are_the_model_s_own_hidden_states_at_every_non_special_position(hf: dict, arch: str) -> None:
    source = _source(hf, arch)
    tokenizer, model = source.pretrained.tokenizer, source.pretrained.model
    separators = 0
    for batch in source.data.val_loader():
        tokens = batch["tokens"]
        assert (tokens[:, 0] == tokenizer.bos_token_id).all()  # every window starts with BOS, as in training
        assert tokens.shape[1] == 16 + 1
        hidden = model(input_ids=tokens[:, :-1], output_hidden_states=True).hidden_states[1]  # after block 0
        special = torch.isin(tokens[:, :-1], torch.tensor(tokenizer.all_special_ids))
        assert special[:, 0].all()  # BOS
        separators += int(special[:, 1:].sum())  # the EOS between files
        torch.testing.assert_close(source.activations(batch), hidden[~special], rtol=0, atol=0)
    assert separators > 0


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_the_clean_loss_is_the_model_s_own_and_splicing_replaces_only_the_kept_positions(hf: dict, arch: str) -> None:
    source = _source(hf, arch, layer=1)
    model, count, total = source.pretrained.model, 0, 0.0
    for batch in source.data.val_loader():  # transformers' own loss, with labels: what "ce_clean" must be
        total += float(model(input_ids=batch["tokens"], labels=batch["tokens"]).loss) * len(batch["tokens"])
        count += len(batch["tokens"])
    seen: list[int] = []

    def zeros(rows: torch.Tensor) -> torch.Tensor:
        seen.append(len(rows))
        return torch.zeros_like(rows)

    got = source.compare({"clean": None, "same": lambda rows: rows.clone(), "zero": zeros})
    assert got["clean"]["ce"] == pytest.approx(total / count, rel=1e-5)
    assert got["same"]["ce"] == pytest.approx(got["clean"]["ce"], rel=1e-9) and got["same"]["kl"] < 1e-9
    assert got["zero"]["kl"] > 1e-4
    rows = sum(int(source.mask(b).sum()) for b in source.data.val_loader())
    assert sum(seen) == rows  # the BOS and EOS positions kept the model's own stream


def test_an_sae_trains_on_a_transformers_model_and_reports_loss_recovered(compose_cfg: Callable, hf: dict) -> None:
    # a source in bfloat16 (a large model on a GPU), the SAE in float32
    cfg = compose_cfg(*_sae_hf(hf, "gpt2"), "source.inputs.torch_dtype=bfloat16", "logger=none", "checkpoint=none")
    run = build(cfg)
    assert run.task.d_in == 32  # the model's hidden size, with no model.d_in
    assert next(run.train_loader.dataset.buffer.source.model.parameters()).dtype == torch.bfloat16
    fit(run)
    m = run.state.metrics
    assert m["val/ce_clean"] < m["val/ce_zero_ablated"], m
    assert m["val/loss_recovered"] == pytest.approx(
        (m["val/ce_zero_ablated"] - m["val/ce_spliced"]) / (m["val/ce_zero_ablated"] - m["val/ce_clean"])
    )
    assert 0 < m["val/fve"] <= 1 and 0 < m["val/l0"] <= 8


def test_a_transformers_sourced_run_resumes_exactly_and_reuses_its_activation_cache(
    compose_cfg: Callable, hf: dict, tmp_path: Path
) -> None:
    cache = tmp_path / "acts"
    live = ("data.buffer_size", "data.samples_per_epoch")  # the ring's sizes; the cache holds 1024 rows
    cached = [*(o for o in _sae_hf(hf, "llama") if not o.startswith(live)), "data=activations_lm_cached"]
    cached += [f"data.cache={cache}", "data.cache_rows=1024"]
    overrides = [*cached, "logger=jsonl", "checkpoint.interval=1000st"]
    assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=3)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["inputs"]["context"] == 16 and manifest["inputs"]["bos"] is not None
    # the same model reading other text is not the cache's source: refused, naming what differs
    other = [*cached, "source.inputs.context=8", "logger=none"]
    with pytest.raises(ConfigError, match="inputs"):
        train(compose_cfg(*other, run_dir=tmp_path / "other"))


def test_an_sae_run_as_another_sae_s_source_is_refused_naming_the_model_it_read(
    compose_cfg: Callable, hf: dict, tmp_path: Path
) -> None:
    # An SAE on a transformers model, then an SAE on that SAE's run: a KeyError from inside the source's forward
    from helpers import finished_run

    first = tmp_path / "sae"
    first.mkdir()
    finished_run(first, *_sae_hf(hf, "gpt2"), "logger=none", "checkpoint=none", "callbacks=none")
    fix = f"give the model it read: source.checkpoint={hf['models']['gpt2']} source.module=transformer.h.1 with "
    fix += "+experiment=sae_hf"
    for module, problem in [
        ("net.1", "source.module='net.1' is not a module of TopKSAE: it has none but itself"),
        ("''", f"source.checkpoint={first}: the validation_step of its TopKSAE gives no loss"),  # its root
    ]:
        with pytest.raises(ConfigError) as caught:
            train(compose_cfg("+experiment=sae_digits", f"source.checkpoint={first}", f"source.module={module}"))
        message = str(caught.value)
        assert problem in message and fix in message and len(message.splitlines()) == 1, message
        assert not (tmp_path / "run").exists()


def test_a_folder_with_pickled_weights_only_is_refused(hf: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    folder.mkdir()
    for f in hf["models"]["gpt2"].iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(hf["models"]["gpt2"] / "model.safetensors"), folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"never unpickles weights \(pytorch_model.bin\)"):
        SourceModel(str(folder), "transformer.h.0", inputs=hf["inputs"])


def test_a_model_that_needs_its_own_code_is_refused(hf: dict, tmp_path: Path) -> None:
    folder = tmp_path / "remote"
    folder.mkdir()
    for f in hf["models"]["gpt2"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoModelForCausalLM": "modeling_evil.Evil"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    with pytest.raises(ConfigError, match="trust_remote_code"):
        SourceModel(str(folder), "transformer.h.0", inputs=hf["inputs"])
    assert not (tmp_path / "ran").exists()


def test_bad_source_settings_name_what_to_change(hf: dict, lm_run: Path) -> None:
    with pytest.raises(ConfigError, match=r"'transformer.h.7' is not a module of GPT2LMHeadModel: .*transformer.h.1"):
        SourceModel(str(hf["models"]["gpt2"]), "transformer.h.7", inputs=hf["inputs"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['context_size'\]"):
        _source(hf, "gpt2", context_size=16)
    with pytest.raises(ConfigError, match="hold none out for validation"):
        _source(hf, "gpt2", val_every=0)
    with pytest.raises(ConfigError, match="fewer than one window"):
        _source(hf, "gpt2", context=100_000)
    with pytest.raises(ConfigError, match="leave source.inputs out"):
        SourceModel(str(lm_run), "blocks.1", inputs={"context": 16})


def test_a_tokens_file_of_the_tokenizer_s_ids_is_read_instead_of_text(hf: dict, tmp_path: Path) -> None:
    source = _source(hf, "gpt_neox")
    ids = torch.cat([b["tokens"][:, 1:].flatten() for b in source.data.train_loader()]).numpy()
    import numpy as np

    np.save(tmp_path / "ids.npy", ids.astype(np.uint32))
    from_file = _source(hf, "gpt_neox", paths=None, tokens=str(tmp_path / "ids.npy"), val_fraction=0.25)
    assert from_file.pretrained.inputs["train_tokens"] == int(len(ids) * 0.75)
    batch = next(iter(from_file.data.val_loader()))
    assert len(from_file.activations(batch)) == int(from_file.mask(batch).sum())


def _sae_hf(hf: dict, arch: str) -> list[str]:
    inputs = hf["inputs"]
    return [
        "+experiment=sae_hf",
        f"source.checkpoint={hf['models'][arch]}",
        f"source.module={HF_ARCHS[arch]}.1",
        f"source.inputs.paths=[{','.join(inputs['paths'])}]",
        "source.inputs.val_every=2",
        "source.inputs.context=16",
        "source.inputs.batch_size=4",
        f"+source.inputs.cache_dir={inputs['cache_dir']}",
        "model.n_latents=64",
        "model.k=8",
        "data.batch_size=32",
        "data.buffer_size=256",
        "data.samples_per_epoch=1024",
        "trainer.max_duration=8st",
        "trainer.val_interval=4st",
        "trainer.log_interval=2st",
    ]


def test_feature_pages_of_a_transformers_sourced_sae_show_its_tokenizer_s_text(
    hf: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import re

    from helpers import finished_run

    from runner.load import load_trained
    from runner.tools.features import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    finished_run(run_dir, *_sae_hf(hf, "gpt2"), "logger=none", "checkpoint=none")
    assert main([str(run_dir), "tokens=200", "top=4", f"out={tmp_path / 'pages'}"]) == 0

    def data(name: str) -> dict:
        text = (tmp_path / "pages" / "data" / name).read_text()
        return json.loads(re.fullmatch(r"FEATURES\.\w+\((.*)\);\n", text, re.DOTALL).group(1))

    index, chunk = data("index.js"), data("latents-0000.js")["latents"]
    assert list(index["splits"]) == ["val"]  # 200 positions: the held-out windows alone
    source = _source(hf, "gpt2", layer=1)
    tokenizer = source.pretrained.tokenizer
    assert index["vocab"][: len(tokenizer)] == [tokenizer.decode([i]) for i in range(len(tokenizer))]
    assert index["lens_tied"] and all(len(d["promoted"]) == 8 for d in chunk.values())
    # brute force over the same rows: each latent's best context is the text around its strongest position
    sae, _ = load_trained(run_dir)
    batches = list(source.data.val_loader())
    rows = torch.cat([source.activations(b) for b in batches])
    where = torch.cat([source.positions(b, 16) + i * 4 * 16 for i, b in enumerate(batches)])
    windows = torch.cat([b["tokens"][:, :-1] for b in batches]).flatten()
    codes, checked = sae.encode(rows[: index["rows"]]), 0
    for latent, found in chunk.items():
        if not found["contexts"]:
            continue
        best, row = found["contexts"][0], int(codes[:, int(latent)].argmax())
        at = int(where[row])
        assert best["ids"][best["at"]] == int(windows[at]) not in tokenizer.all_special_ids
        assert best["ids"][: best["at"] + 1] == windows[at - best["at"] : at + 1].tolist()
        checked += 1
    assert checked >= 16


def test_a_family_on_two_hook_points_of_a_transformers_model_splices_each_into_its_own(
    compose_cfg: Callable, hf: dict
) -> None:
    overrides = [o for o in _sae_hf(hf, "gpt_neox") if not o.startswith(("model.", "source.module="))]
    family = [*overrides, "model=sae_multi", "model.ks=[4]", "model.base.n_latents=64", "logger=none"]
    run = train(compose_cfg(*family, "source.module=[gpt_neox.layers.0,gpt_neox.layers.1]", "checkpoint=none"))
    assert {name: sae.d_in for name, sae in run.task.saes.items()} == {
        "gpt_neox_layers_0_k4": 32,
        "gpt_neox_layers_1_k4": 32,
    }
    m = run.state.metrics
    for module in ("gpt_neox_layers_0", "gpt_neox_layers_1"):
        assert 0 < m[f"val/{module}_k4/fve"] <= 1 and m[f"val/{module}/ce_zero_ablated"] > m["val/ce_clean"], m
