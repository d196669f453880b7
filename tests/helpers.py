"""Helpers shared by the unit and e2e tests (test files never import each other: what two of them need lives here).

Sections: paths and shared command lines; a run's files; in-process runs (compose_job, make_run, callbacks);
subprocesses (the CLI, torchrun, a script, a peer's python, headless Chromium); the e2e tier's runs in the background;
wandb's offline files; transformers sources; coders and attribution graphs (experiments.sae).
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from composition import composed
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from torch import nn

from runner.ckpt.files import checkpoints
from runner.data import DataModule, TensorData
from runner.distributed.strategies import Single
from runner.precision import FP32
from runner.progress import TrainingProgress
from runner.run import Callback, Run, Settings, State
from runner.schedulers import constant

if TYPE_CHECKING:  # the SAE workbench's classes, imported by the helpers that use them
    from experiments.lm.model import GPT
    from experiments.sae.coders.activations import ReLUSAE

# ---- paths --------------------------------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CONF_DIR = ROOT / "runner" / "conf"  # the framework's groups, and config.yaml
# Every folder of config groups: runner/conf and each task package's conf/ (a package: its __init__.py), which
# hydra_plugins/runner_launchers/search_path.py puts on Hydra's search path. Found on disk, not read from the plugin:
# a folder the plugin leaves out fails the tests that compose its options.
CONF_DIRS = [CONF_DIR, *sorted(p.parent for p in (ROOT / "experiments").rglob("conf/__init__.py"))]


def project_modules() -> dict[str, Path]:
    """Every module of the project's packages (runner, experiments, the launchers' plugin), dotted name -> file."""
    found = {}
    for package in ("runner", "experiments", "hydra_plugins/runner_launchers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def config_groups() -> list[str]:
    """The config groups that have options (a YAML file directly in them), over every folder of CONF_DIRS."""
    return sorted({d.name for conf in CONF_DIRS for d in conf.iterdir() if d.is_dir() and any(d.glob("*.yaml"))})


def config_options(group: str) -> dict[str, Path]:
    """A config group's options, name -> file, over every folder of CONF_DIRS, sorted by name."""
    return dict(sorted((f.stem, f) for conf in CONF_DIRS for f in (conf / group).glob("*.yaml")))


# wall-clock figures: the only ones a resume may change (a row whose window held only a launch's first step has none
# of the rates: that step is left out of throughput)
TIMING = {
    "train/samples_per_s",
    "train/tokens_per_s",
    "train/tokens_per_s_per_device",
    "train/mfu",
    "sys/peak_memory_mb",
}

# ---- shared command lines -----------------------------------------------------------------------------------------
# Digits for runs of several processes: no dropout (the same training however the batch is split), validation every
# 10 steps, no wandb, no callbacks unless a test asks.
DIGITS_DDP = [
    "+experiment=digits",
    "model.dropout=0.0",
    "trainer.val_interval=10st",
    "logger=[console,jsonl]",
    "callbacks=none",
]
# A sweep job of 2 ranks for the launchers: 10 optimizer steps of 2 x 16 samples, far inside the first epoch, so
# every step sees 32 samples.
LAUNCHER_TINY = [
    "+experiment=digits",
    "model.dropout=0.0",
    "trainer.max_duration=10st",
    "trainer.val_interval=5st",
    "logger=[console,jsonl]",
    "callbacks=none",
    "data.batch_size=16",
    "distributed=ddp",
]
# Digits for 12 steps with a checkpoint, a validation every 4 and a log row every step (data loss, full disks)
DIGITS_12 = (
    "+experiment=digits",
    "trainer.max_duration=12st",
    "trainer.val_interval=4st",
    "trainer.log_interval=1st",
    "checkpoint.interval=4st",
    "logger=jsonl",
)
# A GPT small enough to train in seconds on one stdlib package (5 files, ~50 kB): a source for the SAE experiments
# A tiny SAE on the tiny GPT's residual stream after block 1 (+experiment=sae_lm, conftest's sae_lm_run): seconds
SAE_LM = ["source.layer=1", "model.n_latents=64", "model.k=4", "data.batch_size=64", "data.buffer_size=512"]
SAE_LM += ["data.samples_per_epoch=1024", "trainer.max_duration=8st", "logger=none", "checkpoint=none"]
TINY_LM = [
    "+experiment=lm",
    f"data.paths=[{Path(sysconfig.get_paths()['stdlib']) / 'json' / '*.py'}]",
    "data.val_every=2",
    "data.val_windows=16",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=32",
    "logger=none",
    "callbacks=none",
    "checkpoint=none",
    "trainer.max_duration=20st",
]


# the slurm extra (pip install runner[slurm]); part of dev
HAS_SUBMITIT = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
needs_submitit = pytest.mark.skipif(not HAS_SUBMITIT, reason="hydra-submitit-launcher")


# ---- a run's files ------------------------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    """A JSON file's contents."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def summary(run_dir: Path) -> dict[str, Any]:
    """A run's summary.json."""
    return read_json(Path(run_dir) / "summary.json")


def jsonl(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of a run's metrics.jsonl, as written."""
    text = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl without the wall-clock figures."""
    return [{k: v for k, v in row.items() if k not in TIMING} for row in jsonl(run_dir)]


def values(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every metrics.jsonl row that has `key`."""
    return [(row["step"], row[key]) for row in jsonl(run_dir) if key in row]


def results_csv(path: Path) -> dict[str, dict[str, str]]:
    """A results.csv (or the one in the folder `path`) by job."""
    path = Path(path)
    with (path / "results.csv" if path.is_dir() else path).open(newline="") as f:
        return {row["job"]: row for row in csv.DictReader(f)}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final weights a run wrote (model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    """The two runs wrote bit-identical weights under the same names."""
    got, expected = weights(run_dir), weights(reference)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def assert_close_weights(run_dir: Path, reference: Path, atol: float) -> None:
    """The same names, every value within `atol` (runs that sum the same gradients in another order)."""
    got, expected = weights(run_dir), weights(reference)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


# ---- in-process runs ----------------------------------------------------------------------------------------------
def compose_job(run_dir: Path, *overrides: str) -> DictConfig:
    """The job config as the CLI would see it, with ${hydra:runtime.output_dir} resolving to `run_dir`. Hydra's
    choices stay available through HydraConfig.get().runtime.choices (the compose_cfg fixture clears them)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = composed("config", [*overrides, f"hydra.run.dir={run_dir}"])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # the job config of a real run has no hydra node
    return cfg


def finished_run(directory: Path, *overrides: str) -> Run:
    """Train `overrides` in this process and leave `directory` as a finished run folder that load_trained reads
    (model.safetensors and .hydra/config.yaml): a source for the SAE experiments."""
    from omegaconf import OmegaConf

    from runner.build import build
    from runner.ckpt.weights import save_weights
    from runner.loop import fit

    cfg = compose_job(directory, *overrides)
    run = fit(build(cfg))
    HydraConfig.instance().cfg = None
    (directory / ".hydra").mkdir(exist_ok=True)
    save_weights(run.task, directory / "model.safetensors")
    OmegaConf.save(cfg, directory / ".hydra" / "config.yaml")
    return run


class StopAt(Callback):
    """Asks the loop to stop at `step` as a preemption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, run: Run) -> None:
        if run.progress.step == self.step:
            run.request_stop("preempted")


class CrashAt(Callback):
    """Fails at `step`, after that step was logged: a crash between two checkpoints."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, run: Run) -> None:
        if run.progress.step == self.step:
            raise RuntimeError("the node died")


class SyncsAreErrors(Callback):
    """Makes every host-device sync an error (torch.cuda.set_sync_debug_mode) from the end of optimizer step `first`
    to the end of step `last`: the steps in between (`guarded` of them) must not sync. The mode goes back to default
    at `last`, at the end of fit, and, whatever a failing test left, after every test (conftest's fixture)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.guarded = first, last, 0

    def on_optimizer_step(self, run: Run) -> None:
        step = run.progress.step
        if self.first < step <= self.last:
            self.guarded += 1
        if step in (self.first, self.last):
            torch.cuda.set_sync_debug_mode("error" if step == self.first else "default")

    def on_fit_end(self, run: Run) -> None:
        torch.cuda.set_sync_debug_mode("default")


class CountSteps(Callback):
    """Counts the optimizer steps this process trained."""

    def __init__(self) -> None:
        self.steps = 0

    def on_optimizer_step(self, run: Run) -> None:
        self.steps += 1


def assert_same_state(a: Run, b: Run) -> None:
    """Two runs hold bit-identical weights, optimizer state and learning rates."""
    for (name, x), (_, y) in zip(a.task.state_dict().items(), b.task.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for key in sa["state"]:
        for field, value in sa["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][key][field])), (key, field)
    assert [g["lr"] for g in a.optimizer.param_groups] == [g["lr"] for g in b.optimizer.param_groups]


def assert_resume_is_exact(compose_cfg: Any, overrides: list[str], root: Path, stop: int) -> tuple[Run, Run]:
    """Train `overrides` whole, and again stopped (preempted) at step `stop` then resumed: bit-identical weights,
    optimizer state and metric rows. Returns (the whole run, the resumed one)."""
    from runner.train import train

    whole = train(compose_cfg(*overrides, run_dir=root / "whole"))
    train(compose_cfg(*overrides, run_dir=root / "split"), extra_callbacks=[StopAt(stop)])
    counter = CountSteps()
    second = train(compose_cfg(*overrides, "resume=auto", run_dir=root / "split"), extra_callbacks=[counter])
    assert counter.steps == whole.progress.step - stop  # it did resume: only the rest was trained
    assert second.progress.step == whole.progress.step
    assert_same_state(whole, second)
    assert metric_rows(root / "split") == metric_rows(root / "whole")
    return whole, second


class Regression(nn.Module):
    """Linear regression; training_step returns NaN losses after its first `poison_from` calls."""

    def __init__(self, poison_from: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.poison_from = poison_from
        self.calls = 0

    def training_step(self, batch):
        x, y = batch
        self.calls += 1
        loss = ((self.linear(x) - y) ** 2).mean()
        if self.poison_from is not None and self.calls > self.poison_from:
            loss = loss * float("nan")
        return {"loss": loss}

    def validation_step(self, batch):
        x, y = batch
        return {"loss": ((self.linear(x) - y) ** 2).mean()}


def regression_data(n: int = 64, seed: int = 0) -> dict[str, Any]:
    """A seeded linear-regression data set: n train samples, the first 16 of them as validation."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return {"train": TensorData(x, y), "val": TensorData(x[:16], y[:16])}


def make_run(
    task: nn.Module | None = None,
    *,
    max_duration: str = "20st",
    batch_size: int = 8,
    accumulate: int = 1,
    lr: float = 0.05,
    val_interval: str = "1ep",
    shuffle: bool = True,
    callbacks=(),
    schedule=None,
    max_nonfinite_steps: int = 10,
    splits=None,
    clip: float | None = None,
    fused: bool = False,
    log_interval: str = "1st",
    precision: FP32 | None = None,
) -> Run:
    """A Run assembled by hand (no Hydra): SGD on Regression (fused: skipped on the device), one process, fp32 unless
    `precision` says otherwise, no loggers."""
    torch.manual_seed(0)
    task = task or Regression()
    data = DataModule(splits or regression_data(), batch_size=batch_size, shuffle=shuffle, seed=0)
    train, val = data.train_loader(accumulate=accumulate), data.val_loader()
    opt = torch.optim.SGD(task.parameters(), lr=lr, fused=fused)
    progress = TrainingProgress(
        max_duration,
        batch_size=batch_size,
        batches_per_epoch=len(train),
        samples_per_epoch=train.batch_sampler.samples_per_epoch,
        accumulate=accumulate,
    )
    schedule = (schedule or constant)(optimizer=opt, progress=progress)
    settings = Settings(
        val_interval=progress.resolve(val_interval),
        log_interval=progress.resolve(log_interval),
        gradient_clip_val=clip,
        max_nonfinite_steps=max_nonfinite_steps,
    )
    return Run(
        task=task,
        optimizer=opt,
        schedule=schedule,
        precision=precision or FP32(),
        strategy=Single("cpu"),
        train_loader=train,
        val_loader=val,
        settings=settings,
        state=State(progress),
        callbacks=list(callbacks),
    )


# ---- host reads ---------------------------------------------------------------------------------------------------
RUNNER_DIR = ROOT / "runner"
# The Tensor methods that copy a value to the host: on a GPU each waits for the device to finish (a sync).
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    """Counts the host reads (HOST_READS) that runner's own code makes, by where they are called from: a read inside
    torch (an optimizer's, say) is torch's. Use as `with HostReads(monkeypatch) as reads: ...; reads.count`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch, self.count, self.where = monkeypatch, 0, []

    def __enter__(self) -> HostReads:
        for name in HOST_READS:
            self.monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        self.monkeypatch.undo()

    def _counted(self, method: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if Path(caller.f_code.co_filename).is_relative_to(RUNNER_DIR):
                self.count += 1
                self.where.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {method.__name__}")
            return method(tensor, *args, **kwargs)

        return read


# ---- subprocesses -------------------------------------------------------------------------------------------------
TIMEOUT_S = 300  # generous: the machine may be shared; a healthy run takes a few seconds
# what a launcher (torchrun, SLURM, submitit) sets: inherited by a test's child, it would make the child a rank
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_PREFIXES = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_")
# The environment as the session started: e2e jobs start children in the background while unit tests monkeypatch
# os.environ (a fake HOME, RANK, WANDB_BASE_URL...), which those children must not inherit.
SESSION_ENV = dict(os.environ)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's `python -m runner`, torchrun or script: the session's (SESSION_ENV) without
    HYDRA_FULL_ERROR (errors look as a user sees them) or a launcher's variables, with wandb offline, one thread per
    process (runs share the cores) and tests/ on PYTHONPATH (for _tasks); `extra` adds or replaces variables."""
    env = {
        k: v
        for k, v in SESSION_ENV.items()
        if k != "HYDRA_FULL_ERROR" and k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)
    }
    path = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return {**env, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def python(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S):
    """`python *args` in `cwd`, output captured (child_env() plus `env`)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=child_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def refused(main, argv: list[str], capsys: Any, message: str) -> str:
    """`main(argv)` exits 2 with a one-paragraph error that matches `message`; returns it."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    return err


def with_run_dir(overrides: tuple[str, ...] | list[str], run_dir: Path | None) -> list[str]:
    """`overrides` plus hydra.run.dir=`run_dir`, unless they set one or `run_dir` is None."""
    if run_dir is None or any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides):
        return list(overrides)
    return [*overrides, f"hydra.run.dir={run_dir}"]


def cli(*overrides: str, cwd: Path, run_dir: Path | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """`python -m runner *overrides` in `cwd`; adds hydra.run.dir=`run_dir` unless the overrides set one."""
    return python("-m", "runner", *with_run_dir(overrides, run_dir), cwd=cwd, **kwargs)


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def torchrun(*overrides: str, cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 -m runner *overrides` in `cwd`."""
    return python(*TORCHRUN, "-m", "runner", *overrides, cwd=cwd, **kwargs)


def popen(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python *args` started in the background; stdout dropped, stderr kept (proc.communicate()[1])."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=child_env(**(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def torchrun_worker(agent: int, rank: int) -> int:
    """The pid of the worker of `rank` under the torchrun agent `agent` (to kill it as the OOM killer would)."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent}")


def wait_for(proc: subprocess.Popen, pattern: str, cwd: Path, timeout: float = 120) -> Path:
    """The first path matching the glob `pattern` under `cwd`, waited for while `proc` runs."""
    deadline = time.monotonic() + timeout
    while not (found := sorted(Path(cwd).glob(pattern))):
        if proc.poll() is not None:
            raise AssertionError(
                f"exited ({proc.returncode}) before {pattern} appeared:\n{proc.communicate()[1][-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{pattern} never appeared under {cwd}:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    return found[0]


def explain(proc: subprocess.CompletedProcess) -> str:
    """What a failed process said: its exit code and the ends of its output."""
    return f"--- rc={proc.returncode}\n--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-3000:]}"


def worker_exit_codes(stderr: str) -> list[int]:
    """The workers' exit codes in torchrun's failure table, sorted."""
    return sorted(int(code) for code in re.findall(r"exitcode\s+: (-?\d+) \(pid", stderr))


def error_lines(stderr: str) -> list[str]:
    """The lines the ranks said their errors on ("error: ..." and "error on rank N: ...")."""
    return [line for line in stderr.splitlines() if line.startswith("error")]


def split_at_first_checkpoint(run_dir: Path, copy: Path) -> Path:
    """`copy`: the finished run `run_dir` as it stood after its first checkpoint (a crash right after it)."""
    shutil.copytree(run_dir, copy, symlinks=True)
    for later in checkpoints(copy / "checkpoints")[:-1]:
        shutil.rmtree(later)
    (copy / "model.safetensors").unlink()
    return copy


def no_worker_traceback(stderr: str) -> None:
    """torchrun prints a traceback of its own (ChildFailedError) when a worker fails; no worker may print one."""
    for said in ("Connection closed by peer", "third_party/gloo", "Error executing job", "runner/__main__.py"):
        assert said not in stderr, stderr[-4000:]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`proc`, which must have exited 0."""
    assert proc.returncode == 0, explain(proc)
    return proc


# ---- the e2e tier's runs: started in the background, shared by the tests that check them -----------------------
# Each e2e module defines `jobs(root, runs) -> {name: job}`: a job is a function that runs processes in its own
# folder under `root` and returns what the tests check (a job that needs another's outcome calls runs[name].result();
# it must come after that one). Every selected e2e module's jobs are queued when the session starts (conftest.py):
# one thread runs them while the unit tier runs in-process on one core, WORKERS threads once the e2e tier starts.
# Most of a tiny run is interpreter and import time, one core per process; one more job than cores, since some jobs
# mostly wait (for a signal, a rendezvous, another job).
WORKERS = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2) + 1
_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_THREADS: list[threading.Thread] = []
_STARTED: dict[str, dict[str, Future]] = {}
# (seconds, "module: job") of every job that ran: pytest's --durations sees only the tests, which wait on the jobs
JOB_TIMES: list[tuple[float, str]] = []


def module_runs(module: Any, tmp_path_factory: Any) -> dict[str, Future]:
    """The runs of an e2e module (its `jobs`), queued once: name -> future of the job's outcome. A test calls
    .result(): a job's error fails the tests that need it, not the others."""
    if module.__name__ not in _STARTED:
        runs: dict[str, Future] = {}
        root = tmp_path_factory.mktemp(module.__name__.rpartition(".")[2].removeprefix("test_"))
        for name, job in module.jobs(root, runs).items():
            runs[name] = Future()
            _QUEUE.put((runs[name], job, f"{module.__name__.rpartition('.')[2]}: {name}"))
        _STARTED[module.__name__] = runs
    return _STARTED[module.__name__]


def _work() -> None:
    while (item := _QUEUE.get()) is not None:
        future, job, name = item
        if future.set_running_or_notify_cancel():
            start = time.perf_counter()
            try:
                future.set_result(job())
            except BaseException as error:  # noqa: BLE001 - the test that needs the outcome raises it
                future.set_exception(error)
            JOB_TIMES.append((time.perf_counter() - start, name))


def run_in_background(threads: int) -> None:
    """Let `threads` threads (at least) take queued jobs."""
    while len(_THREADS) < threads:
        _THREADS.append(threading.Thread(target=_work, name=f"e2e-{len(_THREADS)}"))
        _THREADS[-1].start()


def stop_runs() -> None:
    """Cancel the jobs not started yet (a session cut short) and let the threads end after their current job."""
    while True:
        try:
            item = _QUEUE.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            item[0].cancel()
    for _ in _THREADS:
        _QUEUE.put(None)


# ---- wandb's offline files ----------------------------------------------------------------------------------------
def records(path: Path) -> Iterator[Any]:
    """The protobuf records of a `.wandb` file: wandb's LevelDB-style log (32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    if len(data) < 7:  # still being written
        return
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # the padded end of a block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def offline_run(folder: Path) -> dict[str, Any]:
    """What the one offline run under `folder/wandb` holds: run facts, config, history rows by step, summary, exit."""
    (run_dir,) = (Path(folder) / "wandb").glob("offline-run-*")
    return read_run(run_dir)


def read_run(run_dir: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """What an offline run folder (`wandb/offline-run-*`) holds, once its exit record is there.

    In the process that logged it, wandb's service may still be flushing the file when finish() returns (the service
    outlives the run); a process that has exited has written all of it.
    """
    deadline = time.monotonic() + timeout_s
    while (out := _read_log(run_dir))["exit"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return out


def _read_log(run_dir: Path) -> dict[str, Any]:
    (log,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"dir": run_dir, "history": {}, "summary": {}, "exit": None}
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            out.update(id=r.run_id, name=r.display_name, group=r.run_group, job_type=r.job_type, project=r.project)
            out["config"] = {i.key: json.loads(i.value_json) for i in r.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out["history"].setdefault(row["_step"], {}).update(row)
        elif kind == "summary":
            out["summary"].update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def same_history(run: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Every metrics.jsonl value is in wandb's history at the same optimizer step."""
    assert {row["step"] for row in rows} == set(run["history"])
    for row in rows:
        for key, value in row.items():
            if key != "step":
                assert run["history"][row["step"]][key] == value, (row["step"], key)


# ---- transformers sources (experiments.sae.sources.pretrained) -------------------------------------------------------
# Three architectures' shapes, tiny and random, hooked by the names their models give their blocks.
HF_ARCHS = {"gpt2": "transformer.h", "llama": "model.layers", "gpt_neox": "gpt_neox.layers"}
HF_TEXT = [
    "def add(a, b):\n    return a + b\n\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.getcwd())\nvalue = [x for x in range(3)]\n",
]


def tiny_hf_model(folder: Path, arch: str) -> Path:
    """A 2-block causal LM of `arch` (gpt2, llama, gpt_neox) with a byte-level BPE tokenizer, both trained briefly on
    HF_TEXT, written by save_pretrained into `folder`: what a user's own model folder holds, with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, PreTrainedTokenizerFast

    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if arch != "llama":  # GPT-2 and Pythia: one <|endoftext|> is BOS, EOS (and Pythia's PAD)
        specials = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    special = sorted(set(specials.values()))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet)
    bpe.train_from_iterator(HF_TEXT * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **specials)
    vocab = len(tokenizer)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    shape = {"vocab_size": vocab, "num_attention_heads": 2, "num_hidden_layers": 2, "hidden_size": 32}
    config = {
        "gpt2": lambda: GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=vocab, **ids),
        "llama": lambda: LlamaConfig(
            **shape,
            intermediate_size=64,
            num_key_value_heads=1,
            max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id,
            **ids,
        ),
        "gpt_neox": lambda: GPTNeoXConfig(**shape, intermediate_size=64, max_position_embeddings=64, **ids),
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # 60 steps on the text: a model whose loss the residual stream matters to (ablating it must cost something)
    ids = torch.tensor(tokenizer("".join(HF_TEXT * 3))["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        starts = torch.randint(0, len(ids) - 17, (8,))
        batch = torch.stack([ids[s : s + 17] for s in starts.tolist()])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def hf_text(folder: Path, copies: int = 6) -> list[str]:
    """`copies` x HF_TEXT as text files in `folder` (every 2nd one validation text with val_every=2): their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(copies * len(HF_TEXT)):
        (folder / f"{i:03d}.py").write_text(HF_TEXT[i % len(HF_TEXT)] * (1 + i % 3))
        paths.append(str(folder / f"{i:03d}.py"))
    return paths


def peer_python(peer: str) -> str:
    """The python of the virtualenv of `peer` (saelens, sparsify or circuit-tracer; benchmarks/peers/install.sh makes
    them at the repository root, RUNNER_SAELENS_PYTHON, RUNNER_SPARSIFY_PYTHON or RUNNER_CIRCUIT_TRACER_PYTHON name
    others); the test is skipped without it."""
    variable = f"RUNNER_{peer.upper().replace('-', '_')}_PYTHON"
    path = os.environ.get(variable) or str(ROOT / f".venv-{peer}" / "bin" / "python")
    if not Path(path).exists():
        pytest.skip(f"no {peer} virtualenv ({path}): benchmarks/peers/install.sh makes it, or set {variable}")
    return path


def peer_forward(
    peer: str, script: str, folder: Path, x: torch.Tensor, tmp_path: Path, timeout: float
) -> tuple[torch.Tensor, str]:
    """`script` run by `peer`'s python (peer_python) on `folder`, x.npy and out.npy in `tmp_path`: (out, its stdout)."""
    import numpy as np

    interpreter = peer_python(peer)
    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run(
        [interpreter, "-c", script, str(folder), str(tmp_path / "x.npy"), str(tmp_path / "out.npy")],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.from_numpy(np.load(tmp_path / "out.npy")), done.stdout


# ---- headless Chromium (the pages' browser tests; skipped where Debian's `chromium` is missing) -----------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def headless_chromium(url: str, *args: str) -> tuple[str, list[str]]:
    """The DOM after `url`'s scripts ran in CHROMIUM (or what `args` ask instead), and the console lines it logged."""
    done = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
        + ["--virtual-time-budget=5000", *(args or ["--dump-dom"]), url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if "CONSOLE" in line]


# ---- coders and attribution graphs (experiments.sae; imported in the helpers, not with this module) --------------
def random_transcoder(
    cls: type, d: int, n_latents: int, skip: bool = False, **kwargs: Any
) -> tuple[nn.Module, torch.Tensor]:
    """A `cls` transcoder (d -> d, seeded) initialized from random raw rows, in eval mode: (it, the rows)."""
    from experiments.sae.coders.jumprelu import JumpReLUSAE

    torch.manual_seed(0)
    sae = cls(d_in=d, n_latents=n_latents, d_out=d, skip=skip, **kwargs)
    rows = torch.cat([torch.randn(256, d) * 3 + 1, torch.randn(256, d) * 0.2], dim=1)
    sae.initialize_from(rows)
    with torch.no_grad():
        if skip:
            sae.W_skip.normal_(std=0.1)
        if cls is JumpReLUSAE:
            sae.threshold.uniform_(0.0, 0.5)
    return sae.eval(), rows


class ReluMlp(nn.Module):
    """down(relu(up(x))): an MLP a ReLU transcoder reproduces exactly."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def relu_mlp_gpt(layers: int, d: int, hidden: int) -> GPT:
    """A random GPT (seeded, float64, eval) of `layers` blocks whose MLPs are ReluMlps of `hidden` units."""
    from experiments.lm.model import GPT

    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, seq_len=16, n_layer=layers, n_head=2, d_model=d, init_std=0.3)
    for block in gpt.blocks:
        block.mlp = ReluMlp(d, hidden)
    return gpt.double().eval()


def exact_coder(coder: nn.Module, mlp: ReluMlp, scale: float) -> None:
    """Make `coder`'s features `mlp`'s hidden units: W_enc = up^T (on inputs scaled by `scale`), W_dec = down^T."""
    d = mlp.down.out_features
    with torch.no_grad():
        coder.input_scale.fill_(scale) if coder.input_scale.ndim == 0 else None
        coder.W_enc.copy_(mlp.up.weight.t() / scale)
        coder.b_enc.zero_()
        coder.W_dec[:, :d] = mlp.down.weight.t()
        coder.b_dec.zero_()


def exact_transcoders(gpt: GPT) -> list[ReLUSAE]:
    """A float64 ReLU transcoder per block of a relu_mlp_gpt, exact_coder of its MLP on inputs scaled by 2."""
    from experiments.sae.coders.activations import ReLUSAE

    coders = []
    for block in gpt.blocks:
        d, hidden = block.mlp.up.in_features, block.mlp.up.out_features
        coder = ReLUSAE(d_in=d, n_latents=hidden, d_out=d).double()
        exact_coder(coder, block.mlp, 2.0)
        coders.append(coder)
    return coders


def clt_graph(prompt: str, coder: list[str]) -> dict[str, Any]:
    """The pruned graph of a random 2-block GPT and its CLT on `prompt`, as `python -m runner.attribute` writes it."""
    from functools import partial

    from experiments.lm.model import GPT
    from experiments.sae.circuits.attribute import attribute
    from experiments.sae.circuits.coders import CoderSet
    from experiments.sae.circuits.frozen import FrozenGPT
    from experiments.sae.circuits.output import graph_data
    from experiments.sae.circuits.prune import prune, scores
    from experiments.sae.coders.activations import ReLUSAE
    from experiments.sae.coders.clt import CrossLayerTranscoder

    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=16, init_std=0.3).eval()
    clt = CrossLayerTranscoder(partial(ReLUSAE, n_latents=24), layers=2, d_in=16, d_out=16)
    with torch.no_grad():
        for layer in clt.coders:
            layer.W_dec.normal_(0, 0.3)
            layer.b_enc.fill_(0.1)
    graph = attribute(FrozenGPT(gpt, torch.tensor(list(prompt.encode()))), CoderSet.of_clt(clt))
    return graph_data(graph, prune(graph), scores(graph), {"coder": coder, "model": "lm", "prompt": prompt})


def finished_clt_run(directory: Path, lm_run: Path) -> Path:
    """A finished CLT of 32 latents per block on lm_run's two MLPs (SAE_LM's data and budget), in `directory`."""
    settings = [o for o in SAE_LM if not o.startswith(("source.", "model."))]
    layers = ["source.module=[blocks.0.mlp_norm,blocks.1.mlp_norm]", "source.target=[blocks.0.mlp,blocks.1.mlp]"]
    finished_run(
        directory, "+experiment=clt_lm", f"source.checkpoint={lm_run}", *layers, "model.coder.n_latents=32", *settings
    )
    return directory


@contextlib.contextmanager
def deadline(seconds: int = 60) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes, which none does in a test)."""

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: something waits forever (a FIFO opened?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


GEMMA_HUB = "hf://google/gemma-scope-2-1b-pt/clt/width_262k_l0_medium/"  # where config.yaml's entries point


def gemma_scope_clt(
    folder: Path, layers: int = 3, n: int = 16, d: int = 8, config: bool = True, pad: bool = False, **extra: Any
) -> list[dict[str, torch.Tensor]]:
    """A random CLT (seeded) as Gemma Scope 2's files in `folder`: params_layer_{i}.safetensors with w_enc [d, n],
    b_enc [n], threshold [n] (>= 0), w_dec [n, L, d] (its writes to earlier layers too, which no reader may use),
    b_dec [d], and the tensors `extra`; with `config`, circuit-tracer's config.yaml listing them as hub files (`pad`:
    the last twice, as circuit-tracer 0.5.0's loader needs). Returns each layer's tensors."""
    import yaml
    from safetensors.torch import save_file

    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(layers):
        tensors = {
            "w_enc": torch.randn(d, n) / d**0.5,
            "b_enc": torch.randn(n) * 0.1,
            "threshold": torch.rand(n) * 0.8,
            "w_dec": torch.randn(n, layers, d) * 0.3,
            "b_dec": torch.randn(d) * 0.1,
            **extra,
        }
        save_file(tensors, folder / f"params_layer_{i}.safetensors")
        written.append(tensors)
    if config:
        files = [f"{GEMMA_HUB}params_layer_{i}.safetensors" for i in range(layers)]
        cfg = {"model_kind": "cross_layer_transcoder", "feature_input_hook": "mlp.hook_in",
               "feature_output_hook": "hook_mlp_out", "transcoders": files + files[-1:] * pad}  # fmt: skip
        (folder / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return written


def gemma_scope_forward(
    tensors: list[dict[str, torch.Tensor]], inputs: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(each layer's codes, each layer's MLP output) of Gemma Scope 2's CLT `tensors` on each layer's raw MLP input, in
    float64 by circuit-tracer's formulas: codes = pre * (pre > threshold); layer j's output, the sum over i <= j of
    layer i's codes @ w_dec[:, j], plus b_dec of j."""
    t = [{k: v.double() for k, v in layer.items()} for layer in tensors]
    pre = [x.double() @ layer["w_enc"] + layer["b_enc"] for x, layer in zip(inputs, t, strict=True)]
    codes = [p * (p > layer["threshold"]) for p, layer in zip(pre, t, strict=True)]
    out = [sum(codes[i] @ t[i]["w_dec"][:, j] for i in range(j + 1)) + t[j]["b_dec"] for j in range(len(t))]
    return codes, out
