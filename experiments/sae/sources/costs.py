"""What replacing modules' outputs costs a frozen model (SourceModel.compare): its mean validation loss with each
replacement, and the KL divergence of its next-token distribution from the clean model's, over the validation split."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from experiments.sae.sources.replacements import Replacement
from runner.data import batch_size_of, to_device

Run = Callable[[Any, Replacement], tuple[torch.Tensor, torch.Tensor | None]]  # SourceModel.run: (loss, logits)


@torch.no_grad()
def compare(
    run: Run,
    loader: Collection[Any],
    device: torch.device,
    replacements: dict[str, Replacement],
    working: Callable[[int, int | None], None] | None = None,
) -> dict[str, dict]:
    """Over the batches of `loader`, for each named replacement: the mean loss of `run` ("ce") and, when it gives
    logits, the KL divergence from the clean model's ("kl"); `working(done, total)` hears after each batch."""
    sums = {name: torch.zeros(2, dtype=torch.float64) for name in replacements}
    count, has_logits = 0, True
    for done, batch in enumerate(loader, 1):
        batch = to_device(batch, device)
        size = batch_size_of(batch)
        clean = run(batch, None)
        for name, replace in replacements.items():
            loss, logits = clean if replace is None else run(batch, replace)
            has_logits = has_logits and logits is not None
            kl = _kl(clean[1], logits) if has_logits else torch.zeros((), dtype=torch.float64)
            sums[name] += torch.stack([loss.double().cpu(), kl.cpu()]) * size
        count += size
        if working is not None:
            working(done, len(loader))
    means = {name: (total / count).tolist() for name, total in sums.items()}
    return {name: {"ce": ce, **({"kl": kl} if has_logits else {})} for name, (ce, kl) in means.items()}


def _kl(clean: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(clean || other) of the distributions given by logits [..., vocab], averaged over positions, in float64."""
    p = clean.double().log_softmax(-1)
    q = other.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean()
