"""Whole modules spread over the ranks (`distributed=spread`): each rank trains the modules it owns, on every rank's
rows, which the task routes to it (model=sae_multi: each SAE of a family on one rank, as sparsify's
`distribute_modules`). The others stay on the meta device in the task (their names and shapes, no memory), so that the
optimizer numbers the parameters as one process does. No gradient is all-reduced; norms add up every rank's part; what
rank 0 writes holds each module once, in one process's format: a checkpoint or model.safetensors loads anywhere."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runner import ConfigError
from runner.distributed.strategies import DDP, Single


class Spread(DDP):
    """One process per device (torchrun or SLURM, like ddp); the task's modules each on one rank."""

    strategy = "spread"
    checkpoint_format = "dcp"  # each rank writes its own modules (runner.ckpt.dcp)
    # the model key that builds a task this way (experiments.sae.coders.multi.MultiSAE's): runner.build fills it in
    model_args = {"distribute": True}
    every_module_here = False  # the other ranks' modules are meta placeholders here

    def __init__(self, device: str = "auto") -> None:
        super().__init__(device)

    def wrap(self, task: nn.Module) -> Callable[[Any], dict[str, torch.Tensor]]:
        """The task's own training_step: it trains its own modules on the rows routed to them."""
        if not getattr(task, "distribute", False):
            raise ConfigError(
                f"distributed=spread trains each SAE of a family on one rank (model=sae_multi); {type(task).__name__} "
                "has nothing to spread: use distributed=ddp (or fsdp)"
            )
        return task.training_step

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Nothing to synchronise: each gradient is whole on its own rank."""
        return contextlib.nullcontext()

    def norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of these tensors together over every rank's (the meta placeholders hold none)."""
        own = Single.norm(self, [t for t in tensors if not t.is_meta])
        return self.all_sum(own.square()).sqrt()

    def model_state(self, task: nn.Module) -> dict[str, Any]:
        """The task's full state_dict; collective: rank 0 receives every rank's tensors on the CPU, others None."""
        state = task.state_dict()
        parts = self._to_main({k: v.detach().cpu() for k, v in state.items() if not v.is_meta})
        if parts is None:
            return dict.fromkeys(state)
        whole = {k: v for part in parts for k, v in part.items()}
        return {k: whole[k] for k in state}  # the task's order, as one process writes it

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state_dict (states by the parameters' indices, as one process numbers them);
        collective: rank 0 receives every rank's, others None."""
        state = optimizer.state_dict()
        own = {
            i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state["state"].items()
            if not any(isinstance(v, torch.Tensor) and v.is_meta for v in s.values())
        }
        parts = self._to_main(own)
        if parts is None:
            return {"state": None, "param_groups": state["param_groups"]}
        merged = {i: s for part in parts for i, s in part.items()}
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    def _to_main(self, value: Any) -> list[Any] | None:
        # every rank's value, by rank, on rank 0 (None elsewhere)
        if self.world_size == 1:
            return [value]
        parts: list[Any] = [None] * self.world_size if self.is_main else None
        torch.distributed.gather_object(value, parts, dst=0)
        return parts

    def load_model_state(self, task: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full weights: each rank keeps its own modules' (its placeholders stay as they are)."""
        own = task.state_dict()
        task.load_state_dict({k: own[k] if k in own and own[k].is_meta else v for k, v in state.items()})

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state: each rank keeps its own parameters' states."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        own = {i: s for i, s in state["state"].items() if not params[int(i)].is_meta}
        optimizer.load_state_dict({**state, "state": own})
