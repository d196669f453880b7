"""What a checkpoint holds besides the weights (the training state), and putting it back exactly.

Layered one way: runner.ckpt.files (bytes on disk) <- this module (what the bytes mean) <- runner.ckpt.callback (when).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from runner.ckpt.files import CheckpointError, bare_names
from runner.run import Run


def model_weights(run: Run) -> dict[str, torch.Tensor]:
    """The bare model's full weights, for files. Collective: every rank calls it; under FSDP only rank 0's are real."""
    return bare_names(run.strategy.model_state(run.task))


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
    per_rank = run.strategy.gather if gather else (lambda value: [value] * run.world_size)
    return {
        "optimizer": run.strategy.optimizer_state(run.optimizer) if gather else run.optimizer.state_dict(),
        "schedule": run.schedule.state_dict(),
        "precision": run.precision.state_dict(),
        # every rank's run state (progress, metric sums since the last log, best, non-finite streak...) and
        # generators, by rank
        "state": per_rank(run.state.state_dict()),
        "rng": per_rank(rng_state()),
        "callbacks": {_key(i, cb): cb.state_dict() for i, cb in enumerate(run.callbacks)},
        "loggers": {type(logger).__name__: logger.state_dict() for logger in run.loggers},
        "shapes": _shapes(run),
        "exactness": exactness(run),
    }


def _shapes(run: Run) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in bare_names(run.task.state_dict()).items()}


def exactness(run: Run) -> dict[str, int]:
    """What must not change between a run and its resume for the resume to be exact."""
    p = run.progress
    return {"batch_size": p.batch_size, "world_size": p.world_size, "accumulate": p.accumulate}


def _key(index: int, callback: Any) -> str:
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
    shapes = _shapes(run)
    if shapes != state["shapes"]:
        diff = sorted(k for k in set(shapes) | set(state["shapes"]) if shapes.get(k) != state["shapes"].get(k))
        raise CheckpointError(
            f"the model differs from the checkpoint's ({len(diff)} tensors differ in name or shape, e.g. "
            f"{diff[:3]}): a checkpoint resumes the same model; use init_from to start from its weights"
        )
    run.strategy.load_model_state(run.task, weights)  # FSDP: each rank keeps its shards of the full tensors
    run.strategy.load_optimizer_state(run.optimizer, state["optimizer"])
    run.schedule.load_state_dict(state["schedule"])
    run.precision.load_state_dict(state["precision"])
    # another world size only with resume_allow_changes: ranks beyond the checkpoint's reuse its ranks' values
    run.state.load_state_dict(_own(state["state"], run.strategy.rank))
    set_rng_state(_own(state["rng"], run.strategy.rank))
    for i, cb in enumerate(run.callbacks):
        if _key(i, cb) in state["callbacks"]:
            cb.load_state_dict(state["callbacks"][_key(i, cb)])
    for logger in run.loggers:
        logger.resume(run.progress.step, state["loggers"].get(type(logger).__name__, {}))
    return manifest


def _own(per_rank: list[Any], rank: int) -> Any:
    return per_rank[rank % len(per_rank)]
