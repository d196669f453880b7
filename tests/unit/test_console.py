"""The console logger outside a terminal (CI, SLURM logs): plain progress lines, throttled, with a true ETA."""

from __future__ import annotations

import pytest

from runner.log import console
from runner.log.console import ConsoleLogger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(console.time, "monotonic", fake)
    monkeypatch.setattr(ConsoleLogger, "beat_s", None)  # the tests beat themselves: no thread racing the fake clock
    return fake


def lines(capsys: pytest.CaptureFixture) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]


def test_plain_lines_come_every_every_s_with_progress_and_eta(clock: Clock, capsys: pytest.CaptureFixture) -> None:
    console = ConsoleLogger(every_s=30)
    assert not console.console.is_terminal  # pytest captures stderr: what CI and SLURM see
    console.start({"total_steps": 1000})
    capsys.readouterr()
    for step in range(10, 201, 10):  # a log call every 10 steps, one step a second
        clock.now += 10
        console.log({"train/loss": 1.0 / step, "train/lr": 0.01}, step)
    got = lines(capsys)
    # 200 s of training, a line once 30 s have passed since the last one: at 30, 60, ..., 180 s
    assert [line.split()[1] for line in got] == ["30/1000", "60/1000", "90/1000", "120/1000", "150/1000", "180/1000"]
    assert got[0] == "step 30/1000 (3%)  loss 0.03333  lr 0.01  eta 16m10s"  # 970 steps at 1 s each
    console.close(None)


def test_a_validation_prints_its_own_line_not_a_progress_line(clock: Clock, capsys: pytest.CaptureFixture) -> None:
    console = ConsoleLogger(every_s=0)
    console.start({"total_steps": 100})
    capsys.readouterr()
    clock.now += 5
    console.log({"train/loss": 0.5}, 10)
    console.log({"val/loss": 0.25, "epoch": 0.5}, 10)
    assert lines(capsys) == [
        "step 10/100 (10%)  loss 0.5  eta 0m45s",
        "step 10  epoch 0.50  train/loss 0.5  val/loss 0.25",
    ]


def test_a_resumed_launch_counts_its_rate_from_the_resume_step(clock: Clock, capsys: pytest.CaptureFixture) -> None:
    console = ConsoleLogger(every_s=0)
    console.resume(500, {})
    console.start({"total_steps": 1000})
    capsys.readouterr()
    clock.now += 50  # 100 steps in 50 s: 400 more take 200 s (not 1000 - 600 steps at 600 steps / 50 s)
    console.log({"train/loss": 0.1}, 600)
    assert lines(capsys) == ["step 600/1000 (60%)  loss 0.1  eta 3m20s"]


def test_a_long_every_s_prints_no_progress_line(clock: Clock, capsys: pytest.CaptureFixture) -> None:
    console = ConsoleLogger(every_s=3600)
    console.start({"total_steps": 100})
    for step in range(1, 101):
        clock.now += 1
        console.log({"train/loss": 1.0}, step)
    assert lines(capsys) == []


def test_the_final_table_names_the_training_rate_and_the_whole_run_average(capsys: pytest.CaptureFixture) -> None:
    console = ConsoleLogger()
    summary = {
        "stop_reason": "max_duration",
        "progress": {"step": 300, "samples": 9600, "tokens": 0},
        "metrics": {"val/loss": 1.5},
        "wall_time_s": 40.0,
        "samples_per_s": 240.0,
        "tokens_per_s": None,
        "steady": {"samples_per_s": 900.0, "mfu": 0.41},
    }
    console.close(summary)
    out = capsys.readouterr().err
    assert "samples/s, training   900" in out and "samples/s, whole run  240" in out
    assert "MFU, training" in out and "0.410" in out and "tokens/s" not in out  # no tokens: no tokens/s rows


def test_the_run_folder_is_printed_whole_at_the_start_and_the_end(capsys: pytest.CaptureFixture) -> None:
    # outside a terminal the console is 80 columns wide: a table cell would cut a long path with an ellipsis
    path = "/data/" + "a_rather_long_experiment_folder_name/" * 4 + "2026-11-26/10-31-07"
    console = ConsoleLogger()
    console.start({"task": "SAE", "run_dir": path})
    console.close(
        {
            "stop_reason": "max_duration",
            "progress": {"step": 1},
            "metrics": {},
            "wall_time_s": 1.0,
            "samples_per_s": 1.0,
        }
    )
    lines = capsys.readouterr().err.splitlines()
    assert lines.count(f"run dir {path}") == 2 and "…" not in "".join(lines)


def test_a_long_validation_prints_its_progress_every_every_s(clock: Clock, capsys: pytest.CaptureFixture) -> None:
    console = ConsoleLogger(every_s=30)
    console.start({"total_steps": 100})
    capsys.readouterr()
    for done in range(1, 101):  # 100 batches, 2 s each: a line once 30 s have passed since the last one
        clock.now += 2
        console.working("validation", done, 100)
    got = [line for line in capsys.readouterr().err.splitlines() if line.startswith("validation ")]
    # its clock starts at its first batch's end: 14 batches in 28 s, 85 more at 2 s each
    assert got[0] == "validation 15/100 (15%)  elapsed 0m28s  eta 2m50s"
    assert [line.split()[1] for line in got] == [f"{n}/100" for n in range(15, 100, 15)]
    console.working("splicing", 1, None)  # a loader without a length: the count alone
    clock.now += 31
    console.working("splicing", 2, None)
    assert capsys.readouterr().err.strip() == "splicing 2  elapsed 0m31s"
    console.close(None)


def test_every_validation_pass_reports_its_batches_to_the_loggers(built) -> None:
    from runner.loop import fit
    from runner.run import Logger

    class Heard(Logger):
        def __init__(self) -> None:
            self.calls: list[tuple[str, int, int | None]] = []

        def working(self, what: str, done: int, total: int | None) -> None:
            self.calls.append((what, done, total))

    _, run = built("+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=10st", "logger=none")
    heard = Heard()
    run.loggers.append(heard)
    fit(run)
    batches = len(run.val_loader)
    # two validations (steps 10 and 20), each batch by batch to the last; the final re-measure on the best weights
    assert [c for c in heard.calls if c[0] == "validation"][:batches] == [
        ("validation", d, batches) for d in range(1, batches + 1)
    ]
    assert sum(1 for c in heard.calls if c == ("validation", batches, batches)) >= 2


def test_outside_a_terminal_a_pass_speaks_every_30_s_even_while_one_step_runs_for_minutes(
    clock: Clock, capsys: pytest.CaptureFixture
) -> None:
    # a pass that printed "61/124 (49%) eta 0m28s" and then nothing for minutes tells the user nothing
    console = ConsoleLogger()  # what runner.features and sae_eval make: no training bar
    assert console.pass_every_s == 30  # pytest's stderr is no terminal: CI's and SLURM's cadence
    console.working("features: pages (3 of 3)", 0, 124)  # the phase announces itself: its clock starts here
    times = []
    for done in range(1, 62):  # 61 steps of 1 s; the heartbeat looks every second, as its thread does
        clock.now += 1
        console.working("features: pages (3 of 3)", done, 124)
        console.beat()
    for _ in range(210):  # then step 62 runs for 3.5 minutes
        clock.now += 1
        console.beat()
    for line in capsys.readouterr().err.splitlines():
        assert line.startswith("features: pages (3 of 3) ") and "/124 (" in line and "  eta " in line, line
        times.append(int(line.split("elapsed ")[1][:1]) * 60 + int(line.split("elapsed ")[1][2:4]))
    # a line at least every 30 s of the 271 s, naming the phase, its total and an ETA that grows with the stall
    assert times == list(range(30, 271, 30))
    assert all(b - a <= 30 for a, b in zip([0, *times], [*times, 271], strict=True))
    console.close(None)
    clock.now += 60
    console.beat()  # the pass is over (closed): no more lines
    assert capsys.readouterr().err == ""


def test_a_long_step_s_line_says_how_long_it_has_run_and_the_eta_grows(
    clock: Clock, capsys: pytest.CaptureFixture
) -> None:
    console = ConsoleLogger(every_s=30)
    console.working("splicing", 0, 10)
    clock.now += 10
    console.working("splicing", 1, 10)
    clock.now += 60  # step 2 runs a minute: the last rate (10 s a step) no longer holds
    console.beat()
    assert (
        capsys.readouterr().err.strip() == "splicing 1/10 (10%)  elapsed 1m10s  eta 10m30s  (step 2 running for 1m00s)"
    )
    console.working("splicing", 10, 10)  # the end: the heartbeat stops
    clock.now += 60
    console.beat()
    assert capsys.readouterr().err == ""


def test_in_a_terminal_without_a_training_bar_a_pass_speaks_every_10_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    assert ConsoleLogger().pass_every_s == 10 and ConsoleLogger(every_s=5).pass_every_s == 5
