"""Distributed training for real on the CPU: torchrun, 2 processes, the gloo backend. Preemption, a killed worker, a
full disk on rank 0 and a rank that drifts are test callbacks chosen on the command line (tests/_tasks.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    DIGITS_DDP,
    TORCHRUN,
    assert_close_weights,
    assert_same_weights,
    cli,
    error_lines,
    explain,
    metric_rows,
    no_worker_traceback,
    ok,
    popen,
    python,
    summary,
    torchrun,
    torchrun_worker,
    values,
    wait_for,
    worker_exit_codes,
)

# The 2-rank run that the other 2-rank runs of the module must reproduce: 20 steps of 2 x 16 samples, checkpoints at
# steps 10 and 20, and the rank-consistency check (parameters at the start and after steps 5, 10, 15, gradients of
# steps 6, 11, 16) riding along. 20 steps stay inside the first epoch of 1438 samples, where no window is short.
CHECKPOINTED = [
    *DIGITS_DDP[:-1],  # without callbacks=none
    "distributed=ddp",
    "data.batch_size=16",
    "trainer.max_duration=20st",
    "callbacks=rank_consistency",
    "checkpoint.interval=10st",
    "callbacks.rank_consistency.interval=5st",
    "callbacks.rank_consistency.gradients=true",
]
# 0.2 s after every optimizer step (tests/_tasks.py): a job signalled once its step-10 checkpoint exists is still
# training, with 10 steps (2 s) to spare
SLOW_STEPS = ["+callbacks.slow._target_=_tasks.SleepEachStep", "+callbacks.slow.seconds=0.2"]


def whole(root: Path) -> dict[str, Any]:
    """CHECKPOINTED without hydra.run.dir: the job must make one run folder under outputs/, not one per rank."""
    (root / "whole").mkdir()
    done = ok(torchrun(*CHECKPOINTED, cwd=root / "whole"))
    return {"stderr": done.stderr, "run_dirs": list((root / "whole" / "outputs").glob("*/*"))}


def single(root: Path, name: str, *overrides: str) -> Path:
    ok(cli(*overrides, cwd=root, run_dir=root / name))
    return root / name


def slow_torchrun(cwd: Path, max_restarts: int, *overrides: str) -> subprocess.Popen:
    return popen(*TORCHRUN, f"--max-restarts={max_restarts}", "-m", "runner", *overrides, *SLOW_STEPS, cwd=cwd)


def preempted(root: Path) -> dict[str, Any]:
    """SIGTERM, as SLURM sends it, once the first checkpoint exists (torchrun forwards it to both workers, each at its
    own step), then resume=auto. The ranks agree on the stop at every third step (trainer.stop_check_interval)."""
    split = root / "split"
    proc = slow_torchrun(root, 0, *CHECKPOINTED, "trainer.stop_check_interval=3st", f"hydra.run.dir={split}")
    wait_for(proc, "split/checkpoints/step-00000010", root)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    stopped = {"err": err, "summary": summary(split)}
    # the same callbacks as the stopped launch (a resume refuses another config): at most 10 steps of 0.2 s
    resumed = torchrun(*CHECKPOINTED, *SLOW_STEPS, f"hydra.run.dir={split}", "resume=auto", cwd=root)
    return {"stopped": stopped, "resumed": resumed, "run_dir": split}


def restarted(root: Path) -> dict[str, Any]:
    """A worker dies (OOM killer, hardware fault) once the first checkpoint exists; torchrun --max-restarts=1 starts
    both again. No hydra.run.dir: the restarted workers must find the dated folder of the first launch by themselves."""
    (root / "restarted").mkdir()
    proc = slow_torchrun(root / "restarted", 1, *CHECKPOINTED)
    wait_for(proc, "outputs/*/*/checkpoints/step-00000010", root / "restarted")
    os.kill(torchrun_worker(proc.pid, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    return {"code": proc.returncode, "err": err, "run_dirs": list((root / "restarted" / "outputs").glob("*/*"))}


def full_disk(root: Path) -> dict[str, Any]:
    """Rank 0's disk fills after step 12 (the other rank writes nothing), so the step-20 checkpoint cannot be saved;
    then, with room again, resume=auto."""
    folder = root / "full_disk"
    full = ["+callbacks.full._target_=_tasks.FullDiskFrom", "+callbacks.full.step=12"]
    failed = torchrun(*CHECKPOINTED, *full, f"hydra.run.dir={folder}", cwd=root)
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    stopped = summary(folder)
    resumed = torchrun(*CHECKPOINTED, *full, f"hydra.run.dir={folder}", "resume=auto", cwd=root)
    return {"failed": failed, "left": left, "summary": stopped, "resumed": resumed, "run_dir": folder}


def two_nodes(root: Path) -> dict[str, Any]:
    """CHECKPOINTED as 2 nodes x 1 rank on this machine, with a c10d rendezvous."""
    (root / "nodes").mkdir()
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    launch = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d"]
    launch += [f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=two-nodes"]
    nodes = [
        popen(*launch, f"--node_rank={node}", "-m", "runner", *CHECKPOINTED, cwd=root / "nodes") for node in (0, 1)
    ]
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    return {
        "codes": [node.returncode for node in nodes],
        "errors": errors,
        "run_dirs": list((root / "nodes" / "outputs").glob("*/*")),
    }


def plateau(root: Path) -> dict[str, Path]:
    """A whole epoch with ReduceLROnPlateau on 2 ranks x 8 x accumulation 2, and in one process x 32."""
    common = [
        *DIGITS_DDP,
        "trainer.max_duration=1ep",
        "trainer.val_interval=3st",
        "trainer.log_interval=1st",
        "scheduler=plateau",
        "scheduler.patience=1",
        "scheduler.threshold=0.2",
    ]
    args = [*common, "distributed=ddp", "data.batch_size=8", "trainer.accumulate_grad_batches=2"]
    ok(torchrun(*args, f"hydra.run.dir={root}/plateau_ddp", cwd=root))
    return {"ddp": root / "plateau_ddp", "one": single(root, "plateau_one", *common, "data.batch_size=32")}


def skewed(root: Path) -> Path:
    """Early stopping on val/skew (tests/_tasks.py), which each rank's shard alone judges the other way. A rank that
    decided on its own shard would train on while the other waits in the next all-reduce: the timeout catches it."""
    overrides = [
        *DIGITS_DDP[:-1],
        "model._target_=_tasks.SkewedValidation",
        "distributed=ddp",
        "data.batch_size=16",
        "trainer.max_duration=100st",
        "trainer.val_interval=5st",
        "callbacks=early_stopping",
        "callbacks.early_stopping.monitor=val/skew",
        "callbacks.early_stopping.patience=2",
    ]
    ok(torchrun(*overrides, f"hydra.run.dir={root}/skewed", cwd=root, timeout=120))
    return root / "skewed"


def desynced(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """Rank 1 nudges one weight after step 7 (tests/_tasks.py Desync); the check after step 10 must catch it."""
    desync = ["+callbacks.desync._target_=_tasks.Desync", "+callbacks.desync.step=7"]
    desync += ["+callbacks.desync.parameter=net.3.weight"]
    check = ["callbacks=[rank_consistency]", "callbacks.rank_consistency.interval=5st", *desync]
    args = [*DIGITS_DDP[:-1], *check, "distributed=ddp", "data.batch_size=16", "trainer.max_duration=20st"]
    return torchrun(*args, f"hydra.run.dir={root}/desynced", cwd=root), root / "desynced"


def diverged(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """lr 1e30: every rank stops after 10 steps (exit 3); rank 0 takes 3 s more than rank 1 to write its outputs."""
    slow = ["model._target_=_tasks.SlowToWrite", "+model.write_seconds=3", "checkpoint=none"]
    args = [*DIGITS_DDP, *slow, "distributed=ddp", "data.batch_size=16"]
    args += ["trainer.max_duration=20st", "optimizer.lr=1e30", "trainer.max_nonfinite_steps=2"]
    return torchrun(*args, f"hydra.run.dir={root}/diverged", cwd=root), root / "diverged"


def sae_resampled(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """A ReLU SAE on 2 ranks whose latents die fast (L1 20, dead after 2 steps), resampled every 3 steps, the ranks'
    parameters compared after each: each rank's b_dec initialisation and resampling inputs were its own data's."""
    sae = ["+experiment=sae", "model=sae_relu", "model.n_latents=2048", "model.l1_coeff=20.0", "model.l1_warmup=0st"]
    sae += ["model.dead_window=2st", "data.splits.n_train=4096", "data.batch_size=64", "distributed=ddp"]
    sae += ["trainer.max_duration=24st", "trainer.val_interval=12st", "trainer.log_interval=4st", "logger=jsonl"]
    sae += ["callbacks=[sae_resample,rank_consistency]", "callbacks.rank_consistency.interval=3st"]
    sae += ["callbacks.sae_resample.every=3st", "callbacks.sae_resample.until=1.0dur"]
    sae += ["callbacks.sae_resample.samples=256"]
    return torchrun(*sae, f"hydra.run.dir={root}/sae_resampled", cwd=root), root / "sae_resampled"


def without_rendezvous(root: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """Rank 1 of 2 by its variables (helpers.child_env drops MASTER_* and SLURM_*): a launch without torchrun."""
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    return cli("+experiment=digits", cwd=root, run_dir=root / "alone", env=env, timeout=120), root / "alone"


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    digits20 = [*DIGITS_DDP, "trainer.max_duration=20st"]
    return {
        "whole": lambda: whole(root),
        "preempted": lambda: preempted(root),
        "restarted": lambda: restarted(root),
        "full_disk": lambda: full_disk(root),
        "two_nodes": lambda: two_nodes(root),
        "plateau": lambda: plateau(root),
        "skewed": lambda: skewed(root),
        "desynced": lambda: desynced(root),
        "one": lambda: single(root, "one", *digits20, "data.batch_size=32"),
        "acc": lambda: single(root, "acc", *digits20, "data.batch_size=16", "trainer.accumulate_grad_batches=2"),
        "without_rendezvous": lambda: without_rendezvous(root),
        "diverged": lambda: diverged(root),
        "sae_resampled": lambda: sae_resampled(root),
        "sae_ranks": lambda: python(*TORCHRUN, str(Path(__file__).parents[1] / "_sae_ranks.py"), cwd=root),
    }


def the_whole_run(runs: dict[str, Future]) -> Path:
    (run_dir,) = runs["whole"].result()["run_dirs"]
    return run_dir


def test_torchrun_ddp_one_folder_exact_counts_and_the_same_training_as_one_process(runs: dict[str, Future]) -> None:
    # 2 processes x batch 16, 1 process x batch 32, 1 process x batch 16 x accumulation 2: the same 32 samples in
    # every optimizer step.
    stderr, folders = runs["whole"].result()["stderr"], runs["whole"].result()["run_dirs"]
    assert len(folders) == 1, folders  # one run folder for the job, not one per rank
    run_dir = folders[0]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and not list(run_dir.glob(".hydra/resume-*"))
    progress = summary(run_dir)["progress"]
    assert progress["step"] == 20 and progress["samples"] == 20 * 32
    assert "ddp, backend gloo, 2 rank(s) per node" in stderr  # the startup table, printed once (rank 0)
    assert stderr.count("global batch") == 1
    assert stderr.count("is tuned by the config but not selected") == 1  # rank 1 stays quiet
    # parameters at the start and after steps 5, 10, 15, gradients of steps 6, 11, 16: no false alarm
    assert "rank consistency: parameters and gradients identical on every rank in 7 checks" in stderr
    one, acc = runs["one"].result(), runs["acc"].result()
    # Tolerance: the three sum the same 32 per-sample gradients in a different order (all-reduce of two means of 16,
    # two accumulated halves, one mean of 32), so they differ by float32 rounding, which AdamW's division by
    # sqrt(v) amplifies for near-zero gradients over 20 steps; 1e-5 absolute is far below one step's change (~1e-3).
    for other in (run_dir, acc):
        assert_close_weights(other, one, atol=1e-5)
    # validation metrics are reduced exactly over the two ranks' shards: sums and counts, no padding
    assert [v for _, v in values(run_dir, "val/loss")] == pytest.approx(
        [v for _, v in values(one, "val/loss")], abs=1e-5
    )


def test_a_whole_epoch_with_its_short_last_step_and_plateau_schedule_match_one_process(
    runs: dict[str, Future],
) -> None:
    # 1438 samples = 44 global batches of 32 + one of 30. On 2 ranks x 8 x accumulation 2 that last step is two
    # micro-batches of 15, split 8 + 7 over the ranks: weighted by their share, it is still the mean over its 30
    # samples. ReduceLROnPlateau (patience 1, a 20% improvement needed) is stepped once per validation on the
    # reduced val/loss: its LR drops at the same validations as in one process (not once per rank).
    ddp, one = runs["plateau"].result()["ddp"], runs["plateau"].result()["one"]
    for run_dir in (ddp, one):
        progress = summary(run_dir)["progress"]
        assert progress["step"] == 45 and progress["samples"] == 1438
    lr_ddp, lr_one = values(ddp, "train/lr"), values(one, "train/lr")
    assert lr_ddp == lr_one and len({lr for _, lr in lr_one}) >= 3, lr_one  # two drops at least, at the same steps
    # 45 AdamW steps: the rounding differences of the 1e-5 test above grow a little; still far below a step (~1e-3)
    assert_close_weights(ddp, one, atol=2e-5)


def test_early_stopping_that_one_rank_alone_would_not_trigger_stops_every_rank_at_the_same_step(
    runs: dict[str, Future],
) -> None:
    # val/skew: rank 0's shard alone improves at every validation, rank 1's alone worsens; reduced, it is worst
    # after the first validation, so patience 2 stops at the third (step 15) on both ranks.
    run_dir = runs["skewed"].result()
    done = summary(run_dir)
    assert (done["stop_reason"], done["progress"]["step"]) == ("early_stopping", 15)
    skew = [v for _, v in values(run_dir, "val/skew")]
    # the 179 validation samples are sharded 90 + 89: the reduction weights each rank's value by its samples
    assert skew[:3] == pytest.approx([(90 / k + 89 * k) / 179 for k in (1, 2, 3)], rel=1e-7)  # float32 values


def test_ddp_preempted_and_resumed_on_every_rank_equals_the_uninterrupted_run(runs: dict[str, Future]) -> None:
    outcome = runs["preempted"].result()
    stopped = outcome["stopped"]
    assert stopped["summary"]["stop_reason"] == "preempted", stopped["err"][-3000:]
    step = stopped["summary"]["progress"]["step"]
    assert 10 <= step < 20 and step % 3 == 0, stopped["err"][-3000:]  # at a stop check, where every rank stops
    resumed = ok(outcome["resumed"])
    assert resumed.stderr.count("resuming from") == 1  # said once, by rank 0
    assert_same_weights(outcome["run_dir"], the_whole_run(runs))
    assert metric_rows(outcome["run_dir"]) == metric_rows(the_whole_run(runs))


def test_a_killed_worker_is_restarted_by_torchrun_and_the_job_resumes_its_own_run_folder(
    runs: dict[str, Future],
) -> None:
    outcome = runs["restarted"].result()
    assert outcome["code"] == 0, outcome["err"][-4000:]
    assert outcome["err"].count("elastic restart 1: resuming from the newest checkpoint") == 1, outcome["err"][-4000:]
    (run_dir,) = outcome["run_dirs"]  # the restart wrote into the same folder
    assert summary(run_dir)["progress"]["step"] == 20
    assert list(run_dir.glob(".hydra/resume-*/config.yaml"))  # the restart's own config, beside the first one
    assert_same_weights(run_dir, the_whole_run(runs))
    assert metric_rows(run_dir) == metric_rows(the_whole_run(runs))


def test_a_full_disk_on_rank_0_stops_every_rank_and_the_resume_loses_nothing(runs: dict[str, Future]) -> None:
    outcome = runs["full_disk"].result()
    failed = outcome["failed"]
    assert failed.returncode != 0
    assert "disk full" in failed.stderr, explain(failed)  # said by rank 0, which owns the files
    assert "checkpoints/step-00000010/state.pt" in outcome["left"]
    assert not any(".tmp" in name or "step-00000020" in name for name in outcome["left"]), outcome["left"]
    resumed = ok(outcome["resumed"])
    assert "resuming from" in resumed.stderr and "step 10" in resumed.stderr
    assert_same_weights(outcome["run_dir"], the_whole_run(runs))
    rows = metric_rows(outcome["run_dir"])
    assert [r for r in rows if r["step"] > 10] == [r for r in metric_rows(the_whole_run(runs)) if r["step"] > 10]


def test_a_full_disk_on_rank_0_exits_2_on_every_rank_with_one_paragraph(runs: dict[str, Future]) -> None:
    # torchrun's own exit code is 1 whenever a worker fails (torch's ChildFailedError): what is sure is each worker's
    # code in its failure table. Only rank 0 prints its paragraph, rank 1 one line.
    failed = runs["full_disk"].result()["failed"]
    assert failed.returncode != 0 and worker_exit_codes(failed.stderr) == [2, 2], explain(failed)
    errors = error_lines(failed.stderr)
    assert len(errors) == 2, failed.stderr[-4000:]
    paragraph, line = sorted(errors, reverse=True)  # "error:" sorts after "error on"
    assert paragraph.startswith("error: disk full: saving checkpoint ") and "step-00000020" in paragraph, paragraph
    assert "resume=auto" in paragraph
    assert line == "error on rank 1: stopped because rank 0 stopped (exit 2; its message says why)", line
    no_worker_traceback(failed.stderr)
    stopped = runs["full_disk"].result()["summary"]
    assert stopped["stop_reason"] == "failed" and stopped["error"].startswith("disk full: saving checkpoint")


def test_the_run_stopped_by_a_full_disk_resumes_bit_exact(runs: dict[str, Future]) -> None:
    outcome = runs["full_disk"].result()
    resumed = ok(outcome["resumed"])
    assert resumed.stderr.count("resuming from") == 1 and "(step 10)" in resumed.stderr, resumed.stderr[-3000:]
    reference = the_whole_run(runs)
    assert_same_weights(outcome["run_dir"], reference)
    assert metric_rows(outcome["run_dir"]) == metric_rows(reference)


def test_rank_consistency_names_the_parameter_that_diverged(runs: dict[str, Future]) -> None:
    proc, run_dir = runs["desynced"].result()
    assert proc.returncode != 0
    message = "parameter 'net.3.weight' differs between ranks after optimizer step 10: rank 0 has"
    assert proc.stderr.count(message) == 2, explain(proc)  # raised on both ranks: neither waits for the other
    failed = summary(run_dir)  # rank 0's record of the failure
    assert failed["stop_reason"] == "failed" and "'net.3.weight' differs between ranks" in failed["error"]


def test_two_nodes_on_one_machine_with_c10d_rendezvous_train_like_one_node(runs: dict[str, Future]) -> None:
    outcome = runs["two_nodes"].result()
    assert outcome["codes"] == [0, 0], "\n".join(e[-2000:] for e in outcome["errors"])
    (run_dir,) = outcome["run_dirs"]  # one folder for the job, written by the node of rank 0
    # the startup table: once, and it knows the layout
    assert sum("1 rank(s) per node on 2 node(s)" in e for e in outcome["errors"]) == 1
    assert_same_weights(run_dir, the_whole_run(runs))  # 2 nodes x 1 rank train exactly like 1 node x 2 ranks


def test_several_processes_without_a_rendezvous_address_is_a_clear_error(runs: dict[str, Future]) -> None:
    proc, run_dir = runs["without_rendezvous"].result()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, explain(proc)
    assert "error on rank 1: 2 processes but no rendezvous address: launch with torchrun" in proc.stderr
    assert not run_dir.exists()


def test_a_diverged_ddp_run_exits_3_after_rank_0_has_written_its_outputs(runs: dict[str, Future]) -> None:
    # Every rank stops with exit code 3; rank 1 is done first, and torchrun stops the other ranks as soon as one exits
    # with a failure code: rank 1 must wait for rank 0's outputs, or rank 0 is stopped before it writes summary.json.
    proc, run_dir = runs["diverged"].result()
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, explain(proc)  # torchrun's own code is 1
    assert "\nerror: stopped after 2 optimizer steps in a row" in proc.stderr  # rank 0's, not stopped by torchrun
    assert summary(run_dir)["stop_reason"] == "nonfinite"
    assert (run_dir / "model.safetensors").is_file()


def test_an_sae_initialised_from_data_and_resampled_stays_the_same_on_every_rank(runs: dict[str, Future]) -> None:
    proc, run_dir = runs["sae_resampled"].result()
    assert proc.returncode == 0, explain(proc)  # rank_consistency found no parameter that differs
    state = torch.load(run_dir / "checkpoints" / "last" / "state.pt", weights_only=True)
    assert state["callbacks"]["0:ResampleDead"]["resampled"] > 0


def test_an_sae_initialises_from_and_counts_dead_latents_over_every_rank_s_data(runs: dict[str, Future]) -> None:
    proc = runs["sae_ranks"].result()  # the assertions are in tests/_sae_ranks.py, on each rank
    assert proc.returncode == 0 and proc.stdout.count(": ok") == 2, explain(proc)
