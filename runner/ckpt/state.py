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
from runner.rundir.old_names import upgraded


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
    dataset = stateful_data(run)
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
        # by rank: each has its own (an SAE's activation buffer), as of the batches trained on, not those fetched ahead
        **({"data": per_rank(dataset.state_dict(run.progress.micro_batch))} if dataset is not None else {}),
    }


def stateful_data(run: Run) -> Any:
    """The training loader (a stream's: runner.data.streaming) or dataset (an SAE's activation buffer) when it has state
    of its own that a resume needs, or None.

    Such an object has `state_dict(batches)`, its state after this rank's first `batches` training micro-batches
    (the loop fetches ahead of what it trains), and `load_state_dict(state, batches)`, where `state` is None for a
    checkpoint that holds none (written before the data had state)."""
    for data in (run.train_loader, getattr(run.train_loader, "dataset", None)):
        if hasattr(data, "state_dict") and hasattr(data, "load_state_dict"):
            return data
    return None


def _shapes(run: Run) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in bare_names(run.task.state_dict()).items()}


def exactness(run: Run) -> dict[str, int]:
    """What must not change between a run and its resume for the resume to be exact."""
    p = run.progress
    return {"batch_size": p.batch_size, "world_size": p.world_size, "accumulate": p.accumulate}


def _key(index: int, callback: Any) -> str:
    return f"{index}:{type(callback).__name__}"


# Settings that change what is logged, saved or how fast, never the training itself: a resume may change them.
INERT = (
    "resume",
    "resume_allow_changes",
    "run_dir",
    "threads",
    "fail_fast",
    "logger",
    "trainer.log_interval",
    "trainer.max_time",
    "trainer.stop_check_interval",
    "data.num_workers",
    "checkpoint",
    "callbacks.profiler",
    "compile",  # how the same model runs: the weights and their names do not change
    "activation_checkpointing",
    "trainer.peak_flops",
    "trainer.short_run_tolerance",
    "callbacks.text_samples",  # its own generator: sampling never changes the training
    "callbacks.perplexity",
    "init_from",  # the checkpoint's weights replace what init_from loaded
    "init_strict",
)
ABSENT = "<absent>"
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # optimizer settings a resume keeps as built


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def config_changes(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between a checkpoint's config and this run's: (saved, now); INERT keys aside."""
    if saved is None or now is None:  # a run built without a config (from Python): nothing to compare
        return {}
    # A checkpoint written before a shipped class moved or changed its options' shape is read as it is written now;
    # one written before an option existed lacks its key, which a new option's default (null, false: off) leaves
    # as it was.
    a, b = _flat(upgraded(saved)), _flat(now)
    a |= {k: v for k, v in b.items() if k not in a and (v is None or v is False)}
    inert = [k.split(".") for k in INERT]
    return {
        k: (a.get(k, ABSENT), b.get(k, ABSENT))
        for k in sorted(set(a) | set(b))
        if a.get(k, ABSENT) != b.get(k, ABSENT) and not any(k.split(".")[: len(i)] == i for i in inert)
    }


def _apply_optimizer_changes(run: Run, fresh: list[dict[str, Any]], lr_ratio: float) -> None:
    # The loaded optimizer state carries the old hyperparameters: put the new config's back (weight decay, betas,
    # momentum...), and scale the learning rate where the schedule has brought it (its warmup, decay or plateau
    # reductions apply to the new base LR from here on).
    for group, new in zip(run.optimizer.param_groups, fresh, strict=True):
        group.update({k: v for k, v in new.items() if k not in ("lr", "initial_lr")})
        group["lr"] *= lr_ratio
        if "initial_lr" in group:
            group["initial_lr"] *= lr_ratio
    scheduler = getattr(run.schedule, "scheduler", None)
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * lr_ratio for lr in scheduler.base_lrs]


def restore(run: Run, contents: tuple, allow_changes: bool = False) -> dict[str, Any]:
    """Put a loaded checkpoint's state into `run`; returns its manifest, with `config_changes` (key: [saved, now]).

    Refuses a resume that would not continue the same training (another batch size, world size or accumulation, or
    any config change outside INERT) unless `allow_changes`; then the new optimizer settings are applied.
    """
    weights, state, manifest = contents
    now = exactness(run)
    changed = {k: (v, now.get(k)) for k, v in state["exactness"].items() if now.get(k) != v}
    config = config_changes(manifest.get("config"), run.settings.config)
    if (changed or config) and not allow_changes:
        details = [f"{k} {old} -> {new}" for k, (old, new) in changed.items()]
        details += [f"{k}: {old!r} -> {new!r}" for k, (old, new) in config.items()]
        more = f" (and {len(details) - 8} more)" if len(details) > 8 else ""
        raise CheckpointError(
            f"this run differs from the checkpoint in {'; '.join(details[:8])}{more}: the resume would not continue "
            "the same training. Resume with the checkpoint's settings (see .hydra/config.yaml of the run), or set "
            "resume_allow_changes=true to resume with the new ones (recorded in run-resumed-at-STEP.json)."
        )
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    shapes = _shapes(run)
    if shapes != state["shapes"]:
        diff = sorted(k for k in set(shapes) | set(state["shapes"]) if shapes.get(k) != state["shapes"].get(k))
        raise CheckpointError(
            f"the model differs from the checkpoint's ({len(diff)} tensors differ in name or shape, e.g. "
            f"{diff[:3]}): a checkpoint resumes the same model; use init_from to start from its weights"
        )
    if hasattr(weights, "load_into"):  # a distributed checkpoint (runner.ckpt.dcp): each rank reads its own shards
        weights.load_into(run)
    else:
        run.strategy.load_model_state(run.task, weights)  # FSDP: each rank keeps its shards of the full tensors
        run.strategy.load_optimizer_state(run.optimizer, state["optimizer"])
    for group, built in zip(run.optimizer.param_groups, fresh, strict=True):
        # how this process runs the optimizer, not where training stands: fused is off for FSDP's shards and on for
        # one process's tensors (runner.build), and the precision's step follows what was built here
        group.update({k: built[k] for k in IMPLEMENTATION if k in built})
    run.schedule.load_state_dict(state["schedule"])
    if any(k.startswith("optimizer.") for k in config):
        old, new = (manifest["config"].get("optimizer", {}).get("lr"), run.settings.config["optimizer"].get("lr"))
        ratio = new / old if isinstance(old, (int, float)) and isinstance(new, (int, float)) and old else 1.0
        _apply_optimizer_changes(run, fresh, ratio)
    run.precision.load_state_dict(state["precision"])
    # another world size only with resume_allow_changes: ranks beyond the checkpoint's reuse its ranks' values
    run.state.load_state_dict(_own(state["state"], run.strategy.rank))
    set_rng_state(_own(state["rng"], run.strategy.rank))
    dataset = stateful_data(run)
    if dataset is not None:
        saved = state.get("data")
        dataset.load_state_dict(_own(saved, run.strategy.rank) if saved else None, run.progress.micro_batch)
    for i, cb in enumerate(run.callbacks):
        if _key(i, cb) in state["callbacks"]:
            cb.load_state_dict(state["callbacks"][_key(i, cb)])
    for logger in run.loggers:
        logger.resume(run.progress.step, state["loggers"].get(type(logger).__name__, {}))
    return {**manifest, "config_changes": {k: list(v) for k, v in config.items()}}


def _own(per_rank: list[Any], rank: int) -> Any:
    return per_rank[rank % len(per_rank)]
