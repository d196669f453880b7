"""TrainingProgress: counting, durations, ticks, checkpointing, drift warnings.

The tests drive TrainingProgress exactly as runner/loop.py does (window_size, count_micro_batch, window_done,
count_optimizer_step, end_epoch on the last micro-batch, stop when `finished` after a step), keep their own
independent bookkeeping, and compare the two.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest

from runner import ConfigError
from runner.durations import UNITS, Duration, DurationError, parse_duration
from runner.progress import TrainingProgress

EPS = 1e-9


def micro_batch_sizes(n: int, batch_size: int) -> list[int]:
    """Per-rank micro-batch sizes of one epoch of `n` samples, drop_last=False (the last one may be short)."""
    sizes = [batch_size] * (n // batch_size)
    if n % batch_size:
        sizes.append(n % batch_size)
    return sizes


class Row(NamedTuple):
    """What the simulator saw right after one optimizer step (and end_epoch, when the step closed an epoch)."""

    step: int
    epoch_index: int  # the epoch this step belongs to (own bookkeeping)
    last_in_epoch: bool
    samples: int  # own bookkeeping, global
    tokens: int
    epoch_float: float  # own bookkeeping
    p_step: int
    p_samples: int
    p_tokens: int
    p_epoch: int
    p_epoch_float: float
    p_fraction: float
    p_finished: bool
    ticks: frozenset[str]


@dataclass
class Sim:
    """The loop's calls into TrainingProgress, for a loader yielding `sizes` per-rank micro-batches every epoch."""

    sizes: list[int]
    world: int = 1
    tokens_per_sample: int = 0
    intervals: tuple[str, ...] = ()
    epoch: int = 0  # position: the next micro-batch is sizes[next] of epoch `epoch`
    next: int = 0
    samples: int = 0
    tokens: int = 0
    steps: int = 0
    rows: list[Row] = field(default_factory=list)
    windows: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, index, window_size())

    def run(self, p: TrainingProgress, until_step: int | None = None, max_epochs: int = 200) -> Sim:
        n = len(self.sizes)
        while not p.finished:
            assert self.epoch < max_epochs, "the run never finished"
            for i in range(self.next, n):
                last = i == n - 1
                self.windows.append((self.epoch, i, p.window_size()))
                samples = self.sizes[i] * self.world
                p.count_micro_batch(samples, samples * self.tokens_per_sample)
                self.samples += samples
                self.tokens += samples * self.tokens_per_sample
                if not p.window_done(last):
                    continue
                p.count_optimizer_step()
                if last:
                    p.end_epoch()
                self.steps += 1
                epoch_index = self.epoch
                self.epoch, self.next = (self.epoch + 1, 0) if last else (self.epoch, i + 1)
                self.rows.append(
                    Row(
                        step=self.steps,
                        epoch_index=epoch_index,
                        last_in_epoch=last,
                        samples=self.samples,
                        tokens=self.tokens,
                        epoch_float=epoch_index + (i + 1) / n,
                        p_step=p.step,
                        p_samples=p.samples,
                        p_tokens=p.tokens,
                        p_epoch=p.epoch,
                        p_epoch_float=p.epoch_float,
                        p_fraction=p.fraction(),
                        p_finished=p.finished,
                        ticks=frozenset(iv for iv in self.intervals if p.ticked(iv)),
                    )
                )
                if p.finished:
                    break
                if until_step is not None and self.steps >= until_step:
                    return self
        return self


def own_value(row: Row, unit: str) -> float:
    return {"st": row.step, "ep": row.epoch_float, "sa": row.samples, "tok": row.tokens}[unit]


def first_steps_reaching(rows: list[Row], unit: str, targets: list[float]) -> list[int]:
    """For each target, the first step whose own counter in `unit` has reached it."""
    return sorted({next(r.step for r in rows if own_value(r, unit) >= t - EPS) for t in targets})


# ---- the main table -------------------------------------------------------------------------------------------
# (samples per rank N, per-rank batch B, world W, accumulate A, max_duration, the expected number of optimizer steps)
CASES = [
    pytest.param(100, 10, 1, 1, "3ep", 30, id="ep-exact-W1-A1"),
    pytest.param(100, 8, 2, 3, "2ep", 10, id="ep-short-window-short-batch-W2-A3"),
    pytest.param(50, 4, 4, 4, "2.5ep", 10, id="frac-ep-W4-A4"),
    pytest.param(22, 4, 2, 4, "1.9ep", 4, id="frac-ep-ends-in-short-final-window-W2-A4"),
    pytest.param(10, 4, 2, 1, "2.5ep", 8, id="frac-ep-short-batch-W2-A1"),
    pytest.param(9, 3, 2, 3, "4ep", 4, id="ep-accumulate-equals-epoch-W2-A3"),
    pytest.param(20, 3, 4, 3, "10st", 10, id="st-ends-mid-epoch-W4-A3"),
    pytest.param(30, 3, 1, 4, "40st", 40, id="st-short-window-W1-A4"),
    pytest.param(37, 5, 2, 3, "200sa", 8, id="sa-short-batch-W2-A3"),
    pytest.param(64, 16, 4, 1, "1e3sa", 16, id="sa-exact-W4-A1"),
    pytest.param(22, 4, 1, 4, "50sa", 5, id="sa-short-final-window-W1-A4"),
    pytest.param(50, 6, 4, 3, "1000sa", 15, id="sa-whole-epochs-W4-A3"),
]


def make(n: int, b: int, w: int, a: int, max_duration: str, **kw) -> tuple[TrainingProgress, list[int]]:
    sizes = micro_batch_sizes(n, b)
    p = TrainingProgress(
        max_duration,
        batch_size=b,
        batches_per_epoch=len(sizes),
        samples_per_epoch=n * w,
        accumulate=a,
        world_size=w,
        **kw,
    )
    return p, sizes


@pytest.mark.parametrize(("n", "b", "w", "a", "max_duration", "expected_steps"), CASES)
def test_counts_match_an_independent_simulation(n, b, w, a, max_duration, expected_steps):
    p, sizes = make(n, b, w, a, max_duration)
    nb = len(sizes)
    sim = Sim(sizes, world=w, intervals=("1ep", "0.25dur"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim.run(p)
        p.check_total()
    assert [str(x.message) for x in caught] == []  # no drift here, so no warning
    rows = sim.rows

    # total steps: the prediction, the simulation and the table agree
    assert p.total_steps() == expected_steps
    assert len(rows) == expected_steps == p.step
    assert rows[-1].p_finished and not any(r.p_finished for r in rows[:-1])

    # optimizer steps per complete epoch = ceil(batches / A)
    assert p.steps_per_epoch() == math.ceil(nb / a)
    complete = range(p.epoch)
    assert p.epoch == sum(r.last_in_epoch for r in rows)
    for e in complete:
        assert sum(r.epoch_index == e for r in rows) == math.ceil(nb / a)

    # samples are global: every complete epoch is N samples on each of W ranks
    for e in complete:
        assert max(r.samples for r in rows if r.epoch_index == e) == (e + 1) * n * w
    assert [r.p_samples for r in rows] == [r.samples for r in rows]
    assert p.samples == sim.samples

    # epochs and epoch_float after every step
    for r in rows:
        assert r.p_epoch == r.epoch_index + r.last_in_epoch
        assert r.p_epoch_float == pytest.approx(r.epoch_float, abs=1e-12)

    # fraction() after every step, 1.0 at the end
    d = parse_duration(max_duration)
    for r in rows:
        assert r.p_fraction == pytest.approx(min(1.0, own_value(r, d.unit) / d.value), abs=1e-12)
    assert p.fraction() == 1.0

    # ticked('1ep'): once per epoch, on its last step
    assert [r.step for r in rows if "1ep" in r.ticks] == [r.step for r in rows if r.last_in_epoch]

    # ticked('0.25dur'): at the first step reaching each quarter of max_duration, the last quarter on the last step
    quarters = [d.value * k / 4 for k in (1, 2, 3, 4)]
    expected_ticks = first_steps_reaching(rows, d.unit, quarters)
    assert [r.step for r in rows if "0.25dur" in r.ticks] == expected_ticks
    assert expected_ticks[-1] == expected_steps


@pytest.mark.parametrize(("n", "b", "w", "a", "max_duration", "expected_steps"), CASES)
def test_window_size_is_accumulate_except_the_short_last_window(n, b, w, a, max_duration, expected_steps):
    p, sizes = make(n, b, w, a, max_duration)
    nb = len(sizes)
    sim = Sim(sizes, world=w).run(p)
    full_windows_end = (nb // a) * a
    for _, i, size in sim.windows:
        assert size == (a if i < full_windows_end else nb % a), (i, size)
    # the loss of every window is divided by its real size, so the weights 1/size of a window sum to 1
    per_window: dict[tuple[int, int], float] = {}
    for epoch, i, size in sim.windows:
        per_window[(epoch, i // a)] = per_window.get((epoch, i // a), 0.0) + 1 / size
    assert all(v == pytest.approx(1.0) for v in per_window.values())


@pytest.mark.parametrize(
    ("nb", "a", "expected"),
    [(10, 3, [3, 3, 3, 3, 3, 3, 3, 3, 3, 1]), (10, 4, [4] * 8 + [2, 2]), (7, 7, [7] * 7), (5, 1, [1] * 5)],
)
def test_window_size_sequence_of_one_epoch(nb, a, expected):
    p = TrainingProgress("5ep", batch_size=2, batches_per_epoch=nb, accumulate=a)
    seen, closed = [], []
    for i in range(nb):
        seen.append(p.window_size())
        p.count_micro_batch(2)
        closed.append(p.window_done(i == nb - 1))
    assert seen == expected
    assert sum(closed) == math.ceil(nb / a)
    assert closed[-1]


@pytest.mark.parametrize(
    ("max_duration", "nb", "a", "expected"),
    [
        ("100st", 30, 1, [25, 50, 75, 100]),
        ("4ep", 10, 3, [4, 8, 12, 16]),  # 4 steps per epoch (windows 3, 3, 3, 1); a quarter is 1ep
        ("2.5ep", 10, 1, [7, 13, 19, 25]),  # a quarter is 0.625ep: 6.25 batches, 12.5, 18.75, 25
        ("10st", 7, 3, [3, 5, 8, 10]),  # a quarter is 2.5st
    ],
)
def test_ticked_quarter_dur_fires_at_exact_steps(max_duration, nb, a, expected):
    p = TrainingProgress(max_duration, batch_size=1, batches_per_epoch=nb, samples_per_epoch=nb, accumulate=a)
    sim = Sim([1] * nb, intervals=("0.25dur",)).run(p)
    assert [r.step for r in sim.rows if r.ticks] == expected


@pytest.mark.parametrize(
    ("interval", "nb", "a", "expected"),
    [
        ("0.1ep", 30, 1, list(range(3, 31, 3))),  # 9/30 / 0.1 is 2.9999999999999996 in floats
        ("0.3ep", 10, 1, [3, 6, 9]),  # 1.2ep is never reached
        ("0.1ep", 10, 2, [1, 2, 3, 4, 5]),  # two ticks' worth in every step still tick once
        ("7sa", 10, 1, [4, 7]),  # 2 samples a micro-batch: 7 and 14 of the 20 samples
    ],
)
def test_ticked_float_boundaries(interval, nb, a, expected):
    p = TrainingProgress("1ep", batch_size=2, batches_per_epoch=nb, samples_per_epoch=2 * nb, accumulate=a)
    sim = Sim([2] * nb, intervals=(interval,)).run(p)
    assert [r.step for r in sim.rows if r.ticks] == expected
    assert p.elapsed("0.3ep") and p.elapsed("1ep") and not p.elapsed("1.01ep")


@pytest.mark.parametrize(
    ("max_duration", "expected"),
    [
        ("4ep", Duration(1.0, "ep")),
        ("100st", Duration(25.0, "st")),
        ("2.5ep", Duration(0.625, "ep")),
        ("1e6sa", Duration(250000.0, "sa")),
        ("2e7tok", Duration(5e6, "tok")),
    ],
)
def test_quarter_dur_resolves_to_a_quarter_of_max_duration(max_duration, expected):
    p = TrainingProgress(max_duration, batch_size=1, batches_per_epoch=1000, samples_per_epoch=1000)
    assert p.resolve("0.25dur") == expected
    assert p.resolve("1dur") == parse_duration(max_duration)
    assert p.resolve("3st") == Duration(3.0, "st")  # other units pass through


def test_epoch_float_elapsed_and_fraction_at_fraction_points():
    p = TrainingProgress("2ep", batch_size=4, batches_per_epoch=10, samples_per_epoch=40, accumulate=2)
    p.count_micro_batch(4)
    assert p.epoch_float == pytest.approx(0.1)  # live
    assert not p.elapsed("0.1ep")  # but elapsed() is as of the last optimizer step
    assert p.fraction() == 0.0
    p.count_micro_batch(4)
    assert p.window_done(False)
    p.count_optimizer_step()
    assert p.epoch_float == pytest.approx(0.2)
    assert p.elapsed("0.1ep") and p.elapsed("0.2ep") and not p.elapsed("0.21ep")
    assert p.elapsed("1st") and not p.elapsed("2st")
    assert p.elapsed("8sa") and not p.elapsed("9sa")
    assert p.elapsed("0.1dur") and not p.elapsed("0.11dur")
    assert p.fraction() == pytest.approx(0.1)
    floats = [0.2]
    for k in range(2, 8):  # steps 2..7 (the 5th closes epoch 0)
        p.count_micro_batch(4)
        p.count_micro_batch(4)
        p.count_optimizer_step()
        if k == 5:
            p.end_epoch()
        floats.append(p.epoch_float)
    assert floats == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4])
    assert p.epoch == 1 and p.step == 7 and p.samples == 56
    assert p.fraction() == pytest.approx(0.7)
    assert p.elapsed("1ep") and not p.elapsed("1.5ep") and not p.finished


# ---- durations ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [
        ("500st", 500.0, "st"),
        ("3ep", 3.0, "ep"),
        ("1e6sa", 1e6, "sa"),
        ("2e7tok", 2e7, "tok"),
        ("0.25dur", 0.25, "dur"),
        (" 3ep ", 3.0, "ep"),
        ("1.5ep", 1.5, "ep"),
        ("1e3st", 1000.0, "st"),
    ],
)
def test_parse_duration(text, value, unit):
    d = parse_duration(text)
    assert (d.value, d.unit) == (value, unit)
    assert parse_duration(d) is d


@pytest.mark.parametrize("text", ["3 epochs", "3", "ep", "-1st", "", "3ep3", "1.0.0st", "st3"])
def test_unreadable_durations_are_rejected_with_the_units_listed(text):
    with pytest.raises(DurationError) as info:
        parse_duration(text)
    message = str(info.value)
    assert repr(text) in message
    for unit, name in UNITS.items():
        assert f"{unit} ({name})" in message


@pytest.mark.parametrize(("text", "match"), [("2.5st", "whole number"), ("1.5dur", "at most 1")])
def test_out_of_range_durations_are_rejected_with_the_reason(text, match):
    with pytest.raises(DurationError, match=match) as info:
        parse_duration(text)
    assert repr(text) in str(info.value)


def test_duration_error_is_a_config_error():
    assert issubclass(DurationError, ConfigError)
    with pytest.raises(ConfigError):
        parse_duration("3 epochs")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_duration": "1ep", "batch_size": 4, "batches_per_epoch": 10, "accumulate": 0}, "a whole number >= 1"),
        ({"max_duration": "1ep", "batch_size": 4, "batches_per_epoch": 10, "accumulate": 11}, "only 10 micro-batches"),
        ({"max_duration": "0.01ep", "batch_size": 4, "batches_per_epoch": 45}, "shorter than one optimizer step"),
        ({"max_duration": "10sa", "batch_size": 32, "batches_per_epoch": 100}, "shorter than one optimizer step"),
        (
            {"max_duration": "100sa", "batch_size": 32, "batches_per_epoch": 100, "world_size": 4},
            "shorter than one optimizer step",
        ),
        (
            {"max_duration": "0.05ep", "batch_size": 4, "batches_per_epoch": 45, "accumulate": 3},
            "shorter than one optimizer step",
        ),
        ({"max_duration": "0.5dur", "batch_size": 4, "batches_per_epoch": 10}, "'dur' units"),
        ({"max_duration": "3 epochs", "batch_size": 4, "batches_per_epoch": 10}, "cannot read duration"),
        ({"max_duration": "1ep", "batch_size": 4, "batches_per_epoch": None}, "1ep counts epochs, but .* a stream"),
    ],
)
def test_constructor_errors(kwargs, match):
    # a bad accumulation is a plain ConfigError (the data sampler checks it too); the rest are DurationErrors
    with pytest.raises(ConfigError if "whole number" in match else DurationError, match=match):
        TrainingProgress(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_duration": "1st", "batch_size": 4, "batches_per_epoch": 10},
        {"max_duration": "32sa", "batch_size": 32, "batches_per_epoch": 100},
        {"max_duration": "128sa", "batch_size": 32, "batches_per_epoch": 100, "world_size": 4},
        {"max_duration": "0.1ep", "batch_size": 4, "batches_per_epoch": 10},
        {"max_duration": "1ep", "batch_size": 4, "batches_per_epoch": 10, "accumulate": 10},
        {"max_duration": "40sa", "batch_size": 4, "batches_per_epoch": None, "accumulate": 10},  # a stream
    ],
)
def test_constructor_accepts_the_boundaries(kwargs):
    p = TrainingProgress(**kwargs)
    assert p.step == p.samples == p.epoch == 0 and not p.finished


# ---- checkpointing --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "b", "w", "a", "max_duration", "cut"),
    [
        (100, 8, 2, 3, "3ep", 7),  # mid-epoch (epoch 1, second window)
        (100, 8, 2, 3, "3ep", 5),  # right after the short window that closes epoch 0
        (50, 4, 4, 4, "2.5ep", 9),  # in the final, fractional epoch
        (37, 5, 2, 3, "200sa", 4),
        (30, 3, 1, 4, "40st", 20),
    ],
)
def test_state_dict_round_trip_continues_identically(n, b, w, a, max_duration, cut):
    intervals = ("1ep", "0.25dur", "0.5ep", "3st", "50sa")
    p_full, sizes = make(n, b, w, a, max_duration)
    full = Sim(sizes, world=w, intervals=intervals).run(p_full)

    p_first, _ = make(n, b, w, a, max_duration)
    resumed = Sim(sizes, world=w, intervals=intervals).run(p_first, until_step=cut)
    assert resumed.steps == cut and not p_first.finished
    state = p_first.state_dict()
    assert all(type(v) is int for v in state.values())
    p_second, _ = make(n, b, w, a, max_duration)
    p_second.load_state_dict(dict(state))
    assert p_second.state_dict() == state
    assert p_second.fraction() == pytest.approx(p_first.fraction())
    resumed.run(p_second)

    assert resumed.rows == full.rows
    assert resumed.windows == full.windows
    assert p_second.state_dict() == p_full.state_dict()
    assert any(r.ticks for r in full.rows[cut:])  # the comparison covers ticks after the cut


# ---- drift ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("declared", "yielded", "a"), [(10, 9, 1), (10, 11, 1), (10, 8, 3), (10, 11, 2)])
def test_drift_warns_exactly_once(declared, yielded, a):
    p = TrainingProgress("40st", batch_size=2, batches_per_epoch=declared, samples_per_epoch=2 * declared, accumulate=a)
    sim = Sim([2] * yielded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sim.run(p, until_step=math.ceil(yielded / a))  # exactly one epoch
        assert p.epoch == 1
        assert len(caught) == 1
        sim.run(p)  # several more epochs, then the end-of-run check
        p.check_total()
    assert p.epoch >= 3
    assert [w.category for w in caught] == [RuntimeWarning]
    message = str(caught[0].message)
    assert f"yielded {yielded} micro-batches" in message and f"len() is {declared}" in message


def test_no_drift_no_warning_over_many_epochs():
    p = TrainingProgress("12ep", batch_size=2, batches_per_epoch=7, samples_per_epoch=14, accumulate=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Sim([2] * 7).run(p)
        p.check_total()
    assert caught == [] and p.epoch == 12 and p.step == 36


def test_window_size_stays_positive_when_the_loader_yields_more_than_its_len():
    p = TrainingProgress("10ep", batch_size=1, batches_per_epoch=4, samples_per_epoch=4, accumulate=2)
    sizes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(7):  # len() says 4, the loader yields 7
            sizes.append(p.window_size())
            p.count_micro_batch(1)
    assert all(s >= 1 for s in sizes), sizes


# ---- tokens ---------------------------------------------------------------------------------------------------
def test_tok_without_tokens_per_sample_counts_tokens_but_cannot_predict_steps():
    p, sizes = make(40, 8, 2, 2, "3000tok")  # 5 micro-batches, windows 2, 2, 1; 16 tokens a sample
    assert p.total_steps() is None and p.steps_for("1e3tok") is None and p.per_step("tok") is None
    sim = Sim(sizes, world=2, tokens_per_sample=16, intervals=("1000tok",)).run(p)
    # 512, 1024, 1280 | 1792, 2304, 2560 | 3072
    assert [r.tokens for r in sim.rows] == [512, 1024, 1280, 1792, 2304, 2560, 3072]
    assert [r.p_tokens for r in sim.rows] == [r.tokens for r in sim.rows]
    assert [r.p_finished for r in sim.rows] == [False] * 6 + [True]
    assert [r.step for r in sim.rows if r.ticks] == [2, 5, 7]  # 1000, 2000 and 3000 tokens crossed
    assert [r.p_fraction for r in sim.rows] == pytest.approx(
        [t / 3000 for t in (512, 1024, 1280, 1792, 2304, 2560)] + [1.0]
    )
    assert p.elapsed("3072tok") and not p.elapsed("3073tok")


@pytest.mark.parametrize(
    ("n", "b", "w", "a", "tps", "max_duration", "expected_steps"),
    [
        (32, 8, 2, 2, 16, "2560tok", 5),  # 4 micro-batches, whole windows: 512 tokens a step
        (32, 8, 2, 2, 16, "3000tok", 6),
        (48, 8, 1, 3, 10, "1e4tok", 42),  # 240 tokens a step; ceil(41.67)
        (64, 16, 4, 1, 7, "1e4tok", 23),  # 448 tokens a step; ceil(22.3)
    ],
)
def test_tok_total_steps_is_exact_with_tokens_per_sample(n, b, w, a, tps, max_duration, expected_steps):
    p, sizes = make(n, b, w, a, max_duration, tokens_per_sample=tps)
    assert p.total_steps() == expected_steps
    sim = Sim(sizes, world=w, tokens_per_sample=tps).run(p)
    assert sim.steps == p.step == expected_steps
    assert p.tokens == sim.tokens


@pytest.mark.parametrize(
    ("n", "b", "w", "a", "tps", "max_duration", "expected_steps"),
    [
        (40, 8, 2, 2, 16, "3000tok", 7),  # windows 2, 2, 1: epochs of 512 + 512 + 256 tokens
        (10, 4, 1, 1, 10, "200tok", 6),  # micro-batches 4, 4, 2: epochs of 100 tokens
    ],
)
def test_tok_total_steps_with_short_epoch_end(n, b, w, a, tps, max_duration, expected_steps):
    p, sizes = make(n, b, w, a, max_duration, tokens_per_sample=tps)
    sim = Sim(sizes, world=w, tokens_per_sample=tps).run(p)
    assert sim.steps == expected_steps  # the simulation itself is right ...
    assert p.total_steps() == expected_steps  # ... the prediction is not
