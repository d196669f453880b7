"""A TopK SAE's training step, side by side in one process: runner's SAE with its torch kernels and with its Triton
kernels (experiments/sae/coders/kernels.py), and sparsify's SparseCoder stepped as its Trainer steps it.

    python benchmarks/sae_kernels.py [--device cuda] [--precision bf16|fp32] [--d 768] [--n-latents 24576] [--k 32]
                                     [--batch 4096] [--steps 20] [--reps 5] [--json F]

Run it with the sparsify virtualenv's python (`.venv-sparsify/bin/python`, the repository on PYTHONPATH) to have
sparsify beside runner; elsewhere its row is left out. Every contender steps the same Gaussian rows with Adam
(runner fused, as its build makes it; sparsify's `optimizer=adam`: torch's Adam, foreach), no AuxK (nothing dies in
a few steps), and its own arithmetic:
- runner: `training_step` (normalised inputs, its loss), backward, Adam, `after_optimizer_step` (unit decoder rows,
  the dead-latent counters), under torch.autocast(bf16) for bf16. runner's loop around this step costs nothing
  measurable on top (sae_throughput.py: runner against a hand loop).
- sparsify: what `Trainer.fit` does per batch: the forward with its dead mask (whose `int(dead_mask.sum())` reads
  the device), fvu backward, the fired mask, the `float(fvu)` its log sums read every step, the parallel gradient
  removed, Adam, unit decoder rows. Its forward is always under bf16 autocast on CUDA (a decorator on
  `SparseCoder.forward`), also when `--precision fp32`: what could not be made equal.
Each repetition times `--steps` steps of every contender (the order rotating), after warm-up steps, with the device
synchronised at both ends; the table gives medians, the spread, runner / sparsify per repetition, and each one's peak
device memory over its steps (weights, Adam state and the step's tensors).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import default_device, device_name, fused, mib, peak_gpu_mb, synchronize, write_json  # noqa: E402
from experiments.sae.coders.activations import TopKSAE  # noqa: E402
from experiments.sae.coders.kernels import use_triton  # noqa: E402

Step = Callable[[torch.Tensor], None]


def runner_step(kernels: str, args: argparse.Namespace, device: torch.device) -> Step:
    """One training step of runner's TopK SAE with the `kernels` given."""
    torch.manual_seed(0)
    sae = TopKSAE(d_in=args.d, n_latents=args.n_latents, k=args.k, kernels=kernels).to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4, fused=fused(device))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def step(x: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision == "bf16"):
            out = sae.training_step(x)
        out["loss"].backward()
        opt.step()
        sae.after_optimizer_step()
        opt.zero_grad(set_to_none=True)

    return step


def sparsify_step(args: argparse.Namespace, device: torch.device) -> Step:
    """One step of sparsify's Trainer (optimizer=adam, auxk on), on its SparseCoder."""
    from sparsify import SparseCoder, SparseCoderConfig

    torch.manual_seed(0)
    sae = SparseCoder(args.d, SparseCoderConfig(num_latents=args.n_latents, k=args.k), device=device)
    opt = torch.optim.Adam(sae.parameters(), lr=2e-4 / (args.n_latents / 2**14) ** 0.5)
    since_fired = torch.zeros(args.n_latents, dtype=torch.long, device=device)
    fvu_sum = 0.0

    def step(x: torch.Tensor) -> None:
        nonlocal fvu_sum
        dead_mask = since_fired > 10_000_000
        out = sae(x, dead_mask=dead_mask)
        (out.fvu + out.auxk_loss / 32).backward()
        did_fire = torch.zeros(args.n_latents, dtype=torch.bool, device=device)
        did_fire[out.latent_indices.flatten()] = True
        fvu_sum += float(out.fvu.detach())
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
        sae.set_decoder_norm_to_unit_norm()
        since_fired.add_(x.shape[0]).masked_fill_(did_fire, 0)

    return step


def timed(step: Step, batches: list[torch.Tensor], steps: int, device: torch.device) -> dict[str, float | None]:
    """samples/s over `steps` steps and the peak device memory over them."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"samples_per_s": steps * batches[0].shape[0] / seconds, "peak_mb": peak_gpu_mb(device)}


def main() -> None:
    """Build the contenders, time them interleaved, print the table; --json writes it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--n-latents", type=int, default=24576)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(args.batch, args.d, generator=gen).to(device) for _ in range(4)]
    contenders = {"runner torch": runner_step("torch", args, device)}
    if use_triton("triton", device):
        contenders["runner triton"] = runner_step("triton", args, device)
    have_sparsify = importlib.util.find_spec("sparsify") is not None
    if have_sparsify:
        contenders["sparsify"] = sparsify_step(args, device)
    names = list(contenders)
    for name in names:  # warm-up: the first batch initialises runner's SAE; kernels compile; autotuners settle
        for i in range(args.warmup):
            contenders[name](batches[i % len(batches)])
    rates: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            figures = timed(contenders[name], batches, args.steps, device)
            rates[name].append(figures["samples_per_s"])
            if figures["peak_mb"] is not None:
                peaks[name].append(figures["peak_mb"])
    rows = {}
    for name in names:
        row = {
            "samples_per_s": statistics.median(rates[name]),
            "min": min(rates[name]),
            "max": max(rates[name]),
            "peak_mb": max(peaks[name]) if peaks[name] else None,
            "all": rates[name],
        }
        if have_sparsify and name != "sparsify":
            paired = [a / b for a, b in zip(rates[name], rates["sparsify"], strict=True)]
            row["over_sparsify"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}
            if row["peak_mb"] is not None and peaks["sparsify"]:
                row["memory_over_sparsify"] = row["peak_mb"] / max(peaks["sparsify"])
        rows[name] = row
    shape = f"d={args.d} latents={args.n_latents} k={args.k} batch={args.batch}"
    print(f"{device_name(device)}; {args.precision}; {shape}; {args.steps} steps x {args.reps} reps")
    print(f"{'contender':<14} {'samples/s':>11} {'min':>11} {'max':>11} {'peak MiB':>9} {'/ sparsify (min-max)':>22}")
    for name, row in rows.items():
        ratio = row.get("over_sparsify")
        versus = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"
        line = f"{row['samples_per_s']:>11.0f} {row['min']:>11.0f} {row['max']:>11.0f} {mib(row['peak_mb']):>9}"
        print(f"{name:<14} {line} {versus:>22}")
    if not have_sparsify:
        print("sparsify: not importable here (run with .venv-sparsify/bin/python for its row)")
    write_json(args.json, {"device": device_name(device), "precision": args.precision, "shape": shape,
                           "steps": args.steps, "reps": args.reps, "contenders": rows})  # fmt: skip


if __name__ == "__main__":
    main()
