"""FSDP2 (`fully_shard`) as a `distributed` option: the DDP strategy's interface, with parameters, gradients and
optimizer state sharded over the ranks, and full tensors in every file (checkpoints stay portable)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runner import ConfigError
from runner.distributed.strategies import DDP


class FSDP(DDP):
    """Fully sharded data parallel (FSDP2, `fully_shard`): each rank keeps 1/world_size of the parameters, gradients
    and optimizer state, all-gathers a unit's parameters for its forward and backward, and reduce-scatters gradients.

    Units (parameter groups gathered together): the modules whose class name is in `units` (say [Block]), or by
    default every submodule that owns parameters itself (Linear, Embedding, norms); the task is the root and holds the
    rest (naming the task's own class makes it the only unit). Checkpoints hold full, unsharded tensors in the format
    of one process: a checkpoint is portable to another world size or to one process.

    `replicate` > 1 (distributed=hsdp; auto: one per node) is HSDP: a 2-D mesh of `replicate` groups, each sharding
    the model over its world_size / replicate ranks, the groups replicas of one another.
    """

    checkpoint_format = "dcp"  # each rank writes its own shards (runner.ckpt.dcp)

    def __init__(
        self,
        device: str = "auto",
        reshard_after_forward: bool = True,
        units: list[str] | None = None,
        replicate: int | str = 1,
    ) -> None:
        super().__init__(device)
        self.reshard_after_forward, self.units = reshard_after_forward, set(units or ())
        self.replicate = _replicas(replicate, self.world_size, self.local_world_size)
        # reshard_after_forward=false keeps gathered parameters from forward to backward: FSDP1's SHARD_GRAD_OP
        mode = "full shard" if reshard_after_forward else "shard grads and optimizer state"
        shards = f"{self.replicate} replicas x {self.world_size // self.replicate} shards"
        self.strategy = f"fsdp ({mode})" if self.replicate == 1 else f"hsdp ({shards}, {mode})"
        self.pending: tuple[str, bool, bool] | None = None  # init_from, read once wrap has sharded the task

    def _is_unit(self, module: nn.Module, tied: set[int]) -> bool:
        own = list(module.parameters(recurse=False))
        if any(id(p) in tied for p in own):  # a unit of its own would shard one copy of a tie apart from the other
            return False
        return type(module).__name__ in self.units if self.units else bool(own)

    def init_from(self, task: nn.Module, path: str, strict: bool = True, say: bool = True) -> None:
        """Load init_from's weights once wrap has sharded the task, each rank reading only its shards' slices."""
        if self.world_size == 1:
            return super().init_from(task, path, strict, say)
        self.pending = (path, strict, say)

    def empty_init(self, strict: bool = True) -> bool:
        """Whether the task is built with its parameters on the meta device: init_from reads every one of them
        (`strict`) into the shards, and no rank need build them whole."""
        return strict and self.world_size > 1

    def wrap(self, task: nn.Module) -> Callable[[Any], dict[str, torch.Tensor]]:
        """Shard the task in place (before the optimizer is built: its parameters become DTensor shards); training_step
        and validation_step become FSDP forwards, which gather the parameters they use."""
        if self.world_size == 1:
            return task.training_step
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        unknown = self.units - {type(m).__name__ for m in task.modules()}
        if unknown:  # a misspelt unit would leave every parameter to the root, one group gathered at once
            raise ConfigError(f"distributed.units: the task has no module of class {', '.join(sorted(unknown))}")
        with torch.no_grad():
            for param in task.parameters():
                if not param.is_contiguous():  # fully_shard refuses strided parameters (a transposed clone, say)
                    param.data = param.data.contiguous()
            for tensor in task.state_dict().values():  # every rank starts from rank 0's weights, as under DDP
                if not tensor.is_meta:  # a parameter without storage is read from init_from's file, below
                    torch.distributed.broadcast(tensor, src=0)
        # HSDP: shard within a group of world/replicate ranks (a node), replicate across the groups; FSDP2 reduces
        # gradients over both dimensions, and a DTensor's reductions (norms, full_tensor) know the mesh
        if self.replicate > 1:
            shape = (self.replicate, self.world_size // self.replicate)
            mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Bottom-up (reversed pre-order: children first), as fully_shard requires: a unit's group leaves out the
        # parameters of the units inside it.
        tied = tied_parameters(task)  # a parameter two modules hold (a GPT's head and embedding) stays with the root
        for module in reversed(list(task.modules())):
            if module is not task and self._is_unit(module, tied):
                fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(task, mesh=mesh)  # the root keeps its own parameters gathered until backward needs them
        if self.pending is not None:  # every rank read the same weights: rank 0's broadcast init is overwritten
            from runner.ckpt.sliced import load_sliced, materialize

            materialize(task, self.device)  # a task built empty (empty_init) gets storage for its own shards only
            path, strict, say = self.pending
            load_sliced(task, path, strict=strict, say=say)
        # The loop calls these methods, not forward(): FSDP must run its pre-forward (gather) and post-forward hooks
        # around them. Validation calls task.validation_step directly, so it gathers too.
        for method in ("training_step", "validation_step"):
            if hasattr(task, method):
                register_fsdp_forward_method(task, method)
        self.model = task
        return task.training_step

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Micro-batches that do not close a window keep their gradients unsharded and unreduced (FSDP's no_sync)."""
        if self.model is not None:
            self.model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of these tensors together, over every rank's shards: a plain tensor, the same on every rank."""
        return _full(super().norm(tensors))

    def model_state(self, task: nn.Module) -> dict[str, Any]:
        """The task's state_dict with every shard gathered; collective: rank 0 receives CPU tensors, others None."""
        return _gathered(task.state_dict(), self.is_main)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state_dict with every shard gathered, in one process's format (states by parameter index);
        collective: rank 0 receives CPU tensors, others None."""
        return _gathered(optimizer.state_dict(), self.is_main)

    def load_model_state(self, task: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full weights: each rank keeps its own shards of them."""
        own = task.state_dict()
        task.load_state_dict({k: _sharded_like(v, own[k]) if k in own else v for k, v in state.items()})

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state: each rank keeps its own shards of it."""
        if self.model is None:
            return super().load_optimizer_state(optimizer, state)
        # State tensors are indexed like the parameters across groups; a tensor of its parameter's shape (Adam's
        # moments, a momentum buffer) is sharded like the parameter, anything else (step counts) is kept whole.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        per_param = {
            i: {k: _sharded_like(v, params[i]) if _same_shape(v, params[i]) else v for k, v in s.items()}
            for i, s in state["state"].items()
        }
        optimizer.load_state_dict({**state, "state": per_param})


def _replicas(replicate: int | str, world_size: int, local_world_size: int) -> int:
    # distributed.replicate: how many copies of the sharded model (auto: one per node); one process has one
    if world_size == 1:
        return 1
    count = world_size // max(local_world_size, 1) if replicate == "auto" else replicate
    if not isinstance(count, int) or isinstance(count, bool) or count < 1 or world_size % count:
        raise ConfigError(
            f"distributed.replicate={replicate}: the number of replicas of the sharded model must divide the "
            f"{world_size} ranks (auto: one per node, {world_size} // {local_world_size} ranks per node)"
        )
    return count


def tied_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters that more than one module of `model` holds (a GPT's head and embedding)."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP's shards), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _gathered(value: Any, keep: bool) -> Any:
    # Every rank all-gathers the shards of each tensor in the same order (state_dicts are ordered alike on every
    # rank); only `keep` keeps the result, on CPU, one tensor at a time: no rank ever holds the whole model on device.
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        full = value.full_tensor()
        return full.cpu() if keep else None
    if isinstance(value, dict):
        return {k: _gathered(v, keep) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v, keep) for v in value)
    return value


def _same_shape(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # Every rank read the full tensor from the checkpoint: each keeps its own shard, with no communication.
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
