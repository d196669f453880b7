"""runner's Hydra launchers for real: `hydra/launcher=torchrun` (each job of a sweep in several processes) and
`hydra/launcher=slurm` (submitit: the tasks of a SLURM job as the ranks of one run; `slurm_local` runs the same path
with subprocesses on this machine). In-process checks of the launchers: tests/unit/test_launcher.py."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    HAS_SUBMITIT,
    LAUNCHER_TINY,
    assert_same_weights,
    cli,
    explain,
    needs_submitit,
    offline_run,
    ok,
    read_json,
    results_csv,
    summary,
    torchrun,
)
from hydra.core.utils import JobStatus

TINY = LAUNCHER_TINY


def torchrun_sweep(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """Two jobs of 2 processes each through the torchrun launcher; job 0 fails (an unreadable duration)."""
    sweep = root / "torchrun_sweep"
    done = cli(
        "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", *TINY, "logger=[console,jsonl,wandb]",
        "optimizer.lr=3e-3", "trainer.max_duration=bogus,10st", f"hydra.sweep.dir={sweep}", cwd=root,
    )  # fmt: skip
    return done, sweep


def slurm_local(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """One job of submitit's local executor with 2 tasks."""
    sweep = root / "slurm_local"
    done = cli(
        "-m", "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=2", *TINY, "optimizer.lr=3e-3",
        f"hydra.sweep.dir={sweep}", cwd=root,
    )  # fmt: skip
    return done, sweep


def plain_torchrun(root: Path) -> Path:
    """A plain `torchrun --standalone --nproc_per_node=2` run with optimizer.lr=3e-3: what the launchers' jobs with
    that learning rate must reproduce bit for bit."""
    ok(torchrun(*TINY, "optimizer.lr=3e-3", f"hydra.run.dir={root}/reference", cwd=root))
    return root / "reference"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs): the reference run and the sweeps that must reproduce it."""
    found = {"reference": plain_torchrun, "torchrun_sweep": torchrun_sweep}
    if HAS_SUBMITIT:
        found["slurm_local"] = slurm_local
    return {name: (lambda job=job: job(root)) for name, job in found.items()}


def test_torchrun_launcher_one_folder_per_job_trained_by_two_processes_and_a_failed_job_is_a_row(
    runs: dict[str, Future],
) -> None:
    done, sweep = runs["torchrun_sweep"].result()
    assert done.returncode == 0, explain(done)  # job 1 ran: the sweep completes
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml", "results.csv"]  # no per-rank folders
    # job 1: an ordinary 2-process torchrun run in its sweep folder, the same training as a plain torchrun run
    assert "trainer.max_duration=10st" in (sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    progress = summary(sweep / "1")["progress"]
    assert (progress["step"], progress["samples"]) == (10, 10 * 32)
    assert done.stderr.count("global batch") == 1  # the startup table: once per job that started (rank 0)
    assert_same_weights(sweep / "1", runs["reference"].result())
    # job 0 failed: a row with its own error, and the sweep went on
    assert "cannot read duration 'bogus'" in done.stderr and "Traceback" not in done.stderr
    rows = results_csv(sweep)
    assert (rows["0"]["status"], rows["1"]["status"]) == ("failed", "completed")
    assert "cannot read duration 'bogus'" in rows["0"]["error"]  # rank 0 said why before it exited
    assert "1 completed, 1 failed" in done.stdout or "1 failed, 1 completed" in done.stdout
    # the job's processes are a plain torchrun run, yet its wandb run (rank 0's only) knows its sweep and job
    run = offline_run(sweep / "1")
    assert (run["group"], run["name"]) == (f"{sweep.parent.name}/torchrun_sweep", "1: trainer.max_duration=10st")


def test_torchrun_launcher_returns_the_monitored_value_and_inf_for_a_diverged_job(
    tmp_path: Path, launcher_for, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a sweeper (Optuna) reads: JobReturn.return_value, the best val/loss that rank 0 wrote to summary.json.
    # In-process (the launcher's own return values), while the other runs go on in the background.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher's torchrun inherits this process's environment
    launcher = launcher_for("hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", *TINY)
    good, diverged = launcher.launch(
        [[*TINY, "optimizer.lr=1e-3"], [*TINY, "optimizer.lr=1e30", "trainer.max_nonfinite_steps=2"]], 0
    )
    assert good.status == JobStatus.COMPLETED
    assert good.return_value == summary(tmp_path / "sweep" / "0")["best"]["value"]
    assert good.hydra_cfg.hydra.runtime.output_dir == str(tmp_path / "sweep" / "0")
    # a diverged trial is a result (the worst value: Optuna's sampler learns from it), not a failure that ends the
    # sweep, as with Hydra's basic launcher
    assert diverged.status == JobStatus.COMPLETED and diverged.return_value == math.inf
    assert summary(tmp_path / "sweep" / "1")["stop_reason"] == "nonfinite"


@needs_submitit
def test_slurm_local_the_tasks_of_a_job_are_the_ranks_of_one_run(runs: dict[str, Future]) -> None:
    # submitit's local executor starts tasks_per_node processes per job with its own variables (SUBMITIT_LOCAL_*),
    # where SLURM has SLURM_*: the same launcher code turns either into ranks.
    done, sweep = runs["slurm_local"].result()
    assert done.returncode == 0, explain(done)
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "multirun.yaml", "results.csv"]
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file()
    progress = summary(sweep / "0")["progress"]
    assert (progress["step"], progress["samples"]) == (10, 10 * 32)
    assert_same_weights(sweep / "0", runs["reference"].result())
    logs = [p.read_text() for p in (sweep / ".submitit").rglob("*_log.err")]
    assert len(logs) == 2 and sum("global batch" in text for text in logs) == 1  # one startup table: rank 0's


def _slurm_node_idle() -> bool:
    # Asked when the test runs, not at collection: sinfo without a controller retries for 9 s, and the runs of every
    # module wait for the collection to end. A controller that answers does so at once (.ci/slurm-up's is local).
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=3).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state.startswith(("idle", "mix")) for state in out.split())


@needs_submitit
def test_a_real_slurm_job_runs_its_tasks_as_the_ranks_of_one_run(tmp_path: Path, runs: dict[str, Future]) -> None:
    # sbatch through submitit to a real slurmctld/slurmd: SLURM_PROCID, SLURM_NTASKS... become the ranks. No GPU on
    # the test cluster: two tasks per node, asked for directly.
    if not _slurm_node_idle():
        pytest.skip("no SLURM cluster answers here (.ci/slurm-up starts a one-node one)")
    sweep = tmp_path / "sweep"
    done = cli(
        "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10", *TINY, "optimizer.lr=1e-3,3e-3",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, explain(done)
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "1", "multirun.yaml", "results.csv"]
    for job in ("0", "1"):
        progress = summary(sweep / job)["progress"]
        assert (progress["step"], progress["samples"]) == (10, 10 * 32)
        assert read_json(sweep / job / "run.json")["world_size"] == 2
    assert_same_weights(sweep / "1", runs["reference"].result())  # lr 3e-3: the torchrun run, bit for bit
    script = next((sweep / ".submitit").glob(".submission_file_*.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script
