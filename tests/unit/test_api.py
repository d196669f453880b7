"""runner.api as a researcher calls it from a notebook: load a run and its SAE, encode, decode, splice, read the
metrics; SAE.load_from_disk of a runner run and of a SAELens folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from experiments.sae import api as sae_api
from experiments.sae.coders.activations import TopKSAE
from experiments.sae.coders.base import SAE
from runner import ConfigError, api
from runner.tools import export
from runner.train import train


def test_load_encode_decode_and_splice_a_trained_sae(sae_lm_run: Path, lm_run: Path, tmp_path: Path) -> None:
    model, cfg = api.load(sae_lm_run)
    assert cfg.data.module == "blocks.1" and not model.training
    sae = sae_api.load_sae(sae_lm_run)
    assert isinstance(sae, TopKSAE) and isinstance(SAE.load_from_disk(sae_lm_run), TopKSAE)
    src = sae_api.source(sae_lm_run)
    tokens = next(iter(src.data.val_loader()))["tokens"][:2]
    acts = src.output_of(src.name, tokens[:, :-1])  # the batch's tokens: the inputs, then one more (the targets)
    assert acts.shape == (2, tokens.shape[1] - 1, 32)  # the GPT's d_model
    x = acts.flatten(0, 1)
    with torch.no_grad():
        codes = sae.encode(x)
        assert codes.shape == (len(x), 64) and ((codes > 0).sum(1) <= 4).all() and (codes > 0).any()
        torch.testing.assert_close(sae_api.decode(sae, codes), sae(x))
    clean, spliced = sae_api.spliced_loss(sae, src, tokens)
    assert clean == pytest.approx(float(src.loss({"tokens": tokens})[0]))
    assert clean < spliced < clean + 1.0  # the reconstruction costs a little loss, not all of it
    # the same SAE written for SAELens and read back: the field's call, the same latents firing and the same
    # reconstruction (its codes are in raw units: runner's input scale went into them)
    assert export.main([str(sae_lm_run), "format=saelens", f"out={tmp_path / 'saelens'}"]) == 0
    theirs = SAE.load_from_disk(tmp_path / "saelens")
    with torch.no_grad():
        assert torch.equal(theirs.encode(x) > 0, codes > 0)
        torch.testing.assert_close(theirs(x), sae(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match=r"holds a TopKSAE, not a JumpReLUSAE"):
        from experiments.sae.coders.jumprelu import JumpReLUSAE

        JumpReLUSAE.load_from_disk(sae_lm_run)
    with pytest.raises(ConfigError, match="is no SAE: load it with runner.api.load"):
        sae_api.load_sae(lm_run)


def test_metrics_are_the_rows_the_run_logged(compose_cfg: Callable, tmp_path: Path) -> None:
    train(compose_cfg("+experiment=digits", "trainer.max_duration=4st", "trainer.log_interval=2st", "logger=jsonl",
                      "checkpoint=none", "callbacks=none", "trainer.val_interval=4st"))  # fmt: skip
    rows = list(api.metrics(tmp_path / "run"))
    assert [row["step"] for row in rows if "train/loss" in row] == [2, 4]
    assert any("val/acc" in row for row in rows)
    with pytest.raises(ConfigError, match="logged no metrics.jsonl"):
        next(api.metrics(tmp_path))


def test_a_foreign_folder_without_its_model_refuses_the_options_that_attach_it(tmp_path) -> None:
    from experiments.sae.formats import export as write_folder

    sae = TopKSAE(d_in=8, n_latents=16, k=2)
    sae.initialized.fill_(True)
    folder = write_folder(sae, "saelens", tmp_path / "sae", hook="blocks.1", model="tiny")
    assert sae_api.load_sae(folder).n_latents == 16  # the SAE alone
    for option in ({"module": "blocks.0"}, {"target": "blocks.0.mlp"}, {"skip_positions": 0}):
        with pytest.raises(ConfigError, match=f"{next(iter(option))}=: they attach .* give source=MODEL"):
            sae_api.load_sae(folder, **option)
