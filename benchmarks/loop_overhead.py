"""Per-step time of runner's fit() against a minimal hand-written loop on the same model, data and optimizer.

    python benchmarks/loop_overhead.py [--steps 2000] [--reps 5] [--json out.json]

Both loops use one thread, the same init, the same DataLoader, AdamW, a per-step LambdaLR and clipping at 1.0; the
repetitions are interleaved so that machine noise hits both alike. Prints the median per-step time, the spread
and the ratio runner / hand-written, and the largest difference between the two loops' final weights (0 expected).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from runner.data import DataModule, TensorData
from runner.distributed import Single
from runner.loop import Run, fit
from runner.precision import FP32
from runner.progress import TrainingProgress
from runner.schedulers import constant

SIZES = {"tiny": ([32, 64, 10], 32), "mlp": ([256, 1024, 1024, 10], 256)}


class MLP(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def training_step(self, batch):
        x, y = batch
        return {"loss": nn.functional.cross_entropy(self.net(x), y)}


def setup(size: str, steps: int):
    widths, batch = SIZES[size]
    torch.manual_seed(0)
    n = batch * 64
    data = {"train": TensorData(torch.randn(n, widths[0]), torch.randint(0, widths[-1], (n,)))}
    loader = DataModule(data, batch_size=batch, seed=0).train_loader()
    torch.manual_seed(1)
    model = MLP(widths)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = TrainingProgress(f"{steps}st", batch_size=batch, batches_per_epoch=len(loader),
                                samples_per_epoch=len(loader.sampler))
    return model, opt, loader, progress


def hand_written(size: str, steps: int) -> tuple[float, torch.Tensor]:
    model, opt, loader, _ = setup(size, steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    step, epoch, start = 0, 0, time.perf_counter()
    while step < steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = model.training_step(batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    return (time.perf_counter() - start) / steps, _flat(model)


def runner_fit(size: str, steps: int) -> tuple[float, torch.Tensor]:
    model, opt, loader, progress = setup(size, steps)
    run = Run(task=model, optimizer=opt, schedule=constant(optimizer=opt, progress=progress), progress=progress,
              precision=FP32(), train_loader=loader, val_loader=None, device=torch.device("cpu"),
              val_interval=progress.resolve("1ep"), log_interval=progress.resolve(f"{steps}st"),
              gradient_clip_val=1.0, distributed=Single("cpu"))
    start = time.perf_counter()
    fit(run)
    return (time.perf_counter() - start) / steps, _flat(model)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "mlp"])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for size in args.sizes:
        steps = args.steps if size == "tiny" else max(50, args.steps // 10)
        times = {"hand": [], "runner": []}
        for _ in range(args.reps):
            weights = {}
            for name, fn in (("hand", hand_written), ("runner", runner_fit)):
                per_step, weights[name] = fn(size, steps)
                times[name].append(per_step)
            max_diff = (weights["hand"] - weights["runner"]).abs().max().item()
        hand, ours = statistics.median(times["hand"]), statistics.median(times["runner"])
        results[size] = {"steps": steps, "hand_us": hand * 1e6, "runner_us": ours * 1e6, "ratio": ours / hand,
                         "hand_spread_us": (max(times["hand"]) - min(times["hand"])) * 1e6,
                         "runner_spread_us": (max(times["runner"]) - min(times["runner"])) * 1e6,
                         "max_weight_diff": max_diff}
    print(f"{'model':<6} {'steps':>6} {'hand us/step':>13} {'runner us/step':>15} {'ratio':>6} {'weight diff':>12}")
    for size, r in results.items():
        print(f"{size:<6} {r['steps']:>6} {r['hand_us']:>9.1f} ±{r['hand_spread_us'] / 2:<4.0f}"
              f"{r['runner_us']:>10.1f} ±{r['runner_spread_us'] / 2:<4.0f}{r['ratio']:>6.3f}"
              f" {r['max_weight_diff']:>12.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
