"""precision=bf16_true: bfloat16 parameters, fp32 master weights in the optimizer; tracks fp32 training, resumes
exactly (the masters are checkpointed), and is refused with FSDP's sharded parameters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_LM, assert_resume_is_exact

from runner import ConfigError
from runner.build import build
from runner.loop import fit
from runner.precision import MasterWeights

DIGITS = ["+experiment=digits", "trainer.max_duration=90st", "callbacks=none", "checkpoint=none"]
# the helpers' tiny GPT, a little wider and longer
TINY_LM = [*TINY_LM, "model.d_model=64", "model.seq_len=64", "trainer.max_duration=60st", "trainer.val_interval=60st"]


def _trained(compose_cfg: Callable, *overrides: str):
    return fit(build(compose_cfg(*overrides)))


def test_parameters_are_bf16_and_the_optimizer_steps_fp32_masters(compose_cfg: Callable) -> None:
    run = build(compose_cfg(*DIGITS, "precision=bf16_true", "trainer.max_duration=3st"))
    assert {p.dtype for p in run.task.parameters()} == {torch.bfloat16}
    stepped = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in stepped} == {torch.float32} and len(stepped) == len(list(run.task.parameters()))
    fit(run)
    for p, master in zip(run.precision.params, run.precision.master, strict=True):
        assert torch.equal(p, master.to(torch.bfloat16))  # the model holds its masters' rounding
        assert p.grad is None and master.grad is None  # nothing is left between steps


@pytest.mark.parametrize(
    ("overrides", "tolerance"),
    [(DIGITS, 0.02), (TINY_LM, 0.01)],
    ids=["digits", "lm"],
)
def test_bf16_true_tracks_fp32_training(compose_cfg: Callable, overrides: list[str], tolerance: float) -> None:
    fp32 = _trained(compose_cfg, *overrides).state.metrics["val/loss"]
    true = _trained(compose_cfg, *overrides, "precision=bf16_true").state.metrics["val/loss"]
    autocast = _trained(compose_cfg, *overrides, "precision=bf16").state.metrics["val/loss"]
    # the stated tolerance (README): the final validation loss within 2% (digits, 90 steps) / 1% (lm, 60 steps)
    assert abs(true - fp32) <= tolerance * fp32, (true, fp32, autocast)
    assert true != fp32


def test_bf16_true_resumes_exactly(compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*DIGITS, "precision=bf16_true", "trainer.max_duration=40st", "checkpoint=default", "logger=jsonl"]
    whole, second = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=20)
    for a, b in zip(whole.precision.master, second.precision.master, strict=True):  # checkpointed, restored
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_bf16_true_refuses_parameters_it_does_not_hold() -> None:
    precision = MasterWeights()
    model = torch.nn.Linear(2, 2)
    precision.cast(model)
    assert precision.optimizer_groups([{"params": list(model.parameters())}])[0]["params"] == precision.master
    with pytest.raises(ConfigError, match="with FSDP use precision=bf16"):
        precision.optimizer_groups([{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ConfigError, match="bfloat16 only"):
        MasterWeights(dtype="float16")


def test_bf16_true_refuses_a_task_that_constrains_its_weights_after_each_step(compose_cfg: Callable) -> None:
    with pytest.raises(ConfigError, match="TopKSAE's after_optimizer_step .* use precision=bf16"):
        build(compose_cfg("+experiment=sae", "precision=bf16_true"))
