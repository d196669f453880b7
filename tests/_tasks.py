"""Test-only tasks and callbacks for subprocess runs (helpers.child_env puts this folder on PYTHONPATH): select them
on the command line, e.g. `model._target_=_tasks.Affine` or `+callbacks.slow._target_=_tasks.SleepEachStep`."""

import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from experiments.digits import MLPClassifier
from runner.ckpt.callback import Checkpoint
from runner.run import Callback


class SlowToWrite(MLPClassifier):
    """Digits, whose final outputs take rank 0 `write_seconds` longer to write (a slow disk): the time in which a
    rank that exits first with a failure code would have torchrun stop rank 0 mid-write, after training."""

    def __init__(self, write_seconds: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.write_seconds = write_seconds

    @property
    def parts(self) -> dict[str, str]:
        # read by rank 0 alone, between model.safetensors and summary.json (runner.ckpt.weights.weight_parts)
        time.sleep(self.write_seconds)
        return {}


class SkewedValidation(MLPClassifier):
    """Digits, plus a validation metric 'skew' that rank 0's data alone would see improve at every validation
    (1/k at the k-th) and rank 1's alone would see worsen (k): only their exact reduction decides early stopping."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.validations, self.trained = 0, False

    def training_step(self, batch):
        self.trained = True
        return super().training_step(batch)

    def validation_step(self, batch):
        out = super().validation_step(batch)
        # one batch per rank and validation (val_batch_size >= the rank's shard); the runner's probe for metric names
        # before training is not a validation
        self.validations += self.trained
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        k = float(max(self.validations, 1))
        return {**out, "skew": torch.tensor(k if rank == 1 else 1 / k)}


class Rendezvous(Callback):
    """At fit start, each job says it started (a file in `dir`) and waits until `count` jobs have.

    Jobs run one after another never all get there: the first one fails after `timeout_s`. Jobs that succeed ran at
    the same time, however long each process took to start.
    """

    def __init__(self, dir: str, count: int, timeout_s: float = 120.0) -> None:
        self.dir, self.count, self.timeout_s = Path(dir), count, timeout_s

    def on_fit_start(self, run) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"{os.getpid()}.started").touch()
        deadline = time.monotonic() + self.timeout_s
        while (started := len(list(self.dir.glob("*.started")))) < self.count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {started} of {self.count} jobs started within {self.timeout_s} s")
            time.sleep(0.05)


class Affine(nn.Module):
    """Digits by one affine map whose parameters sit on the task itself and are used without forward() (as an SAE's
    are): under FSDP only the registered step methods gather them. (Run as `model._target_=_tasks.Affine`.)"""

    def __init__(self, in_features: int = 64, num_classes: int = 10, **unused: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, num_classes) * 0.1)
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cross-entropy of x @ weight + bias."""
        x, y = batch
        return {"loss": F.cross_entropy(x @ self.weight + self.bias, y)}

    validation_step = training_step  # the class's function, not the instance's FSDP-wrapped training_step


# ---- slowdowns and faults, chosen on the command line through the callbacks group ----------------------------------
# python -m runner ... +callbacks.slow._target_=_tasks.SleepEachStep +callbacks.slow.seconds=0.05


class StopAt(Callback):
    """Asks every rank to stop after optimizer step `step`, as a preemption would (a checkpoint, exit 75); a resumed
    run, past that step, goes on to the end."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, run) -> None:
        if run.progress.step == self.step:
            run.request_stop("preempted")


class FullDiskFrom(Callback):
    """From optimizer step `step` on, rank 0's disk is full (every fsync fails with ENOSPC); the other ranks write
    nothing. Only in a run started from scratch: its resume, on a disk with room again, trains to the end. A save
    still in flight in the writer thread finishes first: the disk fills at this step, not at a moment the machine's
    speed picks (on a slow machine the previous checkpoint was still being written at `step`)."""

    def __init__(self, step: int) -> None:
        self.step, self.armed = step, False

    def on_fit_start(self, run) -> None:
        self.armed = run.progress.step == 0 and run.strategy.is_main

    def on_optimizer_step(self, run) -> None:
        if self.armed and run.progress.step == self.step:
            import errno

            from runner import rundir
            from runner.ckpt.callback import Checkpoint

            for callback in run.callbacks:
                if isinstance(callback, Checkpoint):
                    callback.wait()

            def full(fd: int) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            rundir.files.os.fsync = full


class SleepEachStep(Callback):
    """Sleeps `seconds` after every optimizer step: the run lives long enough for a test to signal it at a chosen
    moment (once a checkpoint exists, say) with steps to spare."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_optimizer_step(self, run) -> None:
        time.sleep(self.seconds)


class Hold(Callback):
    """After optimizer step `step`, says so (touches the file `held`) and waits until the file `release` exists: the
    run is still running when a test's next process looks, however slowly a busy machine starts that one, and no
    longer than the test needs. A run that finds `release` already there does not wait (a sweep's later jobs)."""

    def __init__(self, held: str, release: str, step: int = 1, timeout_s: float = 120.0) -> None:
        self.held, self.release, self.step, self.timeout_s = Path(held), Path(release), step, timeout_s

    def on_optimizer_step(self, run) -> None:
        if run.progress.step != self.step or self.release.exists():
            return
        self.held.touch()
        deadline = time.monotonic() + self.timeout_s
        while not self.release.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.release} did not appear within {self.timeout_s} s")
            time.sleep(0.02)


class _Stall:
    """Sleeps when pickled: torch.save inside write_checkpoint then stalls with the checkpoint half written."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (float, (0.0,))


class SlowCheckpoint(Checkpoint):
    """The checkpoint callback whose writer thread takes `seconds` over the folder named `slow_folder`, in the middle
    of writing it (its temporary folder made, its files not yet): a save in flight that a test can kill.

        checkpoint._target_=_tasks.SlowCheckpoint +checkpoint.slow_folder=step-00000020
        +checkpoint.seconds=60
    """

    def __init__(self, slow_folder: str | None = None, seconds: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slow_folder, self.seconds = slow_folder, seconds

    def write(self, folder: Path, model: dict, state: dict, info: dict) -> None:
        if folder.name == self.slow_folder:
            state = {**state, "stall": _Stall(self.seconds)}
        super().write(folder, model, state, info)


class Desync(Callback):
    """After optimizer step `step`, rank 1 nudges parameter `parameter` by 1e-6: the ranks silently diverge."""

    def __init__(self, step: int, parameter: str) -> None:
        self.step, self.parameter = step, parameter

    def on_optimizer_step(self, run) -> None:
        if run.progress.step == self.step and run.strategy.rank == 1:
            with torch.no_grad():
                dict(run.task.named_parameters())[self.parameter].view(-1)[0] += 1e-6


class Misbehave(Callback):
    """After optimizer step `step`, rank `rank` warns (warnings.warn and a logging warning, both naming the rank) or,
    with `raise_error`, raises RuntimeError: what logs/rank-K.log must hold."""

    def __init__(self, step: int, rank: int = 1, raise_error: bool = False) -> None:
        self.step, self.rank, self.raise_error = step, rank, raise_error

    def on_optimizer_step(self, run) -> None:
        if run.progress.step != self.step or run.strategy.rank != self.rank:
            return
        if self.raise_error:
            raise RuntimeError(f"misbehaving on rank {self.rank} at step {self.step}")
        warnings.warn(f"a warning from rank {self.rank}", UserWarning, stacklevel=1)
        logging.getLogger("tests.misbehave").warning("a logged warning from rank %d", self.rank)


# ---- a tiny language model: Block units for compile, activation checkpointing and FSDP, token batches --------------
class TokenData(torch.utils.data.Dataset):
    """Token sequences [N, T]; a batch is {"tokens": [B, T], "num_tokens": B x T}, as a language model's are."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitems__(self, indices: list[int]) -> dict:
        tokens = self.tokens[torch.as_tensor(indices)]
        return {"tokens": tokens, "num_tokens": tokens.numel()}


def token_splits(n: int = 512, seq_len: int = 8, vocab: int = 16, seed: int = 0, **unused: object) -> dict:
    """Counting sequences mod `vocab` from random starts (learnable: the next token is the last plus one)."""
    g = torch.Generator().manual_seed(seed)
    tokens = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(seq_len)) % vocab
    return {"train": TokenData(tokens[: n - n // 8]), "val": TokenData(tokens[n - n // 8 :])}


class Block(nn.Module):
    """x + mlp(norm(x)): a residual unit, named as the GPT's transformer block is."""

    def __init__(self, d: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    """Next-token prediction with an embedding, `n_blocks` Blocks and a linear head. (`model._target_=_tasks.TinyLM`
    with `data.splits._target_=_tasks.token_splits`.)"""

    def __init__(self, vocab: int = 16, d: int = 16, n_blocks: int = 3, block_dropout: float = 0.0, **unused) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, block_dropout) for _ in range(n_blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: dict) -> dict:
        tokens = batch["tokens"]
        logits = self(tokens[:, :-1])
        return {"loss": F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())}

    validation_step = training_step

    def flops_per_token(self) -> float:
        """6 x the non-embedding parameters (no attention here)."""
        return 6.0 * sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed."))


class CountHostReads(Callback):
    """Counts the host reads runner's own code makes (helpers.HostReads) between optimizer steps `first` and `last`,
    and writes where they were made to <run folder>/host-reads-rank<K>.json when fit ends."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.before, self.where = first, last, 0, None

    def on_fit_start(self, run) -> None:
        import pytest
        from helpers import HostReads

        self.reads = HostReads(pytest.MonkeyPatch()).__enter__()

    def on_optimizer_step(self, run) -> None:
        if run.progress.step == self.first:
            self.before = len(self.reads.where)
        elif run.progress.step == self.last:
            self.where = self.reads.where[self.before :]

    def on_fit_end(self, run) -> None:
        self.reads.__exit__()
        from hydra.core.hydra_config import HydraConfig

        folder = Path(HydraConfig.get().runtime.output_dir)
        (folder / f"host-reads-rank{run.strategy.rank}.json").write_text(json.dumps(self.where))
