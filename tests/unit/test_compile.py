"""compile and activation_checkpointing on a tiny model with Blocks (tests/_tasks.py TinyLM): the same training as
eager, the same state-dict keys, checkpoints that resume across the two, and a clear error for a model without units.
Compiling with inductor takes seconds per graph on the CPU, so the compiled runs here are few and a few steps long."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _tasks import TinyLM, token_splits
from helpers import StopAt, make_run, summary

from runner import ConfigError
from runner.build import build
from runner.compile import ActivationCheckpointing, Compile
from runner.loop import fit
from runner.run import Logger, Run
from runner.train import train

# TinyLM on counting sequences, 6 steps, one validation (at the end), a checkpoint only when stopped
LM = [
    "model._target_=_tasks.TinyLM",
    "data.splits._target_=_tasks.token_splits",
    "data.batch_size=8",
    "trainer.max_duration=6st",
    "trainer.val_interval=6st",
    "logger=none",
    "callbacks=none",
    "checkpoint.interval=1000st",
]
# Compiled and eager runs sum the same numbers in another order (inductor fuses and reorders): float32 rounding
RTOL, ATOL = 1e-4, 1e-5


class Rows(Logger):
    """Keeps every logged row."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append(metrics)


def _trained(*apply: Compile | ActivationCheckpointing, steps: int = 4) -> tuple[Run, list[float]]:
    torch.manual_seed(0)  # every run starts from the same weights
    task = TinyLM()
    run = make_run(task, max_duration=f"{steps}st", splits=token_splits())
    for option in apply:
        option.apply(run.task)
    run.val_loader, rows = None, Rows()  # no validation: eval mode would be one more graph to compile
    run.loggers = [rows]
    fit(run)
    return run, [row["train/loss"] for row in rows.rows]


@pytest.mark.parametrize("units", [["Block"], None], ids=["compile=blocks", "compile=model"])
def test_compiled_training_tracks_eager_over_120_steps_with_the_same_state_dict_keys(units: list[str] | None) -> None:
    # fp32 on the CPU: every logged loss of 120 steps within float tolerance of eager's (measured: 3e-7 relative at
    # worst), so a compiled run that drifts from eager is a bug, not rounding
    eager, eager_losses = _trained(steps=120)
    compiled, losses = _trained(Compile(units=units), steps=120)
    if units:
        assert all(block._compiled_call_impl is not None for block in compiled.task.blocks)
    else:
        assert compiled.task._compiled_call_impl is not None
    assert len(losses) == 120 and losses == pytest.approx(eager_losses, rel=RTOL, abs=ATOL) and losses[-1] < losses[0]
    assert list(compiled.task.state_dict()) == list(eager.task.state_dict())
    for (name, a), b in zip(compiled.task.state_dict().items(), eager.task.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)


def _gradients(task: TinyLM) -> list[torch.Tensor]:
    batch = token_splits()["train"].__getitems__(list(range(16)))
    torch.manual_seed(1)  # the same dropout masks
    task.training_step(batch)["loss"].backward()
    return [p.grad for p in task.parameters()]


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_gives_the_eager_gradients_exactly(every: int) -> None:
    # dropout in every block: the recompute must draw the masks the forward drew
    torch.manual_seed(0)
    eager = TinyLM(block_dropout=0.2)
    torch.manual_seed(0)
    checkpointed = TinyLM(block_dropout=0.2)
    assert (
        ActivationCheckpointing(units=["Block"], every=every).apply(checkpointed)
        == f"{len(range(0, 3, every))} x Block"
    )
    assert list(checkpointed.state_dict()) == list(eager.state_dict())
    for a, b in zip(_gradients(checkpointed), _gradients(eager), strict=True):
        assert torch.equal(a, b)


def test_activation_checkpointing_composes_with_compile() -> None:
    eager, eager_losses = _trained(steps=2)
    both, losses = _trained(ActivationCheckpointing(units=["Block"]), Compile(units=["Block"]), steps=2)
    assert losses == pytest.approx(eager_losses, rel=RTOL, abs=ATOL)
    for a, b in zip(both.task.parameters(), eager.task.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("first", "then"), [("blocks", "none"), ("none", "blocks")], ids=["compiled-then-eager", "eager-then-compiled"]
)
def test_a_checkpoint_resumes_across_compile_settings_without_refusal(
    compose_cfg: Callable, tmp_path: Path, first: str, then: str
) -> None:
    whole = train(compose_cfg(*LM, run_dir=tmp_path / "whole"))
    stopped = train(compose_cfg(*LM, f"compile={first}", run_dir=tmp_path / "split"), extra_callbacks=[StopAt(3)])
    assert stopped.progress.step == 3
    compiled_first = summary(tmp_path / "split")["compile_time_s"]  # the first launch's first step, compiling
    assert (compiled_first is not None and compiled_first > 0) == (first == "blocks")
    # compile is INERT for a resume: no resume_allow_changes needed
    resumed = train(compose_cfg(*LM, f"compile={then}", "resume=auto", run_dir=tmp_path / "split"))
    assert resumed.progress.step == 6 and resumed.stop_reason == "max_duration"
    assert (summary(tmp_path / "split")["compile_time_s"] is not None) == (then == "blocks")
    assert list(resumed.task.state_dict()) == list(whole.task.state_dict())
    for (name, a), b in zip(resumed.task.state_dict().items(), whole.task.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("group", ["compile", "activation_checkpointing"])
def test_blocks_on_a_model_without_blocks_names_the_classes_it_has(compose_cfg: Callable, group: str) -> None:
    with pytest.raises(
        ConfigError, match=r"has no module of such a class; its classes are MLPClassifier, Sequential, "
    ):
        build(compose_cfg("+experiment=digits", f"{group}=blocks"))
