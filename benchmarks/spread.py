"""A family of SAEs spread over ranks (distributed=spread) against the same family replicated (distributed=ddp): the
SAE state each rank holds and the throughput, on 1, 2 and 4 gloo ranks; and the plan for a model that no CPU holds.

    python benchmarks/spread.py [--ranks 1 2 4] [--steps 30] [--device cpu|cuda] [--json out.json] [override ...]
    python benchmarks/spread.py --plan          # the memory and communication formula, Llama-3-8B on 8 x 80 GB

The family is +experiment=sae's synthetic activations (d 256, 1024 true features) with model=sae_multi and four TopK
SAEs of 4096 latents (ks 8, 16, 32, 64: equal sizes, one per rank on 4 ranks), batch 512 per rank. Each rank measures
the SAE state it holds (weights, gradients and Adam's moments: the tensors that are not meta placeholders) just
before an optimizer step, and its peak RSS; the run's steady samples/s comes from its summary.json. Every launch is a
whole torchrun job; ranks beyond the machine's cores share them (the figures say how many cores there were).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAMILY = [
    "+experiment=sae",
    "model=sae_multi",
    "model.ks=[8,16,32,64]",
    "model.base.n_latents=4096",
    "data.splits.d=256",
    "data.splits.n_features=1024",
    "data.splits.n_val=0",
    "callbacks=none",
    "checkpoint=none",
    "logger=none",
    "data.batch_size=512",
    "trainer.log_interval=10st",
]


def worker(out: Path, steps: int, overrides: list[str]) -> None:
    """One rank of a torchrun job: train the family, write this rank's figures to out/rank-R.json."""
    import torch
    from hydra import compose, initialize_config_module

    from runner.config import resolvers
    from runner.run import Callback
    from runner.train import train

    class Held(Callback):
        def __init__(self) -> None:
            self.bytes = 0

        def on_before_optimizer_step(self, run) -> None:
            tensors = [p for p in run.task.parameters() if not p.is_meta]
            tensors += [p.grad for p in tensors if p.grad is not None]
            tensors += [v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self.bytes = max(self.bytes, sum(t.numel() * t.element_size() for t in tensors if not t.is_meta))

    resolvers.register()
    with initialize_config_module("runner.conf", version_base="1.3"):
        cfg = compose("config", overrides=[*FAMILY, f"trainer.max_duration={steps}st", *overrides])
    cfg.run_dir = str(out / "run")
    held = Held()
    run = train(cfg, extra_callbacks=[held])
    rank = run.strategy.rank if hasattr(run.strategy, "rank") else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    figures = {"sae_state_mb": held.bytes / 2**20, "peak_rss_mb": rss}
    (out / f"rank-{rank}.json").write_text(json.dumps(figures))


def launch(ranks: int, strategy: str, steps: int, overrides: list[str]) -> dict:
    """A torchrun job of `ranks` processes under `strategy`: every rank's figures and the run's samples/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        command += [__file__, "--worker", str(out), "--steps", str(steps), f"distributed={strategy}", *overrides]
        env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{strategy} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
        per_rank = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]
        steady = json.loads((out / "run" / "summary.json").read_text())["steady"]
    return {
        "ranks": ranks,
        "strategy": strategy,
        "sae_state_mb": max(r["sae_state_mb"] for r in per_rank),  # the most any rank holds
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
        "samples_per_s": steady["samples_per_s"],
    }


def plan(
    d_model: int = 4096,
    layers: int = 32,
    latents: int = 65_536,
    gpus: int = 8,
    tokens_per_gpu: int = 4096,
    source_params: float = 8.03e9,
    peak_flops: float = 989e12,
    link_bytes_per_s: float = 450e9,
) -> dict[str, float]:
    """The memory and communication of TopK SAEs on every layer of a model, spread over `gpus` (the defaults:
    Llama-3-8B, 65,536 latents, 8 x H100 SXM with NVLink 4: 989 TFLOP/s dense bf16, 450 GB/s each way per GPU)."""
    per_sae = 2 * d_model * latents + latents + d_model  # W_enc, W_dec, b_enc, b_dec
    state = 4 * per_sae * 4  # fp32 weights, gradients and Adam's two moments
    rows = tokens_per_gpu * gpus  # each SAE trains on every rank's rows: the global batch
    sent = tokens_per_gpu * d_model * layers * (gpus - 1) / gpus * 2  # bf16 rows to the other ranks' SAEs
    # a step per SAE: encoder forward and its two backward products, dense (2 x rows x d x n each); the decoder's
    # are sparse (k of n latents) and left out
    sae_flops = 3 * 2 * rows * d_model * latents * layers / gpus
    source_flops = 2 * source_params * tokens_per_gpu  # the frozen source's forward on this rank's own tokens
    return {
        "sae_params_m": per_sae / 1e6,
        "family_state_gb": state * layers / 1e9,
        "state_per_gpu_gb": state * layers / gpus / 1e9,
        "source_replicated_gb": source_params * 2 / 1e9,
        "source_sharded_gb": source_params * 2 / gpus / 1e9,
        "all_to_all_gb_per_step": sent / 1e9,
        "all_to_all_ms": sent / link_bytes_per_s * 1e3,
        "compute_ms": (sae_flops + source_flops) / peak_flops * 1e3,
        "tokens_per_s_bound": rows / ((sae_flops + source_flops) / peak_flops),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plan", action="store_true", help="print the Llama-3-8B plan and stop")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.worker:
        return worker(args.worker, args.steps, overrides)
    if args.plan:
        for key, value in plan().items():
            print(f"{key:24s} {value:,.1f}")
        return
    from benchmarks.common import machine

    print(f"{machine()}; 4 TopK SAEs 256 -> 4096, batch 512 per rank, on {args.device}")
    rows = []
    for ranks in args.ranks:
        for strategy in ("ddp", "spread"):
            rows.append(launch(ranks, strategy, args.steps, [f"distributed.device={args.device}", *overrides]))
            print(json.dumps(rows[-1]), flush=True)
    one = next(r for r in rows if r["ranks"] == min(args.ranks) and r["strategy"] == "ddp")
    print(
        "| ranks | strategy | SAE state per rank, MB | vs replicated | peak RSS per rank, MB | samples/s | "
        f"vs {one['ranks']} rank(s), ddp |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        replicated = next(x for x in rows if x["ranks"] == r["ranks"] and x["strategy"] == "ddp")
        print(
            f"| {r['ranks']} | {r['strategy']} | {r['sae_state_mb']:.1f} | "
            f"{r['sae_state_mb'] / replicated['sae_state_mb']:.3f} | {r['peak_rss_mb']:.0f} | "
            f"{r['samples_per_s']:,.0f} | {r['samples_per_s'] / one['samples_per_s']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
