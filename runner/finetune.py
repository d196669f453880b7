"""LoRA fine-tuning through PEFT (finetune=lora), and merging the trained adapters into the base weights.

PEFT's `inject_adapter_in_model` replaces the named linear layers in place, so the task stays the same nn.Module with
its `training_step` (a PeftModel wrapper would hide it). Two hooks on the task make its state_dict the adapters
alone: checkpoints, model.safetensors and the resume's shape check then hold and compare only what trains, and a load
of adapter-only weights does not count the frozen base weights (loaded by init_from) as missing.

    python -m runner.finetune merge RUN_DIR    # writes RUN_DIR/model.merged.safetensors: W + (alpha/rank) B A
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from runner import ConfigError
from runner.ckpt.files import ADAPTER, read_weights, save_weights
from runner.rundir import CONFIG, MODEL

MERGED = "model.merged.safetensors"
TARGET = "runner.finetune.Lora"  # not f"{__name__}.Lora": under `python -m runner.finetune` that is __main__.Lora
_LORA_A = re.compile(rf"^(.*)\.{ADAPTER}A\.([^.]+)\.weight$")


class Lora:
    """Low-rank adapters (rank, alpha, dropout) on the modules named `target_modules`; everything else frozen."""

    def __init__(
        self,
        base: str | None,
        rank: int = 8,
        alpha: float = 16,
        dropout: float = 0.0,
        target_modules: Sequence[str] = ("qkv", "out", "gate_up", "down"),
    ) -> None:
        if not base:
            raise ConfigError("finetune=lora adapts a trained model: give its run folder, init_from=outputs/DATE/TIME")
        if rank < 1 or not 0.0 <= dropout < 1.0:
            raise ConfigError(f"finetune.rank must be >= 1 and finetune.dropout in [0, 1), got {rank}, {dropout}")
        self.rank, self.alpha, self.dropout, self.target_modules = rank, alpha, dropout, list(target_modules)

    def apply(self, task: nn.Module) -> nn.Module:
        """Inject the adapters into `task` in place and freeze every other parameter; returns the task."""
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError:
            raise ConfigError("finetune=lora needs PEFT: pip install 'runner[lora]' (or pip install peft)") from None
        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            bias="none",
        )
        try:
            inject_adapter_in_model(config, task)
        except ValueError as error:  # no module of that name
            raise ConfigError(f"finetune.target_modules={self.target_modules}: {error}") from None
        for name, parameter in task.named_parameters():
            parameter.requires_grad_(ADAPTER in name)
        task.register_state_dict_post_hook(_adapters_only)
        task.register_load_state_dict_post_hook(_base_not_missing)
        return task


def _adapters_only(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    # prefix: under DDP this task's keys start with `module.`; keys outside it are not this task's to drop
    for key in [k for k in state if k.startswith(prefix) and ADAPTER not in k]:
        del state[key]


def _base_not_missing(module: nn.Module, incompatible: Any) -> None:
    # the frozen base weights came from init_from; only a missing adapter is a real mismatch
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if ADAPTER in k]


def merged_weights(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """The base weights with each adapter folded in, W + scale * B @ A, under the base model's own names."""
    merged = dict(base)
    for key in adapters:
        found = _LORA_A.match(key)
        if found is None:
            continue
        module, name = found.groups()
        a, b = adapters[key], adapters[f"{module}.{ADAPTER}B.{name}.weight"]
        w = base[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged


def merge(run_dir: str | Path) -> Path:
    """Fold a finetune=lora run's adapters (model.safetensors) into its base (init_from); returns the merged file."""
    run_dir = Path(run_dir)
    cfg = OmegaConf.load(run_dir / CONFIG)
    lora = cfg.get("finetune") or {}
    if lora.get("_target_") != TARGET:
        raise ConfigError(f"{run_dir} is not a finetune=lora run (its {CONFIG} has no finetune=lora)")
    adapters = read_weights(run_dir / MODEL)
    out = run_dir / MERGED
    save_weights(merged_weights(read_weights(lora.base), adapters, lora.alpha / lora.rank), out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m runner.finetune merge RUN_DIR."""
    parser = argparse.ArgumentParser(prog="python -m runner.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["merge"])
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        print(merge(args.run_dir))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
