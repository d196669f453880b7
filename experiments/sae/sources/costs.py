"""What replacing modules' outputs costs a frozen model (SourceModel.compare and .costs): its mean validation loss with
each replacement, and the KL divergence of its next-token distribution from the clean model's, per validation batch."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from experiments.sae.sources.replacements import Replacement
from runner.data import batch_size_of, to_device

Run = Callable[[Any, Replacement], tuple[torch.Tensor, torch.Tensor | None]]  # SourceModel.run: (loss, logits)


class CleanRuns:
    """The clean model's (loss, logits) of each validation batch, kept on the CPU while they fit in `budget_mb`, so
    that later comparisons over the same batches run only their replacements (a validation's splice: one forward a
    batch, not two). The same batches give the same clean outputs: the model is frozen."""

    def __init__(self, budget_mb: float) -> None:
        self.budget, self.used = budget_mb * 2**20, 0
        self.runs: list[tuple[torch.Tensor, torch.Tensor | None]] | None = [] if budget_mb > 0 else None

    def get(self, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Batch `index`'s clean outputs on `device`, if kept."""
        if self.runs is None or index >= len(self.runs):
            return None
        loss, logits = self.runs[index]
        return loss.to(device), None if logits is None else logits.to(device, non_blocking=True)

    def put(self, index: int, clean: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Keep batch `index`'s clean outputs, unless they are past the budget (then none are kept)."""
        if self.runs is None or index < len(self.runs):
            return
        loss, logits = clean
        self.used += 0 if logits is None else logits.nbytes
        if self.used > self.budget:
            self.runs = None  # all or nothing: a partial set would still need the clean model for the rest
            return
        self.runs.append((loss.detach().cpu(), None if logits is None else logits.detach().cpu()))


@dataclass
class BatchCosts:
    """Each replacement's loss and KL divergence summed over the rows of each validation batch (mean x size), batch
    after batch from the split's first, and the batches' sizes: the means over any first batches come from them, so
    a replacement and its baselines are always compared over the same batches."""

    sums: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)
    has_logits: bool = True

    def __len__(self) -> int:
        return len(self.sizes)

    def extend(self, more: BatchCosts) -> None:
        """Append the batches that follow these (the same replacements)."""
        for name, rows in more.sums.items():
            self.sums.setdefault(name, []).extend(rows)
        self.sizes += more.sizes
        self.has_logits = self.has_logits and more.has_logits

    def means(self, batches: int | None = None) -> dict[str, dict]:
        """Each replacement's mean loss ("ce") and KL divergence ("kl", when the model gives logits) over the first
        `batches` batches (None: all)."""
        batches = len(self.sizes) if batches is None else batches
        out = {}
        for name, rows in self.sums.items():
            total = torch.zeros(2, dtype=torch.float64)
            for row in rows[:batches]:  # in order, one by one: the same sum whatever the number of batches
                total += row
            ce, kl = (total / sum(self.sizes[:batches])).tolist()
            out[name] = {"ce": ce, **({"kl": kl} if self.has_logits else {})}
        return out


@torch.no_grad()
def batch_costs(
    run: Run,
    loader: Collection[Any],
    device: torch.device,
    replacements: dict[str, Replacement],
    working: Callable[[int, int | None], None] | None = None,
    clean_runs: CleanRuns | None = None,
    batches: range | None = None,
) -> BatchCosts:
    """Over the batches of `loader` (those numbered in `batches`; None: all), for each named replacement: the loss of
    `run` and, when it gives logits, the KL divergence from the clean model's, per batch; `working(done, total)` hears
    after each batch. `clean_runs`: the clean outputs kept from an earlier call over the same loader, and kept here for
    later ones."""
    costs = BatchCosts({name: [] for name in replacements})
    batches = range(len(loader)) if batches is None else batches
    for index, batch in enumerate(itertools.islice(loader, batches.stop)):
        if index < batches.start:
            continue
        batch = to_device(batch, device)
        size = batch_size_of(batch)
        clean = clean_runs.get(index, device) if clean_runs is not None else None
        if clean is None:
            clean = run(batch, None)
            if clean_runs is not None:
                clean_runs.put(index, clean)
        for name, replace in replacements.items():
            loss, logits = clean if replace is None else run(batch, replace)
            costs.has_logits = costs.has_logits and logits is not None
            kl = _kl(clean[1], logits) if costs.has_logits else torch.zeros((), dtype=torch.float64)
            costs.sums[name].append(torch.stack([loss.double().cpu(), kl.cpu()]) * size)
        costs.sizes.append(size)
        if working is not None:
            working(index + 1 - batches.start, len(batches))
    return costs


def _kl(clean: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(clean || other) of the distributions given by logits [..., vocab], averaged over positions, in float64."""
    p = clean.double().log_softmax(-1)
    q = other.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean()
