"""JumpReLU SAE (Rajamanoharan et al. 2024, "Jumping Ahead: Improving Reconstruction Fidelity with JumpReLU SAEs").

Each latent fires when its pre-activation exceeds its own learned threshold: codes = pre * H(pre - threshold), and
the sparsity penalty counts the firing latents (L0) directly. Neither the jump nor the count has a useful derivative in
the threshold, so both use the paper's pseudo-derivatives, a rectangle kernel of width `bandwidth` around it:
    d/dthreshold JumpReLU = -(threshold / bandwidth) * K((pre - threshold) / bandwidth)
    d/dthreshold H        = -(1 / bandwidth) * K((pre - threshold) / bandwidth),   K(u) = 1 for |u| < 1/2
The pre-activations get the true derivatives: H(pre - threshold) through the JumpReLU and none through the count (the
penalty moves thresholds only). Thresholds are stored as they are (not as logs as in the paper and in Anthropic's
Jan-2025 update: with logs, Adam's steps are multiplicative and a tiny threshold hardly moves) and clamped at zero
after each step. As in SAELens and Anthropic's update, an optional pre-activation loss pulls dead latents' pre-
activations up towards their thresholds, and as in dictionary_learning, the penalty may aim at a target L0 instead.
"""

from __future__ import annotations

from typing import Any

import torch

from experiments.sae.coders.base import SAE
from runner import ConfigError
from runner.config.trust import buildable
from runner.progress import parse_duration


def _window(pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
    # The rectangle kernel K((pre - threshold) / bandwidth), flattened to [N, n_latents], in float32: under bf16
    # autocast pre is bf16 and bandwidth-sized differences would vanish in its 8-bit mantissa.
    z = pre.reshape(-1, pre.shape[-1]).float() - threshold
    return (z.abs() < bandwidth / 2).float()


class JumpReLUFunction(torch.autograd.Function):
    """pre * H(pre - threshold) with the paper's pseudo-derivative in the threshold."""

    @staticmethod
    def forward(ctx: Any, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        """Codes in pre's dtype; the comparison in float32, so that a bf16 pre never rounds the threshold."""
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre.float() > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """H(pre - threshold) to pre; the kernel's pseudo-derivative, summed over the batch, to the threshold."""
        pre, threshold = ctx.saved_tensors
        grad_pre = grad * (pre.float() > threshold).to(grad.dtype)
        kernel = _window(pre, threshold, ctx.bandwidth) * grad.reshape(-1, grad.shape[-1]).float()
        return grad_pre, -(threshold / ctx.bandwidth) * kernel.sum(0), None


class StepFunction(torch.autograd.Function):
    """H(pre - threshold) as float32, with the paper's pseudo-derivative in the threshold and none in pre."""

    @staticmethod
    def forward(ctx: Any, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        """1 where a latent fires, else 0 (float32)."""
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre.float() > threshold).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        """The kernel's pseudo-derivative, summed over the batch, to the threshold."""
        pre, threshold = ctx.saved_tensors
        kernel = _window(pre, threshold, ctx.bandwidth) * grad.reshape(-1, grad.shape[-1]).float()
        return None, -kernel.sum(0) / ctx.bandwidth, None


@buildable("model")
class JumpReLUSAE(SAE):
    """JumpReLU codes with a per-latent threshold and an L0 penalty, its coefficient warmed up linearly from 0."""

    inference = "jumprelu"

    def __init__(
        self,
        threshold_init: float = 0.001,
        bandwidth: float = 0.001,
        l0_coeff: float = 1e-3,
        l0_warmup: str = "100st",
        target_l0: float | None = None,
        pre_act_coeff: float = 0.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        # (a float32 parameter: a value beyond float32's range would overflow; a NaN fails too)
        if not 0 <= threshold_init <= torch.finfo(torch.float32).max or not bandwidth > 0:
            raise ConfigError(f"model.threshold_init={threshold_init} must be >= 0 and bandwidth={bandwidth} > 0")
        if target_l0 is not None and target_l0 <= 0:
            raise ConfigError(f"model.target_l0={target_l0} must be > 0 (or null: penalise L0 itself)")
        warmup = parse_duration(l0_warmup)
        if warmup.unit != "st":
            raise ConfigError(f"model.l0_warmup={l0_warmup}: give it in optimizer steps (st)")
        self.bandwidth, self.l0_coeff, self.l0_warmup = bandwidth, l0_coeff, warmup.value
        self.threshold_init = float(threshold_init)
        self.target_l0, self.pre_act_coeff = target_l0, pre_act_coeff
        # float32 whatever the autocast: a bf16 threshold could not move by steps smaller than 1/256 of itself
        self.threshold = torch.nn.Parameter(torch.full((self.n_latents,), float(threshold_init)))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def latent_slices(self, latents: torch.Tensor) -> dict[torch.nn.Parameter, tuple[Any, ...]]:
        """The base SAE's, and the latents' thresholds."""
        return {**super().latent_slices(latents), self.threshold: (latents,)}

    @torch.no_grad()
    def restart_latents(self, latents: torch.Tensor) -> None:
        """Also the thresholds back at threshold_init: a dead latent's may have climbed above anything it sees."""
        super().restart_latents(latents)
        self.threshold[latents] = self.threshold_init

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Also keep thresholds >= 0 (a negative one would let negative codes through) and count warmup steps."""
        super().after_optimizer_step()
        self.threshold.clamp_(min=0.0)
        self.steps += 1

    def revive_hint(self, key: str = "model") -> str:
        """What brings a JumpReLU's unused latents back: its pre-act loss, a lower starting threshold, a longer run
        (on a GPT's residual stream after 160 steps: 5.1% never fired from thresholds at 1.0, 0.6% from 0.5)."""
        window = f"{key}.dead_window={self.dead_window:g}{self.dead_unit}"
        pull = (
            f"its pre-act loss ({key}.pre_act_coeff={self.pre_act_coeff:g}) pulls latents silent for {window} up to "
            "their thresholds"
            if self.pre_act_coeff > 0
            else f"nothing pulls a silent latent back up ({key}.pre_act_coeff=0; the preset's 0.001 does)"
        )
        return (
            f"{pull}; a lower starting threshold ({key}.threshold_init={self.threshold_init:g}) or a longer "
            "trainer.max_duration leaves fewer unused"
        )

    def activate(self, pre: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Dense JumpReLU codes."""
        return JumpReLUFunction.apply(pre, self.threshold, self.bandwidth), None

    def aux_loss(
        self, x: torch.Tensor, pre: torch.Tensor, values: torch.Tensor, indices: None, recon: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The L0 penalty (or its squared distance from target_l0) and, for dead latents, the pre-activation loss."""
        l0 = StepFunction.apply(pre, self.threshold, self.bandwidth).sum(-1).mean()
        penalty = l0 if self.target_l0 is None else (l0 / self.target_l0 - 1).pow(2)
        ramp = (self.steps.float() / self.l0_warmup).clamp(max=1.0) if self.l0_warmup > 0 else 1.0
        out = {"l0_loss": penalty.detach(), "l0_term": self.l0_coeff * ramp * penalty}
        if self.pre_act_coeff > 0:
            # How far below its threshold each dead latent sits (0 for live ones: the mask is on the device, no read),
            # weighted by decoder norms and divided by sqrt(d) as ReLUSAE divides its L1; pulls pre up, threshold down.
            gap = (self.threshold - pre.float()).clamp_min(0) * self.dead * torch.linalg.vector_norm(self.W_dec, dim=1)
            pre_act = gap.sum(-1).mean() / x.shape[-1] ** 0.5
            out.update(pre_act_loss=pre_act.detach(), pre_act_term=self.pre_act_coeff * pre_act)
        out["threshold_mean"] = self.threshold.detach().mean()
        return out
