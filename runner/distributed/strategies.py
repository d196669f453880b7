"""How the processes train together: `Single`, `DDP` (and `FSDP`, runner/distributed/fsdp.py) share one interface
(runner.interfaces.Strategy: wrapping, gradient sync, norms, full state dicts, the few collectives the loop and
checkpoints need), so the loop has no distributed branches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runner.distributed.env import environment, init_process_group, pick_device


class Single:
    """One process on one device."""

    rank = 0
    local_rank = 0
    world_size = 1
    local_world_size = 1
    is_main = True
    backend = "none"
    strategy = "single"
    # model keys the strategy decides (runner.build): a family's SAEs are spread over ranks only by distributed=spread
    model_args = {"distribute": False}
    # every module is on every rank (whole, or as FSDP's shards): callbacks that read all of them can run
    every_module_here = True
    # checkpoint.format=auto: whole tensors gathered on rank 0 (runner.ckpt.files); fsdp and spread: each rank's shards
    checkpoint_format = "files"

    def __init__(self, device: str = "auto") -> None:
        self.device = pick_device(device)

    def init_from(self, task: nn.Module, path: str, strict: bool = True, say: bool = True) -> None:
        """Load init_from's weights into the task, whole, now (FSDP: each rank its own slices, once wrap shards it)."""
        from runner.ckpt.weights import load_weights

        load_weights(task, path, strict=strict, say=say)

    def empty_init(self, strict: bool = True) -> bool:
        """Whether a task whose weights init_from reads is built with its parameters on the meta device (FSDP)."""
        return False

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

    def all_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over ranks (here: the tensor)."""
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

    def all_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over ranks: queued on the device stream like the gradients' all-reduce, the host
        does not wait for it."""
        if self.world_size == 1:
            return tensor
        most = tensor.clone()
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return most

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, by rank (small Python values: RNG states, flags)."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def any(self, flags: list[bool]) -> list[bool]:
        """Per position: whether any rank's flag is set (one small all-reduce of host values: a CPU tensor, which
        gloo reduces also beside NCCL, so the GPU is never waited for)."""
        if self.world_size == 1:
            return flags
        total = self.all_sum(torch.tensor(flags, dtype=torch.float32))
        return [bool(v) for v in total.tolist()]

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Leave the process group."""
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
