"""Where the processes run: torchrun's or SLURM's variables, the process group, one launch time for every rank, and
an exit that gloo survives. Read once here: nothing else in runner reads these environment variables."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import Any, NoReturn

import torch

from runner import ConfigError


def pick_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto' means this rank's CUDA device when there is one, else CPU; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"distributed.device={device} but this torch sees no CUDA device; use auto or cpu")
    return chosen


def _first_host(nodelist: str) -> str:
    # SLURM_NODELIST: "node07", "node[07-09,12]", "gpu-a[1-2],gpu-b3": the first node hosts rank 0
    match = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)
    if not match:
        raise ConfigError(f"cannot read the first host of SLURM_NODELIST={nodelist!r}")
    return match.group(1) + (match.group(2) or "")


def environment() -> dict[str, Any]:
    """Rank, world size, local rank and rendezvous address from torchrun's or SLURM's variables (else one process)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun / torch.distributed.elastic
        return {
            "launcher": "torchrun",
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1)),
            "master": env.get("MASTER_ADDR"),
            "port": env.get("MASTER_PORT"),
        }
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return {
            "launcher": "slurm",
            "rank": int(env["SLURM_PROCID"]),
            "world_size": int(env["SLURM_NTASKS"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            # SLURM_NTASKS_PER_NODE only with --ntasks-per-node; SLURM_TASKS_PER_NODE always, e.g. "4(x2),3"
            "local_world_size": int(
                re.split(r"[(,]", env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1"))[0]
            ),
            "master": env.get("MASTER_ADDR")
            or _first_host(env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", ""))),
            "port": env.get("MASTER_PORT", "29500"),
        }
    return {
        "launcher": "none",
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "local_world_size": 1,
        "master": None,
        "port": None,
    }


def init_process_group() -> bool:
    """Join the job's process group once (idempotent); False in one process. Gloo for CPU tensors, NCCL for CUDA."""
    info = environment()
    if info["world_size"] <= 1:
        return False
    if torch.distributed.is_initialized():
        return True
    if not info["master"]:
        raise ConfigError(
            f"{info['world_size']} processes but no rendezvous address: launch with torchrun, or set MASTER_ADDR and "
            "MASTER_PORT"
        )
    os.environ.setdefault("MASTER_ADDR", info["master"])
    os.environ.setdefault("MASTER_PORT", str(info["port"]))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a worker group: after a `--max-restarts` restart it still holds the dead
        # group's gloo/NCCL addresses, which a quick new rank reads and fails to connect to (pytorch/pytorch#167288).
        # Each attempt gets keys of its own.
        agent = torch.distributed.TCPStore(info["master"], int(info["port"]), info["world_size"], is_master=False)
        store = torch.distributed.PrefixStore(f"runner/attempt-{restart_count()}/", agent)
    torch.distributed.init_process_group(backend, store=store, rank=info["rank"], world_size=info["world_size"])
    # kept past the process group: a rank that stops tells the others through it (runner.distributed.stopping)
    _job["store"] = torch.distributed.distributed_c10d._get_default_store()
    return True


_job: dict[str, Any] = {}  # the job's store, once the process group is formed


def job_store() -> Any:
    """The store of this process's job (torchrun's, or rank 0's), kept past the process group; None in one process."""
    return _job.get("store")


def exit_without_teardown(code: Any) -> NoReturn:
    """End this rank's process with `code` (as sys.exit takes it) once its work is done, skipping the interpreter's
    teardown.

    Gloo's worker threads outlive destroy_process_group, and one may still be releasing the last collective's tensors
    when the interpreter finalizes: that release needs the GIL, the thread is killed mid-C++ and the process aborts
    (SIGABRT, "terminate called without an active exception"): 1 in 24 two-rank runs here. Every file is
    closed by then (summary, logs, checkpoints); the log handlers and standard streams are flushed here.
    """
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (`--max-restarts`); 0 on the first launch."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _first_launch_time(now: float) -> float:
    # torchrun's rendezvous store lives as long as the job, across worker restarts: the first launch's time is kept
    # there, so that restarted workers date the same run folder and resume it.
    store = torch.distributed.distributed_c10d._get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    key = f"runner/launch_time/{os.environ['TORCHELASTIC_RUN_ID']}"
    return float(store.compare_set(key, "", repr(now)).decode())


def shared_launch_time() -> float:
    """Rank 0's clock, the same on every rank of a job: Hydra's dated run folder is one folder, not one per rank
    (and under torchrun, the first launch's clock: workers restarted by `--max-restarts` find their run folder)."""
    now = time.time()
    if not init_process_group():
        return now
    if torch.distributed.get_rank() == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        now = _first_launch_time(now)
    shared = [now]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


# Hydra overrides for a rank > 0 (under torchrun, or a SLURM task): rank 0 owns the filesystem, the other ranks write
# no .hydra/ and no runner.log (only their logs/rank-K.log: runner.log.ranks).
QUIET_RANK = ["hydra.output_subdir=null", "hydra/job_logging=quiet_rank"]


def with_resume_auto(overrides: list[str]) -> list[str]:
    """`overrides` with any resume= replaced by resume=auto: a restarted or requeued job goes on from its newest
    checkpoint."""
    return [o for o in overrides if not o.startswith(("resume=", "+resume=", "++resume="))] + ["resume=auto"]
