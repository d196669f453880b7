"""Data loaders from datasets (their samplers: runner.data.samplers), fast in-memory batches, pinned memory and batches
copied ahead on CUDA."""

from __future__ import annotations

import math
import multiprocessing
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from runner import ConfigError, check_whole
from runner.config.trust import buildable
from runner.data.samplers import GlobalBatchSampler, ValidationShard, limited


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


def _collate(batch: Any) -> Any:
    # A dataset's __getitems__ (TensorData's) already returns a batch; a list of samples gets the default collate.
    if isinstance(batch, list):
        return torch.utils.data.default_collate(batch)
    return batch


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; numpy and random need the same seed by hand.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


@buildable("data", splits="splits")
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
        limit_train_batches: float | int | None = None,
        limit_val_batches: float | int | None = None,
        overfit_batches: int | None = None,
    ) -> None:
        if "train" not in splits:
            raise ConfigError(f"data.splits must have a 'train' split, got {sorted(splits)}")
        check_whole(batch_size, "data.batch_size")
        if val_batch_size is not None:
            check_whole(val_batch_size, "data.val_batch_size")
        self.splits, self.batch_size = splits, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers, self.shuffle, self.drop_last, self.seed = num_workers, shuffle, drop_last, seed
        self.tokens_per_sample = tokens_per_sample
        # Shorter epochs for debugging (runner/conf/debug/): the samplers shrink, so TrainingProgress counts the
        # shorter epochs like any other. Training: limit_train_batches (optimizer steps per epoch, a fraction or a
        # number) or overfit_batches (that many global batches, the same ones every epoch); validation:
        # limit_val_batches (a fraction of the split, or batches per rank).
        if overfit_batches is not None:
            check_whole(overfit_batches, "data.overfit_batches")
            if limit_train_batches is not None:
                raise ConfigError("data.overfit_batches and data.limit_train_batches both limit training: set one")
        self.limit_train_batches, self.limit_val_batches = limit_train_batches, limit_val_batches
        self.overfit_batches = overfit_batches
        self.info: dict[str, Any] = {}  # facts about the data for run.json (a corpus's size and hash, say)
        # Model keys that the data decides, filled where the model's config leaves them null (runner.build): an
        # SAE's d_in is its activations' width.
        self.model_args: dict[str, Any] = {}

    def _loader(
        self, dataset: Dataset, batches: torch.utils.data.Sampler, device: torch.device, seed: int
    ) -> DataLoader:
        return DataLoader(
            dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=device.type == "cuda",
            collate_fn=_collate,
            worker_init_fn=_seed_worker,
            generator=torch.Generator().manual_seed(seed),
            multiprocessing_context=self._start_method(),
        )

    def _start_method(self) -> str | None:
        # The platform's own start method, named: a host process may have replaced the global default (joblib's
        # loky workers do, and their "loky" context cannot start a DataLoader worker: hydra#964).
        return multiprocessing.get_all_start_methods()[0] if self.num_workers > 0 else None

    def train_loader(
        self, rank: int = 0, world_size: int = 1, device: torch.device | None = None, accumulate: int = 1
    ) -> DataLoader:
        """The training loader for this rank: its micro-batches of the global batches (GlobalBatchSampler)."""
        dataset = self.splits["train"]
        sampler = GlobalBatchSampler(
            len(dataset),
            self.batch_size,
            rank,
            world_size,
            accumulate,
            self.shuffle,
            self.seed,
            self.drop_last,
            limit_steps=self.overfit_batches or self.limit_train_batches,
            repeat=self.overfit_batches is not None,
        )
        return self._loader(dataset, sampler, device or torch.device("cpu"), self.seed + rank)

    def val_loader(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None) -> DataLoader | None:
        """The validation loader for this rank (every sample once over all ranks), or None without a 'val' split."""
        return self.split_loader("val", rank, world_size, device)

    def split_loader(
        self, split: str, rank: int = 0, world_size: int = 1, device: torch.device | None = None
    ) -> DataLoader | None:
        """A loader over the named split for evaluation, in order (every sample once over all ranks), or None."""
        dataset = self.splits.get(split)
        if dataset is None:
            return None
        n = len(dataset)
        limit = self.limit_val_batches
        if split == "val" and limit is not None:  # its first samples: the same ones at every validation
            per_batch = self.val_batch_size * world_size  # one batch on every rank
            kept = limited(limit, math.ceil(n / per_batch), "data.limit_val_batches")
            n = min(n, kept * per_batch) if isinstance(limit, int) else max(min(world_size, n), int(limit * n))
        sampler = ValidationShard(n, rank, world_size, self.val_batch_size)
        return self._loader(dataset, sampler, device or torch.device("cpu"), self.seed + rank)


def load_npy(path: str | Path, what: str) -> np.ndarray:
    """A .npy array, memory-mapped and never unpickled; a ConfigError naming `what` if the file is not a .npy array."""
    with open(path, "rb") as f:
        magic = f.read(len(np.lib.format.MAGIC_PREFIX))
    if magic != np.lib.format.MAGIC_PREFIX:
        raise ConfigError(
            f"{what} cannot be read: it is not a valid .npy file (it does not start with numpy's header; empty, "
            "truncated, or another format). Write it with numpy.save"
        )
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:  # a header numpy cannot read, or object arrays (pickled)
        raise ConfigError(f"{what} cannot be read as a plain .npy array ({error})") from None


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    # the batch with fn applied to every tensor in it, nested in mappings, lists and tuples; anything else as it is
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device` without blocking. To a GPU, host tensors go from page-locked
    memory: one in pageable memory is pinned first (a copy from there waits for the GPU's queued work)."""
    if device.type != "cuda":
        return _map_tensors(batch, lambda t: t.to(device, non_blocking=True))
    return _map_tensors(batch, lambda t: (t.pin_memory() if _pageable(t) else t).to(device, non_blocking=True))


def _pageable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not t.is_pinned()


def device_batches(loader: Iterable, device: torch.device) -> Iterator[Any]:
    """The loader's batches on `device`. On CUDA each batch's copy (from pinned memory) is issued on a side stream
    one batch ahead, so the next batch travels while this step computes; elsewhere a plain move."""
    if device.type != "cuda":
        yield from (to_device(batch, device) for batch in loader)
        return
    compute, copies = torch.cuda.current_stream(device), torch.cuda.Stream(device)

    def issue(batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(copies):
            moved = to_device(batch, device)
            return moved, copies.record_event()

    ahead = None
    for batch in loader:
        following = issue(batch)  # on its way before the batch ahead of it is handed out
        if ahead is not None:
            yield _ready(*ahead, compute)
        ahead = following
    if ahead is not None:
        yield _ready(*ahead, compute)


def _ready(batch: Any, copied: torch.cuda.Event, compute: torch.cuda.Stream) -> Any:
    compute.wait_event(copied)  # the compute stream waits on the device: the host goes on
    # its memory is not reused until the compute stream is done with it
    return _map_tensors(batch, lambda t: t.record_stream(compute) or t)


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, (torch.Tensor, Mapping, list, tuple)):
            return batch_size_of(value)
    raise ValueError("cannot tell the batch size: the batch holds no tensor")


def map_rows(batch: Any, size: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor of a (nested) batch whose first dimension is `size`, its samples'; the rest (a mask
    or table the samples share, a count) as they are, and dicts, lists and tuples of their own types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch) if batch.ndim and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return type(batch)({k: map_rows(v, size, fn) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_rows(v, size, fn) for v in batch)
    return batch


def first_rows(batch: Any, n: int) -> Any:
    """The batch's first `n` samples (map_rows); a batch that holds no tensor, whole."""
    try:
        size = batch_size_of(batch)
    except ValueError:
        return batch
    return map_rows(batch, size, lambda t: t[:n])


def tokens_of(batch: Any) -> int | None:
    """Tokens in a batch: its 'num_tokens' entry when it is a mapping that has one (counted on the host), else None."""
    if isinstance(batch, Mapping) and "num_tokens" in batch:
        return int(batch["num_tokens"])
    return None


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
