"""model=sae_multi: several SAEs from one activation pass, each trained exactly as alone, logged and saved apart."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from safetensors.torch import load_file

from experiments.sae.coders.activations import BatchTopKSAE, TopKSAE
from experiments.sae.coders.multi import MultiSAE
from runner import ConfigError
from runner.build import build
from runner.load import load_trained
from runner.train import train

SMALL = (
    "+experiment=sae",
    "model=sae_multi",
    "model.ks=[2,4]",
    "model.base.n_latents=64",
    "model.base.dead_window=10st",
    "data.splits.d=16",
    "data.splits.n_features=32",
    "data.splits.mean_active=2",
    "data.batch_size=128",
    "data.splits.n_val=512",
    "data.val_batch_size=256",
    "trainer.max_duration=30st",
    "trainer.val_interval=15st",
    "checkpoint=none",
)


def test_each_sae_of_a_family_trains_exactly_as_it_would_alone() -> None:
    torch.manual_seed(0)
    base = functools.partial(TopKSAE, n_latents=32, dead_window="2st")
    family = MultiSAE(d_in=8, base=base, ks=[2, 4])
    alone = {name: TopKSAE(d_in=8, n_latents=32, k=sae.k, dead_window="2st") for name, sae in family.saes.items()}
    for name, sae in alone.items():
        sae.load_state_dict(family.saes[name].state_dict())
    opt = torch.optim.Adam(family.parameters(), lr=1e-2)
    opts = {name: torch.optim.Adam(sae.parameters(), lr=1e-2) for name, sae in alone.items()}
    x = torch.randn(6, 64, 8) * torch.linspace(0.1, 3, 8)
    for batch in x:
        out = family.training_step((batch,))
        assert set(out) >= {"loss", "k2/loss", "k4/loss", "k2/auxk_loss", "k4/l0"}
        assert torch.equal(out["loss"], out["k2/loss"] + out["k4/loss"])
        out["loss"].backward()
        opt.step(), opt.zero_grad(), family.after_optimizer_step()
        for name, sae in alone.items():
            sae.training_step((batch,))["loss"].backward()
            opts[name].step(), opts[name].zero_grad(), sae.after_optimizer_step()
    for name, sae in alone.items():
        for key, value in sae.state_dict().items():
            assert torch.equal(value, family.saes[name].state_dict()[key]), (name, key)
    assert family.saes["k2"].n_dead > 0  # the AuxK path ran too: dead latents trained through it


def test_a_family_mixes_widths_ks_and_architectures() -> None:
    base = functools.partial(TopKSAE, n_latents=32)
    extra = {"batch": functools.partial(BatchTopKSAE, n_latents=16, k=3)}
    family = MultiSAE(d_in=8, base=base, ks=[2, 4], widths=[16, 32], saes=extra)
    shapes = {name: (sae.n_latents, getattr(sae, "k", None), type(sae).__name__) for name, sae in family.saes.items()}
    assert shapes == {
        "n16_k2": (16, 2, "TopKSAE"),
        "n16_k4": (16, 4, "TopKSAE"),
        "n32_k2": (32, 2, "TopKSAE"),
        "n32_k4": (32, 4, "TopKSAE"),
        "batch": (16, 3, "BatchTopKSAE"),
    }
    assert all(sae.d_in == 8 for sae in family.saes.values())
    with pytest.raises(ConfigError, match="trains no SAE"):
        MultiSAE(d_in=8, base=base)
    with pytest.raises(ConfigError, match="already taken"):
        MultiSAE(d_in=8, base=base, ks=[2], saes={"k2": base})
    with pytest.raises(ConfigError, match=r"model.ks=\[2, 4, 2\] names a value twice"):  # one SAE lost, before
        MultiSAE(d_in=8, base=base, ks=[2, 4, 2])
    with pytest.raises(ConfigError, match=r"model.widths=\[16, 16\] names a value twice"):
        MultiSAE(d_in=8, base=base, widths=[16, 16])


def test_a_jumprelu_member_trains_beside_topk_ones(compose_cfg: Callable[..., DictConfig]) -> None:
    jump = "+model.saes.jump={_target_:experiments.sae.coders.jumprelu.JumpReLUSAE,_partial_:true,n_latents:64}"
    run = train(compose_cfg(*SMALL, jump))
    assert set(run.task.saes) == {"k2", "k4", "jump"}
    m = run.state.metrics
    assert 0 < m["val/jump/fve"] <= 1 and m["val/jump/l0"] > 0
    assert m["val/fve"] == pytest.approx((m["val/k2/fve"] + m["val/k4/fve"] + m["val/jump/fve"]) / 3)


def test_sae_multi_run_logs_each_sae_and_writes_its_own_weights(compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(*SMALL, "callbacks=sae_ground_truth")
    run = train(cfg)
    m = run.state.metrics
    for name in ("k2", "k4"):
        assert 0 < m[f"val/{name}/fve"] <= 1 and 0 < m[f"val/{name}/mmcs"] <= 1
    assert m["val/fve"] == pytest.approx((m["val/k2/fve"] + m["val/k4/fve"]) / 2)
    assert m["val/mmcs"] == pytest.approx((m["val/k2/mmcs"] + m["val/k4/mmcs"]) / 2)
    assert m["val/loss"] == pytest.approx(m["val/k2/loss"] + m["val/k4/loss"])
    assert m["val/k2/l0"] <= 2 < m["val/k4/l0"] <= 4
    run_dir = Path(cfg.run_dir)
    whole = load_file(run_dir / "model.safetensors")
    for name, k in (("k2", 2), ("k4", 4)):
        part = load_file(run_dir / f"model.{name}.safetensors")
        alone = TopKSAE(d_in=16, n_latents=64, k=k)
        alone.load_state_dict(part)  # strict: the file is exactly one SAE's weights
        assert torch.equal(part["W_dec"], whole[f"saes.{name}.W_dec"])
    # each SAE is told its own row of the last log (its AuxK switch on a GPU)
    run.task.logged({"train/k2/silent_fraction": 0.25, "train/k4/silent_fraction": 0.0, "train/silent_fraction": 0.1})
    assert run.task.saes["k2"].auxk_active and not run.task.saes["k4"].auxk_active
    # the run folder holds its config although Hydra did not make it (run_dir elsewhere): a usable finished run
    family, _ = load_trained(run_dir)
    assert torch.equal(family.saes["k4"].W_dec, whole["saes.k4.W_dec"])


def test_sae_multi_needs_no_d_in_and_refuses_a_wrong_one(compose_cfg: Callable[..., DictConfig]) -> None:
    assert {sae.d_in for sae in build(compose_cfg(*SMALL)).task.saes.values()} == {16}
    with pytest.raises(ConfigError, match="model.d_in=8, but the data gives 16"):
        build(compose_cfg(*SMALL, "model.d_in=8"))
