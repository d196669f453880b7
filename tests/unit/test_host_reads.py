"""Host reads (a device sync on a GPU) that runner's own code makes per training step, counted on the CPU: a step that
neither logs, validates nor checkpoints reads the device once today (the window's loss and the global gradient norm
together, for the non-finite guard); issue 18 takes that read away."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers import HostReads

from runner.build import build
from runner.loop import fit
from runner.run import Callback, Run


class Snapshot(Callback):
    """The host-read count after optimizer steps `first` and `last` (steps in between neither log nor validate)."""

    def __init__(self, reads: HostReads, first: int, last: int) -> None:
        self.reads, self.first, self.last, self.seen = reads, first, last, {}

    def on_optimizer_step(self, run: Run) -> None:
        if run.progress.step in (self.first, self.last):
            self.seen[run.progress.step] = (self.reads.count, list(self.reads.where))


@pytest.mark.parametrize(
    "overrides",
    [
        ["+experiment=digits", "callbacks=[ema,early_stopping]", "trainer.gradient_clip_val=0.5"],
        ["+experiment=digits", "trainer.accumulate_grad_batches=3", "scheduler=cosine"],
        ["+experiment=sae", "data.batch_size=256"],
    ],
    ids=["digits-ema-clip", "digits-accumulate", "sae"],
)
def test_a_step_that_does_not_log_reads_the_device_once(
    overrides: list[str], compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_cfg(
        *overrides,
        "trainer.max_duration=12st",
        "trainer.log_interval=12st",
        "trainer.val_interval=12st",
        "checkpoint=none",
        "logger=none",
    )
    run = build(cfg)
    with HostReads(monkeypatch) as reads:
        snapshot = Snapshot(reads, 2, 10)
        run.callbacks.append(snapshot)
        fit(run)
    (before, _), (after, where) = snapshot.seen[2], snapshot.seen[10]
    assert after - before == 8, where[-(after - before) :]  # steps 3..10: one read each
    assert all(w.startswith("loop.py") and w.endswith("tolist") for w in where[before:after]), where[before:after]
