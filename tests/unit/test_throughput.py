"""Throughput and MFU through the real loop on a fake clock: the same work per device reads the same per-device
tokens/s and MFU whatever the world size and accumulation, and the first (compiling) step is left out."""

from __future__ import annotations

import time

import pytest
import torch
from _tasks import TinyLM, token_splits

from runner.data import DataModule
from runner.distributed.strategies import Single
from runner.loop import fit
from runner.meter import Meter, peak_flops
from runner.precision import FP32
from runner.progress import TrainingProgress
from runner.run import Logger, Run, Settings, State
from runner.schedulers import constant

RATE = 1000.0  # tokens a device trains per (fake) second
FIRST_STEP_S = 100.0  # what compiling adds to the first step
PEAK = 1e9  # FLOP/s of one device


class Ranks(Single):
    """Rank 0 of `world_size` whose peers train batches of the same sizes: a sum over ranks is world_size x its own."""

    def __init__(self, world_size: int) -> None:
        super().__init__("cpu")
        self.world_size = world_size

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * self.world_size


class Rows(Logger):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append(metrics)


def _run(task: TinyLM, loader, progress: TrainingProgress, strategy: Single, log_every: str) -> tuple[Run, Rows]:
    """A Run of `task` with SGD, a constant LR, no validation, a log row every `log_every` and MFU against PEAK."""
    optimizer, rows = torch.optim.SGD(task.parameters(), lr=0.01), Rows()
    run = Run(
        task=task,
        optimizer=optimizer,
        schedule=constant(optimizer=optimizer, progress=progress),
        precision=FP32(),
        strategy=strategy,
        train_loader=loader,
        val_loader=None,
        settings=Settings(val_interval=progress.resolve("100st"), log_interval=progress.resolve(log_every)),
        state=State(progress, meter=Meter(progress, task.flops_per_token(), PEAK)),
        loggers=[rows],
    )
    return run, rows


def _logged(world_size: int, accumulate: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The metrics of 5 steps in which each device trains 32 sequences (in `accumulate` micro-batches) at RATE."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    class Timed(TinyLM):
        def training_step(self, batch: dict) -> dict:
            now[0] += batch["num_tokens"] / RATE + (FIRST_STEP_S if now[0] == 0 else 0.0)
            return super().training_step(batch)

    torch.manual_seed(0)
    task = Timed()
    data = DataModule(token_splits(), batch_size=32 // accumulate, shuffle=False)
    loader = data.train_loader(0, world_size, accumulate=accumulate)
    progress = TrainingProgress(
        "5st",
        batch_size=data.batch_size,
        batches_per_epoch=len(loader),
        samples_per_epoch=loader.batch_sampler.samples_per_epoch,
        accumulate=accumulate,
        world_size=world_size,
    )
    run, rows = _run(task, loader, progress, Ranks(world_size), "5st")
    fit(run)
    assert run.state.meter.first_step_s == pytest.approx(FIRST_STEP_S + 32 * 8 / RATE)
    (row,) = rows.rows
    return row


@pytest.mark.parametrize(("world_size", "accumulate"), [(2, 1), (1, 4), (2, 4)])
def test_the_same_work_per_device_reads_the_same_per_device_rate_and_mfu(
    world_size: int, accumulate: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = _logged(1, 1, monkeypatch)
    many = _logged(world_size, accumulate, monkeypatch)
    flops = TinyLM().flops_per_token()
    for row, world in ((one, 1), (many, world_size)):
        # steps 2 to 5: the first step (compiling) is left out of every rate
        assert row["train/tokens_per_s_per_device"] == pytest.approx(RATE)
        assert row["train/tokens_per_s"] == pytest.approx(world * RATE)
        assert row["train/samples_per_s"] == pytest.approx(world * RATE / 8)
        assert row["train/mfu"] == pytest.approx(RATE * flops / PEAK)


def test_no_mfu_without_a_peak_and_no_peak_on_the_cpu() -> None:
    assert peak_flops(torch.device("cpu"), "bf16") is None
    progress = TrainingProgress("5st", batch_size=1, batches_per_epoch=10)
    meter = Meter(progress, flops_per_token=100.0, peak_flops=None)
    assert "train/mfu" not in meter._throughput(samples=10, tokens=100, elapsed=1.0)


def test_the_steady_rate_leaves_out_the_first_log_window_and_summary_json_holds_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 8 steps logged every 2: step 1 compiles (untimed), step 2 is slow too (a recompile, caches warming): the first
    # window's rate is low, the later windows run at RATE. summary.json's steady figures are RATE's; its whole-launch
    # average is lower, with every slow step in it.
    from runner.train import summarize

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    calls = [0]

    class Warming(TinyLM):
        def training_step(self, batch: dict) -> dict:
            calls[0] += 1
            now[0] += batch["num_tokens"] / RATE + {1: FIRST_STEP_S, 2: 50.0}.get(calls[0], 0.0)
            return super().training_step(batch)

    task = Warming()
    data = DataModule(token_splits(), batch_size=32, shuffle=False)
    loader = data.train_loader(0, 1)
    progress = TrainingProgress("8st", batch_size=32, batches_per_epoch=len(loader))
    run, rows = _run(task, loader, progress, Single("cpu"), "2st")
    fit(run)
    assert rows.rows[0]["train/tokens_per_s"] < RATE / 2  # the warm-up window
    steady = summarize(run)["steady"]
    assert steady["tokens_per_s"] == pytest.approx(RATE) and steady["samples_per_s"] == pytest.approx(RATE / 8)
    assert steady["mfu"] == pytest.approx(RATE * task.flops_per_token() / PEAK)
    assert summarize(run)["tokens_per_s"] < RATE / 10  # the whole launch: compiling and warm-up included


def test_a_run_with_one_log_window_reports_that_window_as_its_rate() -> None:
    progress = TrainingProgress("5st", batch_size=1, batches_per_epoch=10)
    meter = Meter(progress)
    assert meter.steady_throughput() == {}  # nothing timed yet
    meter.warmup = [100, 0, 2.0]
    assert meter.steady_throughput() == {"samples_per_s": 50.0}
