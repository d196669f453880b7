"""Learning-rate schedules: stepped once per optimizer step (never per micro-batch), or once per validation."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from runner import ConfigError
from runner.progress import TrainingProgress
from runner.schedulers import OnMetric, PerStep, constant, cosine, plateau, step, wsd


def setup(max_duration: str = "1ep", batches: int = 40, batch_size: int = 8, accumulate: int = 4, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    progress = TrainingProgress(
        max_duration,
        batch_size=batch_size,
        batches_per_epoch=batches,
        samples_per_epoch=batches * batch_size,
        accumulate=accumulate,
        **kw,
    )
    return model, opt, progress


def drive(model, opt, progress: TrainingProgress, schedule: PerStep, batches: int, batch_size: int) -> list[float]:
    """The loop's calls, in the loop's order; returns the LR after every optimizer step."""
    lrs = []
    x = torch.ones(batch_size, 3)
    while not progress.finished:
        for i in range(batches):
            last = i == batches - 1
            window = progress.window_size()
            progress.count_micro_batch(batch_size)
            (model(x).square().mean() / window).backward()
            if not progress.window_done(last):
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            progress.count_optimizer_step()
            if last:
                progress.end_epoch()
            schedule.on_optimizer_step()
            lrs.append(opt.param_groups[0]["lr"])
            if progress.finished:
                break
    return lrs


def lr(opt) -> float:
    return opt.param_groups[0]["lr"]


def cosine_factor(t: int, warm: int, total: int, ratio: float) -> float:
    if t < warm:
        return (t + 1) / (warm + 1)
    done = min(1.0, (t - warm) / max(1, total - warm))
    return ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * done))


# ---- cosine ---------------------------------------------------------------------------------------------------
def test_cosine_steps_once_per_optimizer_step_and_ends_at_its_floor():
    model, opt, progress = setup("1ep", batches=40, batch_size=8, accumulate=4)  # 10 optimizer steps
    schedule = cosine(optimizer=opt, progress=progress, warmup="3st", min_lr_ratio=0.1)
    assert lr(opt) == pytest.approx(0.25)  # step 0 of a 3-step warmup: 1/4 of the base LR
    with mock.patch.object(schedule, "on_optimizer_step", wraps=schedule.on_optimizer_step) as spy:
        lrs = drive(model, opt, progress, schedule, batches=40, batch_size=8)
    assert progress.micro_batch == 40 and progress.step == 10 and progress.total_steps() == 10
    assert spy.call_count == 10
    assert schedule.scheduler.last_epoch == 10
    assert len(lrs) == 10
    assert abs(lrs[-1] - 0.1 * 1.0) <= 1e-12  # the floor, exactly at max_duration
    assert lrs[-2] > 0.1 + 1e-3  # and not before
    # warmup: 0.25, 0.5, 0.75, 1.0 -- linear
    warm = [0.25, *lrs[:3]]
    assert warm == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(b - a == pytest.approx(0.25) for a, b in zip(warm, warm[1:], strict=False))
    # after warmup: monotone non-increasing, strictly decreasing here
    decay = lrs[2:]
    assert all(b < a for a, b in zip(decay, decay[1:], strict=False))
    assert lrs == pytest.approx([cosine_factor(t, 3, 10, 0.1) for t in range(1, 11)], abs=1e-12)


@pytest.mark.parametrize(
    ("max_duration", "batches", "batch_size", "accumulate", "warmup", "expected_total", "expected_warm"),
    [
        ("1ep", 40, 8, 4, "0.02dur", 10, 1),  # default warmup: 0.02ep of 40 batches, 1 step
        ("2.5ep", 42, 2, 4, "0.25ep", 28, 3),  # 11 steps an epoch (short last window); 0.25ep = 10.5 batches
        ("50st", 7, 2, 3, "0.1dur", 50, 5),
        ("1000sa", 13, 8, 2, "100sa", 67, 7),  # 7 steps (104 samples) an epoch: 9 epochs + 4 steps; 100sa -> 7
        ("3ep", 9, 4, 1, "0st", 27, 0),
    ],
)
def test_cosine_reaches_the_floor_exactly_at_max_duration(
    max_duration, batches, batch_size, accumulate, warmup, expected_total, expected_warm
):
    model, opt, progress = setup(max_duration, batches=batches, batch_size=batch_size, accumulate=accumulate)
    assert progress.total_steps() == expected_total
    assert progress.steps_for(warmup) == expected_warm
    schedule = cosine(optimizer=opt, progress=progress, warmup=warmup, min_lr_ratio=0.05)
    assert lr(opt) == pytest.approx(cosine_factor(0, expected_warm, expected_total, 0.05))
    lrs = drive(model, opt, progress, schedule, batches=batches, batch_size=batch_size)
    assert len(lrs) == expected_total == schedule.scheduler.last_epoch
    assert abs(lrs[-1] - 0.05) <= 1e-12
    assert lrs[-2] > 0.05
    after = lrs[max(0, expected_warm - 1) :]
    assert all(b <= a for a, b in zip(after, after[1:], strict=False))
    expected = [cosine_factor(t, expected_warm, expected_total, 0.05) for t in range(1, expected_total + 1)]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_cosine_total_with_a_max_duration_of_many_digits():
    model, opt, progress = setup("1200001sa", batches=2000, batch_size=1000, accumulate=1)
    assert progress.total_steps() == 1201
    schedule = cosine(optimizer=opt, progress=progress, warmup="0st", min_lr_ratio=0.1)
    lrs = []
    for _ in range(1201):
        opt.step()
        schedule.on_optimizer_step()
        lrs.append(lr(opt))
    assert abs(lrs[-1] - 0.1) <= 1e-12
    assert lrs[-2] > 0.1  # fails: the floor is already reached one step before max_duration


def test_cosine_state_dict_round_trip():
    model, opt, progress = setup("1ep", batches=40, batch_size=8, accumulate=4)
    schedule = cosine(optimizer=opt, progress=progress, warmup="2st", min_lr_ratio=0.1)
    for _ in range(4):
        opt.step()
        schedule.on_optimizer_step()
    state = schedule.state_dict()
    _, opt2, progress2 = setup("1ep", batches=40, batch_size=8, accumulate=4)
    schedule2 = cosine(optimizer=opt2, progress=progress2, warmup="2st", min_lr_ratio=0.1)
    schedule2.load_state_dict(state)
    for _ in range(3):
        opt.step()
        schedule.on_optimizer_step()
        opt2.step()
        schedule2.on_optimizer_step()
    assert schedule2.scheduler.last_epoch == schedule.scheduler.last_epoch == 7
    assert lr(opt2) == pytest.approx(lr(opt), abs=1e-12)
    assert lr(opt) == pytest.approx(cosine_factor(7, 2, 10, 0.1), abs=1e-12)


def test_cosine_ignores_validation():
    model, opt, progress = setup("1ep")
    schedule = cosine(optimizer=opt, progress=progress, warmup="0st", min_lr_ratio=0.1)
    before = lr(opt)
    schedule.on_validation({"val/loss": 1.0})
    schedule.on_validation({"val/loss": 10.0})
    assert lr(opt) == before == 1.0
    assert schedule.monitor is None


# ---- constant and step ----------------------------------------------------------------------------------------
def test_constant_with_warmup():
    model, opt, progress = setup("1ep", batches=40, batch_size=8, accumulate=4)
    schedule = constant(optimizer=opt, progress=progress, warmup="4st")
    assert lr(opt) == pytest.approx(0.2)
    lrs = drive(model, opt, progress, schedule, batches=40, batch_size=8)
    assert lrs == pytest.approx([0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_wsd_whose_warmup_and_decay_fill_the_run_decays_right_after_warmup_despite_rounding():
    # 576 steps: 0.01dur is 6 steps and 0.99dur 571 (each rounded up), one more than the run: sparsify's schedule,
    # a linear decay over the whole run after warmup, must not be refused for that step
    model, opt, progress = setup("576st", batches=576, batch_size=1, accumulate=1)
    schedule = wsd(optimizer=opt, progress=progress, warmup="0.01dur", decay="0.99dur")
    lrs = drive(model, opt, progress, schedule, batches=576, batch_size=1)
    # lrs[i] is the factor for step i + 1: warmup to 1 at step 6, then a straight line to 0 at the last step
    assert lrs[4:] == pytest.approx([1.0] + [1 - (t - 6) / 570 for t in range(6, 577)], abs=1e-12)
    with pytest.raises(ConfigError, match="together are longer than the whole run"):
        wsd(optimizer=opt, progress=setup("576st", batches=576, batch_size=1, accumulate=1)[2], decay="0.995dur")
    with pytest.raises(ConfigError, match="together are longer than the whole run"):  # steps given: taken as given
        wsd(
            optimizer=opt,
            progress=setup("576st", batches=576, batch_size=1, accumulate=1)[2],
            warmup="6st",
            decay="571st",
        )


@pytest.mark.parametrize(
    ("every", "batches", "accumulate", "max_duration", "size"),
    [
        ("2ep", 10, 3, "6ep", 8),  # 4 steps an epoch (windows 3, 3, 3, 1)
        ("1ep", 12, 4, "4ep", 3),
        ("5st", 10, 1, "2ep", 5),
        ("0.5dur", 10, 3, "6ep", 12),  # 3ep
    ],
)
def test_step_schedule_multiplies_by_gamma_at_the_right_steps(every, batches, accumulate, max_duration, size):
    model, opt, progress = setup(max_duration, batches=batches, batch_size=2, accumulate=accumulate)
    schedule = step(optimizer=opt, progress=progress, every=every, gamma=0.5)
    lrs = drive(model, opt, progress, schedule, batches=batches, batch_size=2)
    assert len(lrs) == progress.total_steps()
    assert lrs == pytest.approx([0.5 ** (k // size) for k in range(1, len(lrs) + 1)], abs=1e-12)
    drops = [k for k in range(1, len(lrs)) if lrs[k] < lrs[k - 1]]
    assert [k + 1 for k in drops] == list(range(size, len(lrs) + 1, size))  # step k's LR is lrs[k - 1]


def test_step_schedule_every_shorter_than_a_step_is_rejected():
    _, opt, progress = setup("1ep")
    with pytest.raises(ConfigError, match="shorter than one optimizer step"):
        step(optimizer=opt, progress=progress, every="0st")


# ---- plateau --------------------------------------------------------------------------------------------------
def test_plateau_min_drops_after_patience_plus_one_bad_validations():
    _, opt, progress = setup("1ep")
    schedule = plateau(optimizer=opt, progress=progress, patience=2, factor=0.5)
    assert isinstance(schedule, OnMetric) and schedule.monitor == "val/loss"
    schedule.on_validation({"val/loss": 1.0})  # the first value is the best so far
    assert lr(opt) == 1.0
    history = []
    for _ in range(6):
        schedule.on_validation({"val/loss": 1.0, "val/acc": 0.0})
        history.append(lr(opt))
    assert history == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25]


def test_plateau_min_improvement_resets_the_count():
    _, opt, progress = setup("1ep")
    schedule = plateau(optimizer=opt, progress=progress, patience=2, factor=0.5)
    history = []
    for v in [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]:
        schedule.on_validation({"val/loss": v})
        history.append(lr(opt))
    assert history == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]


def test_plateau_max_mode():
    _, opt, progress = setup("1ep")
    schedule = plateau(optimizer=opt, progress=progress, monitor="val/acc", mode="max", patience=2, factor=0.5)
    assert schedule.monitor == "val/acc"
    history = []
    for v in [0.5, 0.5, 0.4, 0.5, 0.6, 0.6, 0.6, 0.6]:  # 0.6 improves on 0.5, resetting the count
        schedule.on_validation({"val/acc": v, "val/loss": 0.0})
        history.append(lr(opt))
    assert history == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_plateau_max_mode_drops_after_patience_plus_one():
    _, opt, progress = setup("1ep")
    schedule = plateau(optimizer=opt, progress=progress, monitor="val/acc", mode="max", patience=3, factor=0.1)
    history = []
    for v in [0.9, 0.9, 0.9, 0.9, 0.9]:
        schedule.on_validation({"val/acc": v})
        history.append(lr(opt))
    assert history == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.1])


def test_plateau_ignores_optimizer_steps():
    model, opt, progress = setup("1ep", batches=40, batch_size=8, accumulate=4)
    schedule = plateau(optimizer=opt, progress=progress, patience=0, factor=0.5)
    lrs = drive(model, opt, progress, schedule, batches=40, batch_size=8)
    assert lrs == [1.0] * 10
    schedule.on_validation({"val/loss": 1.0})
    schedule.on_validation({"val/loss": 1.0})  # patience 0: the first bad validation drops it
    assert lr(opt) == 0.5
    for _ in range(20):
        schedule.on_optimizer_step()
    assert lr(opt) == 0.5


# ---- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "max_duration", "kwargs"),
    [
        (cosine, "1e6tok", {"warmup": "0st"}),
        (cosine, "1ep", {"warmup": "1e4tok"}),
        (constant, "1ep", {"warmup": "1e4tok"}),
        (step, "1ep", {"every": "1e4tok"}),
    ],
)
def test_token_durations_without_tokens_per_sample_are_rejected(build, max_duration, kwargs):
    _, opt, progress = setup(max_duration)
    with pytest.raises(ConfigError, match="'st'"):
        build(optimizer=opt, progress=progress, **kwargs)


def test_token_durations_with_tokens_per_sample_are_accepted():
    _, opt, progress = setup("1e6tok", batches=40, batch_size=8, accumulate=4, tokens_per_sample=100)
    schedule = cosine(optimizer=opt, progress=progress, warmup="0st", min_lr_ratio=0.1)
    # 3200 tokens a step: 312.5 -> 313 steps, and the cosine reaches its floor there
    assert progress.total_steps() == 313
    f = schedule.scheduler.lr_lambdas[0]
    assert f(313) == pytest.approx(0.1, abs=1e-12) and f(312) > 0.1


@pytest.mark.parametrize("mode", ["bad", "MIN", ""])
def test_plateau_bad_mode(mode):
    _, opt, progress = setup("1ep")
    with pytest.raises(ConfigError, match="mode"):
        plateau(optimizer=opt, progress=progress, mode=mode)
