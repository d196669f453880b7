"""The JumpReLU SAE: codes cut at per-latent thresholds, the pseudo-derivatives of the jump and of the L0 count (inside
the bandwidth only), thresholds stored as they are and kept >= 0 and in float32 under bf16 autocast, the L0 warmup and
target, the dead latents' pre-activation loss, and a short run from the config that lowers the loss.

Tiny sizes (one CPU thread: tests/conftest.py); the module takes a few seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from omegaconf import DictConfig

from experiments.sae.coders.jumprelu import JumpReLUFunction, JumpReLUSAE, StepFunction
from runner import ConfigError
from runner.build import build
from runner.loop import fit


def _tiny(**kwargs) -> JumpReLUSAE:
    torch.manual_seed(kwargs.pop("seed", 0))
    return JumpReLUSAE(**{"d_in": 8, "n_latents": 16, "geometric_median_init": False, **kwargs})


def test_codes_are_zero_at_or_below_the_threshold_and_pre_above_it() -> None:
    sae = _tiny(n_latents=3)
    with torch.no_grad():
        sae.threshold.copy_(torch.tensor([0.5, 1.0, 0.0]))
    pre = torch.tensor([[0.4, 1.5, -0.2], [0.5, 1.0, 0.3], [0.7, 0.99, 0.0]])
    codes, indices = sae.activate(pre)
    assert indices is None
    expected = torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, 0.3], [0.7, 0.0, 0.0]])
    assert torch.equal(codes, expected)  # a fired code is pre itself: the jump, not a shifted ReLU


def _grads(fn: type[torch.autograd.Function], pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float):
    pre, threshold = pre.clone().requires_grad_(), threshold.clone().requires_grad_()
    fn.apply(pre, threshold, bandwidth).sum().backward()
    return pre.grad, threshold.grad


def test_threshold_gradients_are_the_paper_s_rectangle_pseudo_derivatives() -> None:
    # One latent at threshold 1.0, bandwidth 0.1: pre 0.97 and 1.04 are inside the window, 0.93 and 1.2 outside it.
    theta, eps = torch.tensor([1.0]), 0.1
    pre = torch.tensor([[0.97], [1.04], [0.93], [1.2]])
    pre_grad, theta_grad = _grads(JumpReLUFunction, pre, theta, eps)
    assert theta_grad == pytest.approx([-2 * 1.0 / eps])  # -(theta / eps) per sample in the window
    assert pre_grad.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]  # H(pre - theta): the true derivative, no STE
    pre_grad, theta_grad = _grads(StepFunction, pre, theta, eps)
    assert theta_grad == pytest.approx([-2 / eps])  # -(1 / eps) per sample in the window
    assert pre_grad is None  # the count moves thresholds only
    far = torch.tensor([[0.5], [1.07], [0.94], [3.0]])  # all outside the window: no gradient at all
    assert _grads(JumpReLUFunction, far, theta, eps)[1] == pytest.approx([0.0])
    assert _grads(StepFunction, far, theta, eps)[1] == pytest.approx([0.0])


def _pre_near_threshold(sae: JumpReLUSAE, x: torch.Tensor) -> None:
    sae.initialize_from(x)
    with torch.no_grad():
        sae.threshold.copy_(sae.pre_activations(x[:1] * sae.input_scale)[0])  # every threshold on row 0's pre


def _losses(sae: JumpReLUSAE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reconstruction loss and the auxiliary terms of a training step, before they are summed."""
    xn = x * sae.input_scale
    pre = sae.pre_activations(xn)
    codes, _ = sae.activate(pre)
    recon = sae.decode(codes, None)
    sst = (xn - xn.mean(0)).pow(2).sum(1).mean().clamp_min(1e-8)
    return {"recon_loss": (recon - xn).pow(2).sum(1).mean() / sst, **sae.aux_loss(xn, pre, codes, None, recon)}


def test_the_l0_penalty_and_the_reconstruction_reach_thresholds_within_the_bandwidth_only() -> None:
    sae = _tiny(l0_warmup="0st", l0_coeff=1.0, bandwidth=1e-3)
    x = torch.randn(4, 8)
    _pre_near_threshold(sae, x)
    with torch.no_grad():
        sae.threshold.sub_(1e-4)  # row 0 fires, 0.1 bandwidth above every threshold: inside every window
    out = _losses(sae, x[:1])
    l0_grad = torch.autograd.grad(out["l0_term"], sae.threshold, retain_graph=True)[0]
    assert torch.allclose(l0_grad, torch.full_like(l0_grad, -1 / 1e-3))  # the count falls as thresholds rise
    recon_grad = torch.autograd.grad(out["recon_loss"], sae.threshold)[0]
    assert (recon_grad != 0).all()  # the codes jump between pre and 0 there: the reconstruction feels it
    with torch.no_grad():
        sae.threshold.add_(0.01)  # 10 bandwidths above row 0's pre: no pseudo-derivative, and nothing fires
    out = _losses(sae, x[:1])
    threshold_grad, enc_grad = torch.autograd.grad(out["recon_loss"] + out["l0_term"], [sae.threshold, sae.W_enc])
    assert torch.equal(threshold_grad, torch.zeros(16))
    assert torch.equal(enc_grad, torch.zeros_like(enc_grad))  # the count gives pre no gradient


def test_threshold_is_stored_as_is_and_kept_non_negative() -> None:
    sae = _tiny(threshold_init=0.001)
    names = dict(sae.named_parameters())
    assert "threshold" in names and not any("log" in n for n in names)
    assert torch.equal(sae.threshold.detach(), torch.full((16,), 0.001))
    optimizer = torch.optim.SGD([sae.threshold], lr=1.0)
    sae.threshold.grad = torch.cat([torch.full((8,), 1.0), torch.full((8,), -1.0)])  # half pushed below zero
    optimizer.step()
    sae.after_optimizer_step()
    assert torch.equal(sae.threshold.detach()[:8], torch.zeros(8))
    assert torch.allclose(sae.threshold.detach()[8:], torch.full((8,), 1.001))
    assert int(sae.steps) == 1 and float(sae.W_dec.detach().norm(dim=1).max()) == pytest.approx(1.0)  # super() ran


def test_under_bf16_autocast_the_threshold_is_compared_and_kept_in_float32() -> None:
    theta, below, above = 1.001e-3, 1.0005e-3, 1.0015e-3
    as_bf16 = torch.tensor([theta, below, above]).bfloat16()
    assert as_bf16[0] == as_bf16[1] == as_bf16[2]  # in bf16 the three are one number: the test would catch a cast
    sae = _tiny(n_latents=1, threshold_init=theta, bandwidth=1e-6)
    pre = torch.tensor([[below], [above]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes = sae.activate(pre)[0]
        fired = StepFunction.apply(pre, sae.threshold, sae.bandwidth)
    assert torch.equal(codes, torch.tensor([[0.0], [above]])) and fired.flatten().tolist() == [0.0, 1.0]
    # a bf16 pre (a matmul's output under autocast) just above an fp32 threshold that bf16 would round onto it
    pre = torch.tensor([[above]]).bfloat16()
    with torch.no_grad():
        sae.threshold.fill_(pre.float().item() - 1e-7)
    assert sae.threshold.detach().bfloat16() == pre.flatten()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes = sae.activate(pre)[0]
        fired = StepFunction.apply(pre, sae.threshold, sae.bandwidth)
    assert torch.equal(codes, pre) and codes.dtype == torch.bfloat16 and fired.item() == 1.0
    # a training step under autocast: gradients and the parameter stay float32
    sae = _tiny()
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sae.training_step(torch.randn(32, 8))
    out["loss"].backward()
    assert sae.threshold.grad.dtype == torch.float32
    optimizer.step()
    sae.after_optimizer_step()
    assert sae.threshold.dtype == torch.float32


def test_l0_coefficient_ramps_up_and_a_target_l0_is_a_squared_relative_error() -> None:
    sae = _tiny(l0_coeff=2.0, l0_warmup="10st")
    x = torch.randn(32, 8)
    seen = {}
    for step in range(21):
        if step in (0, 5, 20):
            with torch.no_grad():
                out = sae.training_step(x)
            seen[step] = float(out["loss"] - out["recon_loss"]) / float(out["l0_loss"])
        sae.after_optimizer_step()
    assert seen == pytest.approx({0: 0.0, 5: 1.0, 20: 2.0}, rel=1e-4, abs=1e-6)
    with torch.no_grad():
        l0 = float(sae.training_step(x)["l0"])
    at_target = _tiny(target_l0=l0, l0_warmup="0st")
    assert float(at_target.training_step(x)["l0_loss"]) == pytest.approx(0.0, abs=1e-10)
    above = _tiny(target_l0=l0 * 2, l0_warmup="0st")  # fewer fire than the target: the penalty lowers thresholds
    _pre_near_threshold(above, x)
    with torch.no_grad():
        above.threshold.sub_(1e-4)  # row 0 fires, inside the window
    grad = torch.autograd.grad(_losses(above, x)["l0_term"], above.threshold)[0]
    assert (grad > 0).all()


def test_pre_activation_loss_reaches_dead_latents_only() -> None:
    sae = _tiny(pre_act_coeff=1.0, threshold_init=100.0, dead_window="2st")  # nothing fires: all die
    x = torch.randn(32, 8)
    for _ in range(2):
        assert float(sae.training_step(x)["pre_act_loss"]) == 0  # none dead yet
        sae.after_optimizer_step()
    with torch.no_grad():
        sae.threshold[:4] = -1e9  # latents 0-3 fire from now on, but the window still counts them dead
        sae.since_fired[:4] = 0
        sae.dead.copy_(sae.dead_mask())
    assert sae.n_dead == 12
    out = _losses(sae, x)
    assert float(out["pre_act_loss"]) > 0
    grad = torch.autograd.grad(out["pre_act_term"], sae.W_enc)[0]
    assert (grad[:, :4] == 0).all() and (grad[:, 4:].abs().sum(0) > 0).all()


def test_bad_settings_are_refused() -> None:
    for bad in ({"bandwidth": 0.0}, {"threshold_init": -1.0}, {"target_l0": 0}, {"l0_warmup": "1ep"}):
        with pytest.raises(ConfigError):
            _tiny(**bad)


class Losses:
    """A logger that keeps the training loss of every log step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log(self, metrics: dict, step: int) -> None:
        """Keep train/loss."""
        if "train/loss" in metrics:
            self.losses.append(float(metrics["train/loss"]))

    def close(self) -> None:
        """Nothing to close."""


def test_a_short_run_from_the_config_lowers_the_loss(compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(
        "+experiment=sae",
        "model=sae_jumprelu",
        "logger=none",
        "data.splits.d=16",
        "data.splits.n_features=32",
        "model.n_latents=64",
        "data.batch_size=128",
        "data.splits.n_val=256",
        "trainer.max_duration=40st",
        "optimizer.lr=1e-2",
        "trainer.log_interval=1st",
        "trainer.val_interval=40st",
        "checkpoint=none",
    )
    run = build(cfg)
    assert isinstance(run.task, JumpReLUSAE) and run.task.d_in == 16  # the width followed the data
    logged = Losses()
    run.loggers.append(logged)
    fit(run)
    assert run.stop_reason == "max_duration" and run.state.nonfinite_steps == 0 and len(logged.losses) == 40
    first, last = sum(logged.losses[:5]) / 5, sum(logged.losses[-5:]) / 5
    assert last < 0.7 * first, logged.losses
    assert (run.task.threshold >= 0).all() and run.task.threshold.dtype == torch.float32


def test_resampling_sets_a_dead_latent_s_threshold_back_and_forgets_its_optimizer_state() -> None:
    from types import SimpleNamespace

    from experiments.sae.callbacks import ResampleDead
    from runner.data import DataModule, TensorData
    from runner.distributed.strategies import Single
    from runner.progress import TrainingProgress

    sae, x = _tiny(threshold_init=0.01, dead_window="5st"), torch.randn(256, 8)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    sae.training_step((x,))["loss"].backward()
    opt.step()
    dead = torch.tensor([2, 9])
    with torch.no_grad():
        sae.threshold[dead] = 50.0  # climbed above anything the latents see: they never fire again
    sae.since_fired[dead] = 10
    before = sae.threshold.detach().clone()
    loader = DataModule({"train": TensorData(x)}, batch_size=64, shuffle=False).train_loader()
    progress = TrainingProgress("100st", batch_size=64, batches_per_epoch=4, samples_per_epoch=256)
    progress.count_micro_batch(64)
    progress.count_optimizer_step()
    run = SimpleNamespace(
        task=sae, progress=progress, train_loader=loader, optimizer=opt, strategy=Single("cpu"), world_size=1
    )
    ResampleDead(every="1st", until="1.0dur", samples=256).on_optimizer_step(run)
    live = torch.ones(16, dtype=torch.bool)
    live[dead] = False
    assert torch.all(sae.threshold[dead] == 0.01) and torch.equal(sae.threshold[live], before[live])
    assert torch.all(opt.state[sae.threshold]["exp_avg"][dead] == 0)
    assert torch.any(opt.state[sae.threshold]["exp_avg"][live] != 0)
