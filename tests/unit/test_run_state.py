"""The run's state and stop reasons: one table of stop reasons; everything a resume needs is checkpointed by
construction, the non-finite streak included."""

from __future__ import annotations

import dataclasses
import gc
import io
from collections.abc import Callable
from pathlib import Path

import torch
from helpers import StopAt, metric_rows

from runner import collector_paused
from runner.progress import TrainingProgress
from runner.run import Best, Callback, Run, State, StopReason
from runner.train import train


def test_every_stop_reason_says_what_it_means() -> None:
    table = {r.value: (r.resumable, r.finished, r.exit_code, r.status) for r in StopReason}
    assert table == {
        "max_duration": (False, True, 0, "completed"),
        "early_stopping": (False, True, 0, "completed"),
        "nonfinite": (False, False, 3, "diverged"),
        "preempted": (True, False, 75, "stopped"),
        "max_time": (True, False, 75, "stopped"),
        "interrupted": (True, False, 130, "stopped"),  # Ctrl-C: checkpointed at the step, resumable
        "stopped_on_another_rank": (False, False, 0, "stopped"),
        "failed": (False, False, 1, "failed"),
    }
    # files keep the plain strings
    assert f"{StopReason.MAX_TIME}" == "max_time" and StopReason("preempted") == "preempted"
    assert StopReason.status_of("something_else") == "something_else"


def test_every_field_of_the_state_is_in_its_state_dict_and_comes_back() -> None:
    progress = TrainingProgress("10st", batch_size=4, batches_per_epoch=5)
    state = State(progress, best=Best("max"))
    progress.count_micro_batch(samples=4)
    progress.count_optimizer_step()
    state.best.update(0.5, 1)
    state.meter.add({"loss": torch.tensor(1.0), "acc": torch.tensor(0.25)})
    state.meter.add_step(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(1.0), 0.1)  # a skipped step
    state.metrics, state.meter.nonfinite_steps, state.meter.nonfinite_in_a_row = {"val/acc": 0.5}, 3, 2
    saved = state.state_dict()
    assert set(saved) == {f.name for f in dataclasses.fields(State)}
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # what a checkpoint's state.pt holds must load with weights_only=True
    buffer.seek(0)
    fresh = State(TrainingProgress("10st", batch_size=4, batches_per_epoch=5), best=Best("max"))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    again = fresh.state_dict()
    # the wall clock goes on: the restored run counts from the saved total
    assert again.pop("clock")["total_s"] >= saved.pop("clock")["total_s"] == fresh.clock.earlier_s
    assert again == saved


class PoisonAt(Callback):
    """After optimizer step `step`, a NaN in the first weight: every later loss is NaN (a divergence that lasts)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, run: Run) -> None:
        if run.progress.step == self.step:
            with torch.no_grad():
                next(run.task.parameters()).view(-1)[0] = float("nan")


def test_a_run_resumed_in_the_middle_of_a_nonfinite_streak_stops_where_the_uninterrupted_run_does(
    compose_cfg: Callable, tmp_path: Path
) -> None:
    overrides = [
        "+experiment=digits",
        "trainer.max_duration=40st",
        "trainer.log_interval=1st",
        "trainer.max_nonfinite_steps=4",
        "logger=jsonl",
        "callbacks=none",
        "checkpoint.interval=1000st",
    ]
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"), extra_callbacks=[PoisonAt(5)])
    assert (whole.stop_reason, whole.progress.step, whole.state.nonfinite_steps) == ("nonfinite", 9, 4)
    # Stopped after two of the four non-finite steps in a row; the resumed run must count the two already seen.
    train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[PoisonAt(5), StopAt(7)])
    resumed = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"))
    assert (resumed.stop_reason, resumed.progress.step, resumed.state.nonfinite_steps) == ("nonfinite", 9, 4)
    assert resumed.state.nonfinite_in_a_row == 4
    assert metric_rows(tmp_path / "split") == metric_rows(tmp_path / "whole")


class CollectorState(Callback):
    """Whether Python's cyclic garbage collector was on when the run started and at each optimizer step."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_fit_start(self, run: Run) -> None:
        self.seen.append(gc.isenabled())

    def on_optimizer_step(self, run: Run) -> None:
        self.seen.append(gc.isenabled())


def test_the_collector_is_paused_to_build_a_run_and_on_while_it_trains(compose_cfg: Callable) -> None:
    # Building pauses it (runner.collector_paused: the start is a quarter cheaper); a run that trained for hours
    # with it off would keep every cycle it made. A caller who turned it off keeps it off.
    state = CollectorState()
    train(compose_cfg("+experiment=digits", "trainer.max_duration=3st"), extra_callbacks=[state])
    assert state.seen == [True] * 4 and gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
