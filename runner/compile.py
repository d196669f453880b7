"""How the task's modules run, never what they compute: torch.compile (the `compile` group) and activation checkpointing
(the `activation_checkpointing` group). Both work in place, so state-dict keys and checkpoints are those of the eager
model: a compiled run resumes uncompiled and back."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runner import ConfigError


def class_name(module: nn.Module) -> str:
    """The module's own class name, also once FSDP2 has swapped in its subclass (FSDPBlock for Block)."""
    mro = [c.__name__ for c in type(module).__mro__]
    return mro[mro.index("FSDPModule") + 1] if "FSDPModule" in mro else mro[0]


def units_of(task: nn.Module, names: Sequence[str], key: str) -> list[nn.Module]:
    """The task's modules whose class name is in `names`, in order; a ConfigError naming the classes it has if none."""
    found = [m for m in task.modules() if class_name(m) in set(names)]
    if not found:
        classes = ", ".join(dict.fromkeys(class_name(m) for m in task.modules()))
        raise ConfigError(
            f"{key}={list(names)}: the model ({class_name(task)}) has no module of such a class; its classes are "
            f"{classes}. Name the class of its repeated layer (a transformer's block)"
        )
    return found


class Compile:
    """torch.compile in place: each module whose class is in `units` (`module.compile()`), or the whole task's
    forward when `units` is null (`task.compile()`: what `task(x)` runs; the rest of training_step stays eager).

    Applied after DDP/FSDP wrap the task. torch compiles lazily at the first call, which DDP then makes inside its own
    forward: dynamo sees DDP and splits the graph at its gradient buckets (DDPOptimizer), so the all-reduce still
    overlaps the backward. FSDP2 (fully_shard) takes the same order: on gloo, sharded Blocks compiled afterwards (with
    activation checkpointing) train like one eager process (tests/e2e/test_compile.py); units are found by their own
    class name through the FSDP<Name> subclasses that fully_shard swaps in.
    """

    def __init__(
        self,
        units: list[str] | None = None,
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str = "inductor",
    ) -> None:
        self.units = list(units) if units else None
        self.options: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}

    def apply(self, task: nn.Module) -> str:
        """Compile the units (or the task) in place; what was compiled, for the startup table."""
        if hasattr(task, "compile_frozen"):
            # A task that runs a frozen model it holds outside its parameters (an end-to-end coder's source, which
            # it replays in part) chooses which of that model's units to compile.
            return task.compile_frozen(self.units, self.options)
        modules = [task] if self.units is None else units_of(task, self.units, "compile.units")
        for module in modules:
            module.compile(**self.options)
        what = "the model's forward" if self.units is None else _count(modules)
        return f"{what} ({self.options['backend']}, mode {self.options['mode'] or 'default'})"


class ActivationCheckpointing:
    """Each `every`-th module whose class is in `units` keeps only its inputs in forward and recomputes its activations
    in backward (non-reentrant torch.utils.checkpoint around its forward): memory for compute, the same gradients.

    Applied before DDP/FSDP wrap the task (FSDP's gather then happens before the recompute, as in forward) and before
    compile (dynamo traces the checkpoint as one region it can recompute).
    """

    def __init__(self, units: Sequence[str] = ("Block",), every: int = 1) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"activation_checkpointing.every must be a whole number >= 1, got {every!r}")
        self.units, self.every = list(units), every

    def apply(self, task: nn.Module) -> str:
        """Wrap the chosen units' forward in place (state-dict keys unchanged); what was wrapped, for the startup
        table."""
        chosen = units_of(task, self.units, "activation_checkpointing.units")[:: self.every]
        for module in chosen:
            module.forward = functools.partial(_checkpointed, module.forward)
        return _count(chosen)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # preserve_rng_state (the default): dropout in the recompute draws what the forward drew, so gradients are exact
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _count(modules: list[nn.Module]) -> str:
    names = [class_name(m) for m in modules]  # Block, not FSDP2's FSDPBlock
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
