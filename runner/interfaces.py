"""The interfaces the framework's parts follow.

Task: what every experiment's model implements, the one method the loop needs and the optional hooks the framework
looks up by name, each with who calls it; a task package declares its own tools' hooks (the SAE workbench's `coder`,
`saes`, `encode`: experiments.sae.api). Precision, Strategy, Schedule and Logger: the components a config names.
Callback is in runner.run, beside the Run its hooks take: this module imports nothing of the framework, so that
runner.run can import it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


class Task(Protocol):
    """An experiment's model: an `nn.Module` with `training_step`. Everything else here is optional: the framework
    looks each hook up by name where it needs it (getattr/hasattr), so a task defines only those it uses. A typing and
    documentation device, not a base class; TASK_HOOKS names the optional hooks (tests/unit/test_task_hooks.py checks
    it against every lookup in runner/)."""

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Required. runner.loop, each micro-batch (through the strategy's wrap): {"loss": scalar tensor, **metrics}."""

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """runner.validation, each batch of a validation pass: {metric: tensor}; without it a run never validates."""

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """runner.validation at the end of a pass: the metrics from the split's float64 means (a ratio of means)."""

    def after_optimizer_step(self) -> None:
        """runner.loop after each optimizer step, skipped ones too: a constraint on the weights (precision=*_true
        refuses a task that has it)."""

    def logged(self, metrics: dict[str, float]) -> None:
        """runner.loop at each log step, with the row just logged: what later steps compute, decided without a sync."""

    def flops_per_token(self) -> float:
        """runner.build once, before the strategy wraps the task: training FLOPs per token, for train/mfu."""

    def compile_frozen(self, units: list[str] | None, options: dict[str, Any]) -> str:
        """runner.compile (compile=...) in place of compiling the task: compile a frozen model it holds; what it
        compiled, for the startup table."""

    def advice(self, metrics: dict[str, float]) -> list[str]:
        """runner.train at the end, with the final metrics: what they say to change (summary.json's `advice`, each
        printed under the final table)."""

    distribute: bool  # runner.distributed.spread's wrap: True where the task spreads its modules over ranks
    parts: dict[str, str]  # runner.train at the end: part name -> weights prefix; each part gets its own weights file

    def export(self, fmt: str, out: Any, cfg: Any, summary: dict | None = None) -> list[Any]:
        """runner.tools.export (`python -m runner.export`): write the weights as `fmt` into `out`; the folders."""

    def features(self, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
        """runner.tools.features (`python -m runner.features`): write the feature pages into `out`; the pages."""

    def generate(
        self, tokens: torch.Tensor, new_tokens: int, temperature: float, top_k: int | None, generator: Any
    ) -> torch.Tensor:
        """runner.tools.generate (`python -m runner.generate`): the prompt `tokens` [B, T] followed by `new_tokens`."""

    vocab_size: int  # runner.tools.generate: the token ids a prompt may hold (256: bytes, so a prompt= of text)


TASK_HOOKS = (  # the Task's optional hooks, in the order above
    "validation_step",
    "validation_summary",
    "after_optimizer_step",
    "logged",
    "flops_per_token",
    "compile_frozen",
    "advice",
    "distribute",
    "parts",
    "export",
    "features",
    "generate",
    "vocab_size",
)


# ---- the components' interfaces --------------------------------------------------------------------------------------
class Precision(Protocol):
    """Numeric precision (runner.precision): autocast for the forward, backward and the optimizer step."""

    name: str
    handles_overflow: bool  # it skips steps whose gradients overflowed itself (fp16 loss scaling)

    def cast(self, task: nn.Module) -> None: ...
    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]: ...
    def stepped(self, params: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def autocast(self) -> AbstractContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Strategy(Protocol):
    """Where the processes run and how they agree (runner.distributed): one process, DDP or FSDP."""

    rank: int
    world_size: int
    local_world_size: int
    is_main: bool
    device: torch.device
    backend: str
    strategy: str

    def wrap(self, task: nn.Module) -> Any: ...
    def sync(self, enabled: bool) -> AbstractContextManager: ...
    def norm(self, tensors: list[torch.Tensor]) -> torch.Tensor: ...
    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor: ...
    def model_state(self, task: nn.Module) -> dict[str, Any]: ...
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...
    def load_model_state(self, task: nn.Module, state: dict[str, torch.Tensor]) -> None: ...
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None: ...
    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def all_max(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def gather(self, value: Any) -> list[Any]: ...
    def any(self, flags: list[bool]) -> list[bool]: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


class Schedule(Protocol):
    """When the learning rate moves (runner.schedulers): per optimizer step, or on a validation metric."""

    monitor: str | None

    def on_optimizer_step(self) -> None: ...
    def on_validation(self, metrics: dict[str, float]) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Logger(Protocol):
    """start(info), log(metrics, step), log_histograms(values, step), close(summary); a logger overrides what it
    needs (subclass this)."""

    def start(self, info: dict[str, Any]) -> None:
        """Called once before training with facts about the run (parameters, batch, steps, config...)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at an optimizer step."""

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        """Record distributions (one value per layer, say) at an optimizer step, where the logger can draw them."""

    def working(self, what: str, done: int, total: int | None) -> None:
        """Progress through a long pass that logs nothing until it ends (a validation): `done` of `total` batches."""

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and release; `summary` is what summary.json holds (None if the run failed)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run continues this log (e.g. a wandb run id)."""
        return {}

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Before start(): the run resumes after `step` from a checkpoint that held state_dict()."""
