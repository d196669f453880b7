"""Sparse autoencoders: TopK (+AuxK), ReLU + L1, BatchTopK, on the recipe they share (experiments.sae.coders.base.SAE,
imported here too: configs and code name experiments.sae.coders.activations.SAE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from experiments.sae.coders.base import SAE, geometric_median  # noqa: F401 (geometric_median: re-exported)
from experiments.sae.coders.sparse import Pre, bag, pick, pick_columns, pick_flat, plain, top_indices
from runner import ConfigError
from runner.config.trust import buildable
from runner.progress import parse_duration


def auxk_loss(
    pre: Pre,
    dead: torch.Tensor,
    W_dec: torch.Tensor,
    k_aux: int,
    residual: torch.Tensor,
    masked: bool,
    kernels: str = "torch",
) -> torch.Tensor:
    """How badly the top k_aux `dead` latents (of `pre`, decoded by `W_dec`) reconstruct `residual`, normalised by its
    variance; exactly 0, with no gradient to any latent, when none is dead.

    Two ways to the same value and gradients. gathered: the dead columns picked out (nonzero: a read of the device),
    their top min(k_aux, n_dead) decoded densely, which with k_aux ~ d/2 codes per row is faster on the CPU than an
    embedding_bag (measured 33 vs 50 ms per step). masked: the top k_aux of every latent with the live ones at -inf,
    which ReLU turns into zero codes (no value, no gradient) when fewer than k_aux are dead, decoded sparsely, and
    multiplied by (any dead): nothing is read from the device (`kernels`: the SAE's choice for that sparse decode).
    A SparsePre's gradient reaches the dead columns only (gathered: densely in them; masked: the picked entries).
    """
    sst = (residual - residual.mean(0)).pow(2).sum(1).mean().clamp_min(1e-8)
    values = plain(pre)
    if masked:
        picked = values.masked_fill(~dead, float("-inf")).topk(min(k_aux, values.shape[1]), dim=1).indices
        top = pick(pre, picked).masked_fill(~dead[picked], float("-inf"))  # live picks: no value, no gradient
        aux = bag(picked, F.relu(top).to(W_dec.dtype), W_dec, kernels)
        return (aux - residual).pow(2).sum(1).mean() / sst * dead.any()
    dead_idx = dead.nonzero().flatten()
    if len(dead_idx) == 0:
        return torch.zeros((), device=values.device)
    dead_pre = pick_columns(pre, dead_idx)
    top, picked = dead_pre.topk(min(k_aux, len(dead_idx)), dim=1)
    aux = torch.zeros_like(dead_pre).scatter(1, picked, F.relu(top)) @ W_dec[dead_idx]
    return (aux - residual).pow(2).sum(1).mean() / sst


@buildable("model")
class TopKSAE(SAE):
    """Keeps the k largest pre-activations (ReLU'd) per sample; AuxK trains dead latents on the residual."""

    inference = "topk"  # what its inference is in SAELens's names (experiments/sae/formats/common.py)

    def __init__(
        self,
        k: int = 5,
        auxk_coeff: float = 1 / 32,
        k_aux: int | None = None,
        sparse_backward: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not 0 < k <= self.n_latents:
            raise ConfigError(f"model.k={k} must be in [1, n_latents={self.n_latents}]")
        self.k, self.auxk_coeff, self.sparse_backward = k, auxk_coeff, sparse_backward
        self.k_aux = k_aux or self.d_out // 2

    def activate(self, pre: Pre) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k values (ReLU'd) and their indices."""
        values, indices = plain(pre).topk(self.k, dim=1, sorted=False)
        return F.relu(pick(pre, indices, values)), indices

    def aux_loss(
        self, x: torch.Tensor, pre: Pre, values: torch.Tensor, indices: torch.Tensor | None, recon: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """AuxK: the top k_aux dead latents reconstruct the main residual (gradient reaches dead latents only)."""
        if self.auxk_coeff <= 0:
            return {"auxk_loss": torch.zeros((), device=x.device)}  # the same keys every step, for the log means
        # On a GPU, picking out the dead columns would read their number from the device every step; on the CPU
        # there is nothing to wait for, and the gather is the faster way (auxk_loss). On a GPU the masked way (a top
        # k_aux over every latent) runs only while the last log row saw dead latents.
        masked = x.device.type != "cpu"
        if masked and not self.auxk_active:
            return {"auxk_loss": torch.zeros((), device=x.device)}
        auxk = auxk_loss(pre, self.dead, self.W_dec, self.k_aux, (x - recon).detach(), masked, self.kernels)
        return {"auxk_loss": auxk.detach(), "auxk_term": self.auxk_coeff * auxk}


@buildable("model")
class ReLUSAE(SAE):
    """ReLU codes with an L1 penalty (weighted by decoder norms), its coefficient warmed up linearly from 0."""

    inference = "standard"

    def __init__(self, l1_coeff: float = 0.1, l1_warmup: str = "100st", **kwargs) -> None:
        super().__init__(**kwargs)
        warmup = parse_duration(l1_warmup)
        if warmup.unit != "st":
            raise ConfigError(f"model.l1_warmup={l1_warmup}: give it in optimizer steps (st)")
        self.l1_coeff, self.l1_warmup = l1_coeff, warmup.value
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def after_optimizer_step(self) -> None:
        """Also count steps for the L1 warmup."""
        super().after_optimizer_step()
        self.steps += 1

    def revive_hint(self, key: str = "model") -> str:
        """What keeps this SAE's latents in use: its L1 silences them and no AuxK trains them back."""
        return (
            f"its L1 ({key}.l1_coeff={self.l1_coeff:g}) silences latents and ReLU codes have no AuxK to train them "
            "back: sae_resample in callbacks=[...] restarts them, a smaller coefficient or a TopK SAE (model=sae_topk) "
            "keeps them in use"
        )

    def activate(self, pre: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Dense ReLU codes."""
        return F.relu(pre), None

    def aux_loss(
        self, x: torch.Tensor, pre: torch.Tensor, values: torch.Tensor, indices: None, recon: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """L1 of the codes times decoder row norms, normalised by the input variance like the reconstruction."""
        l1 = (values * torch.linalg.vector_norm(self.W_dec, dim=1)).sum(1).mean() / x.shape[1] ** 0.5
        ramp = (self.steps.float() / self.l1_warmup).clamp(max=1.0) if self.l1_warmup > 0 else 1.0
        return {"l1_loss": l1.detach(), "l1_term": self.l1_coeff * ramp * l1}


@buildable("model")
class BatchTopKSAE(SAE):
    """Keeps the k x batch largest activations across the batch; inference uses a learned global threshold."""

    inference = "jumprelu"  # at inference: ReLU codes above the global threshold

    def __init__(
        self,
        k: int = 5,
        auxk_coeff: float = 1 / 32,
        k_aux: int | None = None,
        threshold_momentum: float = 0.99,
        sparse_backward: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not 0 < k <= self.n_latents:
            raise ConfigError(f"model.k={k} must be in [1, n_latents={self.n_latents}]")
        self.k, self.momentum, self.sparse_backward = k, threshold_momentum, sparse_backward
        self.auxk_coeff, self.k_aux = auxk_coeff, k_aux or self.d_out // 2
        self.register_buffer("threshold", torch.full((), -1.0))

    def activate(self, pre: Pre) -> tuple[torch.Tensor, None]:
        """Training: batch top-k (and update the threshold); eval: everything above the threshold."""
        if not self.training:
            pre = F.relu(plain(pre))
            return pre * (pre > self.threshold), None
        flat = F.relu(plain(pre).detach()).flatten()  # to select from; the kept values' gradient comes from pick
        idx = top_indices(flat, min(self.k * len(plain(pre)), len(flat)))
        top = F.relu(pick_flat(pre, idx))
        with torch.no_grad():
            smallest = top.detach().min()
            new = torch.where(
                self.threshold < 0, smallest, self.momentum * self.threshold + (1 - self.momentum) * smallest
            )
            self.threshold.copy_(new)
        return torch.zeros_like(flat).scatter(0, idx, top).view_as(plain(pre)), None

    aux_loss = TopKSAE.aux_loss  # the same AuxK on dead latents
