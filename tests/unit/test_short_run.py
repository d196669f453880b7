"""A run that trained its whole max_duration while its monitored metric was still improving says it may be short, in
summary.json's short_run and on the console's last lines, with the max_duration to try; any other run says nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from helpers import make_run, summary

from runner import ConfigError
from runner.build import build
from runner.log.console import ConsoleLogger
from runner.run import Best, Run, State, StopReason
from runner.train import summarize, train

STEPS = list(range(2, 21, 2))  # ten validations over a 20-step run: three in its last quarter (16, 18, 20)


def _ended(values: list[float], monitor: str = "val/fve", mode: str = "max", **settings: object) -> Run:
    """A 20-step run that trained its whole max_duration with `values` of `monitor` at STEPS."""
    run = make_run(max_duration="20st")
    run.settings = dataclasses.replace(run.settings, **{"monitor": monitor, "short_run_tolerance": 0.01, **settings})
    run.state.best = Best(mode)
    run.state.monitored = [[s, v] for s, v in zip(STEPS, values, strict=True)]
    run.progress.step, run.stop_reason = 20, StopReason.MAX_DURATION
    return run


def _printed(run: Run, capsys: pytest.CaptureFixture) -> list[str]:
    capsys.readouterr()
    ConsoleLogger().close(summarize(run))
    return capsys.readouterr().err.splitlines()


RISING = [0.2, 0.3, 0.36, 0.4, 0.43, 0.45, 0.47, 0.48, 0.5, 0.52]


def test_a_metric_still_rising_at_the_end_is_said_with_twice_the_duration(capsys: pytest.CaptureFixture) -> None:
    run = _ended(RISING)
    said = summarize(run)["short_run"]
    assert said["suggested_max_duration"] == "40st" and said["window"] == "quarter" and said["steps"] == [16, 20]
    line = "val/fve was still rising over the last quarter (0.48 -> 0.52, +0.04): the run may be short; try "
    assert said["message"] == line + "trainer.max_duration=40st (2x)"
    assert said["message"] in _printed(run, capsys)  # a line of its own, after the final table


def test_a_min_metric_still_falling_is_said(capsys: pytest.CaptureFixture) -> None:
    run = _ended([2.0, 1.8, 1.7, 1.6, 1.5, 1.45, 1.4, 1.3, 1.2, 1.1], monitor="val/loss", mode="min")
    said = summarize(run)["short_run"]
    assert said["message"].startswith("val/loss was still falling over the last quarter (1.3 -> 1.1, -0.2)")
    assert said["mode"] == "min" and said["suggested_max_duration"] == "40st"
    assert said["message"] in _printed(run, capsys)


@pytest.mark.parametrize(
    "values",
    [
        [0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # flat at the end
        [0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.52, 0.5, 0.49],  # falling at the end (max mode)
        [0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.501, 0.502],  # rising by less than 1% of its size
    ],
)
def test_a_metric_that_stopped_improving_says_nothing(values: list[float], capsys: pytest.CaptureFixture) -> None:
    run = _ended(values)
    assert summarize(run)["short_run"] is None
    assert not any("may be short" in line for line in _printed(run, capsys))


def test_a_noisy_plateau_whose_last_validation_is_above_its_first_says_nothing() -> None:
    run = _ended(RISING)
    end = [0.49, 0.51, 0.51, 0.49, 0.49, 0.50]  # +0.01 (2%) from first to last, but the fitted line falls
    run.state.monitored = [[s, 0.5] for s in range(1, 15)] + [[s, v] for s, v in zip(range(15, 21), end, strict=True)]
    assert summarize(run)["short_run"] is None


def test_a_run_stopped_early_or_with_too_few_validations_says_nothing() -> None:
    for reason in (StopReason.EARLY_STOPPING, StopReason.INTERRUPTED, StopReason.MAX_TIME):
        run = _ended(RISING)
        run.stop_reason = reason
        assert summarize(run)["short_run"] is None
    run = _ended(RISING)
    run.state.monitored = run.state.monitored[-2:]  # two validations in the run's last half
    assert summarize(run)["short_run"] is None
    assert summarize(_ended(RISING, short_run_tolerance=None))["short_run"] is None  # trainer.short_run_tolerance=null


def test_the_last_half_is_judged_when_the_last_quarter_holds_too_few_validations() -> None:
    run = _ended(RISING)
    run.state.monitored = [[5, 0.42], [10, 0.44], [15, 0.48], [20, 0.52]]  # val_interval=0.25dur
    said = summarize(run)["short_run"]
    assert said["window"] == "half" and said["validations"] == 3 and said["first"] == 0.44


def test_a_checkpoint_from_before_the_history_resumes_without_it() -> None:
    run = make_run()
    saved = run.state.state_dict()
    del saved["monitored"]
    fresh = State(run.progress)
    fresh.load_state_dict(saved)
    assert fresh.monitored == []


def test_a_real_run_that_ends_still_improving_says_so(
    tmp_path, compose_cfg: Callable, capsys: pytest.CaptureFixture
) -> None:
    # An SAE on sparse codes of 256 directions, one short epoch: its FVE is far from done (a short sae_file run, small)
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((256, 32)).astype(np.float32)
    codes = np.zeros((6000, 256), np.float32)
    codes[np.arange(6000)[:, None], rng.integers(0, 256, (6000, 4))] = rng.exponential(1.0, (6000, 4))
    np.save(tmp_path / "acts.npy", codes @ directions)
    args = [f"data.train_path={tmp_path / 'acts.npy'}", "model.n_latents=256", "model.k=4", "data.batch_size=128"]
    cfg = compose_cfg("+experiment=sae_file", *args, "threads=1", "checkpoint=none")
    train(cfg)
    said = summary(cfg.run_dir)["short_run"]
    assert said["monitor"] == "val/fve" and said["suggested_max_duration"] == "2ep" and said["last"] > said["first"]
    assert said["message"].endswith("the run may be short; try trainer.max_duration=2ep (2x)")
    assert said["message"] in capsys.readouterr().err.splitlines()


def test_a_negative_tolerance_is_refused(compose_cfg: Callable) -> None:
    with pytest.raises(ConfigError, match="trainer.short_run_tolerance must be >= 0"):
        build(compose_cfg("+experiment=digits", "trainer.short_run_tolerance=-0.1"))
