"""Transcoders resume exactly: stopped (preempted) at step N and resumed with resume=auto, each one reaches step 2N
with the weights and buffers (input_scale, target_scale, since_fired, a BatchTopK threshold, ...), the optimizer's
state and the metric rows of an uninterrupted run, bit for bit (helpers.assert_resume_is_exact).

Every transcoder option: TopK, skip (W_skip, a linear part in the target), BatchTopK and Matryoshka (their inference
thresholds are buffers), JumpReLU (learned thresholds, a step counter for the L0 warmup) on synthetic transcoder data;
a transcoder and a cross-layer transcoder on a tiny GPT's MLPs (the activation ring and the source's position are
state too). Small sizes: a few seconds each on one CPU thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_resume_is_exact

N = 6  # stopped at step N, trained to 2N
# Logs every 2 steps, validates every 4 (N=6 is between two validations: the resumed run's first one is its own),
# dead after 2 silent steps (AuxK and the dead-latent clock are live state), no checkpoint but the preemption's.
COMMON = [
    f"trainer.max_duration={2 * N}st",
    "trainer.log_interval=2st",
    "trainer.val_interval=4st",
    "logger=jsonl",
    "checkpoint.interval=1000st",
]
SYNTHETIC = [
    "+experiment=sae",
    "data=transcoder_synthetic",
    *("data.splits.d=32", "data.splits.d_out=24", "data.splits.n_features=64", "data.splits.n_val=256"),
    "data.batch_size=64",
    "model.n_latents=96",
    "model.dead_window=2st",
    *COMMON,
]
SYNTHETIC_CASES = {
    "topk": ["model.k=4"],
    "skip": ["model.k=4", "model.skip=true", "data.splits.linear=0.5", "data.splits.noise=0.05"],
    "batchtopk": ["model=sae_batchtopk", "model.k=4"],
    "matryoshka": ["model=sae_matryoshka", "model.k=4", "model.group_sizes=[16,32,48]"],
    "jumprelu": ["model=sae_jumprelu", "model.l0_warmup=4st"],  # the warmup ends between the stop and the end
}
# the tiny GPT of tests/helpers.TINY_LM: 2 blocks of width 32
LM_COMMON = [
    "data.batch_size=64",
    "data.buffer_size=512",  # refilled every 4 steps: the stop at 6 is half-way through a fill
    "data.samples_per_epoch=2048",
    *COMMON,
]
TRANSCODER_LM = [
    "+experiment=transcoder_lm",
    "source.layer=1",
    *("model.n_latents=64", "model.k=4", "model.dead_window=2st"),
    *LM_COMMON,
]
CLT_LM = [
    "+experiment=clt_lm",
    "source.module=[blocks.0.mlp_norm,blocks.1.mlp_norm]",
    "source.target=[blocks.0.mlp,blocks.1.mlp]",
    *("model.coder.n_latents=64", "model.coder.k=4", "model.coder.dead_window=2st"),
    *LM_COMMON,
]


def _check_buffers(whole, second, names: tuple[str, ...]) -> None:
    # assert_same_state pairs the state dicts in order; the same keys too, and the buffers the test is about exist
    a, b = whole.task.state_dict(), second.task.state_dict()
    assert list(a) == list(b)
    for name in names:
        assert any(key.endswith(name) for key in a), name


@pytest.mark.parametrize("case", list(SYNTHETIC_CASES))
def test_a_transcoder_on_synthetic_data_resumes_exactly(compose_cfg: Callable, tmp_path: Path, case: str) -> None:
    overrides = [*SYNTHETIC, *SYNTHETIC_CASES[case]]
    whole, second = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=N)
    sae = whole.task
    assert sae.transcoder and (sae.d_in, sae.d_out) == (32, 24) and sae.skip == (case == "skip")
    _check_buffers(whole, second, ("input_scale", "target_scale", "since_fired", "initialized"))
    # the scales were set from the data (not left at 1), and latents did go dead: the clock was live state
    assert float(sae.target_scale) != 1.0 and float(sae.input_scale) != 1.0
    assert float(sae.since_fired.max()) >= 2
    if case == "skip":
        assert torch.count_nonzero(sae.W_skip) > 0  # W_skip learned (it starts at zero)
    if case in ("batchtopk", "matryoshka"):
        assert float(sae.threshold) > 0  # the inference threshold has moved from its start (-1)
    if case == "jumprelu":
        _check_buffers(whole, second, ("steps",))
    # the rows after the stop were written by the resumed launch (assert_resume_is_exact compared them all)
    rows = [row for row in _rows(tmp_path / "split") if row["step"] > N]
    assert any("train/loss" in row for row in rows) and any("val/fve" in row for row in rows)


@pytest.mark.parametrize("case", ["transcoder", "clt"])
def test_a_transcoder_of_a_gpt_s_mlps_resumes_exactly(
    compose_cfg: Callable, lm_run: Path, tmp_path: Path, case: str
) -> None:
    overrides = [*(TRANSCODER_LM if case == "transcoder" else CLT_LM), f"source.checkpoint={lm_run}"]
    whole, second = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=N)
    _check_buffers(whole, second, ("input_scale", "target_scale", "since_fired"))
    task = whole.task
    if case == "clt":
        assert task.layers == 2 and [c.d_out for c in task.coders] == [64, 32]
        assert torch.count_nonzero(task.coders[0].W_dec[:, 32:]) > 0  # the cross-layer writes were trained
        assert torch.all(task.target_scale != 1.0)
    else:
        assert (task.d_in, task.d_out) == (32, 32) and float(task.target_scale) != 1.0
    rows = [row for row in _rows(tmp_path / "split") if row["step"] > N]
    assert any("val/loss_recovered" in row for row in rows)  # the splice evaluation ran after the resume too


def _rows(run_dir: Path) -> list[dict]:
    from helpers import jsonl

    return jsonl(run_dir)
