"""Activation data for SAEs: synthetic activations with known features (files of activations:
experiments.sae.sources.files), and for transcoders synthetic (input, target) pairs made from the same sparse codes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from runner import ConfigError, check_whole
from runner.config.trust import buildable
from runner.data import DataModule, TensorData


def _generator(seed: int, stream: str, position: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    # Independent streams per purpose: torch.manual_seed(seed) also seeds the model's init, and a generator seeded
    # with the same number would hand the model the true features as its initial decoder. The seed is worked out on
    # the host, so seeding a CUDA generator reads nothing from the device.
    words = [seed, position, *stream.encode()]
    seed = int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)
    return torch.Generator(device).manual_seed(seed)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class SyntheticFeatures:
    """K random unit feature directions in d dims; feature i is active with probability proportional to decay**i.

    Optional correlation: features in consecutive groups of `group_size` share a Gaussian factor with weight
    `correlation` (a Gaussian copula), which keeps each feature's own probability and makes group mates co-occur.

    With `d_out` (a transcoder's data) the same codes c also make a target: a row is [x | y] with x = c @ features and
    y = c @ targets (K other unit directions in d_out dims) + x @ linear_map (linear * L, L [d, d_out] with entries
    N(0, 1/d); none for linear=0): the part a skip transcoder's W_skip must learn. Optional `noise`: dense Gaussian
    noise of that std added to every input coordinate. Without it the linear part is not identifiable: x @ L = c @ (E L)
    is then itself a sum of feature directions, which a transcoder's decoder can learn instead of its skip map.
    """

    def __init__(
        self,
        d: int = 256,
        n_features: int = 512,
        mean_active: float = 5.0,
        decay: float = 0.99,
        magnitude: tuple[float, float] = (0.0, 1.0),
        correlation: float = 0.0,
        group_size: int = 8,
        seed: int = 0,
        d_out: int | None = None,
        linear: float = 0.0,
        noise: float = 0.0,
    ) -> None:
        # synthetic_splits hands these on as **features, which runner.config.checks cannot type: checked here
        for name, value in (("d", d), ("n_features", n_features), ("group_size", group_size)):
            check_whole(value, f"data.splits.{name}")
        if not _number(mean_active) or not 0 < mean_active <= n_features:
            raise ConfigError(f"data.splits.mean_active={mean_active} must be in (0, n_features={n_features}]")
        if not _number(correlation) or not 0 <= correlation < 1:
            raise ConfigError(f"data.splits.correlation={correlation} must be in [0, 1)")
        if not _number(decay) or not 0 < decay <= 1:
            raise ConfigError(f"data.splits.decay={decay} must be in (0, 1]: feature i is active with odds decay**i")
        if not isinstance(magnitude, Sequence) or len(magnitude) != 2 or not all(map(_number, magnitude)):
            raise ConfigError(
                f"data.splits.magnitude={magnitude} must be [low, high]: e.g. data.splits.magnitude=[0.0,1.0]"
            )
        if not 0 <= magnitude[0] <= magnitude[1]:
            raise ConfigError(f"data.splits.magnitude={list(magnitude)} must be [low, high] with 0 <= low <= high")
        if d_out is not None:  # null: SAE data
            check_whole(d_out, "data.splits.d_out (the target's width; null for SAE data)")
        if not _number(linear) or linear < 0:
            raise ConfigError(f"data.splits.linear={linear!r} must be a finite number >= 0 (the target's linear part)")
        if not _number(noise) or noise < 0:
            raise ConfigError(f"data.splits.noise={noise!r} must be a finite number >= 0 (the inputs' noise std)")
        if linear > 0 and d_out is None:
            raise ConfigError(f"data.splits.linear={linear} maps inputs to a target: set data.splits.d_out too")
        g = _generator(seed, "features")
        self.features = torch.nn.functional.normalize(torch.randn(n_features, d, generator=g), dim=1)
        # The target's directions and linear map come from streams of their own: the features stay those of SAE data.
        self.targets = self.linear_map = None
        if d_out is not None:
            g = _generator(seed, "targets")
            self.targets = torch.nn.functional.normalize(torch.randn(n_features, d_out, generator=g), dim=1)
        if linear > 0:
            self.linear_map = linear * torch.randn(d, d_out, generator=_generator(seed, "linear")) / d**0.5
        self._join()
        weights = decay ** torch.arange(n_features, dtype=torch.float64)
        self.probs = self._probabilities(weights, mean_active).float()
        self.low, self.high = magnitude
        self.correlation, self.group_size, self.seed, self.noise = correlation, group_size, seed, noise
        if correlation > 0:
            normal = torch.distributions.Normal(0.0, 1.0)
            self.cutoffs = normal.icdf(self.probs.clamp(1e-7, 1 - 1e-7))

    @staticmethod
    def _probabilities(weights: torch.Tensor, mean_active: float) -> torch.Tensor:
        # Scale so that the probabilities (each capped at 1) sum to mean_active.
        probs = weights / weights.sum() * mean_active
        for _ in range(100):
            if probs.max() <= 1:
                break
            capped = probs >= 1
            rest = mean_active - capped.sum()
            probs = torch.where(capped, torch.ones_like(probs), weights / weights[~capped].sum() * rest)
        return probs.clamp(max=1)

    def to(self, device: torch.device | str) -> SyntheticFeatures:
        """Move the features, probabilities (and a target's truth) to `device` (in place), where samples are made."""
        self.features, self.probs = self.features.to(device), self.probs.to(device)
        if self.correlation > 0:
            self.cutoffs = self.cutoffs.to(device)
        self.targets, self.linear_map = (t if t is None else t.to(device) for t in (self.targets, self.linear_map))
        self._join()
        return self

    def _join(self) -> None:
        # [K, d + d_out]: one pass over these rows makes [x | c @ targets] (SAE data: the features themselves)
        self.joined = self.features if self.targets is None else torch.cat([self.features, self.targets], 1)

    def _finish(self, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        # In place in [x | c @ targets]: x += noise (drawn after the codes: they stay those of noise=0), then
        # y += x @ linear_map
        d = self.features.shape[1]
        if self.noise > 0:
            out[:, :d].add_(torch.randn(len(out), d, generator=generator, device=out.device), alpha=self.noise)
        if self.linear_map is not None:
            out[:, d:].addmm_(out[:, :d], self.linear_map)
        return out

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """n activation rows [n, d] ([x | y]: [n, d + d_out] with a target), made on the generator's device
        (sample_sparse on the CPU, else sample_dense)."""
        return self.sample_sparse(n, generator) if generator.device.type == "cpu" else self.sample_dense(n, generator)

    def _active(self, n: int, generator: torch.Generator) -> torch.Tensor:
        # [n, K] bool: which features each sample holds
        k, device = len(self.probs), generator.device
        if self.correlation > 0:
            groups = math.ceil(k / self.group_size)
            shared = torch.randn(n, groups, generator=generator, device=device)
            shared = shared[:, :, None].expand(n, groups, self.group_size).flatten(1)[:, :k]  # each group's factor
            noise = torch.randn(n, k, generator=generator, device=device)
            return (self.correlation**0.5 * shared + (1 - self.correlation) ** 0.5 * noise) < self.cutoffs
        return torch.rand(n, k, generator=generator, device=device) < self.probs

    def sample_sparse(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Samples as sums of about mean_active feature rows each: the fastest way on the CPU."""
        active = self._active(n, generator)
        rows, cols = active.nonzero(as_tuple=True)  # on a GPU, its size would be read from the device every batch
        mags = self.low + (self.high - self.low) * torch.rand(len(rows), generator=generator)
        offsets = torch.zeros(n, dtype=torch.long)
        offsets[1:] = active.sum(1).cumsum(0)[:-1]
        out = torch.nn.functional.embedding_bag(cols, self.joined, offsets, per_sample_weights=mags, mode="sum")
        return self._finish(out, generator)

    def sample_dense(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """The same distribution with shapes known in advance (no read of the device): a magnitude is drawn for every
        (sample, feature) and the inactive ones are zeroed, then one [n, K] x [K, d] product sums the features (in
        TF32 where the user allows it for float32 matmuls)."""
        active = self._active(n, generator)
        mags = self.low + (self.high - self.low) * torch.rand(active.shape, generator=generator, device=active.device)
        return self._finish((mags * active) @ self.joined, generator)


class _Truth:
    """The source's ground truth, for evaluation only: directions [K, d] that make the inputs, and for transcoder
    data the directions [K, d_out] that make the targets and the linear map [d, d_out] (None where there is none)."""

    source: SyntheticFeatures

    @property
    def true_features(self) -> torch.Tensor:
        """The ground-truth input directions [K, d]."""
        return self.source.features

    @property
    def true_targets(self) -> torch.Tensor | None:
        """The ground-truth target directions [K, d_out] (None: SAE data)."""
        return self.source.targets

    @property
    def true_linear(self) -> torch.Tensor | None:
        """The target's linear part, linear * L [d, d_out] (None: no linear part)."""
        return self.source.linear_map


class SyntheticActivations(_Truth, Dataset):
    """`size` samples drawn in batches: a batch is generated from (seed, index of its first sample), so any epoch
    and any resumed position yields the same data, with no need to hold it all in memory.

    Batches are made where the source's features are (SyntheticFeatures.to). On a GPU they come from the CUDA
    generator seeded the same way, so they are as reproducible by position (on the same GPU model and torch version)
    and have the same distribution, but other values than the CPU's: the two generators' streams differ.
    """

    def __init__(self, source: SyntheticFeatures, size: int, seed: int) -> None:
        self.source, self.size, self.seed = source, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor]:
        generator = _generator(self.seed, "train", int(indices[0]), self.source.features.device)
        return (self.source.sample(len(indices), generator),)


class SyntheticValidation(_Truth, TensorData):
    """A fixed validation set drawn on the CPU (the same samples whatever the training device), whose true features
    are the source's, wherever they live."""

    def __init__(self, source: SyntheticFeatures, size: int, seed: int) -> None:
        super().__init__(source.sample(size, _generator(seed, "val")))
        self.source = source


@buildable("splits")
def synthetic_splits(n_train: int = 4_194_304, n_val: int = 16_384, seed: int = 0, **features) -> dict[str, Dataset]:
    """Train (generated on the fly) and validation (fixed, in memory; none for n_val=0) splits of synthetic
    activations."""
    check_whole(n_train, "data.splits.n_train")
    if isinstance(n_val, bool) or not isinstance(n_val, int) or n_val < 0 or seed < 0:
        raise ConfigError(
            f"data.splits.n_val={n_val} and seed={seed} must be whole numbers >= 0 (n_val=0: no validation)"
        )
    source = SyntheticFeatures(seed=seed, **features)  # d, n_features, mean_active, ..., d_out, linear
    train = SyntheticActivations(source, n_train, seed)
    return {"train": train, "val": SyntheticValidation(source, n_val, seed)} if n_val else {"train": train}


@buildable("data", splits="splits")
class SyntheticData(DataModule):
    """A DataModule over synthetic_splits that generates the training batches on the training device when it is a
    GPU: no host-to-device copy, and the generator runs there."""

    def __init__(self, splits: dict[str, Dataset], **loader: Any) -> None:
        super().__init__(splits, **loader)
        source = splits["train"].source
        self.model_args = {"d_in": source.features.shape[1]}  # the SAE's width is the task's d
        if source.targets is not None:  # a transcoder's: it reads the d input columns and predicts the d_out others
            self.model_args["d_out"] = source.targets.shape[1]

    def train_loader(
        self, rank: int = 0, world_size: int = 1, device: torch.device | None = None, accumulate: int = 1
    ) -> DataLoader:
        """The training loader for this rank; on a GPU its batches are made on it, in this process."""
        device = torch.device(device or "cpu")
        if device.type == "cuda":
            if self.num_workers > 0:
                raise ConfigError(
                    f"data.num_workers={self.num_workers}: synthetic activations are generated on the GPU ({device}) "
                    "by the training process, not by loader workers; set data.num_workers=0"
                )
            self.splits["train"].source.to(device)
            # The loader's device only decides whether it pins host memory, and these batches are born on the GPU
            # (pinning a CUDA tensor is an error).
            device = torch.device("cpu")
        return super().train_loader(rank, world_size, device, accumulate)


# Older runs' configs name it here (data=activations_file before it had a module of its own).
from experiments.sae.sources.files import ActivationFiles  # noqa: E402, F401
