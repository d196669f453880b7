"""Finding the ranks in the environment: torchrun's variables, SLURM's, and the first host of a SLURM node list.
Runs of several processes: tests/e2e/test_distributed.py and tests/e2e/test_fsdp.py."""

from __future__ import annotations

import pytest

from runner.distributed.env import _first_host, environment


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
