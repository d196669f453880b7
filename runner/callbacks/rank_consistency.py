"""A debugging callback for several processes: are the replicated parameters (and reduced gradients) the same on
every rank? A rank that silently diverges (a non-deterministic op, a rank-dependent branch, a missed all-reduce)
otherwise shows up only as a worse loss much later."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from runner.callbacks import needs_every_module
from runner.durations import parse_duration
from runner.run import Callback

if TYPE_CHECKING:
    from runner.run import Run


class RanksDiverged(RuntimeError):
    """Tensors that should be identical on every rank are not."""


def fingerprints(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Per tensor: its sum, sum of squares and a position-weighted sum in float64, which equal tensors share exactly
    (the same reduction on the same bits) and different ones practically never do (one differing element changes
    the first two; two elements swapped change the third)."""
    if not tensors:
        return []
    rows = []
    for t in tensors:
        x = t.detach().double().flatten()
        weights = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(1009).add_(1)
        rows.append(torch.stack([x.sum(), (x * x).sum(), (x * weights).sum()]))
    return torch.stack(rows).tolist()  # one device sync


class RankConsistency(Callback):
    """Every `interval`, compare every replicated parameter and, with `gradients`, every gradient after the reduce
    across ranks, and stop the job naming the first tensor that differs (on every rank: no rank is left waiting).

    The check runs in an optimizer pre-step hook, where the parameters are those after the previous step and the
    gradients are this step's, already all-reduced. Sharded (FSDP) tensors differ by design and are not compared.
    """

    def __init__(self, interval: str = "100st", gradients: bool = False) -> None:
        self.interval, self.gradients = parse_duration(interval), gradients
        self.checks = 0

    def on_fit_start(self, run: Run) -> None:
        """Compare the starting weights (they must match before the first step), then hook the optimizer."""
        needs_every_module(run, "rank_consistency", "the ranks hold different SAEs by design, none of them twice")
        self.named = [(n, q) for n, q in run.task.named_parameters() if not hasattr(q, "placements")]
        self._compare(run, "parameter", self.named, "at the start")
        self.handle = run.optimizer.register_step_pre_hook(lambda *_: self._before_step(run))

    def _before_step(self, run: Run) -> None:
        p = run.progress
        if p.step == 0 or not p.ticked(self.interval):
            return
        self._compare(run, "parameter", self.named, f"after optimizer step {p.step}")
        if self.gradients:
            holders = run.precision.stepped([q for _, q in self.named])  # *_true: the fp32 masters hold them
            grads = [(n, h.grad) for (n, _), h in zip(self.named, holders, strict=True) if h.grad is not None]
            self._compare(run, "gradient", grads, f"of optimizer step {p.step + 1}, after the all-reduce")

    def _compare(self, run: Run, kind: str, named: list[tuple[str, torch.Tensor]], when: str) -> None:
        dist = run.strategy
        if dist.world_size == 1:
            return
        self.checks += 1
        per_rank = dist.gather(fingerprints([t for _, t in named]))
        for i, (name, _) in enumerate(named):
            values = [rows[i] for rows in per_rank]
            differ = [r for r, v in enumerate(values) if v != values[0]]
            if differ:
                raise RanksDiverged(
                    f"{kind} {name!r} differs between ranks {when}: rank 0 has (sum, sum of squares, weighted sum) "
                    f"{values[0]}, rank {differ[0]} has {values[differ[0]]}"
                    + (f" (and {len(differ) - 1} more ranks)" if len(differ) > 1 else "")
                    + ". Look for rank-dependent code in the model, or non-deterministic ops."
                )

    def on_fit_end(self, run: Run) -> None:
        """Unhook the optimizer and say what was checked."""
        self.handle.remove()
        if run.strategy.is_main and self.checks:
            what = "parameters and gradients" if self.gradients else "parameters"
            print(f"rank consistency: {what} identical on every rank in {self.checks} checks", file=sys.stderr)
