"""Samplers: an epoch's seeded order cut into global batches split over ranks and micro-batches (the same samples in
each optimizer step for any split, and exact resume mid-epoch), and the validation shard of each rank."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from runner import ConfigError, check_whole


class EpochOrder(torch.utils.data.Sampler):
    """The order of an epoch's n samples: a permutation seeded by seed + epoch, or 0..n-1 without shuffling.

    GlobalBatchSampler cuts it into batches and holds it as its `sampler`, where Lightning (and code written for
    torch's BatchSampler over a DistributedSampler) calls set_epoch at each epoch's start.
    """

    def __init__(self, n: int, shuffle: bool = True, seed: int = 0, repeat: bool = False) -> None:
        self.n, self.shuffle, self.seed, self.epoch, self.repeat = n, shuffle, seed, 0, repeat

    def set_epoch(self, epoch: int) -> None:
        # repeat (data.overfit_batches): every epoch is epoch 0, so its first batches are the same samples each time
        self.epoch = 0 if self.repeat else epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.order() if not self.shuffle else self.order().tolist())

    def order(self) -> range | np.ndarray:
        """The epoch's order, sliceable and never a list: a generated dataset's epoch may be 200M samples."""
        if not self.shuffle:
            return range(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).numpy()

    def __len__(self) -> int:
        return self.n


class GlobalBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (index lists) of an epoch laid out in global batches, one per optimizer step.

    An epoch is a seeded permutation of the dataset (`sampler`, an EpochOrder) cut into global batches of batch_size x
    world_size x accumulate samples; a global batch is cut into `accumulate` micro-batches of batch_size x world_size,
    and each of those into world_size consecutive slices, one per rank. So which samples make up each optimizer step
    depends only on the seed and the global batch size, never on how the batch is split over ranks and micro-batches.
    The epoch's last, short global batch (dropped with `drop_last`) is spread over as few micro-batches as fit (every
    rank gets the same number of micro-batches, at least one sample in each, sizes differing by at most one): the loop
    weights each micro-batch's loss by its share of the step's samples, so that step is still the mean over its samples.
    Fewer leftover samples than ranks are dropped.

    `limit_steps` (a fraction or a number) keeps each epoch's first global batches (data.limit_train_batches: an
    epoch that short is what TrainingProgress counts); `repeat` lays out every epoch as the first (overfit_batches).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        accumulate: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        limit_steps: float | int | None = None,
        repeat: bool = False,
    ) -> None:
        check_whole(accumulate, "trainer.accumulate_grad_batches")
        self.n, self.batch_size, self.rank, self.world_size, self.accumulate = (
            n,
            batch_size,
            rank,
            world_size,
            accumulate,
        )
        self.sampler, self.drop_last, self.skip = EpochOrder(n, shuffle, seed, repeat), drop_last, 0
        self.global_batch = batch_size * world_size * accumulate
        self.full_steps, rest = divmod(n, self.global_batch)
        if drop_last or rest < world_size:
            rest = 0
        steps = limited(limit_steps, self.full_steps + bool(rest), "data.limit_train_batches")
        if steps < self.full_steps + bool(rest):
            self.full_steps, rest = steps, 0  # whole global batches only: the short one is the epoch's last
        # the short step's micro-batches: as few as keep every rank's slice within batch_size, and none empty
        k = min(math.ceil(rest / (batch_size * world_size)), rest // world_size)
        self.last_step = [rest // k + (j < rest % k) for j in range(k)] if k else []  # global micro-batch sizes
        self.samples_per_epoch = self.full_steps * self.global_batch + rest
        self.micro_batches = self.full_steps * accumulate + k  # per rank, the same on every rank

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Lay out `epoch`; its first `skip` micro-batches were already trained on (exact resume).

        Lightning calls `sampler.set_epoch(epoch)` instead (it never looks for a batch sampler's own set_epoch): the
        same layout, with the skip left as it was (none unless set here).
        """
        self.sampler.set_epoch(epoch)
        self.skip = skip

    def _chunks(self) -> Iterator[int]:
        # global micro-batch sizes, in order
        for _ in range(self.full_steps * self.accumulate):
            yield self.batch_size * self.world_size
        yield from self.last_step

    def __iter__(self) -> Iterator[list[int]]:
        # sliced batch by batch: a list of a whole epoch's indices took seconds and gigabytes for 200M samples
        order = self.sampler.order() if isinstance(self.sampler, EpochOrder) else list(self.sampler)
        start, w, r = 0, self.world_size, self.rank
        for i, size in enumerate(self._chunks()):
            base, extra = divmod(size, w)
            first = start + r * base + min(r, extra)
            if i >= self.skip:
                batch = order[first : first + base + (r < extra)]
                yield batch.tolist() if isinstance(batch, np.ndarray) else list(batch)
            start += size

    def __len__(self) -> int:
        return self.micro_batches - self.skip


class ValidationShard(torch.utils.data.Sampler):
    """Every `world_size`-th index from `rank` in batches of at most `batch_size`, no padding: each sample is
    evaluated exactly once over all ranks. Every rank gets as many batches (a rank whose shard is one sample short of
    another batch splits its last one), so that a task whose validation_step is a collective (a family spread over
    the ranks, distributed=spread) is called as often on every rank."""

    def __init__(self, n: int, rank: int, world_size: int, batch_size: int) -> None:
        indices = list(range(rank, n, world_size))
        self.batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
        most = math.ceil(math.ceil(n / world_size) / batch_size)  # rank 0's: its shard is the largest
        while 0 < len(self.batches) < most and len(self.batches[-1]) > 1:
            last = self.batches.pop()
            self.batches += [last[:-1], last[-1:]]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def limited(limit: float | int | None, total: int, name: str) -> int:
    """How many of `total` batches `limit` keeps: a fraction in (0, 1] (at least one batch), or a whole number."""
    if limit is None:
        return total
    if isinstance(limit, float) and 0 < limit <= 1:
        return max(1, int(limit * total))
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        return min(limit, total)
    raise ConfigError(f"{name} must be a fraction in (0, 1] or a whole number of batches >= 1, got {limit!r}")
