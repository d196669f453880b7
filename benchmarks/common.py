"""What the benchmarks share: the models and data every contender trains, fresh worker processes, and the tables.

Every contender (hand-written loop, runner, Lightning) trains the same `Net` on the same `splits()` through the same
DataLoader with AdamW (matrices decayed, biases not), a per-step cosine schedule (`cosine_factor`) and clipping at 1.0.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
# name: (layer widths, batch size, samples in the dataset, learning rate)
SIZES = {"tiny": ([32, 64, 10], 32, 32 * 64, 1e-3), "mlp": ([256, 1024, 1024, 10], 256, 256 * 32, 1e-3)}
WEIGHT_DECAY, CLIP, MIN_LR_RATIO = 0.01, 1.0, 0.1


class Net(nn.Module):
    """An MLP classifier with runner's task interface; initialised from its own seed, whatever the global RNG."""

    def __init__(self, size: str = "tiny") -> None:
        super().__init__()
        widths = SIZES[size][0]
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(1)
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])
        torch.random.set_rng_state(generator_state)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cross-entropy of the batch."""
        x, y = batch
        return {"loss": nn.functional.cross_entropy(self.net(x), y)}


def splits(size: str = "tiny") -> dict[str, Any]:
    """A seeded random classification set of SIZES[size] samples (a 'train' split only)."""
    from runner.data import TensorData

    widths, _, n, _ = SIZES[size]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (n,), generator=generator)
    return {"train": TensorData(x, y)}


def loader(size: str, device: str | torch.device = "cpu") -> torch.utils.data.DataLoader:
    """The training loader, built exactly as runner builds it from benchmarks/conf/data/bench.yaml (pinned on CUDA)."""
    from runner.data import DataModule

    return DataModule(splits(size), batch_size=SIZES[size][1], seed=0).train_loader(device=torch.device(device))


def bench_run(
    model: nn.Module, optimizer: Any, loader: Any, progress: Any, schedule: Any, log_interval: str, device: str = "cpu"
) -> Any:
    """A runner Run on `device` without validation, for benchmarks that call fit() or a save directly."""
    from runner.distributed.strategies import Single
    from runner.precision import FP32
    from runner.run import Run, Settings, State

    return Run(
        task=model,
        optimizer=optimizer,
        schedule=schedule,
        precision=FP32(device),
        strategy=Single(device),
        train_loader=loader,
        val_loader=None,
        settings=Settings(val_interval=progress.resolve("1ep"), log_interval=progress.resolve(log_interval)),
        state=State(progress),
    )


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """AdamW groups as runner makes them: weight decay on matrices, none on biases."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def cosine_factor(t: int, total: int) -> float:
    """The LR factor of runner's cosine schedule without warmup (the same float arithmetic)."""
    done = min(1.0, t / max(1, total))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * done))


@torch.no_grad()
def final_loss(model: nn.Module, size: str) -> float:
    """Mean loss of the trained model over the whole dataset: the contenders must agree on it."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in splits(size)["train"].tensors)
    return float(nn.functional.cross_entropy(model.net(x), y))


def default_device() -> str:
    """Every script's --device default: cuda when torch sees a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str | torch.device) -> str:
    """The device in words, for table headers and the JSON's "device": the GPU's name, or cpu."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on a GPU, so that a clock read next counts it (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def fused(device: str | torch.device) -> bool | None:
    """AdamW's `fused` as runner's `optimizer.fused: null` picks it (fused on CUDA and the CPU), so that every contender
    does the same arithmetic and the final losses stay identical."""
    from runner.optimizers import FUSED_DEVICES

    return True if torch.device(device).type in FUSED_DEVICES else None


def peak_gpu_mb(device: str | torch.device) -> float | None:
    """This process's peak allocated GPU memory (MiB) on `device`; None on the CPU."""
    device = torch.device(device)
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def peak_rss_mb() -> float:
    """This process's own peak RSS (MiB): VmHWM, which exec resets. ru_maxrss (and wait4's) keeps the high-water mark
    of the process before exec, so a child forked from a large parent would report the parent's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class OpCount(TorchDispatchMode):
    """Counts the device operations (aten ops below autograd: forward, backward and optimizer alike) run under it,
    and on CUDA the host-device syncs (torch's sync debug mode warns at each): what a step launches, per contender."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.ops, self.syncs = device, 0, 0
        self._warnings = warnings.catch_warnings(record=True)

    def __enter__(self) -> OpCount:
        if self.device.type == "cuda":
            self.caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self.syncs = sum("synchroniz" in str(w.message) for w in self.caught)
            self._warnings.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        # views and detaches launch nothing on a device: counted apart would only blur the comparison
        if not (func.is_view or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.lift_fresh)):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class Stamps:
    """Clock readings a worker takes: at the first optimizer step, then at the ends of `segments` equal stretches of
    the steady state (after `warmup` of `steps` steps).

    Only those steps read the clock: on CUDA each reading waits for the GPU first (torch.cuda.synchronize), and a
    step that reads no clock makes no sync, so the loop runs ahead of the GPU as it would untimed. The last
    `COUNTED` steps of the warm-up (untimed) run under an OpCount: the operations and syncs of a step.
    """

    COUNTED = 5

    def __init__(
        self,
        warmup: int,
        steps: int,
        device: str | torch.device = "cpu",
        segments: int = 10,
        count_ops: bool = True,
    ) -> None:
        self.warmup, self.steps, self.device = warmup, steps, torch.device(device)
        self.marks = {warmup + round(i * (steps - warmup) / segments) for i in range(segments + 1)}
        # after the first step (its one-off work), ending where the clock starts: where the warm-up is long enough
        self.count_from = warmup - self.COUNTED if count_ops and warmup > self.COUNTED else None
        self.counter: OpCount | None = None
        self.counted: dict[str, float] = {}
        self.first_step: float | None = None
        self.clock: dict[int, float] = {}  # step -> perf_counter after it, at the marks
        self.cpu: list[float] = []  # process CPU time after the warm-up and after the last step
        self.train_peak_mb: float | None = None  # the GPU peak at the last step, before any validation after it

    def step(self, step: int) -> None:
        """Call after optimizer step `step` (1-based)."""
        if step == self.count_from:
            synchronize(self.device)  # the syncs counted are the steps' own
            self.counter = OpCount(self.device).__enter__()
        elif self.counter is not None and step == self.warmup:
            self.counter.__exit__(None, None, None)
            self.counted = {"ops_per_step": self.counter.ops / self.COUNTED}
            if self.device.type == "cuda":
                self.counted["syncs_per_step"] = self.counter.syncs / self.COUNTED
            self.counter = None
        if step == 1 or step in self.marks:
            synchronize(self.device)
        if step == 1:
            self.first_step = time.time()
        if step in self.marks:
            self.clock[step] = time.perf_counter()
            if step in (self.warmup, self.steps):
                self.cpu.append(time.process_time())
            if step == self.steps:
                self.train_peak_mb = peak_gpu_mb(self.device)

    def write(self, path: str | Path, **extra: Any) -> None:
        """Write the figures to `path` as JSON.

        per_step_s is the median over the equal stretches of the steady state, so that a burst of machine noise in
        one stretch does not move it; mean_step_s and cpu_step_s are over the whole steady state; peak_gpu_mb is
        torch.cuda.max_memory_allocated on CUDA at the last step (None on the CPU): training's own peak, whatever a
        contender validates or scores after it.
        """
        marks = sorted(self.clock)
        figures: dict[str, Any] = {
            "first_step": self.first_step,
            "per_step_s": None,
            "peak_gpu_mb": self.train_peak_mb if self.train_peak_mb is not None else peak_gpu_mb(self.device),
            "own_peak_rss_mb": peak_rss_mb(),
            **self.counted,
        }
        if len(marks) > 1:
            clock, steps = self.clock, marks[-1] - marks[0]
            stretches = [(clock[b] - clock[a]) / (b - a) for a, b in zip(marks, marks[1:], strict=False)]
            figures.update(
                per_step_s=statistics.median(stretches),
                mean_step_s=(clock[marks[-1]] - clock[marks[0]]) / steps,
                cpu_step_s=(self.cpu[-1] - self.cpu[0]) / steps,
            )
        Path(path).write_text(json.dumps({**figures, **extra}))


def spawn(command: list[str], out: Path, env: dict[str, str] | None = None, log: Path | None = None) -> dict[str, Any]:
    """Run one worker process; return what it wrote to `out` plus launch time, wall time and peak RSS (MiB).

    The worker reports its own peak GPU memory (Stamps.write's peak_gpu_mb): wait4 sees only host memory.
    """
    # every contender under one OpenMP wait policy, PASSIVE unless the caller sets one: `python -m runner` would
    # otherwise choose its own from the load at its start (runner/waits.py), which a hand-written loop does not
    policy = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **policy, "PYTHONPATH": str(ROOT)}
    child = {**base, **(env or {})}  # the caller's variables win (a worker's threads, its own compile cache)
    out.unlink(missing_ok=True)
    sink = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    launched = time.time()
    # in the caller's folder: a relative path among the caller's overrides (data.cache_dir=cache) is the caller's
    proc = subprocess.Popen(command, env=child, stdout=sink, stderr=subprocess.STDOUT if log else sink)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - launched
    proc.returncode = os.waitstatus_to_exitcode(status)
    if log:
        sink.close()
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-3000:] if log else ""
        raise RuntimeError(f"{' '.join(command)} failed with exit code {proc.returncode}\n{tail}")
    result = json.loads(out.read_text())
    result.update(launched=launched, wall_s=wall, peak_rss_mb=usage.ru_maxrss / 1024)
    if result.get("first_step") is not None:
        result["to_first_step_s"] = result["first_step"] - launched
    return result


def summary(values: list[float]) -> dict[str, float]:
    """Median and half the min-max spread."""
    return {"median": statistics.median(values), "spread": (max(values) - min(values)) / 2}


def median_gpu_mb(reps: list[dict[str, Any]]) -> float | None:
    """The median of the processes' peak GPU memory (MiB); None on the CPU, where they report none."""
    values = [r["peak_gpu_mb"] for r in reps if r.get("peak_gpu_mb") is not None]
    return statistics.median(values) if values else None


def mib(value: float | None) -> str:
    """A table cell for a MiB figure that is None on the CPU."""
    return "-" if value is None else f"{value:.0f}"


def torchrun(ranks: int) -> list[str]:
    """The start of a command that runs a module or script in `ranks` local processes (torchrun, one node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]


def runner_command(
    size: str,
    steps: int,
    warmup: int,
    out: Path,
    run_dir: Path,
    *overrides: str,
    ranks: int = 1,
    batch_size: int | None = None,
    device: str = "cpu",
) -> list[str]:
    """`python -m runner` on the benchmark experiment on `device`, with a StepTimer callback writing to `out`.

    ranks > 1: under torchrun with that many local processes (add `distributed=ddp` to the overrides); batch_size:
    the micro-batch of each process (default SIZES[size][1]).
    """
    launcher = torchrun(ranks) if ranks > 1 else [sys.executable]
    # Under torchrun `auto` is each rank's own GPU (LOCAL_RANK): `cuda` would put every rank on the same one.
    where = "auto" if ranks > 1 and torch.device(device).type == "cuda" else device
    return [
        *launcher,
        "-m",
        "runner",
        "--config-dir",
        str(ROOT / "benchmarks" / "conf"),
        "+experiment=bench",
        f"bench.size={size}",
        f"data.batch_size={batch_size or SIZES[size][1]}",
        f"optimizer.lr={SIZES[size][3]}",
        f"optimizer.weight_decay={WEIGHT_DECAY}",
        f"trainer.gradient_clip_val={CLIP}",
        f"scheduler.min_lr_ratio={MIN_LR_RATIO}",
        f"trainer.max_duration={steps}st",
        f"bench.warmup={warmup}",
        f"bench.out={out}",
        f"hydra.run.dir={run_dir}",
        f"distributed.device={where}",
        *overrides,
    ]


def machine() -> str:
    """One line about where the figures come from."""
    import platform

    return (
        f"{platform.node()}: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def cpu_model() -> str:
    """The CPU's model name and widest vector instructions (the CPU behind these machines varies between sessions)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"{name or 'unknown CPU'} ({'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'})"


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write the results as JSON when --json was given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
