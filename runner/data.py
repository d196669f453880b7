"""Data loaders from datasets: seeded shuffling, sharding by rank, fast in-memory batches, pinned memory on CUDA."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from runner import ConfigError


class TensorData(Dataset):
    """In-memory tensors indexed along dim 0. A whole batch is one fancy-indexing call (no per-sample collate)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        if len({len(t) for t in tensors}) != 1:
            raise ValueError(f"TensorData: tensors differ in length: {[len(t) for t in tensors]}")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can begin its next epoch part-way: `skip` indices are left out once (exact resume)."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class _Shard(torch.utils.data.Sampler):
    """Every `world_size`-th index from `rank`, no padding: each sample is evaluated exactly once over all ranks."""

    def __init__(self, n: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, n, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _collate(batch: Any) -> Any:
    # TensorData.__getitems__ already returns a batch; other datasets get the default collate.
    if isinstance(batch, tuple):
        return batch
    return torch.utils.data.default_collate(batch)


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; numpy and random need the same seed by hand.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class DataModule:
    """Turns `splits` (a mapping with 'train' and optionally 'val' datasets) into loaders for one rank."""

    def __init__(
        self,
        splits: Mapping[str, Dataset],
        batch_size: int,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        tokens_per_sample: float | None = None,
    ) -> None:
        if "train" not in splits:
            raise ConfigError(f"data.splits must have a 'train' split, got {sorted(splits)}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"data.batch_size must be a whole number >= 1, got {batch_size!r}")
        self.splits, self.batch_size = splits, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers, self.shuffle, self.drop_last, self.seed = num_workers, shuffle, drop_last, seed
        self.tokens_per_sample = tokens_per_sample

    def _loader(
        self, dataset: Dataset, batch_size: int, train: bool, rank: int, world_size: int, device: torch.device
    ) -> DataLoader:
        # DistributedSampler also serves one process: seeded, epoch-aware shuffling that resumes exactly.
        sampler = (
            ResumableSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=self.shuffle,
                seed=self.seed,
                drop_last=self.drop_last,
            )
            if train
            else _Shard(len(dataset), rank, world_size)
        )
        generator = torch.Generator().manual_seed(self.seed + rank)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=train and self.drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=device.type == "cuda",
            collate_fn=_collate,
            worker_init_fn=_seed_worker,
            generator=generator,
        )

    def train_loader(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None) -> DataLoader:
        """The training loader for this rank."""
        return self._loader(
            self.splits["train"], self.batch_size, True, rank, world_size, device or torch.device("cpu")
        )

    def val_loader(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None) -> DataLoader | None:
        """The validation loader for this rank, or None without a 'val' split."""
        if self.splits.get("val") is None:
            return None
        return self._loader(
            self.splits["val"], self.val_batch_size, False, rank, world_size, device or torch.device("cpu")
        )


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`, without blocking when the memory is pinned."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, (torch.Tensor, Mapping, list, tuple)):
            return batch_size_of(value)
    raise ValueError("cannot tell the batch size: the batch holds no tensor")


def tokens_of(batch: Any) -> int:
    """Tokens in a batch: its 'num_tokens' entry when it is a mapping that has one (an int, counted on the host)."""
    if isinstance(batch, Mapping) and "num_tokens" in batch:
        return int(batch["num_tokens"])
    return 0


def with_last(iterable: Any) -> Iterator[tuple[Any, bool]]:
    """Yield (item, is_last): the loop must know which micro-batch ends an epoch to close its accumulation window."""
    iterator = iter(iterable)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield item, False
        item = following
    yield item, True
