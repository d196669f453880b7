"""`python -m runner.evaluate RUN_DIR [split=val] [weights=PATH] [device=cpu] [trusted_targets=[a,b]] [data.KEY=VALUE]`
`python -m runner.evaluate SAE_DIR source=MODEL [hook=NAME] [module=MODULE] [target=MODULE] [skip_positions=N]`

Evaluates a finished run's weights (or a checkpoint's: weights=RUN_DIR/checkpoints/step-N, or any model.safetensors)
with the run's own config on a named split of its data, exactly as validation does (each validation_step output
averaged over the whole split in float64, then the task's validation_summary), and writes RUN_DIR/eval-<split>.json.
On the validation split the run's metric callbacks add theirs, as in training: `val/ppl`, an SAE's `val/mmcs`, or its
source model's loss with the SAE spliced in (`val/loss_recovered`, `val/kl_spliced`, ...). They measure on data of
their own (the source's validation windows) or the weights alone, so other splits get only the task's metrics.
RUN_DIR may also be weights inside a run folder (its model.safetensors, a checkpoint folder or its file): the run is the
folder above them, as if they were given with weights=. SAE_DIR, an SAE folder of SAELens or sparsify, is evaluated as
if runner had trained it on MODEL's module (runner.load.load_model; experiments/sae/attach.py): the same metrics,
written to SAE_DIR/eval-<split>.json.
Exit codes as `python -m runner`: 0, or 2 with a one-line message for a wrong argument, split or file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from runner import ConfigError, check_whole
from runner.build import build_data
from runner.config import trust
from runner.interfaces import Precision
from runner.load import TRUSTED_TARGETS, Attach, is_foreign, load_model, measuring_callbacks, trusted_here
from runner.log.console import ConsoleLogger
from runner.rundir import CONFIG, MODEL, DiskFull, write_json
from runner.rundir.outputs import write_failed
from runner.tools.cli import help_asked, key_values
from runner.validation import evaluate_loader

USAGE = "usage: python -m runner.evaluate RUN_DIR [split=val] [weights=PATH] [device=cpu] [data.KEY=VALUE ...]"


def evaluate_run(
    run_dir: str | Path,
    split: str = "val",
    weights: str | Path | None = None,
    device: str = "cpu",
    trusted: tuple[str, ...] = TRUSTED_TARGETS,
    data_overrides: dict[str, Any] | None = None,
    attach: Attach | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Metrics of `weights` (default: the run's model.safetensors) on `split`, written to RUN_DIR/eval-<split>.json.
    `run_dir` may also be weights inside a run folder (its model.safetensors, a checkpoint folder): the run is the
    folder above them, as if given with weights=; or an SAE folder of SAELens or sparsify, with `attach` naming the
    model it reads (runner.load.load_model)."""
    if not isinstance(split, str) or not split or "/" in split or os.sep in split or "\0" in split:
        # it names the file written in the run folder, eval-SPLIT.json, and the split names are the run folder's word
        raise ConfigError(f"split={split!r}: give the name of one of the run's data splits, e.g. split=val")
    foreign = is_foreign(run_dir)
    run_dir, weights = (Path(run_dir), weights) if foreign else _run_and_weights(Path(run_dir), weights)
    device = checked_device(device)
    model, cfg = load_model(run_dir, trusted, attach, weights=weights, callbacks=True)
    loader = _split_loader(cfg, run_dir, split, data_overrides or {}, trusted, device)
    metrics = _measured(model, cfg, loader, split, device)
    used = Path(weights) if weights is not None else run_dir / MODEL
    if foreign:  # the folder's own weights file
        used = Path(cfg.imported.weights)
    file = used / MODEL if used.is_dir() else used  # a checkpoint folder's weights file
    result = {
        "split": split,
        "samples": len(loader.dataset),
        "weights": str(used),
        "weights_sha256": hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None,
        "metrics": {key.replace("val/", f"{split}/", 1): value for key, value in metrics.items()},
    }
    out = run_dir / f"eval-{split}.json"
    try:
        write_json(out, result)
    except (OSError, DiskFull) as error:  # a full disk (advice: run it again, not resume=auto), a folder at its name
        kept = f"nothing was written (an earlier {out.name}, if any, is as it was)"
        raise write_failed(error, f"writing {out}", kept) from None
    return result


def _split_loader(
    cfg: Any, run_dir: Path, split: str, data_overrides: dict[str, Any], trusted: tuple[str, ...], device: str
) -> Any:
    """The loader of `split` of the run's data, with the command line's data.KEY= overrides (trusted targets only)."""
    for key, value in data_overrides.items():
        if OmegaConf.select(cfg.data, key, default=KeyError) is KeyError:
            raise ConfigError(f"data.{key}: the data config of {run_dir} has no such key")
        OmegaConf.update(cfg.data, key, value)
    trust.check(OmegaConf.to_container(cfg.data, resolve=True), "data", trusted, "data", "the command line's data.KEY=")
    if cfg.data.get("val_batch_size") is not None:  # DataModule takes 0 as "as batch_size" and -1 as a crash
        check_whole(cfg.data.val_batch_size, "data.val_batch_size")
    try:
        data = build_data(cfg)  # a ConfigError of the data's own comes through bare
    except InstantiationException as error:  # a data.KEY= of the wrong type, a file that is not there
        raise ConfigError(f"cannot build the data of {run_dir}: {' '.join(str(error).split())}") from None
    loader = data.split_loader(split, device=torch.device(device))
    if loader is None:
        raise ConfigError(f"split={split}: the data of {run_dir} has the splits {sorted(data.splits)}; pick one")
    return loader


def _measured(model: Any, cfg: Any, loader: Any, split: str, device: str) -> dict[str, float]:
    """The metrics of `model` on `loader` as validation computes them, and on the validation split the run's metric
    callbacks' too."""
    model.to(device)
    precision = _precision(cfg.get("precision"), device)
    progress = ConsoleLogger()  # a long pass prints where it is every 30 s (none for a pass shorter than that)
    working = functools.partial(progress.working, split)
    try:
        metrics = evaluate_loader(model, loader, precision, torch.device(device), working=working)
        if split == "val":
            # What a metric callback reads of a run (its task, device, validation loader, progress): there is no Run.
            run = SimpleNamespace(task=model, device=torch.device(device), val_loader=loader, working=progress.working)
            for callback in measuring_callbacks(cfg):
                callback.on_validation_end(run, metrics)
    finally:
        progress.close()  # a pass cut short by an error: its heartbeat thread stops with it
    return metrics


def _precision(node: Any, device: str) -> Precision:
    # The run's own precision option (fp32, bf16 or fp16 autocast): evaluated as it validated. load_trained checked
    # that its target is one of runner.precision's classes.
    from hydra.utils import instantiate

    from runner.precision import FP32

    return FP32(torch.device(device)) if node is None else instantiate(node, device=torch.device(device))


def _run_and_weights(path: Path, weights: str | Path | None) -> tuple[Path, str | Path | None]:
    # RUN_DIR as given: a run folder, or weights inside one (the same files weights= takes), whose run is the nearest
    # folder above them with a .hydra/config.yaml (RUN/model.safetensors, RUN/checkpoints/step-N[/model.safetensors])
    if weights is not None and not Path(weights).exists():
        raise ConfigError(f"weights={weights} does not exist: give a checkpoint folder or a .safetensors file")
    hint = "give the folder of a finished run, e.g. python -m runner.evaluate outputs/DATE/TIME"
    if (path / CONFIG).is_file():
        if weights is None and not (path / MODEL).is_file():
            raise ConfigError(f"{path} has no {MODEL} (the run has not finished): give weights=CHECKPOINT, or {hint}")
        return path, weights
    if not path.exists():
        raise ConfigError(f"{path} does not exist: {hint}")
    if not (path.suffix == ".safetensors" if path.is_file() else (path / "manifest.json").is_file()):
        what = "is a file, not a run folder" if path.is_file() else f"is not a run folder (it has no {CONFIG})"
        raise ConfigError(f"{path} {what}: {hint}")
    run = next((p for p in list(path.parents)[:3] if (p / CONFIG).is_file()), None)
    if run is None:
        raise ConfigError(f"{path} is not inside a run folder (none above it has a {CONFIG}): {hint}")
    if weights is not None:
        raise ConfigError(f"{path} are weights, and so is weights={weights}: give the run folder {run} and weights=")
    return run, path


def checked_device(device: Any) -> str:
    """`device` if this machine has it (torch takes "cuda" without one and fails deep inside the first copy)."""
    try:
        kind = torch.device(device).type if isinstance(device, str) else None
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device={device}: give device=cpu, device=cuda (or cuda:N) or device=mps")
    index = torch.device(device).index or 0
    if kind == "cuda" and index >= torch.cuda.device_count():
        found = f"only {torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise ConfigError(f"device={device}: this machine has {found}; give device=cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device}: this machine has no MPS (Apple GPU) device; give device=cpu")
    return device


_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def read_value(key: str, value: str) -> Any:
    """The value of a command-line KEY=VALUE as Hydra reads it (64 -> int, 2e6 -> float, [a,b] -> list), or why it
    cannot be."""
    if _EXPONENT.fullmatch(value):  # YAML 1.1 reads 2e6 as text (it wants 2.0e+6); Hydra, as a number
        return float(value)
    try:
        return yaml.safe_load(value) if value else value
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        quoted = f"'{key}=\"{value}\"'"
        raise ConfigError(f"{key}={value}: cannot read the value {value!r} ({problem}); quote text: {quoted}") from None


def read_options(args: list[str], defaults: dict[str, Any], texts: tuple[str, ...], usage: str) -> dict[str, Any]:
    """`defaults` updated from a tool's KEY=VALUE arguments (`texts`: keys kept as text, the others read as Hydra
    reads values); an unknown key or a bare word is a ConfigError that lists the keys, and `usage`'s tail."""
    options = dict(defaults)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in defaults:
            raise ConfigError(f"{arg!r}: give KEY=VALUE with KEY one of {', '.join(defaults)}{usage}")
        options[key] = value if key in texts else read_value(key, value)
    return options


def _arguments(argv: list[str]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    argv = key_values(argv, ("split", "weights", "device", "trusted_targets", "data.", *Attach.keys()))
    if not argv or "=" in argv[0] or argv[0] in ("-h", "--help"):
        raise ConfigError(USAGE)
    options: dict[str, Any] = {}
    data: dict[str, Any] = {}
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg!r} is not KEY=VALUE; {USAGE}")
        parsed = read_value(key, value)
        if key.startswith("data."):
            data[key.removeprefix("data.")] = parsed
        elif key in ("split", "weights", "device", "trusted_targets"):
            options[key] = parsed
        elif key in Attach.keys():  # an SAE folder of SAELens or sparsify: the model it reads
            options.setdefault("attach", {})[key] = value if key in Attach.TEXT else parsed
        else:
            raise ConfigError(
                f"unknown argument {key!r}: give split=, weights=, device=, trusted_targets=, data.KEY=, or for an "
                "SAE folder of SAELens or sparsify source=, hook=, module=, target=, skip_positions=, inputs="
            )
    for key in ("split", "weights", "device"):
        if key in options and not isinstance(options[key], str):
            raise ConfigError(f"{key}={options[key]!r}: give one name, e.g. split=test, weights=PATH, device=cpu")
    if "trusted_targets" in options:
        targets = options.pop("trusted_targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"trusted_targets={targets!r}: give a list of module paths, e.g. trusted_targets=[a,b]")
        options["trusted"] = tuple(targets)
    else:  # the project's runner.yaml in the folder this is launched from (runner init writes it)
        options["trusted"] = trusted_here()
    return Path(argv[0]), options, data


def main(argv: list[str] | None = None) -> int:
    """The command: evaluate, print the metrics, exit 0; or print why not and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, __doc__):
        return 0
    try:
        path, options, data = _arguments(argv)
        run_dir = path
        if not is_foreign(path):
            run_dir, options["weights"] = _run_and_weights(path, options.get("weights"))
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
