"""`hydra/launcher=torchrun`: run each job of a sweep in `nproc_per_node` processes, as torchrun would.

    python -m runner -m +experiment=digits hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 \
        distributed=ddp optimizer.lr=1e-3,3e-3

The sweep process resolves each job's folder (outputs/multirun/DATE/TIME/N) as Hydra's basic launcher does, then starts
the job's processes with torch's elastic launcher: `python -m runner <the job's overrides> hydra.run.dir=<its folder>`.
The children are an ordinary torchrun job (rank 0 writes .hydra/, logs and summary.json into that folder). The job's
return value for sweepers is the monitored value that rank 0 wrote to summary.json, which is what main() returns.
"""

# No `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules, where dataclasses
# cannot resolve string annotations.
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.grammar.utils import escape_special_characters
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)

# Hydra overrides of the sweep that must not reach a job: a job is a plain run into the folder the launcher chose.
_SWEEP_ONLY = ("hydra/launcher", "hydra.launcher", "hydra/sweeper", "hydra.sweeper", "hydra.mode", "hydra.run.dir")


@dataclass
class TorchrunLauncherConf:
    """One node; every job gets its own rendezvous on a free local port (like `torchrun --standalone`)."""

    _target_: str = "hydra_plugins.runner_launchers.torchrun_launcher.TorchrunLauncher"
    nproc_per_node: Any = 1  # processes per job: a number, or gpu / cpu / auto as torchrun accepts
    max_restarts: int = 0  # restarts of a failed job (add resume=auto to continue from its last checkpoint)
    monitor_interval: float = 0.1  # seconds between checks of the job's processes


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf, provider="runner")


class TorchrunLauncher(Launcher):
    """Runs the jobs one after another, each in `nproc_per_node` processes."""

    def __init__(self, nproc_per_node: Any = 1, max_restarts: int = 0, monitor_interval: float = 0.1) -> None:
        self.nproc_per_node = nproc_per_node
        self.max_restarts = max_restarts
        self.monitor_interval = monitor_interval
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        """Keep the sweep's config; the task function runs in the children, not here."""
        self.config = config
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run every job to its end (a failed job does not stop the others) and return their results."""
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally, {self.nproc_per_node} processes each")
        returns, sweep_hydra = [], HydraConfig.instance().cfg
        try:
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                returns.append(self._run(idx, list(overrides)))
        finally:
            HydraConfig.instance().cfg = sweep_hydra
        return returns

    def _run(self, idx: int, overrides: list[str]) -> JobReturn:
        assert self.config is not None and self.hydra_context is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config):
            config.hydra.job.id = idx
            config.hydra.job.num = idx
        HydraConfig.instance().set_config(config)  # ${hydra.job.num} in the folder's name resolves against this job
        job_dir = Path(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir)).absolute()
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = str(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)

        args = ["-m", "runner", *self._child_options(config), *overrides]
        args += [
            f"hydra.run.dir={escape_special_characters(str(job_dir))}",
            f"hydra.job.num={idx}",
            f"hydra.job.id={idx}",
        ]
        # The children are plain runs (RUN mode): this tells them they are job `idx` of this sweep (wandb's group
        # and name, summary.json's `failed` record; runner.build.sweep_job).
        from runner.sweeps.job import SWEEP_DIR_VARIABLE  # here, not at the top: Hydra imports every plugin at startup

        os.environ[SWEEP_DIR_VARIABLE] = str(Path(str(config.hydra.sweep.dir)).absolute())
        try:
            failures = _elastic_run(args, self.nproc_per_node, self.max_restarts, self.monitor_interval)
        finally:
            del os.environ[SWEEP_DIR_VARIABLE]

        ret = JobReturn(overrides=overrides, hydra_cfg=config, cfg=OmegaConf.masked_copy(config, _task_keys(config)))
        ret.working_dir, ret.task_name = os.getcwd(), str(config.hydra.job.name)
        from runner.run import StopReason
        from runner.rundir import SUMMARY, read_json, write_json
        from runner.sweeps.job import objective

        # As main() does in a sweep: a failed job is recorded (summary.json, then results.csv) and the sweep goes on.
        summary = read_json(job_dir / SUMMARY) or {}
        ret.status = JobStatus.COMPLETED
        if not failures:
            ret.return_value = (summary.get("best") or {}).get("value")
        elif _diverged(failures):
            ret.return_value = objective(StopReason.NONFINITE, None, str(config.mode))
        else:
            said = _reason(job_dir, failures)
            error = f"job #{idx} failed ({_describe(failures)}{said}); its output is above, its folder: {job_dir}"
            log.error(error)
            if summary.get("stop_reason") != StopReason.FAILED:  # a rank died before rank 0 could say why
                write_json(job_dir / SUMMARY, {**summary, "stop_reason": StopReason.FAILED, "error": error})
            ret.return_value = objective(StopReason.FAILED, None, str(config.mode))
        self.hydra_context.callbacks.on_job_end(config=config, job_return=ret)
        return ret

    def _child_options(self, config: DictConfig) -> list[str]:
        # The sweep's own choices a job needs to compose the same config: its config name, --config-dir, and the
        # Hydra overrides of the command line (hydra.verbose, hydra/job_logging=...), less the sweep-only ones.
        options = [f"--config-name={config.hydra.job.config_name}"]
        options += [
            f"--config-dir={source.path.removeprefix('file://')}"
            for source in config.hydra.runtime.config_sources
            if source.provider == "command-line" and source.schema == "file"
        ]
        for override in self.config.hydra.overrides.hydra:
            key = override.split("=", 1)[0].lstrip("~+")
            if not key.startswith(_SWEEP_ONLY):
                options.append(override)
        return options


def _elastic_run(args: list[str], nproc_per_node: Any, max_restarts: int, monitor_interval: float) -> dict[int, int]:
    """Run `python *args` in nproc_per_node processes with a fresh local rendezvous; {rank: exit code} of failures."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.distributed.run import determine_local_world_size

    nproc = determine_local_world_size(str(nproc_per_node))
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: no thread oversubscription on the CPU
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port for each job, as `torchrun --standalone`
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
    )
    # The elastic agent installs its own signal handlers; give the sweep back its own afterwards (Ctrl-C). Its
    # process-level log lines ("failed (exitcode: 2) local_rank: 1 ...") are what the job's error says again.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    processes = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level, processes.level = processes.level, logging.CRITICAL
    try:
        elastic_launch(launch, entrypoint=sys.executable)(*args)
    except ChildFailedError as error:
        return {rank: failure.exitcode for rank, failure in error.failures.items()}
    except SignalException as stop:
        # Ctrl-C or SIGTERM to the sweep, which the agent has passed on to the job's processes: end the sweep as
        # a run ends when interrupted (exit 128 + the signal), without the agent's traceback.
        print(f"sweep stopped by {stop.sigval.name}", file=sys.stderr)
        raise SystemExit(128 + stop.sigval) from None
    finally:
        processes.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return {}


def _task_keys(config: DictConfig) -> list[str]:
    return [key for key in config if key != "hydra"]


def _describe(failures: dict[int, int]) -> str:
    # The ranks that exited with a code first: the others were stopped by the elastic agent (SIGTERM) because of them.
    def one(rank: int, code: int) -> str:
        return (
            f"rank {rank} exited with code {code}"
            if code >= 0
            else f"rank {rank} was stopped by {signal.Signals(-code).name}"
        )

    return ", ".join(
        one(rank, code) for rank, code in sorted(failures.items(), key=lambda item: (item[1] < 0, item[0]))
    )


def _reason(job_dir: Path, failures: dict[int, int]) -> str:
    # The first rank to fail may exit before rank 0 has written summary.json (the agent then stops rank 0): the
    # reason is in that rank's own log (runner.log.ranks.record_failure writes it before the rank exits).
    from runner.log.ranks import FAILED
    from runner.rundir import RANK_LOG

    for rank in sorted(rank for rank, code in failures.items() if code >= 0):
        path = job_dir / RANK_LOG.format(rank)
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        said = [line.split(FAILED, 1)[1] for line in lines if FAILED in line]
        if said:
            return f": {said[-1]}"
    return ""


def _diverged(failures: dict[int, int]) -> bool:
    # The ranks stop on non-finite losses together, but the first to exit (code 3) makes the elastic agent stop the
    # others (SIGTERM), perhaps before rank 0 has written summary.json: the exit codes are what is sure.
    from runner.run import StopReason

    codes, diverged = set(failures.values()), StopReason.NONFINITE.exit_code
    return diverged in codes and all(code in (diverged, -signal.SIGTERM) for code in codes)
