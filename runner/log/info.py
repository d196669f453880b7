"""Facts about a run for its files and loggers: run.json (command, git, versions, host), the loggers' start() info,
and, in a sweep, the job's name and group."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from runner import waits
from runner.run import Run
from runner.sweeps.job import SweepJob


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(device: str, world_size: int) -> dict[str, Any]:
    """What run.json records: command line, git state, versions, host, device, world size."""
    import hydra

    commit = _git("rev-parse", "HEAD")
    return {
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "git": {"commit": commit, "dirty": bool(_git("status", "--porcelain")) if commit else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "hydra": hydra.__version__},
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),  # with summary.json's wall_time_s: when the run ran (did parallel jobs overlap?)
        "device": device,
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "openmp_wait_policy": waits.chosen or {"policy": os.environ.get("OMP_WAIT_POLICY"), "why": "not chosen"},
    }


def _held(task: torch.nn.Module) -> dict[str, int]:
    # distributed=spread: rank 0 holds its own SAEs' parameters, the others' are placeholders (the meta device)
    held = sum(q.numel() for q in task.parameters() if not q.is_meta)
    return {"parameters_on_rank_0": held} if held != sum(q.numel() for q in task.parameters()) else {}


def run_info(run: Run, cfg: DictConfig, sweep: SweepJob | None = None) -> dict[str, Any]:
    """Facts for the loggers' start(): what the console's startup table shows and what wandb stores as config."""
    p = run.progress
    return {
        "task": type(run.task).__name__,
        "parameters": sum(q.numel() for q in run.task.parameters()),
        "trainable_parameters": sum(q.numel() for q in run.task.parameters() if q.requires_grad),  # LoRA: adapters
        **_held(run.task),
        "device": str(run.device),
        "precision": run.precision.name,
        "world_size": run.world_size,
        "threads": torch.get_num_threads(),  # intra-op threads: they change speed, and the last bits of results
        "wait_policy": f"{waits.chosen['policy']}: {waits.chosen['why']}" if waits.chosen else "not chosen (library)",
        "distributed": f"{run.strategy.strategy}, backend {run.strategy.backend}, "
        f"{run.strategy.local_world_size} rank(s) per node on {run.world_size // run.strategy.local_world_size} "
        "node(s)",
        "compile": run.settings.compiled or "off",
        "activation_checkpointing": run.settings.recomputed or "off",
        "global_batch": f"{p.batch_size} x {run.world_size} x {p.accumulate} = "
        f"{p.batch_size * run.world_size * p.accumulate}",
        "total_steps": p.total_steps(),
        "max_duration": str(p.max_duration),
        "run_dir": cfg.get("run_dir"),
        "config": OmegaConf.to_container(cfg, resolve=True),
        **hydra_facts(sweep),
    }


def _parsed(override: str) -> tuple[str, Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_override(override)
        return parsed.get_key_element(), parsed.value()
    except HydraException:
        return override.partition("=")[0], override


def hydra_facts(sweep: SweepJob | None) -> dict[str, Any]:
    """Which experiment this is and, in a sweep, the sweep folder (its name, its path) and this job's own overrides;
    else None."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {"experiment": None, "sweep": None, "sweep_dir": None, "job": None}
    hc = HydraConfig.get()
    experiment = hc.runtime.choices.get("experiment")
    if sweep is None:
        return {"experiment": experiment, "sweep": None, "sweep_dir": None, "job": None}
    sweep_dir, num = sweep.dir, sweep.num
    # The job is named by what the sweep sets for it: the overrides whose value differs from the sweep command
    # line's (multirun.yaml; the last one of a key wins): "seed=0,1" there, "seed=1" here. Values are compared
    # parsed, as the sweeper rewrites them ("optimizer.lr=3e-3" reaches the job as "optimizer.lr=0.003").
    shared = sweep_dir / "multirun.yaml"
    given = OmegaConf.load(shared).hydra.overrides.task if shared.is_file() else []
    command_line = dict(map(_parsed, given))
    own = [o for o in hc.overrides.task if command_line.get(_parsed(o)[0], o) != _parsed(o)[1]]
    return {
        "experiment": experiment,
        # the last two parts (multirun/DATE/TIME -> DATE/TIME): unique across days, short enough to read
        "sweep": "/".join(sweep_dir.parts[-2:]),
        "sweep_dir": str(sweep_dir),  # where a logger keeps what the jobs share (MLflow's default store)
        "job": f"{num}: {' '.join(own)}" if own else str(num),
    }
