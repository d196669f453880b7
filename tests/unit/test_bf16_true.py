"""precision=bf16_true and fp16_true: low-precision parameters, fp32 master weights in the optimizer (fp16 with loss
scaling, unscaled on the masters); they track fp32 training, resume exactly (the masters and the scaler are
checkpointed), and are refused with FSDP's sharded parameters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_LM, assert_resume_is_exact

from runner import ConfigError
from runner.build import build
from runner.loop import fit
from runner.precision import MasterWeights, ScaledMasterWeights

DIGITS = ["+experiment=digits", "trainer.max_duration=90st", "callbacks=none", "checkpoint=none"]
# the helpers' tiny GPT, a little wider and longer
TINY_LM = [*TINY_LM, "model.d_model=64", "model.seq_len=64", "trainer.max_duration=60st", "trainer.val_interval=60st"]


def _trained(compose_cfg: Callable, *overrides: str):
    return fit(build(compose_cfg(*overrides)))


@pytest.fixture(scope="module")
def fp32_losses() -> dict:
    """The final validation loss of each fp32 reference run, by its overrides, trained once per module."""
    return {}


@pytest.mark.parametrize(("precision", "dtype"), [("bf16_true", torch.bfloat16), ("fp16_true", torch.float16)])
def test_parameters_are_low_precision_and_the_optimizer_steps_fp32_masters(
    compose_cfg: Callable, precision: str, dtype: torch.dtype
) -> None:
    run = build(compose_cfg(*DIGITS, f"precision={precision}", "trainer.max_duration=3st"))
    assert {p.dtype for p in run.task.parameters()} == {dtype} and run.precision.name == precision
    stepped = [p for group in run.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in stepped} == {torch.float32} and len(stepped) == len(list(run.task.parameters()))
    fit(run)
    for p, master in zip(run.precision.params, run.precision.master, strict=True):
        assert torch.equal(p, master.to(dtype))  # the model holds its masters' rounding
        assert p.grad is None and master.grad is None  # nothing is left between steps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(
    ("overrides", "tolerance"),
    [(DIGITS, 0.02), (TINY_LM, 0.01)],
    ids=["digits", "lm"],
)
def test_true_low_precision_tracks_fp32_training(
    compose_cfg: Callable, overrides: list[str], tolerance: float, precision: str, fp32_losses: dict
) -> None:
    key = tuple(overrides)
    if key not in fp32_losses:  # bf16 and fp16 compare with the same fp32 run
        fp32_losses[key] = _trained(compose_cfg, *overrides).state.metrics["val/loss"]
    fp32 = fp32_losses[key]
    true = _trained(compose_cfg, *overrides, f"precision={precision}_true").state.metrics["val/loss"]
    # the stated tolerance (README): the final validation loss within 2% (digits, 90 steps) / 1% (lm, 60 steps)
    assert abs(true - fp32) <= tolerance * fp32, (true, fp32)
    assert true != fp32


@pytest.mark.parametrize("precision", ["bf16_true", "fp16_true"])
def test_true_low_precision_resumes_exactly(compose_cfg: Callable, tmp_path: Path, precision: str) -> None:
    overrides = [*DIGITS, f"precision={precision}", "trainer.max_duration=40st", "checkpoint=default", "logger=jsonl"]
    whole, second = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=20)
    for a, b in zip(whole.precision.master, second.precision.master, strict=True):  # checkpointed, restored
        assert a.dtype == torch.float32 and torch.equal(a, b)
    if precision == "fp16_true":  # and the loss scale where it had got to
        assert whole.precision.scaler.get_scale() == second.precision.scaler.get_scale()


def test_fp16_true_unscales_on_the_fp32_masters_where_small_gradients_survive() -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(16, 8)
    precision = ScaledMasterWeights()
    precision.cast(model)
    optimizer = torch.optim.SGD(precision.optimizer_groups([{"params": list(model.parameters())}]), lr=1.0)
    with precision.autocast():
        loss = 1e-7 * model(x.half()).float().sum()  # gradients ~1e-7: below float16's smallest normal number
    precision.backward(loss)
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())  # scaled by 65536 to stay representable
    precision.unscale_(optimizer)
    true_grad_w = 1e-7 * torch.ones(4, 1) * x.sum(0)  # d(sum(W x + b))/dW
    master_w = precision.stepped(list(model.parameters()))[0]
    assert master_w.dtype == torch.float32 and all(p.grad is None for p in model.parameters())
    # within float16's 1e-3 relative rounding of the scaled values, where float16's own grid at 1e-7 loses >5%
    torch.testing.assert_close(master_w.grad, true_grad_w, rtol=1e-2, atol=0)
    rounded = true_grad_w.half().float()
    assert ((rounded - true_grad_w).abs() / true_grad_w.abs()).max() > 5e-2
    # an overflow: the step is skipped and the scale halves
    before, scale = [m.detach().clone() for m in precision.master], precision.scaler.get_scale()
    precision.step(optimizer, torch.zeros(()))
    assert not all(torch.equal(a, m) for a, m in zip(before, precision.master, strict=True))  # that step was taken
    with precision.autocast():
        loss = 1e4 * model(x.half()).float().sum()
    precision.backward(loss)  # x 65536: beyond float16
    precision.unscale_(optimizer)
    before = [m.detach().clone() for m in precision.master]
    precision.step(optimizer, torch.zeros(()))
    assert all(torch.equal(a, m) for a, m in zip(before, precision.master, strict=True))
    assert precision.scaler.get_scale() == scale / 2


def test_bf16_true_refuses_parameters_it_does_not_hold() -> None:
    precision = MasterWeights()
    model = torch.nn.Linear(2, 2)
    precision.cast(model)
    assert precision.optimizer_groups([{"params": list(model.parameters())}])[0]["params"] == precision.master
    with pytest.raises(ConfigError, match="with FSDP use precision=bf16"):
        precision.optimizer_groups([{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ConfigError, match="use precision=fp16_true"):
        MasterWeights(dtype="float16")


def test_bf16_true_refuses_a_task_that_constrains_its_weights_after_each_step(compose_cfg: Callable) -> None:
    with pytest.raises(ConfigError, match="TopKSAE's after_optimizer_step .* use precision=bf16"):
        build(compose_cfg("+experiment=sae", "precision=bf16_true"))
