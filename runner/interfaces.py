"""The interface every experiment's model implements (Task): the one method the loop needs and the optional hooks the
framework looks up by name, each with who calls it. The components' own interfaces (Precision, Strategy, Schedule,
Callback, Logger) are in runner.run."""

from __future__ import annotations

from typing import Any, Protocol

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

    distribute: bool  # runner.distributed.spread's wrap: True where the task spreads its modules over ranks
    parts: dict[str, str]  # runner.train at the end: part name -> weights prefix; each part gets its own weights file

    def export(self, fmt: str, out: Any, cfg: Any, summary: dict | None = None) -> list[Any]:
        """runner.export for `python -m runner.export`: write the weights in format `fmt` into `out`; the folders."""

    def features(self, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
        """runner.features for `python -m runner.features`: write the feature pages into `out`; the pages."""

    def generate(
        self, tokens: torch.Tensor, new_tokens: int, temperature: float, top_k: int | None, generator: Any
    ) -> torch.Tensor:
        """runner.generate for `python -m runner.generate`: the prompt `tokens` [B, T] followed by `new_tokens`."""

    vocab_size: int  # runner.generate: the token ids a prompt may hold (256: bytes, so a prompt= of text)
    coder: nn.Module  # runner.api.load_sae and runner.sae_eval: the SAE an end-to-end task trains, taken in its place
    saes: dict[str, nn.Module]  # runner.api.load_sae(name=): a family's SAEs by name

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """runner.api.load_sae: what makes the task (or its coder) an SAE to return; dense codes [B, n_latents]."""

    def reconstruct(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """runner.sae_eval for `python -m runner.sae_eval`: what makes the task (or its coder) an SAE to evaluate."""


TASK_HOOKS = (  # the Task's optional hooks, in the order above
    "validation_step",
    "validation_summary",
    "after_optimizer_step",
    "logged",
    "flops_per_token",
    "compile_frozen",
    "distribute",
    "parts",
    "export",
    "features",
    "generate",
    "vocab_size",
    "coder",
    "saes",
    "encode",
    "reconstruct",
)
