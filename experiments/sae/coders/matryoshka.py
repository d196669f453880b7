"""Matryoshka SAE (Bussmann et al. 2025, "Learning Multi-Level Features with Matryoshka SAEs"; Nabeshima 2024).

The latents are split into consecutive groups, and every prefix of groups must reconstruct the input on its own: the
loss is the sum, over prefix ends m, of the reconstruction error using only latents [0, m) of the codes (plus b_dec),
each normalised like the parent's `recon_loss` (SSE / SST). Early latents are thereby pushed to carry the most
frequent, general directions, and later ones to refine them rather than absorb them. The codes themselves come from
TopK or BatchTopK over all latents, so at inference the SAE is an ordinary one of that kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

import torch

from experiments.sae.coders.activations import BatchTopKSAE, TopKSAE
from experiments.sae.coders.sparse import Pre
from runner import ConfigError
from runner.config.trust import buildable


def prefix_ends(group_sizes: Sequence[float], n_latents: int) -> tuple[int, ...]:
    """Prefix boundaries (cumulative group sizes, the last n_latents) from latent counts summing to n_latents or from
    fractions summing to 1 (rounded; fractions keep working when n_latents is overridden)."""
    sizes = [float(s) for s in group_sizes]
    where = f"model.group_sizes={list(group_sizes)}"
    if not sizes or min(sizes) <= 0:
        raise ConfigError(f"{where}: give one or more positive group sizes")
    if all(s.is_integer() for s in sizes) and sum(sizes) == n_latents:
        ends = [int(e) for e in accumulate(sizes)]
    elif math.isclose(sum(sizes), 1.0, abs_tol=1e-6):
        ends = [round(e * n_latents) for e in accumulate(sizes)]
        ends[-1] = n_latents
    else:
        raise ConfigError(f"{where}: sizes must sum to n_latents={n_latents} (latent counts) or to 1 (fractions)")
    if any(b <= a for a, b in zip([0, *ends[:-1]], ends, strict=True)):
        raise ConfigError(f"{where}: a group of n_latents={n_latents} would be empty: {ends} (prefix ends)")
    return tuple(ends)


@buildable("model")
class MatryoshkaSAE(BatchTopKSAE):
    """Nested prefix losses over latent groups; codes from BatchTopK (the parent, threshold at inference) or TopK.

    The codes stay as `activate` gives them: each row's picked latents (TopK; BatchTopK on the CPU) or dense (BatchTopK
    elsewhere, and at inference). A prefix's reconstruction is then the ordinary decode of the codes of latents [0, m)
    only: for picked latents, the others' values zeroed (a sparse decode each, k rows summed per sample); for dense
    codes, group by group, each adding its own slice of one product.
    """

    def __init__(
        self, group_sizes: Sequence[float] = (0.0625, 0.1875, 0.75), activation: str = "batchtopk", **kwargs
    ) -> None:
        super().__init__(**kwargs)
        if activation not in ("topk", "batchtopk"):
            raise ConfigError(f"model.activation={activation}: choose topk or batchtopk")
        self.activation = activation
        self.inference = "topk" if activation == "topk" else "jumprelu"  # BatchTopK's: its global threshold
        self.prefix_ends = prefix_ends(group_sizes, self.n_latents)

    def activate(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chosen activation's codes."""
        return TopKSAE.activate(self, pre) if self.activation == "topk" else super().activate(pre)

    def _inner_decodes(self, values: torch.Tensor, indices: torch.Tensor | None) -> list[torch.Tensor]:
        # Reconstructions from each prefix but the full one.
        if indices is not None:
            return [self.decode(torch.where(indices < end, values, 0.0), indices) for end in self.prefix_ends[:-1]]
        recons, recon, start = [], self.b_dec, 0
        for end in self.prefix_ends[:-1]:
            recon = recon + values[:, start:end] @ self.W_dec[start:end]
            recons.append(recon)
            start = end
        return recons

    def prefix_decodes(self, values: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
        """Reconstructions [n_prefixes, B, d] (normalised units) of codes (as `activate` gives them) using latents
        [0, m) for each prefix end m; the last is the ordinary decode."""
        return torch.stack([*self._inner_decodes(values, indices), self.decode(values, indices)])

    def prefix_losses(
        self, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None, recon: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each prefix's SSE / SST of normalised inputs `x` (the full prefix's from `recon`, already computed), and
        `prefix_<m>_nmse` metrics (SSE / sum of squares, as `nmse`)."""
        sse = torch.stack([(r - x).pow(2).sum(1).mean() for r in [*self._inner_decodes(values, indices), recon]])
        sst = (x - x.mean(0)).pow(2).sum(1).mean()
        nmse = sse.detach() / x.pow(2).sum(1).mean()
        return sse / sst, {f"prefix_{m}_nmse": nmse[i] for i, m in enumerate(self.prefix_ends)}

    def aux_loss(
        self, x: torch.Tensor, pre: Pre, values: torch.Tensor, indices: torch.Tensor | None, recon: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """AuxK (on the full prefix's residual, as the parent) plus the inner prefixes' losses: `_step` adds the full
        one as `recon_loss`, so the loss is the sum over every prefix."""
        losses, metrics = self.prefix_losses(x, values, indices, recon)
        out = {**super().aux_loss(x, pre, values, indices, recon), **metrics}
        out["matryoshka_loss"] = losses.sum().detach()
        out["matryoshka_term"] = losses[:-1].sum()
        return out

    def validation_step(self, batch) -> dict[str, torch.Tensor]:
        """The parent's statistics plus each prefix's squared error, in float64 (validation_summary makes them
        `prefix_<m>_nmse` over the whole split)."""
        out = super().validation_step(batch)
        # The parent's step keeps its codes to itself: encoding again is one more forward on a validation batch.
        xn, yn = self._normalised(batch)
        recons = (self.prefix_decodes(*self.activate(self.pre_activations(xn))) + self.skip_part(xn)).double()
        return {**out, "prefix_sse": (recons - yn.double()).pow(2).sum(2).mean(1)}  # [n_prefixes]

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parent's metrics, each prefix's SSE / sum of squares over the split, and the sum of the prefixes'
        SSE / SST (`matryoshka_loss`, as trained)."""
        means = dict(means)
        sse = means.pop("prefix_sse")
        out = super().validation_summary(means)
        sst = means["x_sq"] - means["x_mean"].pow(2).sum()
        out.update({f"prefix_{m}_nmse": sse[i] / means["x_sq"] for i, m in enumerate(self.prefix_ends)})
        out["matryoshka_loss"] = (sse / sst).sum()
        return out
