"""How every coder starts: its settings checked, and the data-dependent init (the scale that makes E||x|| = sqrt(d),
the geometric median, every rank's first rows, the encoder's least-squares scale)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runner import ConfigError, check_whole


def check_settings(
    d_in: Any, n_latents: Any, d_out: Any, skip: Any, b_enc_init: float, encoder_init: str | float
) -> float | None:
    """Refuse what an SAE cannot be built with, naming the setting; the encoder columns' starting norm, if given."""
    if isinstance(d_in, bool) or not isinstance(d_in, int) or d_in < 1:
        raise ConfigError(
            f"model.d_in={d_in}: the SAE's input width is unknown (its data gives none). Several hooked modules "
            "(source.module=[...]) need model=sae_multi, which makes an SAE for each"
        )
    check_whole(n_latents, "model.n_latents")
    if d_out is not None:
        check_whole(d_out, "model.d_out")
    if skip not in (True, False) or (skip and d_out is None):
        raise ConfigError(
            f"model.skip={skip!r}: a skip connection maps a transcoder's input to its target; it needs a target "
            "(source.target=<module>, or data with d_out), and true or false"
        )
    if not abs(b_enc_init) <= torch.finfo(torch.float32).max:  # a float32 parameter (a NaN fails too)
        raise ConfigError(f"model.b_enc_init must be a finite number, got {b_enc_init}: e.g. model.b_enc_init=0.0")
    norm = encoder_init if isinstance(encoder_init, (int, float)) and not isinstance(encoder_init, bool) else None
    if encoder_init not in ("unit", "fit") and not (norm is not None and 0 < norm < float("inf")):
        raise ConfigError(
            f"model.encoder_init={encoder_init!r}: give unit, fit or the encoder columns' starting norm (e.g. 0.5)"
        )
    return norm


def geometric_median(points: torch.Tensor, iterations: int = 100, tol: float = 1e-6) -> torch.Tensor:
    """Weiszfeld's algorithm: the point minimising the sum of Euclidean distances to `points` [N, d]."""
    median = points.mean(0)
    for _ in range(iterations):
        weights = 1.0 / torch.linalg.vector_norm(points - median, dim=1).clamp_min(1e-8)
        new = (weights[:, None] * points).sum(0) / weights.sum()
        if torch.linalg.vector_norm(new - median) <= tol * torch.linalg.vector_norm(median).clamp_min(1e-8):
            return new
        median = new
    return median


def ranks_share(sae: nn.Module) -> bool:
    """Whether other ranks train copies of `sae` on other rows of each batch (DDP, FSDP), not this rank alone on
    every rank's rows (distributed=spread: `sees_global_batch`)."""
    return (
        not getattr(sae, "sees_global_batch", False)
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def every_rank(rows: torch.Tensor, sae: nn.Module) -> torch.Tensor:
    """Every rank's `rows` in rank order (the global batch, as one process would see it) where ranks share `sae`."""
    if not ranks_share(sae):
        return rows
    # once per run (a data-dependent init): the ranks' first batches, whatever their sizes, through pickling
    samples: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(samples, rows.detach().cpu())
    return torch.cat(samples).to(rows.device)


def unit_scale(x: torch.Tensor) -> torch.Tensor:
    """The factor that makes E||x|| = sqrt(width) of rows `x`."""
    return x.shape[1] ** 0.5 / torch.linalg.vector_norm(x, dim=1).mean().clamp_min(1e-8)


@torch.no_grad()
def fit_encoder_scale(sae: nn.Module, xn: torch.Tensor, yn: torch.Tensor) -> None:
    """Scale `sae`'s encoder (encoder_init=fit) by the least-squares factor that best reconstructs the normalised
    target `yn` of the first batch `xn`."""
    # Unit-norm encoder columns start the codes, hence the reconstruction, several times too large: on a GPT's
    # residual stream (128 -> 2048, k 32) Adam then spends the run shrinking them (held-out FVE 0.946; sparsify's
    # nn.Linear init, columns of norm ~0.58, gave 0.970). Scaled by the least-squares factor that best
    # reconstructs the first batch instead: 0.974, for any width and k. With b_enc = 0, top-k codes pick the same
    # latents at any scale and scale with it, so the reconstruction is linear in the factor.
    kept = {name: buffer.clone() for name, buffer in sae.named_buffers()}  # BatchTopK's threshold: untouched
    recon = sae.decode(*sae.activate(sae.pre_activations(xn))) - sae.b_dec
    fit = (recon * (yn - sae.b_dec)).sum() / recon.pow(2).sum().clamp_min(1e-12)
    sae.W_enc.mul_(torch.where(fit > 0, fit, 1.0))
    for name, buffer in sae.named_buffers():
        buffer.copy_(kept[name])
