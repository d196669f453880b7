"""An SAE run that leaves latents unused says so at its end: summary.json's `advice` and a line under the final table
name the share that never fired on the validation split and what trains them back, for the SAE's own settings."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from helpers import summary

from experiments.sae.coders.activations import ReLUSAE, TopKSAE
from experiments.sae.coders.dead import dead_advice
from runner.train import train
from runner.validation import summarize


def test_more_than_one_percent_never_firing_is_said_with_its_count_and_the_remedy() -> None:
    (line,) = dead_advice({"val/dead_fraction": 0.25}, 64, "do this")
    assert line == "25.0% of the SAE's 64 latents (16) never fired on the validation split (val/dead_fraction): do this"
    assert dead_advice({"val/dead_fraction": 0.01}, 64, "do this") == []  # 1% and under: nothing said
    assert dead_advice({"val/fve": 0.9}, 64, "do this") == []  # never validated: nothing known
    (member,) = dead_advice({"val/wide/dead_fraction": 0.5}, 8, "x", prefix="wide/")  # a family's member
    assert member.startswith("50.0% of the SAE wide's 8 latents (4) never fired")
    assert "(val/wide/dead_fraction)" in member


def test_the_remedy_is_the_sae_s_own() -> None:
    topk = TopKSAE(d_in=8, n_latents=16, k=2, dead_window="10st", auxk_coeff=0.25)
    assert "model.auxk_coeff=0.25" in topk.revive_hint() and "model.dead_window=10st" in topk.revive_hint()
    off = TopKSAE(d_in=8, n_latents=16, k=2, auxk_coeff=0.0)
    assert "nothing in this SAE trains a latent" in off.revive_hint()
    relu = ReLUSAE(d_in=8, n_latents=16, l1_coeff=3.0)
    assert "model.l1_coeff=3" in relu.revive_hint() and "no AuxK" in relu.revive_hint()
    from experiments.sae.coders.jumprelu import JumpReLUSAE

    jump = JumpReLUSAE(d_in=8, n_latents=16, pre_act_coeff=0.001, threshold_init=1.0, dead_window="10st")
    (line,) = jump.advice({"val/dead_fraction": 0.05}, key="model")
    assert "model.pre_act_coeff=0.001" in line and "model.dead_window=10st" in line and "AuxK" not in line
    assert "model.threshold_init=1" in line and "trainer.max_duration" in line
    off = JumpReLUSAE(d_in=8, n_latents=16, pre_act_coeff=0.0).revive_hint()
    assert "model.pre_act_coeff=0;" in off and "nothing pulls" in off


def test_a_relu_sae_whose_l1_silences_latents_says_so_at_the_end(
    compose_cfg: Callable, capsys: pytest.CaptureFixture
) -> None:
    # an L1 this strong from the first step silences most of 64 latents on the synthetic preset's data
    overrides = ["model=sae_relu", "model.n_latents=64", "model.l1_coeff=30", "model.l1_warmup=0st"]
    cfg = compose_cfg("+experiment=sae", *overrides, "trainer.max_duration=30st", "data.splits.n_val=512")
    train(cfg)
    said = summary(cfg.run_dir)
    (line,) = said["advice"]
    dead = said["metrics"]["val/dead_fraction"]
    assert dead > 0.01 and line.startswith(f"{dead:.1%} of the SAE's 64 latents ({round(dead * 64)}) never fired")
    assert "model.l1_coeff=30" in line
    assert line in capsys.readouterr().err.splitlines()  # under the final table, a line of its own


def test_a_run_with_every_latent_in_use_advises_nothing(compose_cfg: Callable) -> None:
    cfg = compose_cfg("+experiment=sae", "model.n_latents=64", "trainer.max_duration=30st", "data.splits.n_val=512")
    train(cfg)
    said = summary(cfg.run_dir)
    assert said["metrics"]["val/dead_fraction"] <= 0.01 and said["advice"] == []


def test_a_family_names_each_member_and_where_its_settings_are() -> None:
    from experiments.sae.coders.multi import MultiSAE

    base = functools.partial(TopKSAE, n_latents=16, auxk_coeff=0.5)
    own = {"relu": functools.partial(ReLUSAE, n_latents=32, l1_coeff=2.0)}
    family = MultiSAE(d_in=8, base=base, ks=[2], saes=own)
    metrics = {"val/k2/dead_fraction": 0.5, "val/relu/dead_fraction": 0.25, "val/dead_fraction": 0.375}
    k2, relu = family.advice(metrics)
    assert k2.startswith("50.0% of the SAE k2's 16 latents (8)") and "model.base.auxk_coeff=0.5" in k2
    assert relu.startswith("25.0% of the SAE relu's 32 latents (8)") and "model.saes.relu.l1_coeff=2" in relu


def test_a_cross_layer_transcoder_counts_every_layer_s_latents() -> None:
    from experiments.sae.coders.clt import CrossLayerTranscoder

    clt = CrossLayerTranscoder(coder=functools.partial(TopKSAE, n_latents=16, k=2), layers=3, d_in=8, d_out=8)
    (line,) = clt.advice({"val/dead_fraction": 0.125})
    assert line.startswith("12.5% of the cross-layer transcoder's 48 latents (6) never fired")
    assert "model.coder.auxk_coeff" in line
    _, faint = clt.advice({"val/dead_fraction": 0.125, "val/faint_fraction": 0.0625})
    assert faint.startswith("6.2% of the coder's 48 latents (3) fire but write under a tenth")
    # the faint share is over every layer's latents, against the median of them all: layer 2's rows shrunk
    torch.manual_seed(0)
    with torch.no_grad():
        for coder in clt.coders:
            coder.b_enc.fill_(5.0)  # every latent among the top 2 of 16 on some of the 64 rows (seed 0: none dead)
        clt.coders[2].W_dec[:4] *= 1e-3
    rows = torch.randn(64, 3 * 16)
    out = summarize(clt, {k: v.double() for k, v in clt.validation_step(rows).items()})
    assert out["dead_fraction"].item() == 0.0 and out["faint_fraction"].item() == 4 / 48


def test_latents_beyond_the_data_s_true_features_are_called_spare_not_revivable() -> None:
    topk = TopKSAE(d_in=8, n_latents=16, k=2, auxk_coeff=0.25)
    spare = {"val/dead_fraction": 0.5, "val/true_features": 8.0, "val/mmcs": 0.99}
    (line,) = topk.advice(spare)
    assert line.startswith("50.0% of the SAE's 16 latents (8) never fired")
    assert "the data has 8 true features (val/true_features), found at MMCS 0.9900, so 8 of the latents" in line
    assert "model.n_latents" in line and "auxk_coeff=" not in line
    # more dead than the surplus: some latents a feature could use were lost, and AuxK's remedy is the advice
    (lost,) = topk.advice({**spare, "val/dead_fraction": 0.5625})
    assert "model.auxk_coeff=0.25" in lost and "true features" not in lost
    (narrow,) = TopKSAE(d_in=8, n_latents=8, k=2, auxk_coeff=0.25).advice({**spare, "val/dead_fraction": 0.25})
    assert "model.auxk_coeff=0.25" in narrow  # no wider than the data: nothing is spare
    # latents that fire but write almost nothing are as unused as dead ones: spare while both fit in the surplus
    dead, faint = topk.advice({**spare, "val/dead_fraction": 0.25, "val/faint_fraction": 0.25})
    assert faint.startswith("25.0% of the coder's 16 latents (4) fire but write under a tenth of the median")
    assert "so 8 of the latents have none of their own" in dead and "so 8 of the latents have none" in faint
    dead, faint = topk.advice({**spare, "val/dead_fraction": 0.25, "val/faint_fraction": 0.3125})
    assert "model.auxk_coeff=0.25" in dead and "true features" not in faint
    assert "they add almost nothing to the reconstruction" in faint  # unit rows: no shrinking to blame


def test_an_sae_wider_than_the_synthetic_data_says_its_unused_latents_are_spare(compose_cfg: Callable) -> None:
    # 16 true features for 128 latents: 112 have no feature of their own (AuxK has some fire on the others' residue)
    features = ["data.splits.n_features=16", "data.splits.mean_active=2", "model.k=2", "model.n_latents=128"]
    cfg = compose_cfg("+experiment=sae", *features, "trainer.max_duration=30st", "data.splits.n_val=512")
    train(cfg)
    said = summary(cfg.run_dir)
    assert said["metrics"]["val/true_features"] == 16
    dead = said["metrics"]["val/dead_fraction"]
    (line,) = said["advice"]
    assert 0.01 < dead <= 112 / 128
    assert line.startswith(f"{dead:.1%} of the SAE's 128 latents ({round(dead * 128)}) never fired")
    assert "the data has 16 true features" in line and "so 112 of the latents have none of their own" in line


def test_the_synthetic_recipe_on_real_activations_is_pointed_to_the_file_preset() -> None:
    fitted = TopKSAE(d_in=8, n_latents=16, k=2, auxk_coeff=0.25, encoder_init="fit")
    (line,) = fitted.advice({"val/dead_fraction": 0.25})  # no true features: a model's activations
    assert "model.auxk_coeff=0.25" in line and "model.encoder_init=fit" in line and "+experiment=sae_file" in line
    assert "model.encoder_init=unit left under 1% unused" in line
    (synthetic,) = fitted.advice({"val/dead_fraction": 0.25, "val/true_features": 16.0})
    assert "sae_file" not in synthetic  # synthetic data: the fitted start is that preset's own
    (unit,) = TopKSAE(d_in=8, n_latents=16, k=2, auxk_coeff=0.25).advice({"val/dead_fraction": 0.25})
    assert "sae_file" not in unit  # the file recipe's start already
