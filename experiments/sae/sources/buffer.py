"""Live activations in a shuffling ring buffer, and the training dataset that serves it, with the state that a
checkpoint needs to resume it exactly (the source model itself: experiments.sae.sources.source)."""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.data import to_device
from runner.timeline import phase


def source_inputs(loader: Any, epoch: int = 0, consumed: int = 0) -> Iterator[tuple[int, int, Any]]:
    """A source model's training inputs in its loader's order, epoch after epoch from (`epoch`, `consumed` batches)
    on, each with the place after it: (epoch, consumed, batch). A stream's loader (a source trained on
    data=text_stream, runner.data.streaming) is endless and keeps its place itself: its count goes on."""
    sampler = getattr(loader, "batch_sampler", None)
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch, skip=consumed)
        for batch in loader:
            consumed += 1
            yield epoch, consumed, batch
        epoch, consumed = epoch + 1, 0


class ActivationBuffer:
    """A ring of `capacity` activations served in shuffled order; once half is served, that half is refilled
    with fresh activations from the source and the whole ring is reshuffled (so consecutive batches mix inputs).

    `source` gives `activations(batch) -> [rows, d]` for a batch of its training inputs (`source.data`'s train
    loader, epoch after epoch; what an input batch gives beyond the rows a fill needs is dropped). The ring is
    filled at the first take, so a buffer whose state a checkpoint restores never computes one it throws away."""

    def __init__(self, source: Any, capacity: int = 16384, seed: int = 0) -> None:
        self.source, self.capacity = source, capacity
        self.device = torch.device("cpu")  # where the ring lives: the source's device (to)
        self.generator = torch.Generator().manual_seed(seed)
        self.loader = source.data.train_loader()
        self._stream = getattr(self.loader, "batch_sampler", None) is None  # runner.data.streaming.StreamLoader
        self.epoch = self.consumed = 0  # where the source's inputs are: the epoch, and its batches used so far
        self.inputs = self._inputs()
        self.ring: torch.Tensor | None = None
        self.order, self.pos = torch.empty(0, dtype=torch.long), 0

    def _inputs(self) -> Iterator[Any]:
        for epoch, consumed, batch in source_inputs(self.loader, self.epoch, self.consumed):
            self.epoch, self.consumed = epoch, consumed  # where a checkpoint resumes the source's inputs
            yield batch

    def to(self, device: torch.device) -> ActivationBuffer:
        """Run the source and keep the ring on `device` (the training GPU): activations never leave it."""
        self.device = torch.device(device)
        self.source.to(self.device)
        if self.ring is not None:
            self.ring, self.order = self.ring.to(self.device), self.order.to(self.device)
        return self

    def _fill(self, n: int) -> torch.Tensor:
        parts = []
        while n > 0:
            acts = self.source.activations(next(self.inputs)).to(self.device)[:n]
            n -= len(acts)
            parts.append(acts)
        return torch.cat(parts)

    def _shuffle(self) -> None:
        # drawn on the host (the same order on any device), copied once: slicing it then reads nothing back
        self.order, self.pos = to_device(torch.randperm(self.capacity, generator=self.generator), self.device), 0

    def take(self, n: int) -> torch.Tensor:
        """The next `n` activations."""
        if self.ring is None:
            with phase("buffer fill"):
                self.ring = self._fill(self.capacity)
            self._shuffle()
        elif self.pos + n > self.capacity // 2:
            served = self.order[: self.pos]
            # a new ring rather than writes into this one: a checkpoint may still need it (HookedActivations.history)
            self.ring = self.ring.index_put((served,), self._fill(len(served)))
            self._shuffle()
        rows = self.order[self.pos : self.pos + n]
        self.pos += n
        return self.ring[rows]

    def state_dict(self) -> dict[str, Any]:
        """Everything the next takes depend on: the ring, its order and position, the generator, the source's input
        position. The tensors are the buffer's own (never written in place afterwards), not copies."""
        return {
            "ring": self.ring,
            "order": self.order,
            "pos": self.pos,
            "generator": self.generator.get_state(),
            "epoch": self.epoch,
            "consumed": self.consumed,
            **({"stream": self.loader.state_dict(self.consumed)} if self._stream else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict(); the source's inputs go on with the next unused batch."""
        self.ring, self.order, self.pos = state["ring"], state["order"], int(state["pos"])
        if self.ring is not None:
            self.ring, self.order = self.ring.to(self.device), self.order.to(self.device)
        self.generator.set_state(state["generator"])
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        if self._stream:
            self.loader.load_state_dict(state["stream"], self.consumed)
        self.inputs = self._inputs()


class HookedActivations(Dataset):
    """`size` activations per epoch drawn from an ActivationBuffer (stateful: the loader must have num_workers=0).

    Exact resume: the loop fetches a batch or two ahead of the step it trains (runner.loop's with_last, and the copy
    ahead in runner.data.device_batches on CUDA), so when a checkpoint is taken the buffer has served more than the
    checkpoint's step trained on. The buffer's state after each of the last `history` batches is kept (references:
    a refill makes a new ring), and a checkpoint saves the one after the batches the run has trained on. This assumes
    the loop is the training loader's only reader: a callback that draws from it too draws inside `peek()`, which
    puts the buffer back (sae_resample does).

    Under several processes every rank holds the same ring (the same seed, the source's same inputs) and takes the
    rows of every rank's micro-batch, keeping its own share: the ranks train on different rows, together the rows one
    process would take micro-batch after micro-batch (and rank 0's saved state resumes them all). Each rank runs the
    source for all of them, unless the source is sharded (source.shard=fsdp): then each rank runs its slice of every
    batch of inputs through its shards, and every rank gets every slice's rows (SourceModel.activations)."""

    def __init__(self, buffer: ActivationBuffer, size: int, history: int = 4) -> None:
        self.buffer, self.size = buffer, size
        self.rank, self.world_size = 0, 1  # set by the training loader (LiveActivations.train_loader)
        self.taken = 0  # batches served since the run began (the progress counter's micro_batch, once trained on)
        self.history = deque([(0, buffer.state_dict())], maxlen=history)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor]:
        n = len(indices)
        rows = self.buffer.take(n * self.world_size)[self.rank * n : (self.rank + 1) * n]
        self.taken += 1
        self.history.append((self.taken, self.buffer.state_dict()))
        return (rows,)

    @contextlib.contextmanager
    def peek(self) -> Iterator[None]:
        """Draws inside are put back afterwards: the training batches that follow are those that would have (what
        sae_resample draws is what comes next)."""
        taken, history, state = self.taken, list(self.history), self.buffer.state_dict()
        try:
            yield
        finally:
            self.buffer.load_state_dict(state)
            self.taken, self.history = taken, deque(history, maxlen=self.history.maxlen)

    def state_dict(self, batches: int) -> dict[str, Any]:
        """The buffer's state after this rank's first `batches` training batches (runner.ckpt.state saves it)."""
        for taken, state in reversed(self.history):
            if taken == batches:
                return state
        warnings.warn(
            f"the activation buffer has served {self.taken} batches and keeps no state for batch {batches}: "
            "something besides the training loop read the training loader (outside peek()); this checkpoint saves "
            "the buffer as it is now, and a resume from it is not bit-identical to an uninterrupted run",
            RuntimeWarning,
            stacklevel=2,
        )
        return self.history[-1][1]

    def load_state_dict(self, state: dict[str, Any] | None, batches: int) -> None:
        """Put back state_dict(batches); None (a checkpoint written before the buffer's state was saved) or a ring of
        another size (data.buffer_size changed, resume_allow_changes): keep the fresh buffer, not bit-exact."""
        ring = None if state is None else state["ring"]
        why = (
            "the checkpoint holds no activation buffer state (written before runner saved it)"
            if state is None
            else f"the checkpoint's buffer holds {len(ring)} rows, this run's {self.buffer.capacity}"
            if ring is not None and len(ring) != self.buffer.capacity
            else None
        )
        if why:
            warnings.warn(
                f"{why}: the buffer starts afresh, so the resumed run is not bit-identical to an uninterrupted one",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            self.buffer.load_state_dict(state)
        self.taken = batches
        self.history = deque([(batches, self.buffer.state_dict())], maxlen=self.history.maxlen)
