"""LoRA fine-tuning through PEFT (finetune=lora), and merging the trained adapters into the base weights.

PEFT's `inject_adapter_in_model` replaces the named linear layers in place, so the task stays the same nn.Module with
its `training_step` (a PeftModel wrapper would hide it). Two hooks on the task make its state_dict the adapters
alone: checkpoints, model.safetensors and the resume's shape check then hold and compare only what trains, and a load
of adapter-only weights does not count the frozen base weights (loaded by init_from) as missing.

    python -m runner.finetune merge RUN_DIR [--base PATH]   # writes RUN_DIR/model.merged.safetensors:
                                                            # W + (alpha/rank) B A
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from runner import ConfigError, check_whole
from runner.ckpt.files import ADAPTER
from runner.ckpt.weights import read_weights, save_weights
from runner.config import trust
from runner.rundir import CONFIG, MODEL, read_run_config
from runner.tools.cli import as_flags

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
    """The base weights with each adapter folded in, W + scale * B @ A, under the base model's own names; a
    ConfigError naming every adapter the base does not fit (a missing module, another shape)."""
    merged, problems = dict(base), []
    for key in adapters:
        found = _LORA_A.match(key)
        if found is None:
            continue
        module, name = found.groups()
        a, b, w = adapters[key], adapters.get(f"{module}.{ADAPTER}B.{name}.weight"), base.get(f"{module}.weight")
        if b is None or w is None:
            problems.append(f"{module}.weight missing" if b is not None else f"{module}: lora_A without its lora_B")
        elif a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape) or b.shape[1] != a.shape[0]:
            problems.append(f"{module}.weight {tuple(w.shape)} vs B @ A {tuple(b.shape)} @ {tuple(a.shape)}")
        else:
            merged[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    if problems:
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ConfigError(f"the adapters do not fit the base: {'; '.join(problems[:5])}{more}")
    return merged


def _config(run_dir: Path) -> Any:
    # The run's own config, with ${run_dir} as the folder the run is in now (as runner.load reads a run)
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is a file"
        raise ConfigError(f"{run_dir} {what}: give the folder of a finetune=lora run, e.g. outputs/DATE/TIME")
    if not (run_dir / CONFIG).is_file():
        raise ConfigError(f"{run_dir} has no {CONFIG}: give the folder of a finetune=lora run, e.g. outputs/DATE/TIME")
    return read_run_config(run_dir)


def _setting(lora: DictConfig, key: str, config: Path) -> Any:
    # One finetune setting resolved: plain interpolations (${init_from}, ${run_dir}/..., ${oc.env:X}) resolve here;
    # Hydra's own (${hydra:...}) and runner's resolvers do not exist outside a run, and are refused
    try:
        return lora[key] if key in lora else None
    except Exception as error:  # omegaconf's errors for an unknown resolver, a missing key or variable
        raw = OmegaConf.to_container(lora)[key]
        hint = "give the base with --base PATH" if key == "base" else f"write its value into {config}"
        raise ConfigError(
            f"finetune.{key}={raw} in {config} cannot be resolved outside the run ({str(error).splitlines()[0]}); "
            f"{hint}"
        ) from None


def merge(run_dir: str | Path, base: str | Path | None = None) -> Path:
    """Fold a finetune=lora run's adapters (model.safetensors) into its base (init_from, or `base`); returns the
    merged file."""
    run_dir = Path(run_dir)
    cfg, config = _config(run_dir), run_dir / CONFIG
    lora = cfg.get("finetune") or {}
    if not isinstance(lora, DictConfig) or lora.get("_target_") != TARGET:
        raise ConfigError(f"{run_dir} is not a finetune=lora run (its {CONFIG} has no finetune=lora)")
    # a run folder may be anybody's: resolving its settings must not run what it names
    trust.check_resolvers(
        OmegaConf.to_container(lora, resolve=False), f"finetune in {config}", "give the base with --base PATH"
    )
    rank = check_whole(_setting(lora, "rank", config), f"finetune.rank in {config}")
    alpha = _setting(lora, "alpha", config)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ConfigError(f"finetune.alpha in {config} must be a number, got {alpha!r}")
    given = base is not None
    base = base if given else _setting(lora, "base", config)
    if not base:
        raise ConfigError(f"{config} names no base (finetune.base, init_from): give it with --base PATH")
    adapters = read_weights(run_dir / MODEL)
    ranks = {t.shape[0] for k, t in adapters.items() if _LORA_A.match(k) and t.dim() == 2}
    if not ranks:
        raise ConfigError(f"{run_dir / MODEL} holds no LoRA adapters ({ADAPTER}A/B weights): nothing to merge")
    if ranks != {rank}:  # alpha / rank of another rank would scale every update wrongly
        raise ConfigError(f"finetune.rank={rank} in {config}, but the adapters in {MODEL} have rank {sorted(ranks)}")
    try:
        weights = read_weights(base)
    except ConfigError as error:  # a relative path is read from this folder: the run may have started elsewhere
        where = "--base" if given else f"the base (finetune.base) in {config}"
        raise ConfigError(
            f"{where}: {error}. A relative path is read from the current folder; give --base PATH"
        ) from None
    try:
        merged = merged_weights(weights, adapters, alpha / rank)
    except ConfigError as error:
        raise ConfigError(f"cannot merge {run_dir} into {base}: {error}. Is {base} the model it fine-tuned?") from None
    out = run_dir / MERGED
    save_weights(merged, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m runner.finetune merge RUN_DIR [--base PATH]."""
    parser = argparse.ArgumentParser(prog="python -m runner.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["merge"])
    parser.add_argument("run_dir")
    parser.add_argument("--base", help="the base weights, if not the run's init_from (a run folder or .safetensors)")
    args = parser.parse_args(as_flags(sys.argv[1:] if argv is None else argv, ("base",)))
    try:
        print(merge(args.run_dir, args.base))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
