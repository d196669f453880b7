"""`python -m runner.evaluate RUN_DIR [split=val] [weights=PATH] [device=cpu] [trusted_targets=[a,b]] [data.KEY=VALUE]`

Evaluates a finished run's weights (or a checkpoint's: weights=RUN_DIR/checkpoints/step-N, or any model.safetensors)
with the run's own config on a named split of its data, exactly as validation does (each validation_step output
averaged over the whole split in float64, then the task's validation_summary), and writes RUN_DIR/eval-<split>.json.
On the validation split the run's metric callbacks add theirs, as in training: `val/ppl`, an SAE's `val/mmcs`, or its
source model's loss with the SAE spliced in (`val/loss_recovered`, `val/kl_spliced`, ...). They measure on data of
their own (the source's validation windows) or the weights alone, so other splits get only the task's metrics.
Exit codes as `python -m runner`: 0, or 2 with a one-line message for a wrong argument, split or file.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from runner import ConfigError, trust
from runner.build import build_data
from runner.run import Precision
from runner.rundir import write_json
from runner.trained import TRUSTED_TARGETS, load_trained, measuring_callbacks
from runner.validation import evaluate_loader

USAGE = "usage: python -m runner.evaluate RUN_DIR [split=val] [weights=PATH] [device=cpu] [data.KEY=VALUE ...]"


def evaluate_run(
    run_dir: str | Path,
    split: str = "val",
    weights: str | Path | None = None,
    device: str = "cpu",
    trusted: tuple[str, ...] = TRUSTED_TARGETS,
    data_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Metrics of `weights` (default: the run's model.safetensors) on `split`, written to RUN_DIR/eval-<split>.json."""
    run_dir = Path(run_dir)
    model, cfg = load_trained(run_dir, trusted, weights=weights, callbacks=True)
    for key, value in (data_overrides or {}).items():
        if OmegaConf.select(cfg.data, key, default=KeyError) is KeyError:
            raise ConfigError(f"data.{key}: the data config of {run_dir} has no such key")
        OmegaConf.update(cfg.data, key, value)
    trust.check(OmegaConf.to_container(cfg.data, resolve=True), trusted, "data", "the command line's data.KEY=")
    data = build_data(cfg)
    loader = data.split_loader(split, device=torch.device(device))
    if loader is None:
        raise ConfigError(f"split={split}: the data of {run_dir} has the splits {sorted(data.splits)}; pick one")
    model.to(device)
    precision = _precision(cfg.get("precision"), device)
    metrics = evaluate_loader(model, loader, precision, torch.device(device))
    if split == "val":
        # What a metric callback reads of a run (its task, device and validation loader): there is no Run here.
        run = SimpleNamespace(task=model, device=torch.device(device), val_loader=loader)
        for callback in measuring_callbacks(cfg):
            callback.on_validation_end(run, metrics)
    used = Path(weights) if weights is not None else run_dir / "model.safetensors"
    result = {
        "split": split,
        "samples": len(loader.dataset),
        "weights": str(used),
        "weights_sha256": hashlib.sha256(used.read_bytes()).hexdigest() if used.is_file() else None,
        "metrics": {key.replace("val/", f"{split}/", 1): value for key, value in metrics.items()},
    }
    write_json(run_dir / f"eval-{split}.json", result)
    return result


def _precision(node: Any, device: str) -> Precision:
    # The run's own precision option (fp32, bf16 or fp16 autocast): evaluated as it validated. load_trained checked
    # that its target is one of runner.precision's classes.
    from hydra.utils import instantiate

    from runner.precision import FP32

    return FP32(torch.device(device)) if node is None else instantiate(node, device=torch.device(device))


def _arguments(argv: list[str]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    if not argv or "=" in argv[0] or argv[0] in ("-h", "--help"):
        raise ConfigError(USAGE)
    options: dict[str, Any] = {}
    data: dict[str, Any] = {}
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg!r} is not KEY=VALUE; {USAGE}")
        parsed = yaml.safe_load(value) if value else value  # 64 -> int, [a,b] -> list, as Hydra reads them
        if key.startswith("data."):
            data[key.removeprefix("data.")] = parsed
        elif key in ("split", "weights", "device", "trusted_targets"):
            options[key] = parsed
        else:
            raise ConfigError(f"unknown argument {key!r}: give split=, weights=, device=, trusted_targets=, data.KEY=")
    if "trusted_targets" in options:
        options["trusted"] = tuple(options.pop("trusted_targets"))
    return Path(argv[0]), options, data


def main(argv: list[str] | None = None) -> int:
    """The command: evaluate, print the metrics, exit 0; or print why not and exit 2."""
    try:
        run_dir, options, data = _arguments(sys.argv[1:] if argv is None else argv)
        result = evaluate_run(run_dir, data_overrides=data, **options)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for key, value in result["metrics"].items():
        print(f"{key:<24} {value:.6g}")
    print(f"wrote {run_dir / ('eval-' + result['split'] + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
