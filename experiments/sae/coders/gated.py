"""Gated SAE (Rajamanoharan et al. 2024, "Improving Dictionary Learning with Gated Sparse Autoencoders").

Which latents fire and how strongly they fire are two paths through one shared encoder matrix (a transcoder reads
its input x uncentred, as the base SAE's does):
    pi_gate = (x - b_dec) W_enc + b_gate                        a latent fires where pi_gate > 0
    f_mag   = ReLU((x - b_dec) (W_enc * exp(r_mag)) + b_mag)     its magnitude
    f       = 1[pi_gate > 0] * f_mag
The L1 penalty falls on ReLU(pi_gate) (times decoder row norms, as the ReLU SAE's), never on the codes: an L1 on the
codes shrinks them (the bias the paper sets out to remove), while on the gate it only decides which latents fire. The
Heaviside gate has no gradient, so the reconstruction trains the magnitude path (W_enc, r_mag, b_mag) and the decoder,
and the gate learns from the L1 and from an auxiliary reconstruction from ReLU(pi_gate) through a frozen (detached)
decoder and b_dec, which keeps the gate's pre-activations on the codes' scale (the paper's section 3; SAELens's
GatedTrainingSAE, whose auxiliary decoder is not detached).

b_enc is b_gate: the recipe's `pre_activations` are pi_gate, so validation, resampling, the transcoder's initial
centring and the checkpoint keys are the base SAE's. exp(r_mag) scales encoder columns, so the magnitudes are pi_gate
less b_gate, scaled per latent, plus b_mag: one matrix product for both paths. Subtracting b_gate there also cancels,
exactly, the gradient that pi_gate would pass it through the magnitudes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from experiments.sae.coders.base import SAE
from experiments.sae.objectives import batch_errors
from runner import ConfigError
from runner.config.trust import buildable
from runner.progress import parse_duration


@buildable("model")
class GatedSAE(SAE):
    """Gated codes: a gate (b_enc as b_gate) picks the latents, a rescaled magnitude path (r_mag, b_mag) sets them."""

    inference = "gated"  # SAELens's architecture name (experiments/sae/formats/common.py)

    def __init__(self, l1_coeff: float = 0.3, l1_warmup: str = "100st", **kwargs) -> None:
        super().__init__(**kwargs)
        warmup = parse_duration(l1_warmup)
        if warmup.unit != "st":
            raise ConfigError(f"model.l1_warmup={l1_warmup}: give it in optimizer steps (st)")
        if not 0 <= l1_coeff < float("inf"):
            raise ConfigError(f"model.l1_coeff={l1_coeff} must be a number >= 0")
        self.l1_coeff, self.l1_warmup = l1_coeff, warmup.value
        # zeros, as in the paper and SAELens: the magnitude path starts as the gate's encoder, without its bias
        self.r_mag = torch.nn.Parameter(torch.zeros(self.n_latents))
        self.b_mag = torch.nn.Parameter(torch.zeros(self.n_latents))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    @property
    def b_gate(self) -> torch.nn.Parameter:
        """The gate's bias: the recipe's b_enc."""
        return self.b_enc

    @torch.no_grad()
    def initialize_from(self, rows: torch.Tensor) -> None:
        """The base SAE's init; a transcoder's b_mag also gets the shift its b_gate got (both read the input
        uncentred through W_enc: without it, every magnitude would start with the input mean's projection)."""
        before = self.b_enc.clone()
        super().initialize_from(rows)
        self.b_mag.add_((self.b_enc - before) * self.r_mag.exp())

    def latent_slices(self, latents: torch.Tensor) -> dict[torch.nn.Parameter, tuple[Any, ...]]:
        """The base SAE's (W_enc and b_enc = b_gate shared by both paths), and the magnitude path's r_mag and b_mag."""
        return {**super().latent_slices(latents), self.r_mag: (latents,), self.b_mag: (latents,)}

    @torch.no_grad()
    def restart_latents(self, latents: torch.Tensor) -> None:
        """Also the magnitude path back at its start (r_mag and b_mag 0)."""
        super().restart_latents(latents)
        self.r_mag[latents] = 0.0
        self.b_mag[latents] = 0.0

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Also count steps for the L1 warmup."""
        super().after_optimizer_step()
        self.steps += 1

    def activate(self, pre: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Dense gated codes from the gate's pre-activations pi_gate (what `pre_activations` gives)."""
        # A comparison has no gradient: the gate's parameters learn through aux_loss's terms only
        gate = (pre > 0).to(pre.dtype)
        magnitudes = F.relu((pre - self.b_enc) * self.r_mag.exp() + self.b_mag)
        return gate * magnitudes, None

    def aux_loss(
        self, x: torch.Tensor, pre: torch.Tensor, values: torch.Tensor, indices: None, recon: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The L1 of ReLU(pi_gate) times decoder row norms (normalised as ReLUSAE's L1) and the auxiliary
        reconstruction of the target from ReLU(pi_gate) through the frozen decoder (normalised as recon_loss)."""
        active = F.relu(pre.float())
        l1 = (active * torch.linalg.vector_norm(self.W_dec, dim=1)).sum(1).mean() / x.shape[1] ** 0.5
        ramp = (self.steps.float() / self.l1_warmup).clamp(max=1.0) if self.l1_warmup > 0 else 1.0
        # the target detached too: a skip transcoder's target less its skip part must not train W_skip from here
        sse, sst = batch_errors(active @ self.W_dec.detach() + self.b_dec.detach(), x.detach())
        aux = sse / sst.clamp_min(1e-8)
        return {
            "l1_loss": l1.detach(),
            "l1_term": self.l1_coeff * ramp * l1,
            "aux_recon_loss": aux.detach(),
            "aux_recon_term": aux,
        }
