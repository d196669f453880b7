"""The Matryoshka SAE: groups from counts or fractions, each prefix decoding only its own latents, the loss as the sum
of the prefix losses, and short training runs (TopK and BatchTopK codes) whose prefixes reconstruct better as they grow.

One CPU thread; the module takes a few seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from helpers import compose_job
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.sae.coders.matryoshka import MatryoshkaSAE, prefix_ends
from runner import ConfigError
from runner.build import build
from runner.loop import fit


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator[Callable[..., DictConfig]]:
    yield lambda *overrides: compose_job(tmp_path / "run", "logger=none", *overrides)
    HydraConfig.instance().cfg = None


def _tiny(**kwargs) -> MatryoshkaSAE:
    torch.manual_seed(kwargs.pop("seed", 0))
    return MatryoshkaSAE(**{"d_in": 8, "n_latents": 12, "k": 3, "group_sizes": [2, 4, 6], **kwargs})


def test_groups_from_counts_or_fractions() -> None:
    assert prefix_ends([64, 192, 768], 1024) == (64, 256, 1024)
    assert prefix_ends([0.0625, 0.1875, 0.75], 1024) == (64, 256, 1024)
    assert prefix_ends([0.0625, 0.1875, 0.75], 4096) == (256, 1024, 4096)  # fractions follow n_latents
    assert prefix_ends([1 / 3, 1 / 3, 1 / 3], 10) == (3, 7, 10)  # rounded, ending at n_latents
    assert prefix_ends([12], 12) == (12,)  # one group: an ordinary SAE
    for sizes, match in [([64, 192], "sum to n_latents=1024"), ([0, 1024], "positive"), ([0.0001, 0.9999], "empty")]:
        with pytest.raises(ConfigError, match=match):
            prefix_ends(sizes, 1024)
    with pytest.raises(ConfigError, match="choose topk or batchtopk"):
        _tiny(activation="relu")


@pytest.mark.parametrize("activation", ["topk", "batchtopk"])
def test_each_prefix_decodes_only_its_latents_and_the_full_one_is_the_ordinary_decode(activation: str) -> None:
    sae = _tiny(activation=activation)
    with torch.no_grad():
        sae.b_dec.normal_()
    x = torch.randn(16, 8)
    codes = sae.encode(x)
    assert codes.shape == (16, 12) and (codes >= 0).all()
    assert int((codes != 0).sum()) == 3 * 16  # k per sample (topk) or k x batch (batchtopk)
    values, indices = sae.codes(x)  # each row's picks, or dense codes
    assert (indices is None) == (activation == "batchtopk") and torch.equal(sae._dense(values, indices), codes)
    recons = sae.prefix_decodes(values, indices)
    assert recons.shape == (3, 16, 8)
    torch.testing.assert_close(sae.prefix_decodes(codes, None), recons)
    for i, m in enumerate((2, 6, 12)):
        torch.testing.assert_close(recons[i], codes[:, :m] @ sae.W_dec[:m] + sae.b_dec)
    torch.testing.assert_close(recons[-1], sae.decode(codes, None))
    torch.testing.assert_close(recons[-1] / sae.input_scale, sae(x))


@pytest.mark.parametrize("auxk_coeff", [0.0, 0.5])
def test_loss_is_the_sum_of_the_prefix_losses_plus_auxk(auxk_coeff: float) -> None:
    sae = _tiny(activation="topk", auxk_coeff=auxk_coeff, k_aux=4, dead_window="3st")
    x = torch.randn(32, 8) * 3.0 + 1.0
    sae.initialize_from(x)
    with torch.no_grad():
        sae.since_fired[[0, 5, 11]] = 5  # three dead latents, so AuxK has something to train
    sae.after_optimizer_step()
    out = sae.training_step(x)

    xn = x * sae.input_scale
    codes = sae.encode(x).detach()
    sst = ((xn - xn.mean(0)) ** 2).sum(1).mean()
    expected = []
    for m in (2, 6, 12):
        error = ((codes[:, :m] @ sae.W_dec[:m] + sae.b_dec - xn) ** 2).sum(1).mean()
        expected.append(error / sst)
        torch.testing.assert_close(out[f"prefix_{m}_nmse"], error / (xn**2).sum(1).mean())
    torch.testing.assert_close(out["recon_loss"], expected[-1])
    torch.testing.assert_close(out["matryoshka_loss"], sum(expected))
    assert (float(out["auxk_loss"]) > 0) == (auxk_coeff > 0)
    torch.testing.assert_close(out["loss"], sum(expected) + auxk_coeff * out["auxk_loss"])


@pytest.mark.parametrize("activation", ["topk", "batchtopk"])
def test_trained_prefixes_reconstruct_better_as_they_grow(
    compose_cfg: Callable[..., DictConfig], activation: str
) -> None:
    cfg = compose_cfg(
        "+experiment=sae",
        "model=sae_matryoshka",
        f"model.activation={activation}",
        "data.splits.d=32",
        "model.n_latents=128",
        "model.group_sizes=[16,32,80]",
        "model.k=3",
        "data.splits.n_features=64",
        "data.splits.mean_active=2",
        "data.batch_size=256",
        "data.val_batch_size=512",  # four batches: the prefixes' errors are streamed over the split as nmse is
        "data.splits.n_val=2048",
        "trainer.max_duration=150st",
        "checkpoint=none",
    )
    run = build(cfg)
    assert isinstance(run.task, MatryoshkaSAE) and run.task.prefix_ends == (16, 48, 128)
    fit(run)
    m = run.state.metrics
    assert run.state.nonfinite_steps == 0 and m["val/fve"] > 0.6, m
    errors = [m[f"val/prefix_{end}_nmse"] for end in (16, 48, 128)]
    assert errors[0] >= errors[1] >= errors[2], errors
    assert errors[2] < 0.7 * errors[0], errors
    assert errors[2] == pytest.approx(m["val/nmse"], rel=1e-9)
    assert m["val/l0"] == pytest.approx(3.0, rel=0.35)  # batchtopk: k on average, through the learned threshold
