"""SAE training throughput: runner's fit() against a minimal hand-written loop of the same SAE, in one process.

    python benchmarks/sae_throughput.py [--size preset|usual] [--device cpu|cuda] [--precision fp32|bf16]
                                        [--steps 60] [--reps 3] [--json out.json]

Sizes: `preset`, the default TopK SAE of +experiment=sae (d=256, 1024 latents, k=5, AuxK, batch 2048) on its synthetic
activations, generated batch by batch as the preset does (on the GPU when it trains there); `usual`, the field's usual
size (d=768, 24,576 latents, k=32, batch 4096) on Gaussian activations generated once (the step, not the data, is
measured). Both loops train with Adam and the same per-step schedule on the same batches, interleaved repetitions;
prints samples/s of each, the ratio, the MFU where the device's peak is known (encoder FLOPs: 6 x d x latents a
sample), peak GPU memory on CUDA, and the largest difference between the two final decoders (0 expected on the CPU:
the loops do the same arithmetic; on CUDA the atomic adds of the sparse decoder's backward may leave last-bit
differences). On CUDA both loops use fused Adam (runner's `optimizer.fused: null` picks it there) on pinned batches
copied without blocking, and the hand loop reads nothing from the GPU: the clock is read after
torch.cuda.synchronize() at the start and the end only. The SAE's step reads nothing from the GPU either (AuxK
masks the dead latents on the device). On the CPU, torch's default Adam in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import default_device, device_name, fused, mib, peak_gpu_mb, synchronize  # noqa: E402
from experiments.sae.data import SyntheticData, synthetic_splits  # noqa: E402
from experiments.sae.model import TopKSAE  # noqa: E402
from runner.data import DataModule, TensorData, to_device  # noqa: E402
from runner.dist.strategies import Single  # noqa: E402
from runner.loop import fit  # noqa: E402
from runner.meter import peak_flops  # noqa: E402
from runner.precision import FP32, Autocast  # noqa: E402
from runner.progress import TrainingProgress  # noqa: E402
from runner.run import Run, Settings, State  # noqa: E402
from runner.schedulers import wsd  # noqa: E402

SIZES = {  # name: (d_in, n_latents, k, batch)
    "preset": (256, 1024, 5, 2048),
    "usual": (768, 24576, 32, 4096),
}


def setup(size: str, steps: int, batch: int, device: str):
    d, n, k, _ = SIZES[size]
    torch.manual_seed(0)
    if size == "preset":
        splits = synthetic_splits(d=d, n_train=steps * batch, n_val=batch, seed=0)
    else:
        splits = {"train": TensorData(torch.randn(steps * batch, d, generator=torch.Generator().manual_seed(0)))}
    # the preset's data module: on a GPU its batches are generated there, as +experiment=sae does
    module = SyntheticData if size == "preset" else DataModule
    loader = module(splits, batch_size=batch, shuffle=False).train_loader(device=torch.device(device))
    torch.manual_seed(1)
    model = TopKSAE(d_in=d, n_latents=n, k=k, dead_window="10st").to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused(device))  # as runner's build makes it here
    progress = TrainingProgress(
        f"{steps}st",
        batch_size=batch,
        batches_per_epoch=len(loader),
        samples_per_epoch=loader.batch_sampler.samples_per_epoch,
    )
    return model, opt, loader, progress


def _precision(name: str, device: str) -> FP32:
    return FP32(device) if name == "fp32" else Autocast(name, device)


def _start(device: str) -> float:
    # Each loop's own peak memory, and a clock that starts when the GPU has finished the set-up
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    return time.perf_counter()


def _stop(device: str, start: float, samples: int) -> dict[str, float | None]:
    synchronize(device)
    return {"samples_per_s": samples / (time.perf_counter() - start), "peak_gpu_mb": peak_gpu_mb(device)}


def hand_written(size: str, steps: int, batch: int, device: str, precision: str) -> tuple[dict, torch.Tensor]:
    """The loop by hand: no read from the device in it (the model's own aside)."""
    model, opt, loader, progress = setup(size, steps, batch, device)
    sched = wsd(optimizer=opt, progress=progress).scheduler
    autocast = _precision(precision, device).autocast
    start = _start(device)
    for x in loader:
        with autocast():
            loss = model.training_step(to_device(x, torch.device(device)))["loss"]
        loss.backward()
        opt.step()
        model.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return _stop(device, start, steps * batch), model.W_dec.detach().cpu().clone()


def runner_fit(size: str, steps: int, batch: int, device: str, precision: str) -> tuple[dict, torch.Tensor]:
    """runner's fit() on a Run built by hand with the same model, optimizer, schedule and loader."""
    model, opt, loader, progress = setup(size, steps, batch, device)
    run = Run(
        task=model,
        optimizer=opt,
        schedule=wsd(optimizer=opt, progress=progress),
        precision=_precision(precision, device),
        strategy=Single(device),
        train_loader=loader,
        val_loader=None,
        settings=Settings(val_interval=progress.resolve("1ep"), log_interval=progress.resolve("50st")),
        state=State(progress),
    )
    start = _start(device)
    fit(run)
    return _stop(device, start, steps * batch), model.W_dec.detach().cpu().clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="preset")
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=None, help="default: the size's")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = args.device
    batch = args.batch or SIZES[args.size][3]
    torch.set_flush_denormal(True)
    rates: dict[str, list[float]] = {"hand": [], "runner": []}
    peaks: dict[str, list[float]] = {"hand": [], "runner": []}
    diffs = []
    loops = [("hand", hand_written), ("runner", runner_fit)]
    for rep in range(args.reps):
        decoders = {}
        for name, fn in loops if rep % 2 == 0 else loops[::-1]:  # alternate who goes first
            figures, decoders[name] = fn(args.size, args.steps, batch, device, args.precision)
            rates[name].append(figures["samples_per_s"])
            if figures["peak_gpu_mb"] is not None:
                peaks[name].append(figures["peak_gpu_mb"])
        diffs.append((decoders["hand"] - decoders["runner"]).abs().max().item())
    hand, ours = statistics.median(rates["hand"]), statistics.median(rates["runner"])
    d, n, k, _ = SIZES[args.size]
    peak = peak_flops(torch.device(device), args.precision)
    mfu = {name: statistics.median(r) * 6 * d * n / peak for name, r in rates.items()} if peak else None
    gpu = {name: max(p) if p else None for name, p in peaks.items()}
    cuda = torch.device(device).type == "cuda"
    where = device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    result = {
        "size": args.size,
        "shape": {"d_in": d, "n_latents": n, "k": k, "batch": batch},
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "steps": args.steps,
        "batch": batch,
        "reps": args.reps,
        "hand_samples_per_s": hand,
        "runner_samples_per_s": ours,
        "ratio": ours / hand,
        "mfu": mfu,
        "peak_gpu_mb": gpu,
        "max_decoder_diff": max(diffs),
        "hand_all": rates["hand"],
        "runner_all": rates["runner"],
    }
    print(f"{where}; {args.precision}; d={d} latents={n} k={k} batch={batch}; {args.steps} steps x {args.reps} reps")
    print(f"{'loop':<8} {'samples/s (median)':>19} {'min':>9} {'max':>9} {'MFU':>7} {'GPU MiB':>8}")
    for name in ("hand", "runner"):
        share = f"{mfu[name]:.3f}" if mfu else "-"
        row = f"{statistics.median(rates[name]):>19.0f} {min(rates[name]):>9.0f} {max(rates[name]):>9.0f}"
        print(f"{name:<8} {row} {share:>7} {mib(gpu[name]):>8}")
    print(f"runner / hand = {ours / hand:.3f}   max |decoder difference| = {max(diffs):.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
