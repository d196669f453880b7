"""The CUDA paths, on a GPU when there is one (CI has none: skipped there): every precision (autocast with the
GradScaler, *_true's fp32 masters), pinned checkpoint buffers, exact resumes that restore the CUDA RNG state (compiled
too), compiled and checkpointed GPTs against eager, an SAE fed from a source model on the GPU, evaluate there, steady
steps with no host-device sync (torch.cuda.set_sync_debug_mode("error")), batches copied ahead on a side stream."""

from __future__ import annotations

import importlib.util
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    CountSteps,
    StopAt,
    SyncsAreErrors,
    assert_resume_is_exact,
    assert_same_state,
    hf_text,
    jsonl,
    metric_rows,
    read_json,
    summary,
    tiny_hf_model,
)

from runner.ckpt.callback import Checkpoint
from runner.data import device_batches
from runner.tools.evaluate import main as evaluate_main
from runner.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16_true", "fp16_true"])
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
    if precision.startswith("fp16"):
        assert run.precision.state_dict()["scaler"]["scale"] > 0  # the GradScaler ran
    if precision.endswith("_true"):  # the model holds half-precision weights, the optimizer steps fp32 masters
        half = {"bf16_true": torch.bfloat16, "fp16_true": torch.float16}[precision]
        assert {p.dtype for p in run.task.parameters()} == {half}
        assert all(m.is_cuda and m.dtype == torch.float32 for m in run.precision.master)


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
GRAPHS = ("compile.mode=reduce-overhead",)
LM_STEADY = ("+experiment=lm", f"data.paths=[{JSON_PACKAGE}]", "data.val_every=2")
STEADY = {
    "digits-fp32-clip": ["+experiment=digits", "trainer.gradient_clip_val=0.5", "callbacks=[ema]"],
    "digits-bf16-accumulate": ["+experiment=digits", "precision=bf16", "trainer.accumulate_grad_batches=2"],
    "digits-fp16": ["+experiment=digits", "precision=fp16"],
    # text samples are written at the last step, with the log row: a step that samples reads its tokens back, as a
    # log step reads its metrics (in the guarded steps they were the first GPU run's one real sync)
    "lm-bf16": [*LM_STEADY, "precision=bf16", "callbacks.text_samples.every=14st"],
    # compiled at the first step; validation (eval mode: one more graph) after the guarded steps
    "lm-compile-blocks-bf16": [*LM_STEADY, "precision=bf16", "callbacks=none", "compile=blocks"],
    "lm-compile-model-bf16": [*LM_STEADY, "precision=bf16", "callbacks=none", "compile=model"],
    # CUDA graphs (cudagraph trees): recorded in the first steps, replayed in the guarded ones
    "lm-cudagraphs-bf16": [*LM_STEADY, "precision=bf16", "callbacks=none", "compile=blocks", *GRAPHS],
    "lm-checkpointed-bf16_true": [
        *LM_STEADY,
        "precision=bf16_true",
        "callbacks=none",
        "activation_checkpointing=blocks",
    ],
    "digits-fp16_true": ["+experiment=digits", "precision=fp16_true"],
    "sae": ["+experiment=sae"],
    "sae-muon": ["+experiment=sae", "optimizer=muon"],  # drops a non-finite step on the device, as fused Adam
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
    # optimizer.fused=null: fused on CUDA, which takes the skip flag on the device (as runner's Muon does)
    assert run.optimizer._step_supports_amp_scaling


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf)")
def test_a_transformers_source_gives_its_rows_on_the_gpu_without_waiting_for_it(tmp_path: Path) -> None:
    # An SAE's ring refills from the source inside steps that do not log: the kept positions (not special tokens)
    # are counted on the host, and the rows are the CPU's own
    from experiments.sae.sources.source import SourceModel

    inputs = {"paths": hf_text(tmp_path / "text"), "val_every": 2, "context": 16, "batch_size": 4}
    inputs["cache_dir"] = str(tmp_path / "tokens")
    source = SourceModel(str(tiny_hf_model(tmp_path / "gpt2", "gpt2")), "transformer.h.0", inputs=inputs)
    batches = list(source.data.train_loader())[:3]
    on_cpu = [source.activations(b) for b in batches]
    source.to(torch.device("cuda"))
    source.activations(batches[0])  # the first call sets up cuBLAS and moves the special ids
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = [source.activations(b) for b in batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
        assert gpu.is_cuda and gpu.shape == cpu.shape
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)


def test_device_batches_copy_ahead_and_arrive_intact() -> None:
    loader = [{"x": torch.arange(6.0).reshape(2, 3).pin_memory() + i, "n": i} for i in range(5)]
    moved = list(device_batches(loader, torch.device("cuda")))
    assert [b["n"] for b in moved] == list(range(5))
    for i, batch in enumerate(moved):
        assert batch["x"].is_cuda and torch.equal(batch["x"].cpu(), loader[i]["x"])


def test_sae_steps_fed_by_a_source_model_on_the_gpu_make_no_sync(compose_cfg: Callable, lm_run: Path) -> None:
    # A ring of 1024 rows served 128 at a time is refilled from the source every 4 steps: refills fall among the
    # guarded steps (the source's inputs and the ring's order go to the GPU from pinned memory)
    sae_lm = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", "source.layer=1", "model.n_latents=128", "model.k=8"]
    sae_lm += ["data.batch_size=128", "data.buffer_size=1024", "data.samples_per_epoch=8192"]
    # one checkpoint, at the end (sae_lm saves at every quarter): a save copies the state to the host, as a log row does
    sae_lm += ["checkpoint.interval=1.0dur"]
    cfg = compose_cfg(*sae_lm, *(f"trainer.{k}=14st" for k in ("max_duration", "log_interval", "val_interval")))
    guard = SyncsAreErrors(3, 12)
    run = train(cfg, extra_callbacks=[guard])
    assert run.progress.step == 14 and guard.guarded == 9
    assert run.train_loader.dataset.buffer.ring.is_cuda and run.state.metrics["val/fve"] > 0


# The lm preset's GPT at a test's size, in bf16 (on a GPU the LM's usual precision), with a row every 4 steps
LM_GPU = [
    *LM_STEADY,
    *("model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.seq_len=64", "precision=bf16"),
    *("trainer.max_duration=24st", "trainer.log_interval=4st", "trainer.val_interval=24st"),
    *("logger=jsonl", "callbacks=none", "checkpoint=none"),
]


def test_compiled_gpts_track_eager_in_bf16(compose_cfg: Callable, tmp_path: Path) -> None:
    # Under bf16 autocast inductor's fused kernels round less often than eager's op-by-op ones, so the curves part
    # slowly (on the H200, a 12-layer GPT ended 40 steps at 2.96 eager and 3.13 with compile=blocks, for a hand loop as
    # for runner); a small model over 24 steps stays within 3% of eager at every row
    # and the blocks, or the whole forward, replayed as CUDA graphs (compile.mode=reduce-overhead): the loop keeps no
    # graph output past its step (cudagraph trees overwrite them at the next replay, and refuse a read of one)
    variants = {"none": [], "blocks": [], "model": [], "graphs": ["compile=blocks", *GRAPHS]}
    losses, variants["model-graphs"] = {}, ["compile=model", *GRAPHS]
    for name, overrides in variants.items():
        chosen = overrides or [f"compile={name}"]
        train(compose_cfg(*LM_GPU, *chosen, run_dir=tmp_path / name))
        losses[name] = [row["train/loss"] for row in jsonl(tmp_path / name) if "train/loss" in row]
        assert (summary(tmp_path / name)["compile_time_s"] is not None) == (name != "none")
    assert len(losses["none"]) == 6 and losses["none"][-1] < losses["none"][0]
    for name in ("blocks", "model", "graphs", "model-graphs"):
        assert losses[name] == pytest.approx(losses["none"], rel=0.03), name


def test_activation_checkpointing_gives_eager_losses_in_less_gpu_memory(compose_cfg: Callable, tmp_path: Path) -> None:
    # 4 blocks of d 128 over 16 windows of 512 tokens: ~300 MB of activations against 1 MB of weights; checkpointed,
    # only each block's input is kept and one block's activations are recomputed at a time
    shape = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.seq_len=512", "data.batch_size=16"]
    email = str(Path(sysconfig.get_paths()["stdlib"]) / "email" / "*.py")  # ~360 kB: 700 windows in the first epoch
    common = ["+experiment=lm", f"data.paths=[{email}]", *shape, "precision=bf16", "trainer.max_duration=6st"]
    common += ["trainer.log_interval=2st", "trainer.val_interval=6st", "logger=jsonl", "callbacks=none"]
    common += ["checkpoint=none"]
    rows = {}
    for ac in ("none", "blocks"):
        train(compose_cfg(*common, f"activation_checkpointing={ac}", run_dir=tmp_path / ac))
        rows[ac] = [row for row in jsonl(tmp_path / ac) if "train/loss" in row]
    # the recomputed forward is the forward: the same kernels on the same inputs
    eager, checkpointed = ([row["train/loss"] for row in rows[ac]] for ac in ("none", "blocks"))
    assert checkpointed == pytest.approx(eager, rel=1e-5)
    peak = {ac: max(row["sys/peak_memory_mb"] for row in rows[ac]) for ac in rows}
    assert peak["blocks"] < 0.75 * peak["none"], peak


def test_a_compiled_bf16_gpt_resumes_exactly_on_the_gpu(compose_cfg: Callable, tmp_path: Path) -> None:
    overrides = [*(o for o in LM_GPU if not o.startswith(("trainer.", "checkpoint="))), "compile=blocks"]
    overrides += ["trainer.max_duration=8st", "trainer.val_interval=4st", "trainer.log_interval=2st"]
    overrides += ["checkpoint.interval=1000st"]
    whole, second = assert_resume_is_exact(compose_cfg, overrides, tmp_path, stop=3)
    assert next(whole.task.parameters()).is_cuda and summary(tmp_path / "split")["compile_time_s"] > 0


def test_evaluate_on_the_gpu_gives_the_run_s_own_validation(compose_cfg: Callable, tmp_path: Path) -> None:
    run = train(compose_cfg("+experiment=digits", "trainer.max_duration=30st", "logger=none", "callbacks=none"))
    assert run.device.type == "cuda"
    for device, rel in (("cuda", 1e-6), ("cpu", 1e-4)):  # the same kernels; the CPU's sum the same float32 otherwise
        assert evaluate_main([str(tmp_path / "run"), "split=val", f"device={device}"]) == 0
        metrics = read_json(tmp_path / "run" / "eval-val.json")["metrics"]
        for key in ("val/loss", "val/acc"):
            assert metrics[key] == pytest.approx(run.state.metrics[key], rel=rel), (device, key)
