"""Scores of a learned dictionary: against known ground-truth features, the fraction of the loss a splice
recovers, and the frontier the report draws."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.sweeps.frontier import Frontier

# What `python -m runner.report` tabulates and draws for a sweep of k or width, or one run's family (model=sae_multi),
# through the entry point runner.frontiers: SAEBench compares SAEs along an L0 sweep, never at one L0. The spliced
# metrics are there with callbacks=sae_splice.
FRONTIER = Frontier(
    x="val/l0",
    y=("val/fve", "val/kl_spliced", "val/loss_recovered", "val/dead_fraction", "val/faint_fraction"),
    log_x=True,
)


@torch.no_grad()
def feature_recovery(
    decoder: torch.Tensor, true_features: torch.Tensor, thresholds: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)
) -> dict[str, float]:
    """MMCS (mean over true features of the best cosine with any decoder row) and the fraction recovered at each
    cosine threshold. `decoder` is [n_latents, d] (one direction per row), `true_features` [K, d]."""
    cos = F.normalize(true_features.float(), dim=1) @ F.normalize(decoder.float(), dim=1).t()
    best = cos.max(dim=1).values
    scores = {"mmcs": best.mean().item()}
    scores.update({f"recovered_{t:g}": (best >= t).float().mean().item() for t in thresholds})
    return scores


def summary_metric(metrics: dict, key: str) -> object:
    """A run's summary metric `key` (e.g. val/dead_fraction) under its name today: a summary that holds
    val/unfired_fraction counted the training window's silent latents as dead_fraction and the field's dead ones as
    unfired_fraction."""
    if key.endswith("dead_fraction") and (old := key.removesuffix("dead_fraction") + "unfired_fraction") in metrics:
        return metrics[old]
    return metrics.get(key)


@torch.no_grad()
def relative_error(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    """||estimate - truth|| / ||truth|| (Frobenius): how far a learned map is from the true one (0: exact)."""
    return (torch.linalg.norm(estimate.float() - truth.float()) / torch.linalg.norm(truth.float())).item()


# An ablation that moves the loss by less than this share of it leaves the recovered fraction meaningless: a ratio
# of two differences near float noise gave 1.58 "recovered" from an ablation that cost 0.03%
MIN_ABLATION_GAP = 1e-3


def loss_recovered(ablated: float, spliced: float, clean: float) -> tuple[float, str | None]:
    """(ablated - spliced) / (ablated - clean), the share of the ablation's loss the splice recovers; NaN with the
    reason when the ablation moves the loss by under MIN_ABLATION_GAP of it (nothing to divide by)."""
    gap = ablated - clean
    if not abs(gap) >= MIN_ABLATION_GAP * max(abs(clean), 1e-12):  # a NaN loss too
        return float("nan"), f"the ablation moves the loss by {gap:.3g} of {clean:.4g}: too little to divide by"
    return (ablated - spliced) / gap, None
