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
    assert got[0] == "validation batch 15/100 (15%)  eta 2m50s"  # 85 batches at 2 s each
    assert [line.split()[2] for line in got] == [f"{n}/100" for n in range(15, 100, 15)]
    console.working("splicing", 1, None)  # a loader without a length: the count alone
    clock.now += 31
    console.working("splicing", 2, None)
    assert capsys.readouterr().err.strip() == "splicing batch 2"
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
