"""Language-model throughput: runner's fit() against a hand-written nanoGPT-style loop of the same GPT, eager,
compiled (each Block) and with activation checkpointing (each Block), on the CPU or CUDA.

    python benchmarks/lm.py [--device cpu|cuda] [--precision fp32|bf16] [--modes eager,compile,ac]
                            [--steps 40] [--warmup 8] [--reps 3] [--json out.json] [model/data overrides...]

Every measurement is a fresh process (compile caches and peak memory are its own). Both loops train the same model
from the same initialisation on the same batches (runner's data module for +experiment=lm) with AdamW, the cosine
schedule and clipping at 1.0; the hand loop does it as nanoGPT's train.py does, with no logging (on CUDA: fused AdamW,
as runner's optimizer.fused=null picks there, pinned batches copied without blocking, no read from the GPU until the
end, the clock read after torch.cuda.synchronize() at steps 1, warmup and the last only). Throughput is tokens/s
over the steps after `warmup` (compilation happens in the first ones); compile time is the warm-up's extra time over
eager's, compiling from cold (each worker has an empty inductor cache). Peak memory: torch.cuda.max_memory_allocated
on CUDA; on the CPU the process's peak RSS (which includes torch's ~300 MiB of code and buffers, so differences are
what to read). Extra arguments are Hydra overrides for both
loops (the hand loop builds its model and data from the same config), e.g. model.n_layer=12 model.d_model=768.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import default_device, device_name, spawn, synchronize  # noqa: E402

MODES = {  # name -> runner config groups
    "eager": [],
    "compile": ["compile=blocks"],
    "ac": ["activation_checkpointing=blocks"],
}
# A model big enough that its matrix products, not Python, set the pace on 2 CPU cores
CPU_MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.seq_len=256", "data.batch_size=8"]
CUDA_MODEL = ["model.n_layer=12", "model.d_model=768", "model.n_head=12", "model.seq_len=1024", "data.batch_size=16"]


def _config(overrides: list[str], steps: int, device: str, precision: str):
    from hydra import compose, initialize_config_module

    from runner.config import resolvers

    resolvers.register()
    with initialize_config_module("runner.conf", version_base="1.3"):
        return compose(
            "config",
            overrides=[
                "+experiment=lm",
                f"trainer.max_duration={steps}st",
                "data.val_every=0",  # no validation split: neither loop validates (nor runner probes a val batch)
                f"trainer.log_interval={steps}st",
                "logger=none",
                "callbacks=none",
                "checkpoint=none",
                f"precision={precision}",
                f"distributed.device={device}",
                *overrides,
            ],
        )


def hand(cfg, device: str, mode: str, steps: int, warmup: int) -> dict:
    """nanoGPT's loop: autocast forward, backward, clip, AdamW step, LR by a cosine lambda; no logging."""
    from hydra.utils import instantiate
    from torch.utils.checkpoint import checkpoint

    from runner.build import param_groups
    from runner.data import to_device
    from runner.progress import TrainingProgress
    from runner.schedulers import cosine

    start = time.perf_counter()  # as runner's: from building the data and model on
    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data)
    loader = data.train_loader(device=torch.device(device))
    model = instantiate(cfg.model).to(device)
    if mode == "ac":
        for block in model.blocks:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    if mode == "compile":
        for block in model.blocks:
            block.compile()
    # as runner's build makes it: optimizer.fused=null is fused on CUDA (no host read), torch's default elsewhere
    fuse = cfg.optimizer.get("fused", False) is None and torch.device(device).type == "cuda"
    optimizer = instantiate(cfg.optimizer)(param_groups(model), **({"fused": True} if fuse else {}))
    progress = TrainingProgress(
        f"{steps}st",
        batch_size=data.batch_size,
        batches_per_epoch=len(loader),
        samples_per_epoch=loader.batch_sampler.samples_per_epoch,
    )
    scheduler = cosine(optimizer=optimizer, progress=progress).scheduler  # the same per-step factors as runner's
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.precision.get("dtype"))
    autocast = torch.autocast(device, dtype=dtype, enabled=dtype is not None)
    stamps, probe = [], None
    for step, batch in enumerate(loader, 1):
        batch = to_device(batch, torch.device(device))
        probe = probe or batch
        with autocast:
            loss = model.training_step(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step in (1, warmup, steps):
            synchronize(device)
            stamps.append(time.perf_counter())
        if step == steps:
            break
    tokens = data.tokens_per_sample * data.batch_size
    return _figures(stamps, start, steps, warmup, tokens, device, _loss_on(model, probe, autocast))


def runner(cfg, device: str, mode: str, steps: int, warmup: int) -> dict:
    """runner.build + runner.loop.fit, with a callback reading the clock at the same steps."""
    from runner.build import build
    from runner.data import to_device
    from runner.loop import fit
    from runner.run import Callback

    stamps: list[float] = []

    class Clock(Callback):
        def on_optimizer_step(self, run) -> None:
            if run.progress.step in (1, warmup, steps):
                synchronize(device)
                stamps.append(time.perf_counter())

    start = time.perf_counter()
    run = build(cfg)
    run.callbacks.append(Clock())
    probe = to_device(next(iter(run.train_loader)), run.device)  # the first batch, as the hand loop's
    fit(run)
    tokens = run.progress.tokens / run.progress.step
    return _figures(stamps, start, steps, warmup, tokens, device, _loss_on(run.task, probe, run.precision.autocast()))


@torch.no_grad()
def _loss_on(model, batch, autocast) -> float:
    # The trained models' loss on the same batch: the two loops did the same arithmetic if these agree
    with autocast:
        return float(model.training_step(batch)["loss"])


def _figures(stamps, start, steps, warmup, tokens_per_step, device, loss) -> dict:
    first, warm, last = stamps
    return {
        "tokens_per_s": tokens_per_step * (steps - warmup) / (last - warm),
        "warmup_s": warm - start,  # build, first batches and (when compiled) compilation
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "final_loss": float(loss),
    }


def worker(args: argparse.Namespace, overrides: list[str]) -> None:
    torch.set_flush_denormal(True)
    cfg = _config(overrides + MODES[args.mode], args.steps, args.device, args.precision)
    result = (hand if args.worker == "hand" else runner)(cfg, args.device, args.mode, args.steps, args.warmup)
    Path(args.out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=default_device(), help="cpu or cuda (default: cuda when present)")
    # no fp16: runner scales its loss (a GradScaler) and nanoGPT's loop here does not: they would train differently
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--modes", default="eager,compile,ac")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=["hand", "runner"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.worker:
        return worker(args, overrides)
    overrides = (CUDA_MODEL if args.device == "cuda" else CPU_MODEL) + overrides
    modes = args.modes.split(",")
    results: dict[str, dict[str, list[dict]]] = {m: {"hand": [], "runner": []} for m in modes}
    threads = str(args.threads or os.cpu_count())  # benchmarks.common.spawn would give each worker one
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    # absolute: the workers run in the repository root (benchmarks.common.spawn), maybe not where this was started
    out = Path(args.json or "lm_bench.json").resolve().with_suffix(".worker.json")
    for rep in range(args.reps):
        for mode in modes:
            order = ["hand", "runner"] if rep % 2 == 0 else ["runner", "hand"]  # alternate who goes first
            for name in order:
                command = [sys.executable, __file__, "--worker", name, "--mode", mode, "--out", str(out)]
                command += ["--device", args.device, "--precision", args.precision]
                command += ["--steps", str(args.steps), "--warmup", str(args.warmup), *overrides]
                with tempfile.TemporaryDirectory() as cache:  # compile from cold, whoever went first
                    worker_env = {**env, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
                    results[mode][name].append(spawn(command, out, env=worker_env))
    out.unlink(missing_ok=True)
    table = report(results, args, overrides)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


def report(results: dict, args: argparse.Namespace, overrides: list[str]) -> dict:
    """Print the table; return its figures."""
    threads = args.threads or os.cpu_count()
    device = device_name(args.device) if args.device == "cuda" else f"cpu, {threads} threads"
    print(f"device: {device}; {args.precision}; {args.steps} steps ({args.warmup} warm-up); {' '.join(overrides)}")
    print(
        f"{'mode':<8} {'loop':<7} {'tokens/s':>10} {'x hand':>7} {'warm-up s':>10} {'peak MiB':>9} {'final loss':>11}"
    )
    table: dict = {
        "device": device_name(args.device),
        "threads": threads,
        "precision": args.precision,
        "overrides": overrides,
        "modes": {},
    }
    eager = (
        {n: statistics.median(r["warmup_s"] for r in results["eager"][n]) for n in ("hand", "runner")}
        if "eager" in results
        else {}
    )
    for mode, by_loop in results.items():
        rows = {}
        for name in ("hand", "runner"):
            runs = by_loop[name]
            ratios = [r["tokens_per_s"] / h["tokens_per_s"] for r, h in zip(runs, by_loop["hand"], strict=True)]
            peak = [r["peak_cuda_mb"] if r["peak_cuda_mb"] is not None else r["peak_rss_mb"] for r in runs]
            rows[name] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "ratio_to_hand": statistics.median(ratios),  # paired: the same repetition
                "warmup_s": statistics.median(r["warmup_s"] for r in runs),
                "peak_mb": statistics.median(peak),
                "final_loss": runs[0]["final_loss"],
                "all_tokens_per_s": [r["tokens_per_s"] for r in runs],
                "all_peak_mb": peak,
            }
            if mode == "compile" and name in eager:
                rows[name]["compile_time_s"] = rows[name]["warmup_s"] - eager[name]
            row = rows[name]
            print(
                f"{mode:<8} {name:<7} {row['tokens_per_s']:>10.0f} {row['ratio_to_hand']:>7.3f} "
                f"{row['warmup_s']:>10.1f} {row['peak_mb']:>9.0f} {row['final_loss']:>11.5f}"
            )
        table["modes"][mode] = rows
    if "eager" in results:
        for mode in results:
            if mode != "eager":
                this, base = table["modes"][mode]["runner"], table["modes"]["eager"]["runner"]
                speed, memory = this["tokens_per_s"] / base["tokens_per_s"], this["peak_mb"] - base["peak_mb"]
                print(f"{mode} vs eager (runner): {speed:.2f}x tokens/s, peak memory {memory:+.0f} MiB")
    return table


if __name__ == "__main__":
    main()
