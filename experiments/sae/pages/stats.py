"""What each latent of a trained SAE learned, in one streaming pass
(`python -m runner.features`, runner/tools/features.py).

The pass encodes held-out rows chunk by chunk and keeps, per latent, only fixed-size state: how often it fires, the
sum and max of its activations, a histogram of their log10 (HIST_BINS bins from 1e-3), its `top` strongest rows, and
`2 x samples x QUANTILES` rows from each bin of that histogram. No [rows x latents] matrix is ever held: each chunk's
firing (row, latent, value) triples are merged into the per-latent tops by one sort. At the end each kept row is
placed in its fifth of the latent's activations by the rows below its bin (the histogram) and its rank among its
bin's kept rows (a uniform sample of the bin), so a bin that spans several fifths (a latent whose activations fall
in one or two bins) feeds each of them; each fifth shows `samples` of its rows that are not among the strongest
(sae_vis shows examples across a latent's range alike), with the range of its kept rows. Which rows a bin keeps is
decided by a hash of (row, latent), so the same rows in the same order give the same pages. Then, from the weights
alone: the tokens each decoder direction promotes and suppresses through the source model's final norm and
unembedding (the logit lens), and each latent's nearest latents by decoder cosine."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

HIST_LOW, HIST_PER_DECADE, HIST_BINS = -3.0, 8, 48  # log10 bins from 1e-3 to 1e3 (the first and last open-ended)
QUANTILES = 5  # the examples' intervals: fifths of each latent's activations


def bin_edges() -> torch.Tensor:
    """The histogram's bin edges [HIST_BINS + 1], the first 0 and the last inf (they hold what is beyond 1e-3, 1e3)."""
    edges = 10 ** (HIST_LOW + torch.arange(HIST_BINS + 1, dtype=torch.float64) / HIST_PER_DECADE)
    edges[0], edges[-1] = 0.0, float("inf")
    return edges


def top_per_group(groups: torch.Tensor, values: torch.Tensor, k: int, *payload: torch.Tensor) -> list[torch.Tensor]:
    """The entries with the k largest values of each group (ties: the earlier entry), as [groups, values, *payload]
    sorted by group, then by value descending."""
    by_value = torch.argsort(values, descending=True, stable=True)
    order = by_value[torch.argsort(groups[by_value], stable=True)]
    sorted_groups = groups[order]
    rank = torch.arange(len(order)) - torch.searchsorted(sorted_groups, sorted_groups)
    kept = order[rank < k]
    return [groups[kept], values[kept], *(p[kept] for p in payload)]


def _mix(rows: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    # a deterministic pseudo-random priority in [0, 2^31) for each (row, latent): which rows an interval samples
    h = (rows * 0x9E3779B1 + latents * 0x85EBCA77 + 0x165667B1) & 0x7FFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
    return (h ^ (h >> 13)) & 0x7FFFFFFF


class LatentStats:
    """Per-latent statistics over a stream of codes, updated with `add`, read with `result`: the `top` strongest rows
    of each latent, and `samples` rows from each quantile of its activations."""

    def __init__(self, n_latents: int, top: int = 16, samples: int = 3) -> None:
        n, self.n_latents, self.top, self.samples = n_latents, n_latents, top, samples
        self.rows = 0  # rows seen
        self.count, self.total = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.float64)
        self.peak, self.hist = torch.zeros(n), torch.zeros(n, HIST_BINS, dtype=torch.long)
        empty = torch.zeros(0, dtype=torch.long)
        self._top = [empty, torch.zeros(0), empty]  # latent, value, row
        self._samples = [empty, torch.zeros(0, dtype=torch.long), empty, torch.zeros(0)]  # key, priority, row, value

    def add(self, values: torch.Tensor, indices: torch.Tensor | None, first_row: int) -> None:
        """One chunk of codes, as an SAE's `codes` gives them: values [B, k] at `indices` [B, k], or dense
        [B, n_latents] (indices None); its rows are first_row, first_row + 1, ... of the stream."""
        values = values.detach().float().cpu()
        if indices is None:
            row, latent = values.nonzero(as_tuple=True)
            value = values[row, latent]
        else:
            fired = values > 0
            row = torch.arange(len(values)).unsqueeze(1).expand_as(values)[fired]
            latent, value = indices.cpu()[fired], values[fired]
        row = row + first_row
        self.rows = max(self.rows, first_row + len(values))
        n = self.n_latents
        self.count += torch.bincount(latent, minlength=n)
        self.total += torch.bincount(latent, weights=value.double(), minlength=n)
        self.peak.scatter_reduce_(0, latent, value, "amax")
        bins = ((value.log10() - HIST_LOW) * HIST_PER_DECADE).floor().long().clamp(0, HIST_BINS - 1)
        self.hist += torch.bincount(latent * HIST_BINS + bins, minlength=n * HIST_BINS).view(n, HIST_BINS)
        self._top = self._merged(self._top, latent, value, row, self.top, n)
        key, priority = latent * HIST_BINS + bins, _mix(row, latent)
        # enough for every fifth when one bin holds all of a latent's activations, twice over: a row's rank among them
        # places it to within ~1/sqrt(2 x samples x QUANTILES) of its share
        per_bin = 2 * self.samples * QUANTILES
        self._samples = self._merged(self._samples, key, priority, row, per_bin, n * HIST_BINS, value)

    @staticmethod
    def _merged(
        kept: list[torch.Tensor],
        group: torch.Tensor,
        value: torch.Tensor,
        row: torch.Tensor,
        k: int,
        groups: int,
        *extra: torch.Tensor,
    ) -> list[torch.Tensor]:
        # Only the new entries that beat their group's k-th kept value can enter: after the first chunks, few do.
        full = torch.bincount(kept[0], minlength=groups) >= k
        floor = torch.full((groups,), float("-inf"), dtype=torch.float64)
        floor.scatter_reduce_(0, kept[0], kept[1].double(), "amin", include_self=False)
        floor[~full] = float("-inf")
        enter = value.double() > floor[group]
        merged = [torch.cat([old, new[enter]]) for old, new in zip(kept, (group, value, row, *extra), strict=False)]
        return top_per_group(merged[0], merged[1], k, *merged[2:])

    def result(self) -> dict[str, torch.Tensor]:
        """density (fraction of rows it fires on), mean (over its firings) and max activation, hist [n, HIST_BINS],
        top_rows / top_values [n, top] (-1 / 0 where it fired on fewer rows), and per quantile of its activations
        (the lowest fifth first) sample_rows / sample_values [n, QUANTILES, samples] (-1 / 0 where empty: a latent
        that fired on too few rows beyond its strongest) and the range of the kept rows in it, sample_low /
        sample_high [n, QUANTILES] (0 / 0 where empty)."""
        n = self.n_latents
        top_rows, top_values = self._table(self._top[0], self._top[2], self._top[1], n, self.top)
        group, quantile, row, value, priority = self._placed()
        bound = self.rows + 1  # (latent, row) pairs as one number: a kept row among its latent's strongest is not shown
        shown = ~torch.isin(group * bound + row, self._top[0] * bound + self._top[2])
        cell = group * QUANTILES + quantile
        picked = top_per_group(cell[shown], priority[shown], self.samples, row[shown], value[shown])
        sample_rows, sample_values = self._table(picked[0], picked[2], picked[3], n * QUANTILES, self.samples)
        low = torch.full((n * QUANTILES,), float("inf")).scatter_reduce_(0, cell, value, "amin")
        high = torch.zeros(n * QUANTILES).scatter_reduce_(0, cell, value, "amax")
        empty = (sample_rows < 0).all(1)
        low[empty], high[empty] = 0.0, 0.0
        return {
            "density": self.count.double() / max(self.rows, 1),
            "fired": self.count,
            "mean": self.total / self.count.clamp_min(1),
            "max": self.peak,
            "hist": self.hist,
            "top_rows": top_rows,
            "top_values": top_values,
            "sample_rows": sample_rows.view(n, QUANTILES, self.samples),
            "sample_values": sample_values.view(n, QUANTILES, self.samples),
            "sample_low": low.view(n, QUANTILES),
            "sample_high": high.view(n, QUANTILES),
        }

    def _placed(self) -> tuple[torch.Tensor, ...]:
        # The kept rows (latent, quantile, row, value, priority): a row's share of its latent's activations below it
        # is the rows of the bins below plus its rank among its bin's kept rows, a uniform sample of that bin.
        key, priority, row, value = self._samples
        order = torch.argsort(value, stable=True)
        order = order[torch.argsort(key[order], stable=True)]  # by bin, then by value
        key, priority, row, value = key[order], priority[order], row[order], value[order]
        rank = torch.arange(len(key)) - torch.searchsorted(key, key)
        kept = torch.bincount(key, minlength=self.n_latents * HIST_BINS)[key]
        latent, b = key // HIST_BINS, key % HIST_BINS
        hist = self.hist.double()
        below = (hist.cumsum(1) - hist)[latent, b] + (rank + 0.5) / kept * hist[latent, b]
        share = below / hist.sum(1).clamp_min(1)[latent]
        quantile = (share * QUANTILES).long().clamp(0, QUANTILES - 1)
        return latent, quantile, row, value, priority

    @staticmethod
    def _table(group: torch.Tensor, row: torch.Tensor, value: torch.Tensor, groups: int, k: int) -> tuple:
        # entries sorted by group then value descending -> [groups, k] tables of rows and values
        rank = torch.arange(len(group)) - torch.searchsorted(group, group)
        rows, values = torch.full((groups, k), -1, dtype=torch.long), torch.zeros(groups, k)
        rows[group, rank], values[group, rank] = row, value.float()
        return rows, values


@torch.no_grad()
def logit_lens(
    W_dec: torch.Tensor, unembed: torch.Tensor, gain: torch.Tensor | None, k: int = 8, each: Callable | None = None
) -> dict:
    """Per latent, the k output tokens its decoder direction promotes most and suppresses most: W_dec (x the final
    norm's gain) @ unembed^T, in chunks of 1024 latents (`each` hears of each: with a vocabulary of 50k on the CPU,
    minutes). Returns promoted / suppressed token ids and their logits, [n, k]."""
    direction = W_dec.float() * (gain.float() if gain is not None else 1.0)
    out: dict[str, list[torch.Tensor]] = {
        "promoted": [],
        "promoted_logits": [],
        "suppressed": [],
        "suppressed_logits": [],
    }
    for chunk in direction.split(1024):
        logits = chunk @ unembed.float().t()
        up, down = logits.topk(k, dim=1), logits.topk(k, dim=1, largest=False)
        out["promoted"].append(up.indices), out["promoted_logits"].append(up.values)
        out["suppressed"].append(down.indices), out["suppressed_logits"].append(down.values)
        if each is not None:
            each()
    return {name: torch.cat(parts) for name, parts in out.items()}


@torch.no_grad()
def nearest(W_dec: torch.Tensor, k: int = 5, each: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each latent's k nearest other latents by decoder cosine: (indices [n, k], cosines [n, k]); `each` hears of
    each chunk of 1024 latents done."""
    unit = F.normalize(W_dec.float(), dim=1)
    indices, cosines = [], []
    for start in range(0, len(unit), 1024):
        cos = unit[start : start + 1024] @ unit.t()
        rows = torch.arange(len(cos))
        cos[rows, rows + start] = float("-inf")  # not itself
        best = cos.topk(min(k, len(unit) - 1), dim=1)
        indices.append(best.indices), cosines.append(best.values)
        if each is not None:
            each()
    return torch.cat(indices), torch.cat(cosines)


@torch.no_grad()
def best_matches(W_dec: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each latent's best-matching ground-truth feature (synthetic data) and their cosine: (indices, cosines)."""
    cos = F.normalize(W_dec.float(), dim=1) @ F.normalize(features.float().to(W_dec.device), dim=1).t()
    best = cos.max(dim=1)
    return best.indices, best.values
