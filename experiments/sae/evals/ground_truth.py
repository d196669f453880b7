"""SynthSAEBench's ground-truth metrics of an SAE, as SAELens's sae_lens/synthetic/evals.py defines them: MCC (the
mean |cosine| of a one-to-one Hungarian match of decoder rows and true directions), uniqueness (distinct best-matched
true features per latent), per-latent precision, recall, F1 and accuracy of each latent as a detector of its best-
matched true feature (means over latents, 0 where undefined), explained variance, shrinkage (|x_hat| / |x|), dead
latents, and the SAE's and the data's L0. One module for callbacks=sae_ground_truth (val/gt_*) and
`python -m runner.sae_eval RUN evals=[ground_truth]`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from scipy.optimize import linear_sum_assignment

from runner import ConfigError

KEYS = (
    "mcc",
    "uniqueness",
    "precision",
    "recall",
    "f1",
    "accuracy",
    "explained_variance",
    "shrinkage",
    "dead_latents",
    "l0",
    "true_l0",
)
_MIN_NORM = 1e-6  # inputs of smaller norm are left out of the shrinkage (SAELens's ShrinkageCalculator)


def abs_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|cosine| [len(a), len(b)] of the rows of `a` and `b` (a zero row has cosine 0 with everything)."""
    a, b = a.float(), b.float()
    return (a / a.norm(dim=1, keepdim=True).clamp(min=1e-8) @ (b / b.norm(dim=1, keepdim=True).clamp(min=1e-8)).T).abs()


def mcc(decoder: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean |cosine| of the one-to-one match of decoder rows and true directions that maximises its sum (Hungarian;
    min(n_latents, N) pairs)."""
    cos = abs_cosines(decoder, truth).cpu()
    rows, cols = linear_sum_assignment(1 - cos.numpy())
    return cos[rows, cols].mean().item()


def uniqueness(decoder: torch.Tensor, truth: torch.Tensor) -> float:
    """Distinct true features among the latents' best matches, over the number of latents (1: no two alike)."""
    if decoder.shape[0] == 0:
        return 0.0
    return len(abs_cosines(decoder, truth).argmax(dim=1).unique()) / decoder.shape[0]


class Scores:
    """Streaming sums over batches of (inputs, latent codes, reconstructions, true codes)."""

    def __init__(self, decoder: torch.Tensor, truth: torch.Tensor) -> None:
        self.decoder, self.truth = decoder.detach(), truth.detach()
        self.best = abs_cosines(self.decoder, self.truth.to(decoder.device)).argmax(dim=1)
        n = decoder.shape[0]
        self.tp, self.fp, self.fn, self.tn = (torch.zeros(n, dtype=torch.float64) for _ in range(4))
        self.fired = torch.zeros(n, dtype=torch.bool)
        self.sum_x: torch.Tensor | None = None
        self.squares = self.residuals = self.shrink = self.l0 = self.true_l0 = 0.0
        self.samples = self.shrunk = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor, latents: torch.Tensor, recon: torch.Tensor, codes: torch.Tensor) -> None:
        """Count one batch: inputs [B, d], latent codes [B, n], reconstructions [B, d], true codes [B, N]."""
        on, truth_on = (latents != 0).cpu(), (codes[:, self.best.to(codes.device)] > 0).cpu()
        self.tp += (on & truth_on).sum(0)
        self.fp += (on & ~truth_on).sum(0)
        self.fn += (~on & truth_on).sum(0)
        self.tn += (~on & ~truth_on).sum(0)
        self.fired |= on.any(0)
        self.l0 += on.sum().item()
        self.true_l0 += (codes > 0).sum().item()
        x, recon = x.float(), recon.float()
        batch_sum = x.sum(0).double().cpu()
        self.sum_x = batch_sum if self.sum_x is None else self.sum_x + batch_sum
        self.squares += x.pow(2).sum().item()
        self.residuals += (x - recon).pow(2).sum().item()
        norms = x.norm(dim=-1)
        keep = norms > _MIN_NORM
        self.shrink += (recon.norm(dim=-1)[keep] / norms[keep]).sum().item()
        self.shrunk += int(keep.sum().item())
        self.samples += x.shape[0]

    def result(self) -> dict[str, float]:
        """Every metric of KEYS."""
        tp, fp, fn, tn = self.tp, self.fp, self.fn, self.tn
        precision = torch.where(tp + fp > 0, tp / (tp + fp), torch.zeros_like(tp))
        recall = torch.where(tp + fn > 0, tp / (tp + fn), torch.zeros_like(tp))
        both = precision + recall
        f1 = torch.where(both > 0, 2 * precision * recall / both, torch.zeros_like(tp))
        n = max(self.samples, 1)
        variance = self.squares / n - (self.sum_x / n).pow(2).sum().item() if self.sum_x is not None else 0.0
        mse = self.residuals / n
        explained = (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1 - mse / variance
        return {
            "mcc": mcc(self.decoder, self.truth),
            "uniqueness": uniqueness(self.decoder, self.truth),
            "precision": precision.mean().item(),
            "recall": recall.mean().item(),
            "f1": f1.mean().item(),
            "accuracy": ((tp + tn) / (tp + fp + fn + tn).clamp(min=1e-8)).mean().item(),
            "explained_variance": explained,
            "shrinkage": self.shrink / self.shrunk if self.shrunk else 0.0,
            "dead_latents": int((~self.fired).sum().item()),
            "l0": self.l0 / n,
            "true_l0": self.true_l0 / n,
        }


@torch.no_grad()
def score_sae(sae: Any, truth: torch.Tensor, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """KEYS of runner's SAE `sae` on (inputs, true codes) batches whose true directions are `truth` [N, d]."""
    device, training = sae.W_dec.device, sae.training
    scores = Scores(sae.W_dec.float(), truth.to(device))
    sae.eval()  # inference codes: a BatchTopK's threshold, not the batch's top k x B
    try:
        for x, codes in batches:
            x = x.to(device)
            recon, values, indices = sae.reconstruct(x)
            scores.add(x, sae._dense(values, indices), recon, codes.to(device))
    finally:
        sae.train(training)
    return scores.result()


def ground_truth(
    sae: Any, cfg: Any, samples: int, device: str, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """`python -m runner.sae_eval RUN evals=[ground_truth]`: the metrics on `samples` fresh samples of the run's own
    synthetic world (rebuilt from its config: the same seed, the same features)."""
    from experiments.sae.sources.synthetic import _generator  # noqa: PLC0415
    from runner.build import build_data  # noqa: PLC0415

    splits = build_data(cfg).splits
    source = splits["train"].source
    if not hasattr(source, "batches"):
        raise ConfigError(
            "evals=[ground_truth] scores an SAE against the true codes of data=synth_sae_bench; this run's data "
            f"({type(source).__name__}) keeps no codes: its features are scored by callbacks=sae_ground_truth"
        )
    generator = _generator(splits["train"].seed, "ground_truth_eval")  # samples neither split holds
    done, total = 0, samples

    def counted():
        nonlocal done
        for x, codes in source.batches(samples, generator):
            yield x, codes
            done += len(x)
            if progress is not None:
                progress(done, total)

    result = score_sae(sae.to(device), source.features, counted())
    return {"metrics": result, "samples": samples, "notes": [_NOTE]}


_NOTE = (
    "MCC and uniqueness read the decoder alone; precision, recall and F1 score each latent as a detector of its "
    "best-matched true feature (SAELens's definitions); the data are fresh samples of the run's world"
)
