"""Host reads (each a device sync on a GPU) that runner's own code makes on a training step that neither logs,
validates nor checkpoints, counted on the CPU: none with a fused optimizer (the default on CUDA), under fp32, bf16 and
fp16; one with an optimizer that cannot take the skip flag on the device (the documented fallback). Two ranks:
tests/e2e/test_host_reads.py."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import HostReads

from runner.build import build
from runner.loop import fit
from runner.optimizers import SkipsOnDevice
from runner.run import Callback, Run


class Snapshot(Callback):
    """The host-read count after optimizer steps `first` and `last` (steps in between neither log nor validate)."""

    def __init__(self, reads: HostReads, first: int, last: int) -> None:
        self.reads, self.first, self.last, self.seen = reads, first, last, {}

    def on_optimizer_step(self, run: Run) -> None:
        if run.progress.step in (self.first, self.last):
            self.seen[run.progress.step] = (self.reads.count, list(self.reads.where))


def reads_between_steps(compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> list[str]:
    """Where runner's code read the device on steps 3..10 of a run that logs and validates at step 12 only."""
    cfg = compose_cfg(
        *overrides,
        "trainer.max_duration=12st",
        "trainer.log_interval=12st",
        "trainer.val_interval=12st",
        "checkpoint=none",
        "logger=none",
    )
    run = build(cfg)
    # Muon and Signum read a flag that lives on the CPU (reading waits for nothing there): as on a GPU, they must not
    monkeypatch.setattr(SkipsOnDevice, "reads_cpu_flag", False)
    with HostReads(monkeypatch) as reads:
        snapshot = Snapshot(reads, 2, 10)
        run.callbacks.append(snapshot)
        fit(run)
    (before, _), (after, where) = snapshot.seen[2], snapshot.seen[10]
    return where[before:after]


JSON_PACKAGE = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")  # a small corpus: 5 files
CASES = {
    "digits-ema-clip": ["+experiment=digits", "callbacks=[ema,early_stopping]", "trainer.gradient_clip_val=0.5"],
    "digits-accumulate": ["+experiment=digits", "trainer.accumulate_grad_batches=3", "scheduler=cosine"],
    "digits-sgd-bf16": ["+experiment=digits", "optimizer=sgd", "precision=bf16", "trainer.gradient_clip_val=1.0"],
    "digits-fp16": ["+experiment=digits", "precision=fp16"],
    "sae": ["+experiment=sae", "data.batch_size=256"],
    "sae-muon": ["+experiment=sae", "data.batch_size=256", "optimizer=muon"],
    "digits-signum-fp16": ["+experiment=digits", "optimizer=signum", "precision=fp16"],  # GradScaler hands it the flag
    "skip-transcoder": ["+experiment=sae", "data=transcoder_synthetic", "data.batch_size=256", "model.skip=true"],
    "lm": [
        "+experiment=lm",
        f"data.paths=[{JSON_PACKAGE}]",
        "data.val_every=2",
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "model.seq_len=16",
    ],
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_a_step_that_does_not_log_never_reads_the_device_with_a_fused_optimizer(
    overrides: list[str], compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert reads_between_steps(compose_cfg, monkeypatch, *overrides, "optimizer.fused=true") == []


def test_an_optimizer_without_a_device_skip_flag_reads_it_once_per_step(
    compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = reads_between_steps(compose_cfg, monkeypatch, *CASES["digits-ema-clip"], "optimizer.fused=false")
    assert len(where) == 8 and all(w.startswith("precision.py") and w.endswith("item") for w in where), where


def test_an_end_to_end_step_never_reads_the_device(
    compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, lm_run: Path
) -> None:
    # the clean forward, the spliced forward with the coder's step inside its hook, the KL and the backward
    source = [f"source.checkpoint={lm_run}", "source.layer=1", "model.coder.n_latents=64", "model.coder.k=4"]
    for experiment in ("sae_lm_kl", "transcoder_lm_kl"):
        overrides = [f"+experiment={experiment}", *source, "data.batch_size=4", "optimizer.fused=true"]
        assert reads_between_steps(compose_cfg, monkeypatch, *overrides) == [], experiment
