"""The CUDA paths, on a GPU when there is one (CI has none: skipped there): autocast precisions with the GradScaler,
pinned checkpoint buffers, an exact resume that restores the CUDA RNG state, steady steps with no host-device sync
(torch.cuda.set_sync_debug_mode("error")), batches copied ahead on a side stream."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import CountSteps, StopAt, SyncsAreErrors, assert_same_state, jsonl, metric_rows, summary

from runner.ckpt.callback import Checkpoint
from runner.data import device_batches
from runner.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_digits_trains_on_the_gpu_in_every_precision(compose_cfg: Callable, tmp_path: Path, precision: str) -> None:
    run = train(
        compose_cfg("+experiment=digits", f"precision={precision}", "trainer.max_duration=3ep", "callbacks=none")
    )
    assert run.device.type == "cuda" and next(run.task.parameters()).is_cuda
    done = summary(tmp_path / "run")
    assert done["stop_reason"] == "max_duration" and done["metrics"]["val/acc"] > 0.9, done
    rows = jsonl(tmp_path / "run")
    assert all(r["sys/peak_memory_mb"] > 0 for r in rows if "sys/peak_memory_mb" in r)  # the CUDA allocator's peak
    saver = next(cb for cb in run.callbacks if isinstance(cb, Checkpoint))
    # copies from the GPU go to page-locked memory (the weights; RNG states and counters are CPU tensors anyway)
    weights = [t for path, t in saver.buffers.items() if path.startswith("model/")]
    assert len(weights) == len(run.task.state_dict()) and all(t.is_pinned() for t in weights)
    if precision == "fp16":
        assert run.precision.state_dict()["scaler"]["scale"] > 0  # the GradScaler ran


def test_stop_and_resume_on_the_gpu_is_exact(compose_cfg: Callable, tmp_path: Path) -> None:
    # Dropout draws from the CUDA generator, fp16 steps through the GradScaler: both states must come back.
    overrides = [
        "+experiment=digits",
        "precision=fp16",
        "trainer.max_duration=40st",
        "trainer.val_interval=7st",
        "trainer.log_interval=4st",
        "logger=jsonl",
        "callbacks=none",
        "checkpoint.interval=1000st",
    ]
    whole = train(compose_cfg(*overrides, run_dir=tmp_path / "whole"))
    first = train(compose_cfg(*overrides, run_dir=tmp_path / "split"), extra_callbacks=[StopAt(20)])
    assert first.stop_reason == "preempted" and first.progress.step == 20
    counter = CountSteps()
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=tmp_path / "split"), extra_callbacks=[counter])
    assert counter.steps == 20 and second.progress.step == 40
    assert_same_state(whole, second)
    assert metric_rows(tmp_path / "split") == metric_rows(tmp_path / "whole")


JSON_PACKAGE = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
STEADY = {
    "digits-fp32-clip": ["+experiment=digits", "trainer.gradient_clip_val=0.5", "callbacks=[ema]"],
    "digits-bf16-accumulate": ["+experiment=digits", "precision=bf16", "trainer.accumulate_grad_batches=2"],
    "digits-fp16": ["+experiment=digits", "precision=fp16"],
    # text samples are written at the last step, with the log row: a step that samples reads its tokens back, as a
    # log step reads its metrics (in the guarded steps they were the first GPU run's one real sync)
    "lm-bf16": [
        *("+experiment=lm", f"data.paths=[{JSON_PACKAGE}]", "data.val_every=2", "precision=bf16"),
        "callbacks.text_samples.every=14st",
    ],
    "sae": ["+experiment=sae"],
}


@pytest.mark.parametrize("overrides", STEADY.values(), ids=STEADY.keys())
def test_steady_steps_make_no_host_device_sync(compose_cfg: Callable, overrides: list[str]) -> None:
    cfg = compose_cfg(
        *overrides,
        "trainer.max_duration=14st",
        "trainer.log_interval=14st",
        "trainer.val_interval=14st",
        "checkpoint=none",
        "logger=none",
    )
    guard = SyncsAreErrors(3, 12)
    run = train(cfg, extra_callbacks=[guard])
    assert run.progress.step == 14 and guard.guarded == 9
    assert run.optimizer.defaults["fused"]  # optimizer.fused=null: fused on CUDA


def test_device_batches_copy_ahead_and_arrive_intact() -> None:
    loader = [{"x": torch.arange(6.0).reshape(2, 3).pin_memory() + i, "n": i} for i in range(5)]
    moved = list(device_batches(loader, torch.device("cuda")))
    assert [b["n"] for b in moved] == list(range(5))
    for i, batch in enumerate(moved):
        assert batch["x"].is_cuda and torch.equal(batch["x"].cpu(), loader[i]["x"])
