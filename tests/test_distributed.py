"""Distributed training for real on the CPU: torchrun, 2 processes, the gloo backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.dist.env import _first_host, environment

DIGITS = [
    "+experiment=digits",
    "model.dropout=0.0",
    "trainer.val_interval=10st",
    "logger=[console,jsonl]",
    "callbacks=none",
]


def _run(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _torchrun(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return _run(cwd, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner", *overrides)


def _single(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return _run(cwd, "-m", "runner", *overrides)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


@pytest.mark.slow
def test_torchrun_ddp_one_folder_exact_counts_and_the_same_training_as_one_process(tmp_path: Path) -> None:
    # 2 processes x batch 16, 1 process x batch 32, 1 process x batch 16 x accumulation 2: the same 32 samples in
    # every optimizer step (20 steps stay inside the first epoch of 1438 samples, where no window is short).
    (tmp_path / "ddp").mkdir()
    check = [
        "callbacks=[rank_consistency]",
        "callbacks.rank_consistency.interval=5st",
        "callbacks.rank_consistency.gradients=true",
    ]
    ddp = _torchrun(
        tmp_path / "ddp", *DIGITS[:-1], *check, "distributed=ddp", "data.batch_size=16", "trainer.max_duration=20st"
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    folders = list((tmp_path / "ddp" / "outputs").glob("*/*"))
    assert len(folders) == 1, folders  # one run folder for the job, not one per rank
    run_dir = folders[0]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and not list(run_dir.glob(".hydra/resume-*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["progress"]["step"] == 20 and summary["progress"]["samples"] == 20 * 32
    assert "ddp, backend gloo, 2 rank(s) per node" in ddp.stderr  # the startup table, printed once (rank 0)
    assert ddp.stderr.count("global batch") == 1
    assert ddp.stderr.count("has settings but its option is not selected") == 1  # rank 1 stays quiet
    # parameters at the start and after steps 5, 10, 15, gradients of steps 6, 11, 16: no false alarm
    assert "rank consistency: parameters and gradients identical on every rank in 7 checks" in ddp.stderr

    one = _single(tmp_path, *DIGITS, "data.batch_size=32", "trainer.max_duration=20st", f"hydra.run.dir={tmp_path}/one")
    acc = _single(
        tmp_path,
        *DIGITS,
        "data.batch_size=16",
        "trainer.accumulate_grad_batches=2",
        "trainer.max_duration=20st",
        f"hydra.run.dir={tmp_path}/acc",
    )
    assert one.returncode == 0 and acc.returncode == 0, one.stderr[-2000:] + acc.stderr[-2000:]
    reference = _weights(tmp_path / "one")
    # Tolerance: the three sum the same 32 per-sample gradients in a different order (all-reduce of two means of 16,
    # two accumulated halves, one mean of 32), so they differ by float32 rounding, which AdamW's division by
    # sqrt(v) amplifies for near-zero gradients over 20 steps; 1e-5 absolute is far below one step's change (~1e-3).
    for other in (_weights(run_dir), _weights(tmp_path / "acc")):
        for name, tensor in reference.items():
            torch.testing.assert_close(other[name], tensor, rtol=0, atol=1e-5, msg=name)
    val = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_one = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    # validation metrics are reduced exactly over the two ranks' shards: sums and counts, no padding
    assert [r["val/loss"] for r in val if "val/loss" in r] == pytest.approx(
        [r["val/loss"] for r in val_one if "val/loss" in r], abs=1e-5
    )


def _rows_of(run_dir: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


@pytest.mark.slow
def test_a_whole_epoch_with_its_short_last_step_and_plateau_schedule_match_one_process(tmp_path: Path) -> None:
    # 1438 samples = 44 global batches of 32 + one of 30. On 2 ranks x 8 x accumulation 2 that last step is two
    # micro-batches of 15, split 8 + 7 over the ranks: weighted by their share, it is still the mean over its 30
    # samples. ReduceLROnPlateau (patience 1, a 20% improvement needed) is stepped once per validation on the
    # reduced val/loss: its LR drops at the same validations as in one process (not once per rank).
    common = [
        "+experiment=digits",
        "model.dropout=0.0",
        "logger=[console,jsonl]",
        "callbacks=none",
        "trainer.max_duration=1ep",
        "trainer.val_interval=3st",
        "trainer.log_interval=1st",
        "scheduler=plateau",
        "scheduler.patience=1",
        "scheduler.threshold=0.2",
    ]
    ddp = _torchrun(
        tmp_path,
        *common,
        "distributed=ddp",
        "data.batch_size=8",
        "trainer.accumulate_grad_batches=2",
        f"hydra.run.dir={tmp_path}/ddp",
    )
    one = _single(tmp_path, *common, "data.batch_size=32", f"hydra.run.dir={tmp_path}/one")
    assert ddp.returncode == 0 and one.returncode == 0, ddp.stderr[-2000:] + one.stderr[-2000:]
    for run in ("ddp", "one"):
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        assert summary["progress"]["step"] == 45 and summary["progress"]["samples"] == 1438
    lr_ddp, lr_one = _rows_of(tmp_path / "ddp", "train/lr"), _rows_of(tmp_path / "one", "train/lr")
    assert lr_ddp == lr_one and len({lr for _, lr in lr_one}) >= 3, lr_one  # two drops at least, at the same steps
    # 45 AdamW steps: the rounding differences of the 1e-5 test above grow a little; still far below a step (~1e-3)
    for name, tensor in _weights(tmp_path / "one").items():
        torch.testing.assert_close(_weights(tmp_path / "ddp")[name], tensor, rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_early_stopping_that_one_rank_alone_would_not_trigger_stops_every_rank_at_the_same_step(
    tmp_path: Path,
) -> None:
    # val/skew: rank 0's shard alone improves at every validation, rank 1's alone worsens; reduced, it is worst
    # after the first validation, so patience 2 stops at the third (step 15) on both ranks. A rank deciding on its
    # own shard would train on, and the other would hang in the next all-reduce: the 120 s timeout catches that.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    overrides = [
        *DIGITS[:-1],
        "model._target_=_tasks.SkewedValidation",
        "distributed=ddp",
        "data.batch_size=16",
        "trainer.max_duration=100st",
        "trainer.val_interval=5st",
        "callbacks=early_stopping",
        "callbacks.early_stopping.monitor=val/skew",
        "callbacks.early_stopping.patience=2",
        f"hydra.run.dir={tmp_path}/run",
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner"]
    proc = subprocess.run([*launch, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["stop_reason"], summary["progress"]["step"]) == ("early_stopping", 15)
    skew = [v for _, v in _rows_of(tmp_path / "run", "val/skew")]
    # the 359 validation samples are sharded 180 + 179: the reduction weights each rank's value by its samples
    assert skew[:3] == pytest.approx([(180 / k + 179 * k) / 359 for k in (1, 2, 3)], rel=1e-7)  # float32 values


def test_environment_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "SLURM_TASKS_PER_NODE",
    ):
        monkeypatch.delenv(key, raising=False)
    assert environment()["world_size"] == 1
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[07-08]")
    info = environment()
    assert (info["launcher"], info["rank"], info["world_size"], info["local_rank"]) == ("slurm", 3, 8, 1)
    assert (info["local_world_size"], info["master"]) == (4, "gpu07")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")  # `srun -n 8` without --ntasks-per-node sets only this one:
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "5,3")
    assert environment()["local_world_size"] == 5
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert environment()["launcher"] == "torchrun"  # torchrun inside a SLURM allocation wins


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node07", "node07"), ("node[07-09,12]", "node07"), ("gpu-a[1-2],gpu-b3", "gpu-a1"), ("a1,b2", "a1")],
)
def test_first_host_of_a_slurm_nodelist(nodelist: str, host: str) -> None:
    assert _first_host(nodelist) == host


def _rows(run_dir: Path) -> list[dict]:
    timing = {"train/samples_per_s", "sys/peak_memory_mb"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in timing} for row in rows]


CHECKPOINTED = [
    *DIGITS,
    "distributed=ddp",
    "data.batch_size=16",
    "trainer.max_duration=40st",
    "callbacks=checkpoint",
    "callbacks.checkpoint.interval=10st",
]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run that interrupted and resumed ones must reproduce."""
    tmp = tmp_path_factory.mktemp("whole")
    run = _torchrun(tmp, *CHECKPOINTED, f"hydra.run.dir={tmp}/run")
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp / "run"


def _slow_torchrun(cwd: Path, max_restarts: int, *overrides: str) -> subprocess.Popen:
    # tests/_launch.py sleeps in training_step, so that the job is still running when the test strikes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUNNER_TEST_STEP_SLEEP": "0.05"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.Popen(
        [*launch, f"--max-restarts={max_restarts}", str(Path(__file__).parent / "_launch.py"), *overrides],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc: subprocess.Popen, pattern: str, cwd: Path) -> Path:
    import time

    deadline = time.monotonic() + 120
    while not (found := list(cwd.glob(pattern))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    return found[0]


@pytest.mark.slow
def test_ddp_preempted_and_resumed_on_every_rank_equals_the_uninterrupted_run(tmp_path: Path, whole: Path) -> None:
    import signal

    args = CHECKPOINTED
    # The second job trains slowly and is sent SIGTERM, as SLURM does, once its first checkpoint exists; torchrun
    # forwards it to both workers.
    split = tmp_path / "split"
    proc = _slow_torchrun(tmp_path, 0, *args, f"hydra.run.dir={split}")
    _wait_for(proc, "split/checkpoints/step-00000010", tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    summary = json.loads((split / "summary.json").read_text())
    assert summary["stop_reason"] == "preempted" and 10 <= summary["progress"]["step"] < 40, err[-3000:]
    resumed = _torchrun(tmp_path, *args, f"hydra.run.dir={split}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("resuming from") == 1  # said once, by rank 0
    for name, tensor in _weights(whole).items():
        assert torch.equal(tensor, _weights(split)[name]), name
    assert _rows(split) == _rows(whole)


def _worker(agent: int, rank: int) -> int:
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent}")


@pytest.mark.slow
def test_a_killed_worker_is_restarted_by_torchrun_and_the_job_resumes_its_own_run_folder(
    tmp_path: Path, whole: Path
) -> None:
    import signal

    # No hydra.run.dir: the restarted workers must find the dated folder of the first launch by themselves.
    proc = _slow_torchrun(tmp_path, 1, *CHECKPOINTED)
    _wait_for(proc, "outputs/*/*/checkpoints/step-00000010", tmp_path)
    os.kill(_worker(proc.pid, 1), signal.SIGKILL)  # a worker dies (OOM killer, hardware fault)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    assert err.count("elastic restart 1: resuming from the newest checkpoint") == 1, err[-4000:]
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))  # the restart wrote into the same folder
    assert json.loads((run_dir / "summary.json").read_text())["progress"]["step"] == 40
    assert list(run_dir.glob(".hydra/resume-*/config.yaml"))  # the restart's own config, beside the first one
    for name, tensor in _weights(whole).items():
        assert torch.equal(tensor, _weights(run_dir)[name]), name
    assert _rows(run_dir) == _rows(whole)


@pytest.mark.slow
def test_rank_consistency_names_the_parameter_that_diverged(tmp_path: Path) -> None:
    # Rank 1 nudges one weight after step 7 (tests/_launch.py); the check after step 10 must catch it on every rank.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUNNER_TEST_DESYNC": "7:net.3.weight"}
    check = ["callbacks=[rank_consistency]", "callbacks.rank_consistency.interval=5st"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*launch, str(Path(__file__).parent / "_launch.py"), *DIGITS[:-1], *check, "distributed=ddp"]
        + ["data.batch_size=16", "trainer.max_duration=20st", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    message = "parameter 'net.3.weight' differs between ranks after optimizer step 10: rank 0 has"
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]  # raised on both ranks: neither waits for the other
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_two_nodes_on_one_machine_with_c10d_rendezvous_train_like_one_node(tmp_path: Path, whole: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1"]
            + ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=two-nodes", "-m", "runner"]
            + [*CHECKPOINTED],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(e[-2000:] for e in errors)
    (run_dir,) = list((tmp_path / "outputs").glob("*/*"))  # one folder for the job, written by the node of rank 0
    assert (
        sum("1 rank(s) per node on 2 node(s)" in e for e in errors) == 1
    )  # the startup table: once, and it knows the layout
    for name, tensor in _weights(whole).items():  # 2 nodes x 1 rank train exactly like 1 node x 2 ranks
        assert torch.equal(tensor, _weights(run_dir)[name]), name


def test_several_processes_without_a_rendezvous_address_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "SLURM_"))}
    env.update(RANK="1", WORLD_SIZE="2", WANDB_MODE="offline")
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "+experiment=digits", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error on rank 1: 2 processes but no rendezvous address: launch with torchrun" in proc.stderr
    assert not (tmp_path / "run").exists()
