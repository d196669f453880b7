"""Checkpoint stall: how long a save blocks the training loop, asynchronous (runner) against torch.save + fsync.

    python benchmarks/checkpoint.py [--device cpu|cuda] [--sizes 50 500] [--reps 5] [--json out.json]

For each state size (MB of model weights + AdamW moments), a runner Run with that state on --device (default: cuda
when present; on CUDA the state lives on the GPU, as a GPU user's save copies it) is saved repeatedly:
  sync      torch.save of the whole state to a file, flush and fsync (what the loop waits for in a simple trainer)
  blocked   runner's Checkpoint.save(): the loop waits only while tensors are copied to reusable CPU buffers
            (allocated in the background after the first step; "first" is the first save after that)
  written   the background thread's time for the same save (serialise, sha256, fsync, rename, rotate)
  resume    load_checkpoint (read and verify) + restore into a fresh run
Medians over --reps saves; the target is blocked <= 15% of sync. On CUDA every clock is read after
torch.cuda.synchronize(), so a copy from the GPU counts until it has landed. Also reported: the process's peak RSS so
far and, on CUDA, the peak GPU memory of each size.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (  # noqa: E402
    bench_run,
    default_device,
    device_name,
    fused,
    machine,
    mib,
    peak_gpu_mb,
    synchronize,
    write_json,
)
from runner.ckpt.callback import Checkpoint  # noqa: E402
from runner.ckpt.files import checkpoints, load_checkpoint
from runner.ckpt.state import restore  # noqa: E402
from runner.data import DataModule, TensorData  # noqa: E402
from runner.progress import TrainingProgress  # noqa: E402
from runner.run import Run  # noqa: E402
from runner.schedulers import cosine  # noqa: E402


class Stack(nn.Module):
    """Square linear layers: parameters x 12 bytes (weights and two AdamW moments) make the state size."""

    def __init__(self, megabytes: float) -> None:
        super().__init__()
        width = 512 if megabytes < 20 else 1024 if megabytes <= 100 else 2048
        layers = max(1, round(megabytes * 2**20 / 12 / (width * width + width)))
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch):
        return {"loss": self.net(batch[0]).square().mean()}


def make_run(megabytes: float, device: str) -> Run:
    """A Run on `device` holding a model and AdamW state of about `megabytes` (one optimizer step taken)."""
    torch.manual_seed(0)
    model = Stack(megabytes).to(device)
    data = DataModule({"train": TensorData(torch.randn(8, model.net[0].in_features))}, batch_size=8)
    loader = data.train_loader(device=torch.device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused(device))  # runner's optimizer on this device
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    progress = TrainingProgress("1000st", batch_size=8, batches_per_epoch=len(loader), samples_per_epoch=8)
    return bench_run(model, opt, loader, progress, cosine(opt, progress), "10st", device)


def state_bytes(run: Run) -> int:
    """Bytes of tensors in the model and optimizer state."""
    tensors = list(run.task.state_dict().values())
    tensors += [v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def sync_save(run: Run, path: Path) -> float:
    """torch.save of the whole state + fsync; seconds (torch.save copies GPU tensors to the host itself)."""
    synchronize(run.device)
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": run.task.state_dict(), "optimizer": run.optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def measure(megabytes: float, reps: int, directory: Path, device: str) -> dict:
    """Sync, blocked, written and resume times for one state size."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = make_run(megabytes, device)
    saver = Checkpoint(dir=str(directory / "ckpt"), interval="1st", keep_last=2, keep_best=0)
    saver.prepare(run)  # what the callback does after the first step: buffers allocated in the background
    saver.wait()
    sync, blocked, written = [], [], []
    for rep in range(reps):
        sync.append(sync_save(run, directory / "sync.pt"))
        run.progress.step = rep + 1  # a new checkpoint folder each time
        synchronize(device)
        started = time.perf_counter()
        saver.save(run)
        synchronize(device)  # save() waits for its copies from the GPU itself: this only makes sure of it
        blocked.append(time.perf_counter() - started)
        saver.wait()
        written.append(time.perf_counter() - started)
        saver.check()
    fresh = make_run(megabytes, device)
    synchronize(device)
    started = time.perf_counter()
    restore(fresh, load_checkpoint(checkpoints(directory / "ckpt")[0]))
    synchronize(device)  # the copies to the GPU have landed
    resume = time.perf_counter() - started
    ms = [statistics.median(x) * 1e3 for x in (sync, blocked, written)]
    return {
        "state_mb": state_bytes(run) / 2**20,
        "sync_ms": ms[0],
        "blocked_first_ms": blocked[0] * 1e3,
        "blocked_ms": ms[1],
        "written_ms": ms[2],
        "resume_ms": resume * 1e3,
        "blocked_over_sync": ms[1] / ms[0],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # the process's, so far
        "peak_gpu_mb": peak_gpu_mb(device),  # this size's (two runs' states and gradients)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--sizes", nargs="+", type=float, default=[50, 500], help="state sizes in MB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", help="where to write (default: a temporary folder on the default disk)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"machine": machine(), "device": device_name(args.device), "sizes": {}}
    for megabytes in args.sizes:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            results["sizes"][str(megabytes)] = measure(megabytes, args.reps, Path(tmp), args.device)
    print(f"# checkpoint stall on {results['device']} ({results['machine']}), median of {args.reps} saves")
    print(
        f"{'state MB':>9} {'sync ms':>9} {'blocked ms':>11} {'(first)':>8} {'blocked/sync':>13} {'written ms':>11}"
        f" {'resume ms':>10} {'RSS MiB':>8} {'GPU MiB':>8}"
    )
    for r in results["sizes"].values():
        print(
            f"{r['state_mb']:>9.0f} {r['sync_ms']:>9.1f} {r['blocked_ms']:>11.1f} {r['blocked_first_ms']:>8.1f}"
            f" {r['blocked_over_sync']:>13.3f} {r['written_ms']:>11.1f} {r['resume_ms']:>10.1f}"
            f" {r['peak_rss_mb']:>8.0f} {mib(r['peak_gpu_mb']):>8}"
        )
    write_json(args.json, results)


if __name__ == "__main__":
    main()
