"""data=synth_sae_bench: SynthSAEBench-16k's distribution (16,384 features in 768 dims, Zipfian firing, a hierarchy of
128 roots with 4 mutually exclusive children to depth 3, a rank-25 correlation, L0 about 34), generated on the fly
by experiments/sae/sources/synth_bench_world.py. The validation split keeps each sample's true codes, which the
benchmark's metrics need (experiments/sae/evals/ground_truth.py, callbacks=sae_ground_truth)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Dataset

from experiments.sae.sources.synth_bench_world import (
    Hierarchy,
    dictionary,
    low_rank_correlation,
    magnitudes,
    orthogonalize,
    sample_codes,
    zipfian,
)
from experiments.sae.sources.synthetic import SyntheticActivations, _generator
from runner import ConfigError, check_whole
from runner.config.trust import buildable
from runner.data import TensorData


class SynthBench:
    """The world: N unit directions in d dims (`features`), their firing probabilities, magnitudes, correlation and
    hierarchy, all drawn from `seed` as SAELens's SyntheticModel draws them (hierarchy seed + 3, correlation
    seed + 4, dictionary seed, std magnitudes seed + 1). `scale_children_by_parent` multiplies each child's magnitude
    by its parent's over the parent's mean. `sample` makes activations on the generator's device."""

    targets = linear_map = None  # SAE data: no transcoder target (experiments.sae.sources.synthetic's _Truth)

    def __init__(
        self,
        num_features: int = 16384,
        d: int = 768,
        zipf_exponent: float = 0.5,
        max_prob: float = 0.4,
        min_prob: float = 5e-4,
        roots: int = 128,
        branching: int | Sequence[int] = 4,
        depth: int = 3,
        mutually_exclusive: float = 1.0,
        compensate: bool = True,
        scale_children_by_parent: bool = False,  # what a saved run config without the key was drawn with
        rank: int = 25,
        correlation_scale: float = 0.1,
        ortho_steps: int = 100,
        ortho_lr: float = 3e-4,
        mean_magnitude: Sequence[float] = (5.0, 4.0),
        std_magnitude: Sequence[float] = (0.5, 0.5),
        bias: float = 0.5,
        seed: int = 42,
    ) -> None:
        _check(num_features, d, max_prob, min_prob, rank, roots, depth, mutually_exclusive, mean_magnitude)
        self.hierarchy = None
        if roots > 0:
            trees = num_features, roots, branching, depth, mutually_exclusive, seed + 3
            self.hierarchy = Hierarchy(*trees, scale_by_parent=scale_children_by_parent)
        self.factor, diag = low_rank_correlation(num_features, rank, correlation_scale, seed + 4)
        self.diag_sqrt = diag.sqrt()
        self.features, self.bias = dictionary(num_features, d, bias, seed)
        if ortho_steps > 0:
            self.features = _orthogonalized(self.features, ortho_steps, ortho_lr)
        probs = zipfian(num_features, zipf_exponent, max_prob, min_prob)
        if self.hierarchy is not None and compensate:
            probs = (probs * self.hierarchy.corrections(probs)).clamp(max=1.0)
        self.probs = probs
        self.means, self.stds = magnitudes(num_features, mean_magnitude, std_magnitude, seed)

    def to(self, device: torch.device | str) -> SynthBench:
        """Move every tensor to `device` (in place), where samples are then made."""
        for name in ("factor", "diag_sqrt", "features", "bias", "probs", "means", "stds"):
            setattr(self, name, getattr(self, name).to(device))
        if self.hierarchy is not None:
            self.hierarchy.to(device)
        return self

    def sample_with_codes(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(activations [n, d], true codes [n, N]) drawn with `generator` (SAELens's sample_with_features)."""
        args = self.probs, self.factor, self.diag_sqrt, self.means, self.stds, self.hierarchy
        codes = sample_codes(n, *args, generator)
        return codes @ self.features + self.bias, codes

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Activations [n, d] drawn with `generator`."""
        return self.sample_with_codes(n, generator)[0]

    def batches(self, n: int, generator: torch.Generator, chunk: int = 2048) -> Iterator[tuple[torch.Tensor, ...]]:
        """`n` samples as (activations, codes) chunks of at most `chunk` rows: an evaluation's fresh data."""
        for start in range(0, n, chunk):
            yield self.sample_with_codes(min(chunk, n - start), generator)


def _check(
    num_features: int,
    d: int,
    max_prob: float,
    min_prob: float,
    rank: int,
    roots: int,
    depth: int,
    mutually_exclusive: float,
    mean_magnitude: Sequence[float],
) -> None:
    # synth_bench_splits hands these on as **world, which runner.config.checks cannot type: checked here
    for name, value in (("num_features", num_features), ("d", d), ("rank", rank), ("depth", depth)):
        check_whole(value, f"data.splits.{name}")
    if not 0 < min_prob < max_prob <= 1:
        raise ConfigError(f"data.splits.min_prob={min_prob}, max_prob={max_prob}: need 0 < min_prob < max_prob <= 1")
    if isinstance(roots, bool) or not isinstance(roots, int) or roots < 0:
        raise ConfigError(f"data.splits.roots={roots!r} must be a whole number >= 0 (0: no hierarchy)")
    if not 0 <= mutually_exclusive <= 1:
        raise ConfigError(f"data.splits.mutually_exclusive={mutually_exclusive} must be a share in [0, 1]")
    if len(mean_magnitude) != 2 or min(mean_magnitude) <= 0:
        raise ConfigError(f"data.splits.mean_magnitude={list(mean_magnitude)} must be [first, last], both > 0")


class SynthBenchValidation(TensorData):
    """A fixed validation set drawn on the CPU, with its true codes kept sparse (chunks of COO tensors): a dense
    [n_val, 16384] would take a gigabyte. `true_features` are the world's directions."""

    def __init__(self, source: SynthBench, size: int, seed: int, chunk: int = 1024) -> None:
        generator = _generator(seed, "val")
        parts = [source.sample_with_codes(min(chunk, size - i), generator) for i in range(0, size, chunk)]
        super().__init__(torch.cat([x for x, _ in parts]))
        self.codes = [c.to_sparse_coo() for _, c in parts]
        self.source = source

    @property
    def true_features(self) -> torch.Tensor:
        """The ground-truth directions [N, d]."""
        return self.source.features

    true_targets = true_linear = None  # SAE data (experiments.sae.callbacks reads them)

    def truth_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(activations, dense true codes) chunk by chunk, for the benchmark's metrics."""
        start = 0
        for codes in self.codes:
            rows = codes.shape[0]
            yield self.tensors[0][start : start + rows], codes.to_dense()
            start += rows


@buildable("splits")
def synth_bench_splits(
    n_train: int = 200_000_000, n_val: int = 16_384, seed: int = 0, world_seed: int = 42, **world
) -> dict[str, Dataset]:
    """Train (generated on the fly, batch by batch from (seed, position)) and validation (fixed, with its true codes;
    none for n_val=0) splits of SynthSAEBench activations, in the world drawn from `world_seed`."""
    check_whole(n_train, "data.splits.n_train")
    if isinstance(n_val, bool) or not isinstance(n_val, int) or n_val < 0 or seed < 0:
        raise ConfigError(f"data.splits.n_val={n_val} and seed={seed} must be whole numbers >= 0 (n_val=0: none)")
    # SAELens draws the directions from a plain generator seeded world_seed (and the magnitudes, the hierarchy and the
    # correlation from world_seed + 1, 3, 4): the run's torch.manual_seed(seed) would hand the SAE's initial decoder
    # the true directions themselves (seen: MCC 0.96 after 20 steps)
    if seed - world_seed in (0, 1, 3, 4):
        raise ConfigError(
            f"seed={seed} with data.splits.world_seed={world_seed}: the SAE's initial weights would be drawn from a "
            "stream the world's were drawn from; choose a seed other than world_seed + 0, 1, 3 or 4"
        )
    source = SynthBench(seed=world_seed, **world)
    train = SyntheticActivations(source, n_train, seed)
    return {"train": train, "val": SynthBenchValidation(source, n_val, seed)} if n_val else {"train": train}


def mean_l0(source: SynthBench, samples: int = 4096, seed: int = 0) -> float:
    """The world's mean number of active features per sample, measured on `samples` fresh samples."""
    codes = source.sample_with_codes(samples, torch.Generator().manual_seed(seed))[1]
    return (codes > 0).float().sum(1).mean().item()


def _orthogonalized(features: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    # N^2 d products a step: seconds on a GPU, where it runs when there is one (its own rounding: the same world up to
    # float error, not bit for bit with SAELens's CPU draw); on the CPU said first, for the published world is long
    cuda = torch.cuda.is_available()
    if not cuda and steps * features.shape[0] ** 2 * features.shape[1] > 1e13:
        print(
            f"note: data.splits.ortho_steps={steps} pushes {features.shape[0]} directions apart on the CPU: "
            f"about {6 * steps * features.shape[0] ** 2 * features.shape[1] / 5e10 / 60:.0f} minutes on 2 cores; "
            "data.splits.ortho_steps=0 skips it (not the published world)",
            file=sys.stderr,
        )
    moved = orthogonalize(features.cuda() if cuda else features, steps, lr)
    return moved.cpu()
