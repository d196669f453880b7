"""k annealing (callbacks=[...,sae_k_anneal], experiments.sae.anneal.KAnneal): the k each optimizer step trains
with follows sparsify's linear schedule, rounded as sparsify rounds; a run stopped mid-anneal and resumed trains with
the same k sequence and ends with the same weights as an uninterrupted one; what cannot anneal is refused.

Tiny synthetic runs (d=32, 96 latents, k=4, 12 steps; the anneal lasts 8): a second or two each on one CPU thread.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import CountSteps, StopAt, assert_same_state, metric_rows, values

from experiments.sae.anneal import KAnneal, annealed_k
from experiments.sae.coders.activations import TopKSAE
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.coders.multi import members
from runner import ConfigError
from runner.build import build
from runner.loop import fit
from runner.progress import TrainingProgress
from runner.run import Callback, Run
from runner.train import train

K = "callbacks.sae_k_anneal."  # the callback's settings
RUN = [
    "+experiment=sae",
    *("data.splits.d=32", "data.splits.n_features=64", "data.splits.n_val=256", "data.batch_size=64"),
    *("trainer.max_duration=12st", "trainer.log_interval=2st", "trainer.val_interval=4st"),
    *("logger=jsonl", "checkpoint.interval=1000st"),
    "callbacks=[sae_ground_truth,sae_k_anneal]",
    f"{K}duration=8st",
]
MODEL = ["model.n_latents=96", "model.k=4", "model.dead_window=2st"]
SMALL = [*RUN, *MODEL]
# The default start, 10*d_in = 320, is capped at n_latents = 96 (as sparsify's min(num_latents, 10 d_in)); after s of
# the 8 steps k = round(96 (1 - s/8) + 4 s/8): 84.5, 61.5, 38.5 and 15.5 round to even, as Python's round does.
EXPECTED = [96, 84, 73, 62, 50, 38, 27, 16, 4, 4, 4, 4]


def sparsify_k(initial: int, final: int, decay_steps: int, step: int) -> int:
    """sparsify 1.3's Trainer.get_current_k, written out (sparsify/trainer.py)."""
    if step >= decay_steps:
        return final
    progress = step / decay_steps
    return round(initial * (1 - progress) + final * progress)


class RecordK(Callback):
    """The k of every SAE when its optimizer step is taken: the k its forward used."""

    def __init__(self) -> None:
        self.ks: list[dict[str, int]] = []

    def on_before_optimizer_step(self, run: Run) -> None:
        self.ks.append({prefix: sae.k for prefix, sae in members(run.task)})


def _ks(recorder: RecordK, prefix: str = "") -> list[int]:
    return [step[prefix] for step in recorder.ks]


def test_expected_is_sparsifys_schedule() -> None:
    assert [sparsify_k(96, 4, 8, s) for s in range(12)] == EXPECTED
    assert [annealed_k(96, 4, 8, s) for s in range(12)] == EXPECTED


@pytest.mark.parametrize("model", ["sae_topk", "sae_batchtopk", "sae_matryoshka"])
def test_every_step_trains_with_the_scheduled_k(compose_cfg: Callable, tmp_path: Path, model: str) -> None:
    extra = ["model.group_sizes=[16,32,48]"] if model == "sae_matryoshka" else []
    recorder = RecordK()
    run = train(compose_cfg(*SMALL, f"model={model}", *extra), extra_callbacks=[recorder])
    assert run.progress.step == 12
    assert _ks(recorder) == EXPECTED
    assert run.task.k == 4  # the configured k at the end: what the weights file and exports describe
    # each log row's train/k is the k its step trained with
    logged = values(tmp_path / "run", "train/k")
    assert logged == [(s, EXPECTED[s - 1]) for s in range(2, 13, 2)]
    assert run.task.k_aux == 32 / 2  # AuxK's k_aux (d_in / 2) is not annealed


def test_a_resumed_run_trains_with_the_same_k_and_ends_with_the_same_weights(
    compose_cfg: Callable, tmp_path: Path
) -> None:
    whole_k, first_k, second_k, counter = RecordK(), RecordK(), RecordK(), CountSteps()
    whole = train(compose_cfg(*SMALL, run_dir=tmp_path / "whole"), extra_callbacks=[whole_k])
    # preempted at step 5, half-way through the anneal (and between two log rows)
    train(compose_cfg(*SMALL, run_dir=tmp_path / "split"), extra_callbacks=[first_k, StopAt(5)])
    second = train(compose_cfg(*SMALL, "resume=auto", run_dir=tmp_path / "split"), extra_callbacks=[second_k, counter])
    assert counter.steps == 7  # it did resume: only the rest was trained
    assert _ks(whole_k) == EXPECTED
    assert _ks(first_k) + _ks(second_k) == EXPECTED
    assert_same_state(whole, second)
    assert metric_rows(tmp_path / "split") == metric_rows(tmp_path / "whole")


def test_each_sae_of_a_family_anneals_to_its_own_k(compose_cfg: Callable, tmp_path: Path) -> None:
    recorder = RecordK()
    family = ["model=sae_multi", "model.ks=[4,8]", "model.base.n_latents=96", "model.base.dead_window=2st"]
    run = train(compose_cfg(*RUN, *family, f"{K}start=4*k"), extra_callbacks=[recorder])
    for k in (4, 8):
        expected = [annealed_k(4 * k, k, 8, s) for s in range(12)]
        assert _ks(recorder, f"k{k}/") == expected
        assert expected[0] == 4 * k and expected[-1] == k
        assert values(tmp_path / "run", f"train/k{k}/k") == [(s, expected[s - 1]) for s in range(2, 13, 2)]
    assert [sae.k for _, sae in members(run.task)] == [4, 8]


def test_a_cross_layer_transcoders_layers_anneal() -> None:
    clt = CrossLayerTranscoder(coder=partial(TopKSAE, n_latents=40, k=3), layers=2, d_in=8, d_out=6)
    progress = TrainingProgress("10st", batch_size=4, batches_per_epoch=None)
    callback = KAnneal(start="2*d_in", duration="4st")  # 16
    callback.on_fit_start(SimpleNamespace(task=clt, progress=progress))
    assert [coder.k for coder in clt.coders] == [16, 16]
    for step in range(1, 6):
        progress.count_optimizer_step(4)
        callback.on_optimizer_step(SimpleNamespace(task=clt, progress=progress))
        assert [coder.k for coder in clt.coders] == [annealed_k(16, 3, 4, step)] * 2
    assert set(callback.schedule) == {"layer0/", "layer1/"}
    assert [coder.k for coder in clt.coders] == [3, 3]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model=sae_relu", "model.n_latents=96"],
            r"a TopK-style SAE's k .* the model is a ReLUSAE with no k: leave sae_k_anneal out",
        ),
        (["model=sae_jumprelu", "model.n_latents=96"], "the model is a JumpReLUSAE with no k"),
        ([*MODEL, f"{K}start=2"], r"start=2 gives k=2 for the model, below its k=4"),
        ([*MODEL, f"{K}start=0.05*d_in"], r"0.05\*d_in gives k=2 for the model, below its k=4"),
        ([*MODEL, f"{K}start=200"], "start=200 is above the model's n_latents=96: give at most 96"),
        ([*MODEL, f"{K}duration=13st"], "13st is 13 optimizer steps; .* at most the run's 12"),
        ([*MODEL, f"{K}duration=0.01dur"], "0.01dur is 0 optimizer steps; it must last at least"),
    ],
)
def test_what_cannot_anneal_is_refused_at_fit_start(compose_cfg: Callable, overrides: list, message: str) -> None:
    run = build(compose_cfg(*RUN, *overrides))
    with pytest.raises(ConfigError, match=message):
        fit(run)
    assert run.progress.step == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (f"{K}duration=0st", "duration=0st must be longer than zero"),
        (f"{K}start=ten", r"start='ten': give an integer k .* 10\*d_in"),
        (f"{K}start=2.5", "start must be a whole number or a string, got 2.5"),  # runner's type check
    ],
)
def test_bad_settings_are_refused_when_built(compose_cfg: Callable, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(compose_cfg(*SMALL, override))
