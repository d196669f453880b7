"""The training state of a run: what a checkpoint holds besides the weights, and putting it back exactly."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runner import ConfigError
from runner.callbacks import Callback

if TYPE_CHECKING:
    from runner.loop import Run

FINISHED = ("max_duration", "early_stopping")  # stop reasons after which there is nothing left to resume


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, unsafe, or from an incompatible run."""


def bare_state_dict(model: torch.nn.Module, state: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights (or `state`, a state_dict of it) under the names of the bare model (no DDP `module.` or
    torch.compile `_orig_mod.`). Under FSDP, model.state_dict() holds this rank's shards (DTensors): see
    model_weights."""
    bare = {}
    for name, tensor in (model.state_dict() if state is None else state).items():
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        bare[name.replace("._orig_mod.", ".")] = tensor  # a compiled submodule
    return bare


def model_weights(run: Run) -> dict[str, torch.Tensor]:
    """The bare model's full weights, for files. Collective: every rank calls it; under FSDP only rank 0's are real."""
    return bare_state_dict(run.task, run.distributed.model_state(run.task))


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and every CUDA device's generator states (this process's)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore rng_state()."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(run: Run, gather: bool = True) -> dict[str, Any]:
    """Everything but the model weights that an exact resume needs. Collective: per-rank values are gathered, and
    the optimizer's shards under FSDP. With gather=False, no communication: this rank's values stand in for every
    rank's, and its shards for the full tensors (the same shapes: a DTensor's shape is the full tensor's)."""
    per_rank = run.distributed.gather if gather else (lambda value: [value] * run.world_size)
    return {
        "optimizer": run.distributed.optimizer_state(run.optimizer) if gather else run.optimizer.state_dict(),
        "schedule": run.schedule.state_dict(),
        "precision": run.precision.state_dict(),
        "progress": run.progress.state_dict(),
        "rng": per_rank(rng_state()),  # every rank's generators, by rank
        "callbacks": {_key(i, cb): cb.state_dict() for i, cb in enumerate(run.callbacks)},
        "loggers": {type(logger).__name__: logger.state_dict() for logger in run.loggers},
        "run": {
            "best": run.best.state_dict(),
            "metrics": dict(run.metrics),
            "nonfinite_steps": run.nonfinite_steps,
            "meter": per_rank(run.meter.state_dict()),  # each rank's sums since the last log
        },
        "shapes": {k: list(v.shape) for k, v in bare_state_dict(run.task).items()},
        "exactness": exactness(run),
    }


def exactness(run: Run) -> dict[str, int]:
    """What must not change between a run and its resume for the resume to be exact."""
    p = run.progress
    return {"batch_size": p.batch_size, "world_size": p.world_size, "accumulate": p.accumulate}


def _key(index: int, callback: Callback) -> str:
    return f"{index}:{type(callback).__name__}"


def restore(run: Run, contents: tuple, allow_changes: bool = False) -> dict[str, Any]:
    """Put a loaded checkpoint's state into `run`; returns its manifest. Refuses a resume that cannot be exact."""
    weights, state, manifest = contents
    now = exactness(run)
    changed = {k: (v, now.get(k)) for k, v in state["exactness"].items() if now.get(k) != v}
    if changed and not allow_changes:
        details = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
        raise CheckpointError(
            f"this run differs from the checkpoint in {details}: the resume would not continue the same training. "
            "Set resume_allow_changes=true to resume anyway."
        )
    shapes = {k: list(v.shape) for k, v in bare_state_dict(run.task).items()}
    if shapes != state["shapes"]:
        diff = sorted(k for k in set(shapes) | set(state["shapes"]) if shapes.get(k) != state["shapes"].get(k))
        raise CheckpointError(
            f"the model differs from the checkpoint's ({len(diff)} tensors differ in name or shape, e.g. "
            f"{diff[:3]}): a checkpoint resumes the same model; use init_from to start from its weights"
        )
    run.distributed.load_model_state(run.task, weights)  # FSDP: each rank keeps its shards of the full tensors
    run.distributed.load_optimizer_state(run.optimizer, state["optimizer"])
    run.schedule.load_state_dict(state["schedule"])
    run.precision.load_state_dict(state["precision"])
    run.progress.load_state_dict(state["progress"])
    rngs = state["rng"]
    set_rng_state(rngs[run.distributed.rank % len(rngs)])  # another world size only with resume_allow_changes
    for i, cb in enumerate(run.callbacks):
        if _key(i, cb) in state["callbacks"]:
            cb.load_state_dict(state["callbacks"][_key(i, cb)])
    for logger in run.loggers:
        logger.resume(run.progress.step, state["loggers"].get(type(logger).__name__, {}))
    run.best.load_state_dict(state["run"]["best"])
    run.metrics.update(state["run"]["metrics"])
    run.nonfinite_steps = state["run"]["nonfinite_steps"]
    meters = state["run"]["meter"]
    run.meter.load_state_dict(meters[run.distributed.rank % len(meters)])
    return manifest


def init_from(model: torch.nn.Module, path: str | Path, strict: bool = True) -> dict[str, list[str]]:
    """Load only weights into `model` from a checkpoint folder, a run folder or a .safetensors file (fine-tuning).

    Reports missing, unexpected and shape-mismatched keys; with `strict` any of them is an error, otherwise the
    matching tensors are loaded and the rest keep their initial values.
    """
    from safetensors.torch import load as safetensors_load

    from runner.checkpoint import read_manifest, verified

    path = Path(path)
    if (path / "manifest.json").is_file():
        weights = safetensors_load(verified(path, "model.safetensors", read_manifest(path)))
    else:
        file = path / "model.safetensors" if path.is_dir() else path
        try:
            weights = safetensors_load(file.read_bytes())
        except (OSError, Exception) as error:
            raise CheckpointError(
                f"init_from={path}: cannot read weights ({error}); give a checkpoint folder, a run folder or a "
                ".safetensors file"
            ) from None
    own = bare_state_dict(model)
    report = {
        "missing": sorted(set(own) - set(weights)),
        "unexpected": sorted(set(weights) - set(own)),
        "shape_mismatch": sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape),
    }
    problems = {k: v for k, v in report.items() if v}
    if problems and strict:
        details = "; ".join(f"{k}: {v[:5]}{' ...' if len(v) > 5 else ''}" for k, v in problems.items())
        raise CheckpointError(
            f"init_from={path} does not fit the model ({details}). Set init_strict=false to "
            "load the tensors that fit and keep the others as initialised."
        )
    usable = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
    with torch.no_grad():
        for name, tensor in usable.items():
            own[name].copy_(tensor)
    print(
        f"init_from: loaded {len(usable)} of {len(own)} tensors from {path}"
        + "".join(f"; {k}: {len(v)}" for k, v in problems.items()),
        file=sys.stderr,
    )
    return report
