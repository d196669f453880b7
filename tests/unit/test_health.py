"""callbacks=health: per-layer norms and update ratios measured at the logging steps only, exact against the step's
own gradients and weights; a warning naming the layers whose gradients explode."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import HostReads, Regression, make_run, offline_run

from runner import ConfigError
from runner.callbacks.health import TrainingHealth
from runner.loop import fit
from runner.run import Callback
from runner.train import train


class Capture(Callback):
    """The gradients and weights of optimizer step `step` (1-based), before and after it."""

    def __init__(self, step: int) -> None:
        self.step, self.grads, self.before, self.after = step, {}, {}, {}

    def on_before_optimizer_step(self, run) -> None:
        if run.progress.step + 1 == self.step:
            named = dict(run.task.named_parameters())
            self.grads = {n: p.grad.clone() for n, p in named.items()}
            self.before = {n: p.detach().clone() for n, p in named.items()}

    def on_optimizer_step(self, run) -> None:
        if run.progress.step == self.step:
            self.after = {n: p.detach().clone() for n, p in run.task.named_parameters()}


class Exploding(Regression):
    """Regression whose loss (hence gradients) is multiplied by 1e4 from its 31st training step on."""

    def training_step(self, batch):
        out = super().training_step(batch)
        return {**out, "loss": out["loss"] * (1e4 if self.calls > 30 else 1.0)}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_health_measures_each_layer_at_the_measured_steps_only(tmp_path: Path, monkeypatch) -> None:
    health, capture = TrainingHealth(str(tmp_path), every="5st", modules=["linear"]), Capture(10)
    run = make_run(max_duration="20st", callbacks=[capture, health], val_interval="100st")
    with HostReads(monkeypatch) as reads:
        fit(run)
    rows = _rows(tmp_path / "health.jsonl")
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    at10 = rows[1]["layers"]
    assert set(at10) == {"linear.weight", "linear.bias"}
    for name in at10:
        assert at10[name]["grad_norm"] == pytest.approx(float(capture.grads[name].norm()), rel=1e-6)
        assert at10[name]["param_norm"] == pytest.approx(float(capture.before[name].norm()), rel=1e-6)
        ratio = float((capture.after[name] - capture.before[name]).norm() / capture.before[name].norm())
        assert at10[name]["update_ratio"] == pytest.approx(ratio, rel=1e-5)
    acts = rows[1]["activations"]["linear"]
    assert set(acts) == {"mean", "std", "max_abs", "zero_fraction"} and acts["std"] > 0
    # one read of the device per measured step, from the health callback (the log's own reads aside)
    assert sum(w.startswith("health.py") for w in reads.where) == 4 + 4  # per step: the norms and the activations


def test_exploding_gradients_are_named_once(tmp_path: Path, capsys) -> None:
    health = TrainingHealth(str(tmp_path), every="5st")
    # the whole data set in every batch and a tiny step: the gradients are steady until they jump
    fit(make_run(Exploding(), max_duration="45st", callbacks=[health], val_interval="100st", lr=1e-6, batch_size=64))
    err = capsys.readouterr().err
    assert err.count("gradients exploding in linear.weight, linear.bias") == 1, err
    assert "step 35" in err
    assert health.state_dict()["warned"] == [["linear.bias", "exploding"], ["linear.weight", "exploding"]]


def test_health_refuses_an_interval_it_cannot_count_in_steps_and_an_unknown_module(tmp_path: Path) -> None:
    run = make_run(max_duration="20st", callbacks=[TrainingHealth(str(tmp_path), modules=["nope"])])
    with pytest.raises(ConfigError, match="'nope' is not a module of Regression"):
        fit(run)
    with pytest.raises(ConfigError, match="give it in optimizer steps"):
        fit(make_run(max_duration="20st", callbacks=[TrainingHealth(str(tmp_path), every="0st")]))


def test_every_layer_reaches_tensorboard_and_wandb_as_histograms(
    offline: None, compose_cfg: Callable, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["+experiment=digits", "trainer.max_duration=10st", "trainer.val_interval=10st", "trainer.log_interval=5st"]
    train(compose_cfg(*args, "callbacks=health", "logger=[tensorboard,wandb]", "checkpoint=none"))
    layers = _rows(tmp_path / "run" / "health.jsonl")[-1]["layers"]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    for kind in ("grad_norm", "param_norm", "update_ratio"):
        logs = [math.log10(v[kind]) for v in layers.values()]
        drawn = events.Histograms(f"health/log10_{kind}")
        assert [h.step for h in drawn] == [5, 10]
        assert drawn[-1].histogram_value.num == len(layers) == 6  # every layer, not only the top 5
        assert (drawn[-1].histogram_value.min, drawn[-1].histogram_value.max) == pytest.approx((min(logs), max(logs)))
    at10 = offline_run(tmp_path / "run")["history"][10]  # wandb stores a histogram's fields under its key
    assert at10["health/log10_grad_norm/_type"] == "histogram"
    assert sum(at10["health/log10_grad_norm/values"]) == len(layers)  # counts per bin
