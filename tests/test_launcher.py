"""runner's Hydra launchers: `hydra/launcher=torchrun` (each job of a sweep in several processes) and
`hydra/launcher=slurm` (submitit: the tasks of a SLURM job as the ranks of one run; `slurm_local` runs the same path
with subprocesses on this machine)."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, RunMode
from test_wandb import offline_run

from runner.__main__ import main  # (also registers the config's resolvers)
from runner.dist.env import environment

# the slurm extra (pip install runner[slurm]); part of dev
needs_submitit = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None, reason="hydra-submitit-launcher"
)

CONF_DIR = (Path(__file__).resolve().parents[1] / "conf").resolve()
# 10 optimizer steps of 2 ranks x 16 samples: far inside the first epoch, so every step sees 32 samples.
TINY = [
    "+experiment=digits",
    "model.dropout=0.0",
    "trainer.max_duration=10st",
    "trainer.val_interval=5st",
    "logger=[console,jsonl]",
    "callbacks=none",
    "data.batch_size=16",
    "distributed=ddp",
]
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", *TORCH_VARS)}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _assert_same_weights(run_dir: Path, reference: Path) -> None:
    # The same program on the same two ranks, launched another way: bit-identical training.
    expected = _weights(reference)
    got = _weights(run_dir)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain `torchrun --standalone --nproc_per_node=2` run with optimizer.lr=3e-3."""
    root = tmp_path_factory.mktemp("torchrun")
    done = _python(
        root, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner",
        *TINY, "optimizer.lr=3e-3", f"hydra.run.dir={root}/run",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


@pytest.fixture
def launcher_for(tmp_path: Path) -> Iterator:
    """`launcher_for(*overrides)`: the launcher a `-m` sweep with these overrides gets, set up as the sweeper sets it
    up (sweep folder <tmp_path>/sweep). Hydra's logging setup in launch() is undone afterwards."""
    from hydra._internal.callbacks import Callbacks

    handlers, level = logging.root.handlers[:], logging.root.level

    def make(*overrides: str) -> Launcher:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            hydra = GlobalHydra.instance().hydra
            cfg = hydra.compose_config(
                "config", [*overrides, f"hydra.sweep.dir={tmp_path}/sweep"], run_mode=RunMode.MULTIRUN
            )
            context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
            return Plugins.instance().instantiate_launcher(config=cfg, hydra_context=context, task_function=main)

    yield make
    logging.root.handlers[:], logging.root.level = handlers, level


def test_the_launchers_are_found_by_hydra() -> None:
    names = {plugin.__name__ for plugin in Plugins.instance().discover(Launcher)}
    assert "TorchrunLauncher" in names
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
        assert {"RunnerSlurmLauncher", "RunnerLocalLauncher"} <= names


@pytest.mark.slow
def test_torchrun_launcher_one_folder_per_job_trained_by_two_processes_and_a_failed_job_is_a_row(
    tmp_path: Path, reference: Path
) -> None:
    sweep = tmp_path / "sweep"
    done = _python(
        tmp_path, "-m", "runner", "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2",
        *TINY, "logger=[console,jsonl,wandb]", "optimizer.lr=3e-3", "trainer.max_duration=bogus,10st",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # job 1 ran: the sweep completes
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml", "results.csv"]  # no per-rank folders
    # job 1: an ordinary 2-process torchrun run in its sweep folder, the same training as a plain torchrun run
    assert "trainer.max_duration=10st" in (sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    progress = _summary(sweep / "1")["progress"]
    assert (progress["step"], progress["samples"]) == (10, 10 * 32)
    assert done.stderr.count("global batch") == 1  # the startup table: once per job that started (rank 0)
    _assert_same_weights(sweep / "1", reference)
    # job 0 failed: a row with its own error, and the sweep went on
    assert "cannot read duration 'bogus'" in done.stderr and "Traceback" not in done.stderr
    rows = {row["job"]: row for row in csv.DictReader((sweep / "results.csv").open())}
    assert (rows["0"]["status"], rows["1"]["status"]) == ("failed", "completed")
    assert "cannot read duration 'bogus'" in rows["0"]["error"]  # rank 0 said why before it exited
    assert "1 completed, 1 failed" in done.stdout or "1 failed, 1 completed" in done.stdout
    # the job's processes are a plain torchrun run, yet its wandb run (rank 0's only) knows its sweep and job
    run = offline_run(sweep / "1")
    assert (run["group"], run["name"]) == (f"{tmp_path.name}/sweep", "1: trainer.max_duration=10st")


@pytest.mark.slow
def test_torchrun_launcher_returns_the_monitored_value_and_inf_for_a_diverged_job(
    tmp_path: Path, launcher_for, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a sweeper (Optuna) reads: JobReturn.return_value, the best val/loss that rank 0 wrote to summary.json.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launcher = launcher_for("hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", *TINY)
    good, diverged = launcher.launch(
        [[*TINY, "optimizer.lr=1e-3"], [*TINY, "optimizer.lr=1e30", "trainer.max_nonfinite_steps=2"]], 0
    )
    assert good.status == JobStatus.COMPLETED
    assert good.return_value == _summary(tmp_path / "sweep" / "0")["best"]["value"]
    assert good.hydra_cfg.hydra.runtime.output_dir == str(tmp_path / "sweep" / "0")
    # a diverged trial is a result (the worst value: Optuna's sampler learns from it), not a failure that ends the
    # sweep, as with Hydra's basic launcher
    assert diverged.status == JobStatus.COMPLETED and diverged.return_value == math.inf
    assert _summary(tmp_path / "sweep" / "1")["stop_reason"] == "nonfinite"


@needs_submitit
@pytest.mark.slow
def test_slurm_local_the_tasks_of_a_job_are_the_ranks_of_one_run(tmp_path: Path, reference: Path) -> None:
    # submitit's local executor starts tasks_per_node processes per job with its own variables (SUBMITIT_LOCAL_*),
    # where SLURM has SLURM_*: the same launcher code turns either into ranks.
    sweep = tmp_path / "sweep"
    done = _python(
        tmp_path, "-m", "runner", "-m", "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=2",
        *TINY, "optimizer.lr=3e-3", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "multirun.yaml", "results.csv"]
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file()
    progress = _summary(sweep / "0")["progress"]
    assert (progress["step"], progress["samples"]) == (10, 10 * 32)
    _assert_same_weights(sweep / "0", reference)
    logs = [p.read_text() for p in (sweep / ".submitit").rglob("*_log.err")]
    assert len(logs) == 2 and sum("global batch" in text for text in logs) == 1  # one startup table: rank 0's


def _slurm_node_idle() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state.startswith(("idle", "mix")) for state in out.split())


@needs_submitit
@pytest.mark.slow
@pytest.mark.skipif(not _slurm_node_idle(), reason="no SLURM cluster answers here (.ci/slurm-up starts a one-node one)")
def test_a_real_slurm_job_runs_its_tasks_as_the_ranks_of_one_run(tmp_path: Path, reference: Path) -> None:
    # sbatch through submitit to a real slurmctld/slurmd: SLURM_PROCID, SLURM_NTASKS... become the ranks. No GPU on
    # the test cluster: two tasks per node, asked for directly.
    sweep = tmp_path / "sweep"
    done = _python(
        tmp_path, "-m", "runner", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10", *TINY, "optimizer.lr=1e-3,3e-3",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "1", "multirun.yaml", "results.csv"]
    for job in ("0", "1"):
        progress = _summary(sweep / job)["progress"]
        assert (progress["step"], progress["samples"]) == (10, 10 * 32)
        assert json.loads((sweep / job / "run.json").read_text())["world_size"] == 2
    _assert_same_weights(sweep / "1", reference)  # lr 3e-3: the torchrun run, bit for bit
    script = next((sweep / ".submitit").glob(".submission_file_*.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script


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
