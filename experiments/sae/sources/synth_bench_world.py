"""SynthSAEBench's synthetic world (Chanin & Garriga-Alonso 2026; SAELens's sae_lens.synthetic.SyntheticModel), built
here from its published definition: the same algorithm and the same random draws, so that with the same seed the
feature dictionary, the firing probabilities and every sample equal SAELens's bit for bit on the CPU
(tests/e2e/test_synth_bench_agreement.py). SAELens is not imported: it is no dependency of runner.

A sample: a Gaussian copula with a low-rank correlation decides which of N features fire (feature i with probability
p_i, Zipfian in i, raised to undo what the hierarchy takes away); each firing feature gets a magnitude
relu(mean_i + std_i * z); a forest of features gates children on their parent and lets at most one child of each
mutually exclusive parent survive (a random winner); the activation is codes @ directions + bias, in d dimensions."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

_MIN_DIAG = 0.01  # SAELens's floor on each feature's own variance in the copula (rows over it are rescaled)
_LOSER = -1e9  # the score of an inactive sibling when a winner is drawn


class Hierarchy:
    """A forest of `roots` trees over the first features, built breadth first (features 0..roots-1 are the roots, then
    the next level's children in order), each parent with `branching` children (an int, or [low, high] drawn per
    parent) down to `depth`; a `mutually_exclusive` share of the parents (drawn) let at most one child fire. With
    `scale_by_parent` a child's magnitude is multiplied by its parent's over the parent's mean magnitude (SAELens's
    scale_children_by_parent on every parent) instead of passing through unchanged."""

    def __init__(
        self,
        num_features: int,
        roots: int,
        branching: int | Sequence[int],
        depth: int,
        mutually_exclusive: float,
        seed: int,
        me_min_depth: int = 0,
        me_max_depth: int | None = None,
        scale_by_parent: bool = False,
    ) -> None:
        rng = random.Random(seed)
        self.scale_by_parent = scale_by_parent
        self.parent: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        self.level: dict[int, int] = {}
        parents = []  # (feature, depth) of every node that may get children, in the order they were made
        for f in range(min(roots, num_features)):
            self.level[f] = 0
            parents.append((f, 0))
        frontier, used = list(parents), len(parents)
        while frontier:
            deeper = []
            for node, level in frontier:
                if level >= depth:
                    continue
                count = branching if isinstance(branching, int) else rng.randint(branching[0], branching[1])
                kids = list(range(used, min(used + count, num_features)))
                used += len(kids)
                for kid in kids:
                    self.parent[kid], self.level[kid] = node, level + 1
                    if level + 1 < depth:
                        deeper.append((kid, level + 1))
                        parents.append((kid, level + 1))
                self.children[node] = kids
            frontier = deeper
        eligible = [
            node
            for node, level in parents
            if level >= me_min_depth
            and (me_max_depth is None or level <= me_max_depth)
            and len(self.children.get(node, [])) >= 2
        ]
        chosen = int(len(eligible) * mutually_exclusive)
        picks = rng.sample(range(len(eligible)), chosen) if chosen > 0 else []
        self.exclusive = {eligible[i] for i in picks}
        self._levels()

    def _levels(self) -> None:
        # Per level, in breadth-first order: the features gated by a parent, and the exclusive groups whose parent
        # sits there (applied after that level's gating, before the next level's, as SAELens does)
        order = sorted(self.level, key=lambda f: (self.level[f], f))
        top = max(self.level.values(), default=-1)
        # one width for every group: the random winner's draw is [conflicts, widest group] in SAELens
        width = max((len(self.children[g]) for g in self.exclusive), default=0)
        self.gated, self.groups = [], []
        for level in range(top + 1):
            feats = [f for f in order if self.level[f] == level and f in self.parent]
            gated = torch.tensor(feats, dtype=torch.long), torch.tensor([self.parent[f] for f in feats])
            groups = [f for f in order if self.level[f] == level and f in self.exclusive]
            siblings = torch.full((len(groups), width), -1, dtype=torch.long)
            for row, g in enumerate(groups):
                siblings[row, : len(self.children[g])] = torch.tensor(self.children[g])
            sizes = torch.tensor([len(self.children[g]) for g in groups], dtype=torch.long)
            self.gated.append(gated)
            self.groups.append((torch.tensor(groups, dtype=torch.long), siblings, sizes))

    def to(self, device: torch.device | str) -> Hierarchy:
        """Move the index tensors to `device` (in place)."""
        self.gated = [tuple(t.to(device) for t in pair) for pair in self.gated]
        self.groups = [tuple(t.to(device) for t in group) for group in self.groups]
        return self

    def corrections(self, probs: torch.Tensor) -> torch.Tensor:
        """Factors that raise each feature's probability so that, gated by its parent and competing with its exclusive
        siblings, it fires about as often as `probs` says (SAELens's compensate_probabilities)."""
        factors = torch.ones(len(probs), dtype=probs.dtype)
        for f, parent in self.parent.items():
            p = probs[parent].item()
            if p > 0:
                factors[f] = 1.0 / p
        for node in self.exclusive:
            kids = [(k, probs[k].item()) for k in self.children[node]]
            node_prob = probs[node].item()
            total = sum(p for _, p in kids)
            if len(kids) >= 2 and node_prob > 0:
                for kid, p in kids:
                    factors[kid] *= 1.0 + max(0.0, total - p) / node_prob
        return factors

    def apply(self, codes: torch.Tensor, generator: torch.Generator, means: torch.Tensor | None = None) -> torch.Tensor:
        """Gate (or, with scale_by_parent, scale by parent / the parent's mean in `means`) children on their parents
        and draw one winner in each exclusive group, level by level."""
        if self.scale_by_parent and means is None:
            raise ValueError("a hierarchy that scales children by their parents needs the mean magnitudes (means)")
        out = codes.clone()
        for (feats, parents), group in zip(self.gated, self.groups, strict=True):
            if feats.numel() > 0:
                parent = out[:, parents]
                if self.scale_by_parent:
                    # SAELens's factor, op for op: parent / its mean where the parent fired, else 0; the parent is
                    # already scaled by its own parent (levels run top down), so a chain multiplies
                    scale = torch.where(parent > 0, parent / means[parents], torch.zeros_like(parent))
                    out[:, feats] = out[:, feats] * scale
                else:
                    out[:, feats] = out[:, feats] * (parent > 0)
            if group[0].numel() > 0:
                self._exclude(out, *group, generator)
        return out

    @staticmethod
    def _exclude(
        out: torch.Tensor,
        parents: torch.Tensor,
        siblings: torch.Tensor,
        sizes: torch.Tensor,
        generator: torch.Generator,
    ) -> None:
        # The draws follow SAELens's _apply_me_for_groups call for call: a random score per (conflict, sibling),
        # only when some group of an active parent has two or more active children
        parent_on = out[:, parents] > 0
        if not parent_on.any():
            return
        n, (groups, width) = out.shape[0], siblings.shape
        values = out[:, siblings.clamp(min=0).view(-1)].view(n, groups, width)
        valid = torch.arange(width, device=out.device) < sizes.unsqueeze(1)
        active = (values > 0) & valid & parent_on.unsqueeze(2)
        clash = active.sum(dim=2) > 1
        if not clash.any():
            return
        rows, cols = torch.where(clash)
        scores = torch.rand(rows.numel(), width, device=out.device, generator=generator)
        contenders = active[rows, cols]
        scores[~contenders] = _LOSER
        winner = torch.zeros_like(contenders).scatter_(1, scores.argmax(dim=1, keepdim=True), True)
        which, sib = torch.where(contenders & ~winner)
        out[rows[which], siblings[cols[which], sib]] = 0


def zipfian(num_features: int, exponent: float, max_prob: float, min_prob: float) -> torch.Tensor:
    """Probabilities 1 / rank**exponent, rescaled to [min_prob, max_prob] (feature 0 the most frequent)."""
    if num_features == 1:
        return torch.tensor([max_prob])
    probs = 1.0 / torch.arange(1, num_features + 1, dtype=torch.float32) ** exponent
    low, high = probs.min(), probs.max()
    return min_prob + (max_prob - min_prob) * (probs - low) / (high - low)


def low_rank_correlation(num_features: int, rank: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(factor [N, rank], diag [N]) of a correlation matrix factor @ factor.T + diag(diag) with unit diagonal."""
    factor = torch.randn(num_features, rank, generator=torch.Generator().manual_seed(seed)) * scale
    squares = (factor**2).sum(dim=1)
    capped = (1 - squares) < _MIN_DIAG
    factor[capped, :] *= torch.sqrt((1 - _MIN_DIAG) / squares[capped].unsqueeze(1))
    return factor, 1 - (factor**2).sum(dim=1)


def dictionary(num_features: int, d: int, bias: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit directions [N, d], a bias [d] of norm `bias`, zeros for 0), drawn from one generator seeded `seed`."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(num_features, d, generator=generator)
    directions = directions / directions.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)
    if not bias:
        return directions, torch.zeros(d)
    offset = torch.randn(d, generator=generator)
    return directions, offset / offset.norm().clamp(min=1e-8) * float(bias)


def orthogonalize(directions: torch.Tensor, steps: int, lr: float, chunk: int = 1024) -> torch.Tensor:
    """Push unit directions apart: Adam on the sum of squared off-diagonal dot products plus N x the squared
    deviation of each norm from 1, in row chunks (SAELens's orthogonalize_embeddings), then renormalise."""
    n = directions.shape[0]
    weights = (directions / directions.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)).requires_grad_(True)
    optimizer = torch.optim.Adam([weights], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            dots = weights[start:end] @ weights.T
            rows = torch.arange(end - start)
            off = torch.ones_like(dots, dtype=torch.bool)
            off[rows, start + rows] = False
            loss = dots[off].pow(2).sum() + n * (dots[rows, start + rows] - 1).pow(2).sum()
            loss.backward()
        optimizer.step()
    with torch.no_grad():
        weights = weights / weights.norm(p=2, dim=1, keepdim=True).clamp(min=1e-8)
    return weights.detach().clone()


def magnitudes(num_features: int, mean: Sequence[float], std: Sequence[float], seed: int) -> tuple[torch.Tensor, ...]:
    """(means linear from mean[0] (feature 0) to mean[1], stds |std[0] + std[1] * z| drawn with seed + 1)."""
    means = torch.linspace(float(mean[0]), float(mean[1]), num_features)
    z = torch.randn(num_features, generator=torch.Generator().manual_seed(seed + 1))
    return means, torch.abs(std[0] + z * std[1])


def sample_codes(
    n: int,
    probs: torch.Tensor,
    factor: torch.Tensor,
    diag_sqrt: torch.Tensor,
    means: torch.Tensor,
    stds: torch.Tensor,
    hierarchy: Hierarchy | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """Feature codes [n, N] (SAELens's ActivationGenerator.sample with a low-rank correlation, dense)."""
    device = probs.device
    thresholds = math.sqrt(2) * torch.erfinv(1 - 2 * probs)
    eps = torch.randn(n, factor.shape[1], device=device, dtype=factor.dtype, generator=generator)
    eta = torch.randn(n, len(probs), device=device, dtype=diag_sqrt.dtype, generator=generator)
    fires = (eps @ factor.T + eta * diag_sqrt > thresholds.unsqueeze(0)).nonzero(as_tuple=True)
    cols = fires[1]
    deltas = torch.randn(cols.shape[0], device=device, dtype=means.dtype, generator=generator) * stds[cols]
    codes = torch.zeros(n, len(probs), device=device, dtype=means.dtype)
    codes[fires] = (means[cols] + deltas).relu()
    if hierarchy is not None:
        codes = hierarchy.apply(codes, generator, means).relu()
    return codes
