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
    recon: torch.Tensor,
    target: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor | None,
    n_latents: int,
    row_norms: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-row statistics in float64 that runner averages over a whole validation split (every rank's shard): the
    squared error, the target's first and second moments, L0 and each latent's firing rate (codes as `activate` gives
    them: values [B, k] at `indices`, or dense); with the decoder's `row_norms`, each latent's code mass and its row's
    norm, what faint_share reads."""
    recon, target, fired = recon.double(), target.double(), values > 0
    counts = fired.double()  # [B, k] at `indices`, or [B, n_latents]
    if indices is None:
        rate = counts.mean(0)
    else:
        # A row's indices are distinct (its top k), so each latent's count of firing rows is a count of its index
        # among the fired ones: the exact sums of the dense [B, n_latents] matrix, without making it (B x n_latents
        # float64 a batch: 128 MiB at 1024 x 16384)
        rate = torch.bincount(indices[fired], minlength=n_latents).double() / len(values)
    out = {
        "sse": (recon - target).pow(2).sum(1).mean(),
        "x_mean": target.mean(0),  # [d]: the target's (an SAE's: its inputs')
        "x_sq": target.pow(2).sum(1).mean(),
        "l0": counts.sum(1).mean(),
        "firing_rate": rate,  # [n_latents]: the split's mean is each latent's rate over all its rows
    }
    if row_norms is not None:  # each latent's mean code over the rows (0 where it did not fire), summed in float64
        if indices is None:
            mass = values.clamp(min=0).sum(0, dtype=torch.float64) / len(values)
        else:
            mass = torch.bincount(indices[fired], values[fired].double(), minlength=n_latents) / len(values)
        out["code_mass"], out["row_norm"] = mass, row_norms.detach().double()
    return out


# A latent that fires but writes less than this share of the median firing latent's is faint
FAINT = 0.1


def faint_share(means: dict[str, torch.Tensor]) -> torch.Tensor:
    """The share of latents that fire on the split yet write almost nothing: a latent's write is its mean code when it
    fires times its decoder row's norm, and it is faint under FAINT of the median firing latent's. Free decoder rows
    (JumpReLU's) can shrink towards zero while their latents keep firing, which dead_fraction does not count."""
    rate, mass, norm = means["firing_rate"], means["code_mass"], means["row_norm"]
    fired = rate > 0
    if not fired.any():
        return torch.zeros((), dtype=torch.float64, device=rate.device)
    write = mass[fired] / rate[fired] * norm[fired]
    return (write < FAINT * write.median()).double().sum() / len(rate)


def unexplained(means: dict[str, torch.Tensor], suffix: str = "") -> torch.Tensor:
    """SSE / SST over the split from split_statistics' means (keys ending in `suffix`): SST about the split's own
    per-dimension mean, not about zero, and not a mean of per-batch ratios."""
    return means[f"sse{suffix}"] / (means[f"x_sq{suffix}"] - means[f"x_mean{suffix}"].pow(2).sum())
