"""runner's Hydra launchers in-process: Hydra finds them, the SLURM launcher's sbatch script, ranks from SLURM's
variables, and the requeue of a preempted job. Sweeps they launch: tests/e2e/test_launcher.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from helpers import LAUNCHER_TINY as TINY
from helpers import needs_submitit
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher

from runner.distributed.env import environment

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_the_launchers_are_found_by_hydra() -> None:
    names = {plugin.__name__ for plugin in Plugins.instance().discover(Launcher)}
    assert "TorchrunLauncher" in names
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
        assert {"RunnerSlurmLauncher", "RunnerLocalLauncher"} <= names


@needs_submitit
def test_slurm_config_submits_one_task_per_gpu(tmp_path: Path, launcher_for, monkeypatch: pytest.MonkeyPatch) -> None:
    # No SLURM here: a stand-in `srun` lets submitit build its executor, and the sbatch script is read instead of
    # submitted.
    from submitit.slurm.slurm import SlurmExecutor

    from hydra_plugins.runner_launchers.slurm_launcher import RunnerSlurmLauncher

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    scripts = []

    class Submitted(Exception):
        pass

    def read_instead(self: SlurmExecutor, path: Path) -> list[str]:
        scripts.append(Path(path).read_text())
        raise Submitted

    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", read_instead)
    overrides = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.partition=gpu", *TINY]
    launcher = launcher_for(*overrides)
    assert isinstance(launcher, RunnerSlurmLauncher)
    with pytest.raises(Submitted):
        launcher.launch([TINY], 0)
    assert "#SBATCH --gpus-per-node=4" in scripts[0]
    assert "#SBATCH --ntasks-per-node=4" in scripts[0]
    assert "#SBATCH --partition=gpu" in scripts[0]


@needs_submitit
def test_a_slurm_task_is_detected_as_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # What srun sets for task 5 of a job of 2 nodes x 4 tasks; the launcher exports it as torch's variables.
    from hydra_plugins.runner_launchers.slurm_launcher import export_rank

    for key in TORCH_VARS:
        monkeypatch.setenv(key, "stale")
        monkeypatch.delenv(key)
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert export_rank() == 5
    info = environment()
    assert (info["rank"], info["world_size"], info["local_rank"], info["local_world_size"]) == (5, 8, 1, 4)
    assert info["master"] == "gpu07"
    port = info["port"]
    # another job (on the same node, perhaps) rendezvouses on another port; the same job's tasks on the same one
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    export_rank()
    assert environment()["port"] != port
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert export_rank() == 0 and environment()["port"] == port


@needs_submitit
def test_a_requeued_slurm_job_resumes_its_newest_checkpoint() -> None:
    # submitit requeues a timed-out or preempted job (max_num_timeout > 0) with what checkpoint() returns
    from hydra_plugins.runner_launchers.slurm_launcher import RunnerSlurmLauncher

    delayed = RunnerSlurmLauncher().checkpoint(["optimizer.lr=1e-3"], "hydra.sweep.dir", 0, "id", {})
    assert delayed.args[0] == ["optimizer.lr=1e-3", "resume=auto"]


def test_a_failed_torchrun_job_s_row_says_why_though_its_first_rank_exited_before_rank_0_wrote(tmp_path: Path) -> None:
    # rank 1 refused the config and exited (code 2); the agent stopped rank 0 before its summary.json: rank 1's
    # log (runner.log.ranks) holds the reason
    from hydra_plugins.runner_launchers.torchrun_launcher import _reason

    (tmp_path / "logs").mkdir()
    line = "2026-11-26 17:00:00,000 rank 1 ERROR runner.rank_log: the run failed: ConfigError: cannot read 'bogus'"
    (tmp_path / "logs" / "rank-1.log").write_text(f"{line}\nTraceback (most recent call last):\n  ...\n")
    assert _reason(tmp_path, {0: -15, 1: 2}) == ": ConfigError: cannot read 'bogus'"
    assert _reason(tmp_path, {0: -15, 1: -15}) == ""  # stopped ranks said nothing of their own
    assert _reason(tmp_path / "gone", {1: 2}) == ""
