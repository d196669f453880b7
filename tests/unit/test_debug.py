"""The debug group (runner/conf/debug/): each option runs a tiny experiment, overrides the experiment's durations,
overfit learns its few batches by heart, and limit shortens the epochs that TrainingProgress counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import config_options
from omegaconf import DictConfig, OmegaConf

from runner import ConfigError
from runner.__main__ import debug_last
from runner.data.samplers import GlobalBatchSampler
from runner.loop import fit
from runner.run import Logger, Run

OPTIONS = list(config_options("debug"))
EXPERIMENTS = list(config_options("experiment"))  # runner/conf and the task packages' conf folders
DIGITS_TRAIN, DIGITS_STEPS = 1438, 45  # digits' training split, and its optimizer steps of 32 per epoch


class Rows(Logger):
    """Keeps every logged row in memory."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append({**metrics, "step": step})


def test_every_option_is_discovered() -> None:
    assert {"none", "fast", "overfit", "limit", "profile"} <= set(OPTIONS)


def test_a_debug_option_on_the_command_line_is_appended_after_the_experiment() -> None:
    # the experiment's durations would win over a debug option placed before it in the defaults list
    args = ["debug=fast", "+experiment=sae", "seed=1", "trainer.max_duration=7st"]
    assert debug_last(args) == ["+experiment=sae", "seed=1", "trainer.max_duration=7st", "+debug=fast"]
    assert debug_last(["+experiment=sae", "+debug=fast"]) == ["+experiment=sae", "+debug=fast"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("option", OPTIONS)
def test_option_composes_with_every_experiment_and_its_values_win(
    option: str, experiment: str, compose_cfg: Callable[..., DictConfig]
) -> None:
    cfg = compose_cfg(f"+experiment={experiment}", f"+debug={option}")
    own = OmegaConf.load(config_options("debug")[option])
    for key, value in own.get("trainer", {}).items():
        assert cfg.trainer[key] == value, (key, cfg.trainer[key])
    for key, value in own.get("data", {}).items():
        assert cfg.data[key] == value
    if option != "none":
        assert cfg.checkpoint.get("_target_") is None and list(cfg.logger) == ["console"]


@pytest.mark.parametrize("option", OPTIONS)
def test_option_runs_a_tiny_experiment(
    option: str, built: Callable[..., tuple[DictConfig, Run]], tmp_path: Path
) -> None:
    overrides = ["trainer.max_duration=20st"] if option in ("none", "overfit") else []  # the preset's 60 epochs
    cfg, run = built("+experiment=digits", f"+debug={option}", *overrides)
    fit(run)
    assert run.stop_reason == "max_duration" and run.progress.step > 0
    assert "val/loss" in run.state.metrics
    if option != "none":
        assert [type(lg).__name__ for lg in run.loggers] == ["ConsoleLogger"]  # no metrics.jsonl
        assert "Checkpoint" not in [type(cb).__name__ for cb in run.callbacks]
        assert not (tmp_path / "run" / "checkpoints").exists()
    if option == "fast":
        assert run.progress.step == 4  # not the experiment's 60 epochs
    if option == "profile":
        assert (tmp_path / "run" / "profile" / "trace.json").is_file()
        assert [type(cb).__name__ for cb in run.callbacks] == ["EarlyStopping", "Profiler"]  # added to digits'


def test_fast_overrides_the_sae_experiment_and_the_command_line_overrides_fast(
    built: Callable[..., tuple[DictConfig, Run]],
) -> None:
    cfg, run = built("+experiment=sae", "+debug=fast")
    assert run.progress.max_duration.value == 4 and cfg.trainer.val_interval == "2st"  # sae's: 1500st, 0.25dur
    assert [type(cb).__name__ for cb in run.callbacks] == ["GroundTruthRecovery"]  # the experiment's callbacks stay
    assert len(run.val_loader) == 2 and len(run.val_loader.dataset) == 4 * cfg.data.val_batch_size  # 2 of 4 batches
    cfg, _ = built("+experiment=sae", "+debug=fast", "trainer.max_duration=6st")
    assert cfg.trainer.max_duration == "6st"


def test_overfit_drives_the_training_loss_far_down_on_its_few_batches(
    built: Callable[..., tuple[DictConfig, Run]],
) -> None:
    _, run = built("+experiment=digits", "+debug=overfit", "model.dropout=0.0", "trainer.max_duration=150st")
    rows = Rows()
    run.loggers.append(rows)
    assert run.progress.batches_per_epoch == 2
    seen = [sorted(sum((batch[1].tolist() for batch in run.train_loader), [])) for _ in range(2)]
    run.train_loader.batch_sampler.set_epoch(5)
    assert sorted(sum((batch[1].tolist() for batch in run.train_loader), [])) == seen[0] == seen[1]  # repeated
    fit(run)
    losses = [row["train/loss"] for row in rows.rows if "train/loss" in row]
    assert losses[0] > 1.5  # ten classes, from chance
    assert losses[-1] < 0.02 * losses[0], losses
    assert run.progress.step == 150 and run.progress.epoch == 75


def test_limit_shortens_every_epoch_as_asked(built: Callable[..., tuple[DictConfig, Run]]) -> None:
    _, run = built("+experiment=digits", "+debug=limit", "data.limit_train_batches=0.25", "trainer.max_duration=2ep")
    assert run.progress.batches_per_epoch == int(0.25 * DIGITS_STEPS) == len(run.train_loader)
    fit(run)
    p = run.progress
    assert (p.step, p.epoch, p.samples) == (2 * 11, 2, 2 * 11 * 32)
    assert sum(map(len, run.val_loader.batch_sampler)) == int(0.1 * 179)  # limit_val_batches 0.1 of 179 images
    # a whole number: that many optimizer steps, here of two micro-batches each
    _, run = built(
        "+experiment=digits",
        "+debug=limit",
        "data.limit_train_batches=3",
        "trainer.accumulate_grad_batches=2",
        "data.limit_val_batches=1",
        "trainer.max_duration=1ep",
    )
    assert run.progress.batches_per_epoch == 6 and len(run.val_loader) == 1
    fit(run)
    assert (run.progress.step, run.progress.micro_batch, run.progress.epoch) == (3, 6, 1)


def test_limited_sampler_gives_every_rank_the_same_number_of_batches() -> None:
    for rank in (0, 1):
        sampler = GlobalBatchSampler(100, 8, rank, 2, limit_steps=0.5)  # 7 steps, the last short: 3 kept
        assert len(sampler) == 3 and sampler.samples_per_epoch == 3 * 16
        assert all(len(batch) == 8 for batch in sampler)
    assert len(GlobalBatchSampler(100, 8, 0, 2, limit_steps=50)) == 7  # more than there are: the whole epoch


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.limit_train_batches=1.5", "data.limit_train_batches must be a fraction in (0, 1] or a whole number"),
        ("data.limit_val_batches=0", "data.limit_val_batches must be a fraction in (0, 1] or a whole number"),
        ("+data.overfit_batches=0.5", "data.overfit_batches must be a whole number"),
    ],
)
def test_bad_limits_are_configuration_errors(
    override: str, message: str, built: Callable[..., tuple[DictConfig, Run]]
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        built("+experiment=digits", "+debug=limit", override)
