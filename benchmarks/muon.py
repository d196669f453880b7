"""Muon's step on an SAE's two matrices, with its Newton-Schulz iteration in bfloat16, in float32 and as
`optimizer.ns_dtype: null` picks for the device, against Adam's step on the same tensors.

    python benchmarks/muon.py [--d 256] [--n-latents 2048] [--steps 10] [--reps 5] [--device cpu|cuda] [--json out.json]

A CPU without AVX-512 BF16 or AMX emulates bfloat16 matrix products (oneDNN says which:
runner.optimizers.cpu_multiplies_bf16); one with them is made to by ONEDNN_MAX_CPU_ISA=AVX2, which this machine's
figures for such a CPU use. The contenders run interleaved (the order rotates each repetition) on one thread;
milliseconds a step are medians over the repetitions, each a mean over --steps steps, with the ratio to Adam's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import cpu_model, default_device, device_name, synchronize, write_json  # noqa: E402
from runner.optimizers import Muon, cpu_multiplies_bf16  # noqa: E402

CONTENDERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "muon bfloat16": lambda p: Muon(p, lr=2e-3, ns_dtype="bfloat16"),
    "muon float32": lambda p: Muon(p, lr=2e-3, ns_dtype="float32"),
    "muon (ns_dtype null)": lambda p: Muon(p, lr=2e-3),
}


def step_ms(optimizer: torch.optim.Optimizer, steps: int, device: str) -> float:
    """Mean milliseconds of one optimizer step over `steps`."""
    optimizer.step()  # the first builds the state
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=256, help="the activations' width")
    parser.add_argument("--n-latents", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [(args.n_latents, args.d), (args.d, args.n_latents)]  # the encoder's and the decoder's matrices
    optimizers = {}
    for name, make in CONTENDERS.items():
        params = [torch.zeros(s, device=args.device, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(args.device)
        optimizers[name] = make(params)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    names = list(CONTENDERS)
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            times[name].append(step_ms(optimizers[name], args.steps, args.device))
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = {name: {"ms_per_step": ms, "vs_adam": ms / medians["adam"]} for name, ms in medians.items()}
    cpu = args.device == "cpu"
    where = f"{device_name(args.device)}" + (f", {cpu_model()}, bf16 native: {cpu_multiplies_bf16()}" if cpu else "")
    print(f"Muon and Adam steps on {shapes[0]} + {shapes[1]} ({where}; {args.reps} reps of {args.steps} steps)")
    print(f"{'contender':<22} {'ms/step':>9} {'vs adam':>8}")
    for name, row in rows.items():
        print(f"{name:<22} {row['ms_per_step']:9.2f} {row['vs_adam']:7.2f}x")
    write_json(
        args.json,
        {
            "device": device_name(args.device),
            "cpu": cpu_model() if cpu else None,
            "bf16_native": cpu_multiplies_bf16() if cpu else True,
            "shapes": shapes,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
