"""Where the processes run: environment detection (torchrun, SLURM, one process), the process group, DDP wrapping,
and the few collectives the loop and checkpoints need. `Single`, `DDP` and `FSDP` (runner/fsdp.py) share one
interface, so the loop has no distributed branches."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from runner import ConfigError


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto' means this rank's CUDA device when there is one, else CPU; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"distributed.device={device} but this torch sees no CUDA device; use auto or cpu")
    return chosen


def _first_host(nodelist: str) -> str:
    # SLURM_NODELIST: "node07", "node[07-09,12]", "gpu-a[1-2],gpu-b3": the first node hosts rank 0
    match = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)
    if not match:
        raise ConfigError(f"cannot read the first host of SLURM_NODELIST={nodelist!r}")
    return match.group(1) + (match.group(2) or "")


def environment() -> dict[str, Any]:
    """Rank, world size, local rank and rendezvous address from torchrun's or SLURM's variables (else one process)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun / torch.distributed.elastic
        return {
            "launcher": "torchrun",
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1)),
            "master": env.get("MASTER_ADDR"),
            "port": env.get("MASTER_PORT"),
        }
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return {
            "launcher": "slurm",
            "rank": int(env["SLURM_PROCID"]),
            "world_size": int(env["SLURM_NTASKS"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            # SLURM_NTASKS_PER_NODE only with --ntasks-per-node; SLURM_TASKS_PER_NODE always, e.g. "4(x2),3"
            "local_world_size": int(
                re.split(r"[(,]", env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1"))[0]
            ),
            "master": env.get("MASTER_ADDR")
            or _first_host(env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", ""))),
            "port": env.get("MASTER_PORT", "29500"),
        }
    return {
        "launcher": "none",
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "local_world_size": 1,
        "master": None,
        "port": None,
    }


def init_process_group() -> bool:
    """Join the job's process group once (idempotent); False in one process. Gloo for CPU tensors, NCCL for CUDA."""
    info = environment()
    if info["world_size"] <= 1:
        return False
    if torch.distributed.is_initialized():
        return True
    if not info["master"]:
        raise ConfigError(
            f"{info['world_size']} processes but no rendezvous address: launch with torchrun, or set MASTER_ADDR and "
            "MASTER_PORT"
        )
    os.environ.setdefault("MASTER_ADDR", info["master"])
    os.environ.setdefault("MASTER_PORT", str(info["port"]))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a worker group: after a `--max-restarts` restart it still holds the dead
        # group's gloo/NCCL addresses, which a quick new rank reads and fails to connect to (pytorch/pytorch#167288).
        # Each attempt gets keys of its own.
        agent = torch.distributed.TCPStore(info["master"], int(info["port"]), info["world_size"], is_master=False)
        store = torch.distributed.PrefixStore(f"runner/attempt-{restart_count()}/", agent)
    torch.distributed.init_process_group(backend, store=store, rank=info["rank"], world_size=info["world_size"])
    return True


def exit_without_teardown(code: Any) -> NoReturn:
    """End this rank's process with `code` (as sys.exit takes it) once its work is done, skipping the interpreter's
    teardown.

    Gloo's worker threads outlive destroy_process_group, and one may still be releasing the last collective's tensors
    when the interpreter finalizes: that release needs the GIL, the thread is killed mid-C++ and the process aborts
    (SIGABRT, "terminate called without an active exception"): 1 in 24 two-rank runs here. Every file is
    closed by then (summary, logs, checkpoints); the log handlers and standard streams are flushed here.
    """
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (`--max-restarts`); 0 on the first launch."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _first_launch_time(now: float) -> float:
    # torchrun's rendezvous store lives as long as the job, across worker restarts: the first launch's time is kept
    # there, so that restarted workers date the same run folder and resume it.
    store = torch.distributed.distributed_c10d._get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    key = f"runner/launch_time/{os.environ['TORCHELASTIC_RUN_ID']}"
    return float(store.compare_set(key, "", repr(now)).decode())


def shared_launch_time() -> float:
    """Rank 0's clock, the same on every rank of a job: Hydra's dated run folder is one folder, not one per rank
    (and under torchrun, the first launch's clock: workers restarted by `--max-restarts` find their run folder)."""
    now = time.time()
    if not init_process_group():
        return now
    if torch.distributed.get_rank() == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        now = _first_launch_time(now)
    shared = [now]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


class Single:
    """One process on one device."""

    rank = 0
    local_rank = 0
    world_size = 1
    local_world_size = 1
    is_main = True
    backend = "none"
    strategy = "single"

    def __init__(self, device: str = "auto") -> None:
        self.device = pick_device(device)

    def wrap(self, task: nn.Module) -> Callable[[Any], dict[str, torch.Tensor]]:
        """The training forward: one process calls training_step directly."""
        return task.training_step

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for a micro-batch's forward and backward; `enabled`: it closes an accumulation window."""
        return contextlib.nullcontext()

    def norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of these tensors together (the parameters, say)."""
        return torch.nn.utils.get_total_norm(tensors, foreach=True)

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The L2 norm of all gradients together (after DDP's all-reduce every rank holds the same gradients)."""
        return self.norm([q.grad for q in params if q.grad is not None])

    def model_state(self, task: nn.Module) -> dict[str, Any]:
        """The task's state_dict with full tensors (a collective under FSDP, where rank 0 alone receives them)."""
        return task.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict with full tensors (a collective under FSDP, where rank 0 alone receives them)."""
        return optimizer.state_dict()

    def load_model_state(self, task: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full weights (model_state's) into the task."""
        task.load_state_dict(state)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state (optimizer_state's)."""
        optimizer.load_state_dict(state)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (here: the tensor)."""
        return tensor

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, by rank."""
        return [value]

    def any(self, flags: list[bool]) -> list[bool]:
        """Per position: whether any rank's flag is set."""
        return flags

    def barrier(self) -> None:
        """Wait for every rank."""

    def close(self) -> None:
        """Nothing to tear down."""


class _TrainingStep(nn.Module):
    # DDP synchronises gradients only for what runs through its forward(): route training_step through it.
    def __init__(self, task: nn.Module) -> None:
        super().__init__()
        self.task = task

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        return self.task.training_step(batch)


class DDP(Single):
    """DistributedDataParallel over torchrun's or SLURM's processes: one rank per device, gradients all-reduced."""

    strategy = "ddp"

    def __init__(self, device: str = "auto", find_unused_parameters: bool = False) -> None:
        init_process_group()
        info = environment()
        self.rank, self.world_size, self.local_rank = info["rank"], info["world_size"], info["local_rank"]
        self.local_world_size, self.launcher = info["local_world_size"], info["launcher"]
        self.is_main = self.rank == 0
        self.device = pick_device(device, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = torch.distributed.get_backend() if self.world_size > 1 else "none"
        self.find_unused_parameters = find_unused_parameters
        self.model: nn.Module | None = None

    def wrap(self, task: nn.Module) -> Callable[[Any], dict[str, torch.Tensor]]:
        """DDP around the task's training_step (it also broadcasts rank 0's initial weights to every rank)."""
        if self.world_size == 1:
            return task.training_step
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = nn.parallel.DistributedDataParallel(
            _TrainingStep(task), device_ids=ids, find_unused_parameters=self.find_unused_parameters
        )
        return self.model

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """No gradient all-reduce on micro-batches that do not close a window (`no_sync`)."""
        if enabled or self.model is None:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks."""
        if self.world_size == 1:
            return tensor
        total = tensor.clone()
        torch.distributed.all_reduce(total)
        return total

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, by rank (small Python values: RNG states, flags)."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def any(self, flags: list[bool]) -> list[bool]:
        """Per position: whether any rank's flag is set (one small all-reduce)."""
        if self.world_size == 1:
            return flags
        total = self.all_sum(torch.tensor(flags, dtype=torch.float32, device=self.device))
        return [bool(v) for v in total.tolist()]

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
