"""What a coder is trained and scored by: how well it reconstructs its target, in a micro-batch (the loss) and over a
whole validation split (the metrics). Shared by SAEs, transcoders and cross-layer transcoders (each layer's target)."""

from __future__ import annotations

import torch


def batch_errors(recon: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's SSE (squared error summed over a row, averaged over rows) and SST (the same of the target about
    the batch's mean): SSE / SST is the loss, scale-free, and 1 - SSE / SST the batch's FVE."""
    sse = (recon - target).pow(2).sum(1).mean()
    return sse, (target - target.mean(0)).pow(2).sum(1).mean()


def split_statistics(
    recon: torch.Tensor, target: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None, n_latents: int
) -> dict[str, torch.Tensor]:
    """Per-row statistics in float64 that runner averages over a whole validation split (every rank's shard): the
    squared error, the target's first and second moments, L0 and each latent's firing rate (codes as `activate` gives
    them: values [B, k] at `indices`, or dense)."""
    recon, target, fired = recon.double(), target.double(), values > 0
    counts = fired.double()  # [B, k] at `indices`, or [B, n_latents]
    if indices is None:
        rate = counts.mean(0)
    else:
        # A row's indices are distinct (its top k), so each latent's count of firing rows is a count of its index
        # among the fired ones: the exact sums of the dense [B, n_latents] matrix, without making it (B x n_latents
        # float64 a batch: 128 MiB at 1024 x 16384)
        rate = torch.bincount(indices[fired], minlength=n_latents).double() / len(values)
    return {
        "sse": (recon - target).pow(2).sum(1).mean(),
        "x_mean": target.mean(0),  # [d]: the target's (an SAE's: its inputs')
        "x_sq": target.pow(2).sum(1).mean(),
        "l0": counts.sum(1).mean(),
        "firing_rate": rate,  # [n_latents]: the split's mean is each latent's rate over all its rows
    }


def unexplained(means: dict[str, torch.Tensor], suffix: str = "") -> torch.Tensor:
    """SSE / SST over the split from split_statistics' means (keys ending in `suffix`): SST about the split's own
    per-dimension mean, not about zero, and not a mean of per-batch ratios."""
    return means[f"sse{suffix}"] / (means[f"x_sq{suffix}"] - means[f"x_mean{suffix}"].pow(2).sum())
