"""SAE training throughput: runner's fit() against a minimal hand-written loop of the same SAE, in one process.

    python benchmarks/sae_throughput.py [--size preset|usual] [--model topk|batchtopk|matryoshka] [--device cpu|cuda]
                                        [--precision fp32|bf16] [--backward dense sparse triton] [--steps 60] [--reps 3]
                                        [--json out.json]

Sizes: `preset`, the default TopK SAE of +experiment=sae (d=256, 1024 latents, k=5, AuxK, batch 2048) on its synthetic
activations, generated batch by batch as the preset does (on the GPU when it trains there); `usual`, the field's usual
size (d=768, 24,576 latents, k=32, batch 4096) on Gaussian activations generated once (the step, not the data, is
measured). `--model` trains the TopK SAE (default), BatchTopK or Matryoshka (BatchTopK codes) at that size. Both
loops train with Adam and the same per-step schedule on the same batches, interleaved repetitions;
prints samples/s of each, the ratio, the MFU where the device's peak is known (encoder FLOPs: 6 x d x latents a
sample), peak GPU memory on CUDA, and the largest difference between the two final decoders (0 expected on the CPU:
the loops do the same arithmetic; on CUDA the atomic adds of the sparse decoder's backward may leave last-bit
differences). On CUDA both loops use fused Adam (runner's `optimizer.fused: null` picks it there) on pinned batches
copied without blocking, and the hand loop reads nothing from the GPU: the clock is read after
torch.cuda.synchronize() at the start and the end only. The SAE's step reads nothing from the GPU either (AuxK
masks the dead latents on the device). On the CPU, torch's default Adam in both.

`--backward`: the SAE's encoder backward, autograd's dense one (`model.sparse_backward=false`) and the one restricted to
the picked latents (`true`, experiments/sae/coders/sparse.py) with the torch kernels (`model.kernels=torch`), and
`triton`, the same with the Triton kernels (experiments/sae/coders/kernels.py: CUDA, or the CPU under
TRITON_INTERPRET=1); each is run by both loops, all contenders interleaved in one process (the order rotates each
repetition), so the table gives runner / hand for each backward and each / dense for each loop, as medians of the
per-repetition ratios with their min and max. The top-level figures of `--json` (hand_samples_per_s,
runner_samples_per_s, ratio) are the first backward's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks.common import default_device, device_name, fused, mib, peak_gpu_mb, synchronize  # noqa: E402
from experiments.sae.coders.activations import BatchTopKSAE, TopKSAE  # noqa: E402
from experiments.sae.coders.matryoshka import MatryoshkaSAE  # noqa: E402
from experiments.sae.sources.synthetic import SyntheticData, synthetic_splits  # noqa: E402
from runner.data import DataModule, TensorData, to_device  # noqa: E402
from runner.distributed.strategies import Single  # noqa: E402
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


LOG_EVERY = 50  # runner's log rows, and the hand loop's one read of the device, every this many steps
MODELS = {"topk": TopKSAE, "batchtopk": BatchTopKSAE, "matryoshka": MatryoshkaSAE}  # --model


def setup(size: str, model: str, steps: int, batch: int, device: str, backward: str):
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
    kernels = "triton" if backward == "triton" else "torch"  # triton: the sparse backward by its kernels
    model = MODELS[model](
        d_in=d, n_latents=n, k=k, dead_window="10st", sparse_backward=backward != "dense", kernels=kernels
    ).to(device)
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
        gc.collect()  # the last contender's SAE and optimizer may sit in reference cycles (its decoder's hook)
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    return time.perf_counter()


def _stop(device: str, start: float, samples: int) -> dict[str, float | None]:
    synchronize(device)
    return {"samples_per_s": samples / (time.perf_counter() - start), "peak_gpu_mb": peak_gpu_mb(device)}


def hand_written(
    size: str, model: str, steps: int, batch: int, device: str, precision: str, backward: str
) -> tuple[dict, Tensor]:
    """The loop by hand: no read from the device in it (the model's own aside) but one every LOG_EVERY steps, where it
    tells the SAE whether latents died since the last, as runner's log rows do (on CUDA AuxK runs from then on only:
    without it the hand loop would skip AuxK's work there and train another SAE)."""
    model, opt, loader, progress = setup(size, model, steps, batch, device, backward)
    sched = wsd(optimizer=opt, progress=progress).scheduler
    autocast = _precision(precision, device).autocast
    dead = torch.zeros((), device=device)  # the window's dead fractions, summed on the device
    start = _start(device)
    for step, x in enumerate(loader, 1):
        with autocast():
            out = model.training_step(to_device(x, torch.device(device)))
        out["loss"].backward()
        opt.step()
        model.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        dead += out["silent_fraction"]
        if step % LOG_EVERY == 0:
            model.logged({"train/silent_fraction": float(dead)})
            dead.zero_()
    return _stop(device, start, steps * batch), model.W_dec.detach().cpu().clone()


def runner_fit(
    size: str, model: str, steps: int, batch: int, device: str, precision: str, backward: str
) -> tuple[dict, Tensor]:
    """runner's fit() on a Run built by hand with the same model, optimizer, schedule and loader."""
    model, opt, loader, progress = setup(size, model, steps, batch, device, backward)
    run = Run(
        task=model,
        optimizer=opt,
        schedule=wsd(optimizer=opt, progress=progress),
        precision=_precision(precision, device),
        strategy=Single(device),
        train_loader=loader,
        val_loader=None,
        settings=Settings(val_interval=progress.resolve("1ep"), log_interval=progress.resolve(f"{LOG_EVERY}st")),
        state=State(progress),
    )
    start = _start(device)
    fit(run)
    return _stop(device, start, steps * batch), model.W_dec.detach().cpu().clone()


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="preset")
    parser.add_argument("--model", choices=list(MODELS), default="topk", help="the SAE (k, latents: the size's)")
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    backwards = ["dense", "sparse", "triton"]  # triton: the sparse one by experiments/sae/coders/kernels.py (CUDA)
    parser.add_argument("--backward", nargs="+", choices=backwards, default=["dense", "sparse"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=None, help="default: the size's")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = args.device
    batch = args.batch or SIZES[args.size][3]
    torch.set_flush_denormal(True)
    contenders = [(loop, bwd) for bwd in args.backward for loop in ("hand", "runner")]
    rates: dict[tuple[str, str], list[float]] = {c: [] for c in contenders}
    peaks: dict[tuple[str, str], list[float]] = {c: [] for c in contenders}
    diffs: dict[str, list[float]] = {bwd: [] for bwd in args.backward}
    loops = {"hand": hand_written, "runner": runner_fit}
    for rep in range(args.reps):
        decoders = {}
        shift = rep % len(contenders)
        for loop, bwd in contenders[shift:] + contenders[:shift]:  # rotate who goes first
            fn = loops[loop]
            figures, decoders[loop, bwd] = fn(args.size, args.model, args.steps, batch, device, args.precision, bwd)
            rates[loop, bwd].append(figures["samples_per_s"])
            if figures["peak_gpu_mb"] is not None:
                peaks[loop, bwd].append(figures["peak_gpu_mb"])
        for bwd in args.backward:
            diffs[bwd].append((decoders["hand", bwd] - decoders["runner", bwd]).abs().max().item())
    d, n, k, _ = SIZES[args.size]
    peak = peak_flops(torch.device(device), args.precision)
    median = {c: statistics.median(r) for c, r in rates.items()}
    mfu = {c: m * 6 * d * n / peak for c, m in median.items()} if peak else None
    gpu = {c: max(p) if p else None for c, p in peaks.items()}
    backwards = {}
    for bwd in args.backward:
        paired = [r / h for r, h in zip(rates["runner", bwd], rates["hand", bwd], strict=True)]
        backwards[bwd] = {
            "hand_samples_per_s": median["hand", bwd],
            "runner_samples_per_s": median["runner", bwd],
            "ratio": _spread(paired),  # runner / hand, per repetition
            "mfu": {loop: mfu[loop, bwd] for loop in loops} if mfu else None,
            "peak_gpu_mb": {loop: gpu[loop, bwd] for loop in loops},
            "max_decoder_diff": max(diffs[bwd]),
            "hand_all": rates["hand", bwd],
            "runner_all": rates["runner", bwd],
        }
    faster = {}
    for bwd in (b for b in args.backward if b != "dense" and "dense" in args.backward):  # each / dense, per rep
        faster[bwd] = {
            loop: _spread([s / d for s, d in zip(rates[loop, bwd], rates[loop, "dense"], strict=True)])
            for loop in loops
        }
    first = backwards[args.backward[0]]
    cuda = torch.device(device).type == "cuda"
    where = device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    result = {
        "size": args.size,
        "model": args.model,
        "shape": {"d_in": d, "n_latents": n, "k": k, "batch": batch},
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "steps": args.steps,
        "batch": batch,
        "reps": args.reps,
        "hand_samples_per_s": first["hand_samples_per_s"],
        "runner_samples_per_s": first["runner_samples_per_s"],
        "ratio": first["ratio"]["median"],
        "mfu": first["mfu"],
        "max_decoder_diff": max(b["max_decoder_diff"] for b in backwards.values()),
        "backward": backwards,
        "over_dense": faster,
    }
    shape = f"d={d} latents={n} k={k} batch={batch}"
    print(f"{where}; {args.model}, {args.precision}; {shape}; {args.steps} steps x {args.reps} reps")
    print(f"{'loop':<8} {'backward':<9} {'samples/s (median)':>19} {'min':>9} {'max':>9} {'MFU':>7} {'GPU MiB':>8}")
    for loop, bwd in contenders:
        share = f"{mfu[loop, bwd]:.3f}" if mfu else "-"
        row = f"{median[loop, bwd]:>19.0f} {min(rates[loop, bwd]):>9.0f} {max(rates[loop, bwd]):>9.0f}"
        print(f"{loop:<8} {bwd:<9} {row} {share:>7} {mib(gpu[loop, bwd]):>8}")
    for bwd, figures in backwards.items():
        r = figures["ratio"]
        print(
            f"{bwd}: runner / hand = {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})   "
            f"max |decoder difference| = {figures['max_decoder_diff']:.2e}"
        )
    for bwd, per_loop in faster.items():
        for loop, r in per_loop.items():
            print(f"{loop}: {bwd} / dense backward = {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
