"""A cross-layer transcoder against per-layer transcoders of the same width: training speed and memory, and the
memory formula at GPT-2 small's and Llama-3-8B's sizes.

    python benchmarks/clt.py [--layers 6] [--d 128] [--n-latents 2048] [--k 32] [--batch 1024] [--steps 60]
                             [--threads 1] [--device cpu|cuda] [--json out.json]

Both contenders train on the same rows (Gaussian: the step's cost does not depend on what the rows hold) with fused
Adam, as runner's loop runs them (training_step, backward, step, after_optimizer_step): `clt` is
experiments.sae.coders.clt.CrossLayerTranscoder over `--layers` layers of `--d` wide MLP inputs and outputs, `per_layer`
is one TopK transcoder per layer (experiments.sae.coders.activations.TopKSAE with d_out), their losses summed. Each runs
in a fresh process: its median step time over the steps after the first 10, its parameters and what Adam keeps (fp32:
weights, gradients and two moments, 16 bytes a parameter), and its peak RSS (CPU) or peak allocated memory (CUDA).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_name, machine, synchronize, write_json  # noqa: E402


def parameters(layers: int, d_in: int, d_out: int, n: int, cross: bool) -> int:
    """Parameters of L coders of n latents: each an encoder (d_in x n + n) and decoders to its own layer (per-layer)
    or to its own and every later one (cross-layer: L (L + 1) / 2 blocks of n x d_out in all), with their biases."""
    blocks = layers * (layers + 1) // 2 if cross else layers
    return layers * (d_in * n + n) + blocks * (n * d_out + d_out)


def build(contender: str, args: argparse.Namespace) -> torch.nn.Module:
    """The contender's model on `args.device`."""
    from experiments.sae.coders.activations import TopKSAE
    from experiments.sae.coders.clt import CrossLayerTranscoder

    coder = functools.partial(TopKSAE, n_latents=args.n_latents, k=args.k, tied_init=False, encoder_init=0.5)
    if contender == "clt":
        return CrossLayerTranscoder(coder, layers=args.layers, d_in=args.d, d_out=args.d).to(args.device)
    return torch.nn.ModuleList(coder(d_in=args.d, d_out=args.d) for _ in range(args.layers)).to(args.device)


def step_fn(contender: str, model: torch.nn.Module, args: argparse.Namespace):
    """One training step's loss of a batch of rows [x_0 .. x_L-1 | y_0 .. y_L-1] (the CLT's layout)."""
    if contender == "clt":
        return lambda rows: model.training_step(rows)["loss"]
    d, layers = args.d, args.layers

    def loss(rows: torch.Tensor) -> torch.Tensor:
        # layer l's transcoder reads x_l and predicts y_l: its rows [x_l | y_l]
        parts = [
            torch.cat([rows[:, i * d : (i + 1) * d], rows[:, (layers + i) * d : (layers + i + 1) * d]], 1)
            for i in range(layers)
        ]
        return torch.stack([sae.training_step(p)["loss"] for sae, p in zip(model, parts, strict=True)]).sum()

    return loss


def run(contender: str, args: argparse.Namespace) -> dict:
    """Train `contender` for args.steps steps in this process; its figures."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = build(contender, args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    loss_of = step_fn(contender, model, args)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(args.batch, 2 * args.layers * args.d, generator=generator).to(args.device)
    parts = [model] if contender == "clt" else list(model)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = loss_of(rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for part in parts:
            part.after_optimizer_step()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
    steady = statistics.median(times[10:] or times)  # a short smoke run has no steady state to wait for
    params = sum(p.numel() for p in model.parameters())
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if args.device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {"step_ms": 1e3 * steady, "samples_per_s": args.batch / steady, "params": params, "peak_mb": peak}


def main() -> None:
    """Each contender in a fresh process, then the table and the formula's figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--n-latents", type=int, default=2048)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json")
    parser.add_argument("--contender", help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    if args.contender:
        print(json.dumps(run(args.contender, args)))
        return
    results = {}
    for contender in ("per_layer", "clt"):
        command = [sys.executable, __file__, *sys.argv[1:], "--contender", contender]
        results[contender] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    where = machine() if args.device == "cpu" else device_name(args.device)
    print(
        f"\n{where}, {args.device}, {args.threads} thread(s); {args.layers} layers, d {args.d}, "
        f"{args.n_latents} latents a layer, k {args.k}, batch {args.batch}\n"
    )
    print("| contender | parameters | weights + Adam MiB (16 B each) | peak MiB | ms a step | samples/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['params']:,} | {16 * r['params'] / 2**20:.0f} | {r['peak_mb']:.0f} | "
            f"{r['step_ms']:.1f} | {r['samples_per_s']:.0f} |"
        )
    ratio = results["per_layer"]["samples_per_s"] / results["clt"]["samples_per_s"]
    print(
        f"\nclt / per_layer: {results['clt']['params'] / results['per_layer']['params']:.2f}x the parameters, "
        f"{ratio:.2f}x the step time"
    )
    print("\nThe formula at the usual sizes (fp32 weights, gradients and Adam's two moments: 16 bytes a parameter):")
    print("| model | layers | d | latents a layer | per-layer transcoders GiB | CLT GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, layers, d, n in (("GPT-2 small", 12, 768, 24576), ("Llama-3-8B", 32, 4096, 131072)):
        sizes = [16 * parameters(layers, d, d, n, cross) / 2**30 for cross in (False, True)]
        print(f"| {name} | {layers} | {d} | {n:,} (32 x d) | {sizes[0]:,.0f} | {sizes[1]:,.0f} |")
    write_json(args.json, {"device": args.device, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
