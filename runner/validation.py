"""One evaluation pass over a loader, as validation computes it: float64 means over the whole split (every rank's
shard), then the task's validation_summary. A leaf module: the loop, the EMA callback and `runner.tools.evaluate` use
it."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch

from runner import ConfigError
from runner.data import batch_size_of, to_device
from runner.interfaces import Precision


@torch.no_grad()
def evaluate_loader(
    task: torch.nn.Module,
    loader: Iterable,
    precision: Precision,
    device: torch.device,
    all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda total: total,
    working: Callable[[int, int | None], None] | None = None,
    batches: int | None = None,
) -> dict[str, float]:
    """One pass over `loader`, named 'val/<key>': each validation_step output (a number, or a tensor of any shape)
    averaged over the whole split in float64, weighted by batch size (over every rank's shard: `all_sum`); a task
    with `validation_summary` turns those means into its metrics (a ratio of sums, say, which a mean of per-batch
    ratios is not). `working(done, total)` hears after each batch how far the pass has got; `batches`: the first that
    many of the loader's batches (None: all)."""
    task.eval()
    sums: dict[str, torch.Tensor] = {}
    count = 0
    total = len(loader) if hasattr(loader, "__len__") else None
    if batches is not None:
        total, loader = batches if total is None else min(batches, total), itertools.islice(loader, batches)
    for done, batch in enumerate(loader, 1):
        batch = to_device(batch, device)
        size = batch_size_of(batch)
        with precision.autocast():
            out = task.validation_step(batch)
        for key, value in out.items():
            sums[key] = sums.get(key, 0.0) + torch.as_tensor(value, device=device).detach().double() * size
        count += size
        if working is not None:
            working(done, total)
    task.train()
    if not sums:
        return {}
    # Sums and counts over every rank's shard, not a mean of means; one device sync.
    flat = [*(s.reshape(-1) for s in sums.values()), torch.tensor([count], device=device).double()]
    totals = all_sum(torch.cat(flat))
    parts = (totals[:-1] / totals[-1]).split([s.numel() for s in sums.values()])
    means = {k: p.reshape(s.shape) for (k, s), p in zip(sums.items(), parts, strict=True)}
    metrics = summarize(task, means)
    values = torch.stack([torch.as_tensor(v, device=device).double() for v in metrics.values()]).tolist()
    return {f"val/{k}": v for k, v in zip(metrics, values, strict=True)}


def share(value: float | int | None, name: str) -> float | int | None:
    """A share of a split's batches as a setting gives it (a fraction in (0, 1], or a whole number of batches), checked;
    None: all."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (value > 1 and value % 1):
        raise ConfigError(
            f"{name}={value!r}: a fraction of the validation batches (0.25), a number of them (2), or null"
        )
    return value


def batches_of(total: int, value: float | int | None) -> int:
    """How many of a loader's `total` batches the share `value` (see share()) reads: at least one."""
    if value is None:
        return total
    return min(total, max(1, round(value * total)) if value <= 1 and isinstance(value, float) else int(value))


def summarize(task: torch.nn.Module, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The task's metrics from the split's means: its validation_summary, or the means themselves."""
    summary = getattr(task, "validation_summary", None)
    return summary(means) if summary is not None else means
