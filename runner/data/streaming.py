"""Streaming data: an endless IterableDataset, sharded by rank and loader worker, read through torchdata's
StatefulDataLoader, whose state (each worker's place in its shard) goes into the checkpoint. A stream has no epoch
length: durations are in steps, samples or tokens (runner.progress refuses `ep`)."""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from runner import ConfigError, require
from runner.data import DataModule


@contextlib.contextmanager
def _quiet_torchdata() -> Iterator[None]:
    # torchdata 0.11 calls torch.set_vital (deprecated since torch 2.9) when a loader is made and at each iter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        yield


class ShardedStream(IterableDataset):
    """An endless IterableDataset read in `shard()`s, one per rank x loader worker. A subclass keeps its place in
    attributes that `state_dict()` returns and `load_state_dict()` restores (torchdata calls them in each worker), and
    `__iter__` goes on from there. `max_shards`: how many shards it can make (files to share out), None: any;
    `identity`: what it reads (a hash of a corpus's listing), which a checkpoint's stream must match."""

    rank: int = 0
    world_size: int = 1
    max_shards: int | None = None
    identity: str = ""

    def shard(self) -> tuple[int, int]:
        """(this copy's shard, number of shards): rank-major over the ranks' loader workers."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers


class StreamLoader:
    """The training loader of a stream: endless, and it remembers the loader's state after each of the last batches
    it handed out, so that a checkpoint holds the state as of the batches trained on, not those the loop fetched ahead
    (runner.ckpt.state.stateful_data)."""

    def __init__(self, loader: Any, layout: dict[str, int]) -> None:
        self.loader, self.dataset, self.layout = loader, loader.dataset, layout
        self.handed = 0  # batches handed out since the run began (a resumed run counts on from its checkpoint)
        # (batches, the loader's state after them) for the last few; None: the stream's start (asking torchdata for
        # a state before the first batch would start its workers)
        self.states: deque[tuple[int, dict[str, Any] | None]] = deque([(0, None)], maxlen=8)

    def __iter__(self) -> Iterator[Any]:
        while True:  # a stream that ends starts again (its dataset decides what its next pass reads)
            with _quiet_torchdata():
                batches = iter(self.loader)
            before = self.handed
            for batch in batches:
                self.handed += 1
                self.states.append((self.handed, self.loader.state_dict()))
                yield batch
            if self.handed == before:
                raise RuntimeError(f"the stream {type(self.dataset).__name__} yields no batch")

    def state_dict(self, batches: int) -> dict[str, Any]:
        """The loader's state after its first `batches` batches (one of the last few handed out)."""
        for count, state in self.states:
            if count == batches:
                return {**self.layout, "batches": batches, "loader": state}
        raise RuntimeError(
            f"the stream's state after batch {batches} is gone (kept: {[c for c, _ in self.states]}): the loop "
            "fetched further ahead than the stream remembers"
        )

    def load_state_dict(self, state: dict[str, Any] | None, batches: int) -> None:
        """Go on after batch `batches`, from a checkpoint's state_dict (the same ranks and loader workers)."""
        from runner.ckpt.files import CheckpointError

        if state is None:
            raise CheckpointError("the checkpoint holds no state of this stream: it was written with other data")
        saved = {k: state.get(k) for k in self.layout}
        if saved["identity"] != self.layout["identity"]:
            raise CheckpointError(
                f"the stream reads other data than the checkpoint's ({type(self.dataset).__name__}: "
                f"{saved['identity']} then, {self.layout['identity']} now: files added, removed or changed in size): "
                "it cannot go on where it was"
            )
        if saved != self.layout:
            raise CheckpointError(
                f"the stream was checkpointed split over {saved['world_size']} rank(s) x "
                f"{saved['num_workers']} loader worker(s) (data.num_workers), now {self.layout['world_size']} x "
                f"{self.layout['num_workers']}: each shard keeps its own place, so resume with the same ones"
            )
        if state["loader"] is not None:
            self.loader.load_state_dict(state["loader"])
        self.handed = batches
        self.states = deque([(batches, state["loader"])], maxlen=self.states.maxlen)


class StreamingData(DataModule):
    """A DataModule whose training split is a ShardedStream (endless, no epochs) and whose other splits are ordinary
    datasets (validation in order, every sample once over all ranks, as DataModule's)."""

    def __init__(
        self,
        train: ShardedStream,
        batch_size: int,
        val: Dataset | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        **loader: Any,
    ) -> None:
        super().__init__({"train": train, **({"val": val} if val is not None else {})}, batch_size, **loader)
        if self.limit_train_batches is not None or self.overfit_batches is not None:
            raise ConfigError(
                "data.limit_train_batches and data.overfit_batches shorten epochs, and a stream has none: use "
                "trainer.max_duration in steps (debug=fast) instead"
            )
        self.collate = collate

    def train_loader(
        self, rank: int = 0, world_size: int = 1, device: torch.device | None = None, accumulate: int = 1
    ) -> StreamLoader:
        """This rank's endless loader: its workers read shards rank x num_workers + worker of the stream."""
        require("torchdata", "stream", "a streaming data option")
        from torchdata.stateful_dataloader import StatefulDataLoader

        stream = self.splits["train"]
        stream.rank, stream.world_size = rank, world_size
        shards = world_size * max(1, self.num_workers)
        if stream.max_shards is not None and shards > stream.max_shards:
            raise ConfigError(
                f"the stream can be split {stream.max_shards} way(s) ({type(stream).__name__}: whole files to each "
                f"shard), but {world_size} rank(s) x {max(1, self.num_workers)} loader worker(s) need {shards}: "
                "lower data.num_workers, or give more files"
            )
        with _quiet_torchdata():
            loader = StatefulDataLoader(
                stream,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                collate_fn=self.collate,
                pin_memory=(device or torch.device("cpu")).type == "cuda",
                multiprocessing_context=self._start_method(),
                snapshot_every_n_steps=1,  # a worker's place travels with each of its batches
            )
        layout = {"world_size": world_size, "num_workers": self.num_workers, "identity": stream.identity}
        return StreamLoader(loader, layout)
