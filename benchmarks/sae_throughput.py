"""SAE training throughput: runner's fit() against a minimal hand-written loop of the same SAE, in one process.

    python benchmarks/sae_throughput.py [--steps 60] [--reps 3] [--json out.json]

Both train the default TopK SAE (d=256, 1024 latents, k=5, AuxK) with Adam and the same per-step schedule on the
same synthetic activation batches, interleaved repetitions; prints samples/s of each, the ratio, and the largest
difference between the two final decoders (0 expected: the loops do the same arithmetic).
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

from benchmarks.common import cpu_run  # noqa: E402
from experiments.sae.data import synthetic_splits  # noqa: E402
from experiments.sae.model import TopKSAE  # noqa: E402
from runner.data import DataModule  # noqa: E402
from runner.loop import fit  # noqa: E402
from runner.progress import TrainingProgress  # noqa: E402
from runner.schedulers import wsd  # noqa: E402


def setup(steps: int, batch: int):
    torch.manual_seed(0)
    data = DataModule(synthetic_splits(n_train=steps * batch, n_val=batch, seed=0), batch_size=batch, shuffle=False)
    loader = data.train_loader()
    torch.manual_seed(1)
    model = TopKSAE(d_in=256, n_latents=1024, k=5, dead_window="10st")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    progress = TrainingProgress(
        f"{steps}st",
        batch_size=batch,
        batches_per_epoch=len(loader),
        samples_per_epoch=loader.batch_sampler.samples_per_epoch,
    )
    return model, opt, loader, progress


def hand_written(steps: int, batch: int) -> tuple[float, torch.Tensor]:
    model, opt, loader, progress = setup(steps, batch)
    sched = wsd(optimizer=opt, progress=progress).scheduler
    start = time.perf_counter()
    for x in loader:
        loss = model.training_step(x)["loss"]
        loss.backward()
        opt.step()
        model.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return steps * batch / (time.perf_counter() - start), model.W_dec.detach().clone()


def runner_fit(steps: int, batch: int) -> tuple[float, torch.Tensor]:
    model, opt, loader, progress = setup(steps, batch)
    run = cpu_run(model, opt, loader, progress, wsd(optimizer=opt, progress=progress), "50st")
    start = time.perf_counter()
    fit(run)
    return steps * batch / (time.perf_counter() - start), model.W_dec.detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    rates: dict[str, list[float]] = {"hand": [], "runner": []}
    diffs = []
    loops = [("hand", hand_written), ("runner", runner_fit)]
    for rep in range(args.reps):
        decoders = {}
        for name, fn in loops if rep % 2 == 0 else loops[::-1]:  # alternate who goes first
            rate, decoders[name] = fn(args.steps, args.batch)
            rates[name].append(rate)
        diffs.append((decoders["hand"] - decoders["runner"]).abs().max().item())
    hand, ours = statistics.median(rates["hand"]), statistics.median(rates["runner"])
    result = {
        "steps": args.steps,
        "batch": args.batch,
        "reps": args.reps,
        "hand_samples_per_s": hand,
        "runner_samples_per_s": ours,
        "ratio": ours / hand,
        "max_decoder_diff": max(diffs),
        "hand_all": rates["hand"],
        "runner_all": rates["runner"],
    }
    print(f"{'loop':<8} {'samples/s (median)':>19} {'min':>9} {'max':>9}")
    for name in ("hand", "runner"):
        print(f"{name:<8} {statistics.median(rates[name]):>19.0f} {min(rates[name]):>9.0f} {max(rates[name]):>9.0f}")
    print(f"runner / hand = {ours / hand:.3f}   max |decoder difference| = {max(diffs):.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
