"""distributed=spread for real on 2 gloo ranks: each SAE of a family whole on one rank trains as one process trains it
on the global batch, the files hold each SAE once, a rank killed mid-run is restarted and resumes bit for bit, and so
does a run resumed from its distributed checkpoint (checkpoint.format=dcp, the default under spread)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    TORCHRUN,
    assert_close_weights,
    assert_same_weights,
    cli,
    metric_rows,
    ok,
    popen,
    python,
    split_at_first_checkpoint,
    summary,
    torchrun,
    torchrun_worker,
    wait_for,
    weights,
)


def _family(acts: Path) -> list[str]:
    # 3 SAEs of the same size over 2 ranks: k2 and k8 on rank 0, k4 on rank 1. 20 steps inside the first epoch.
    return [
        "+experiment=sae",
        "data=activations_file",
        f"data.train_path={acts}",
        "callbacks=none",
        "model=sae_multi",
        "model.ks=[2,4,8]",
        "model.base.n_latents=64",
        "data.val_batch_size=128",
        "trainer.max_duration=20st",
        "trainer.val_interval=10st",
        "trainer.log_interval=5st",
        "checkpoint.interval=10st",
        "checkpoint.format=files",  # one process's state.pt, which resumes too (dcp: SYNTHETIC below)
        "logger=[console,jsonl]",
    ]


# the synthetic preset with its ground-truth callback: each rank scores its own SAEs against the true features; a
# distributed checkpoint every 10 steps, all kept
SYNTHETIC = [
    "+experiment=sae",
    "model=sae_multi",
    "model.ks=[2,4]",
    "model.base.n_latents=64",
    "data.splits.d=16",
    "data.splits.n_features=32",
    "data.splits.n_val=257",  # 129 + 128 validation rows in batches of 128: as many batches on both ranks
    "data.val_batch_size=128",
    "data.batch_size=64",
    "trainer.max_duration=20st",
    "trainer.val_interval=10st",
    "checkpoint.interval=10st",
    "checkpoint.keep_last=10",
    "logger=jsonl",
    "distributed=spread",
]


def _rows(root: Path) -> Path:
    # 4096 rows of 16: sparse non-negative mixtures of 32 unit directions, and a little noise
    g = torch.Generator().manual_seed(0)
    directions = torch.nn.functional.normalize(torch.randn(32, 16, generator=g), dim=1)
    codes = (torch.rand(4096, 32, generator=g) < 0.06) * torch.rand(4096, 32, generator=g) * 3
    rows = codes @ directions + 0.01 * torch.randn(4096, 16, generator=g)
    np.save(root / "acts.npy", rows.numpy())
    return root / "acts.npy"


def restarted(root: Path, family: list[str]) -> dict[str, Any]:
    """Rank 1 killed (OOM killer, a hardware fault) once the step-10 checkpoint exists; torchrun --max-restarts=1
    starts both again and they resume the run's newest checkpoint."""
    slow = ["+callbacks.slow._target_=_tasks.SleepEachStep", "+callbacks.slow.seconds=0.2"]
    args = [*TORCHRUN, "--max-restarts=1", "-m", "runner", *family, "distributed=spread", "data.batch_size=32", *slow]
    proc = popen(*args, f"hydra.run.dir={root / 'restarted'}", cwd=root)
    wait_for(proc, "restarted/checkpoints/step-00000010", root)
    os.kill(torchrun_worker(proc.pid, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    return {"code": proc.returncode, "err": err, "run_dir": root / "restarted"}


def synthetic_resumed(root: Path, synthetic: Future) -> Path:
    _, run_dir = synthetic.result()
    resumed = split_at_first_checkpoint(run_dir, root / "synthetic_resumed")
    ok(torchrun(*SYNTHETIC, "resume=auto", f"hydra.run.dir={resumed}", cwd=root))
    return resumed


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], Any]]:
    """The module's runs (helpers.module_runs)."""
    family, spread = _family(_rows(root)), ["distributed=spread", "data.batch_size=32"]
    return {
        "spread": lambda: (
            ok(torchrun(*family, *spread, f"hydra.run.dir={root / 'spread'}", cwd=root)),
            root / "spread",
        ),
        "one": lambda: (ok(cli(*family, "data.batch_size=64", cwd=root, run_dir=root / "one")), root / "one"),
        "restarted": lambda: restarted(root, family),
        "synthetic": lambda: (
            ok(torchrun(*SYNTHETIC, f"hydra.run.dir={root / 'synthetic'}", cwd=root)),
            root / "synthetic",
        ),
        "ranks": lambda: python(*TORCHRUN, str(Path(__file__).parents[1] / "_spread_ranks.py"), cwd=root),
        "synthetic_resumed": lambda: synthetic_resumed(root, runs["synthetic"]),
    }


def test_a_spread_family_trains_each_sae_as_one_process_does_on_the_global_batch(runs: dict[str, Future]) -> None:
    (proc, spread), (_, one) = runs["spread"].result(), runs["one"].result()
    # 2 ranks x 32 rows and 1 process x 64 rows read the same rows each step (each rank's slice of the global batch);
    # the rows of a step come in another order, so sums differ in their last bits
    assert_close_weights(spread, one, atol=1e-5)
    rows, expected = metric_rows(spread), metric_rows(one)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [5, 10, 15, 20]
    for row, want in zip(rows, expected, strict=True):
        assert row.keys() == want.keys()
        for key in ("train/loss", "train/k2/fve", "train/k8/l0", "val/fve", "val/k4/loss", "val/loss"):
            if key in want:
                assert abs(row[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (row["step"], key)
    # rank 0 holds k2 and k8 (2 of the 3 equal SAEs), and says so
    total = sum(
        t.numel() for k, t in weights(spread).items() if k.split(".")[-1] in ("W_enc", "W_dec", "b_enc", "b_dec")
    )
    assert f"parameters on rank 0      {total * 2 // 3}" in proc.stderr, proc.stderr[-2000:]


def test_its_files_hold_each_sae_once_in_one_process_s_format(runs: dict[str, Future]) -> None:
    _, spread = runs["spread"].result()
    whole = weights(spread)
    assert sorted({k.split(".")[1] for k in whole}) == ["k2", "k4", "k8"]
    from safetensors.torch import load_file

    for name in ("k2", "k4", "k8"):
        part = load_file(spread / f"model.{name}.safetensors")
        assert all(torch.equal(v, whole[f"saes.{name}.{k}"]) for k, v in part.items())
    state = torch.load(spread / "checkpoints" / "step-00000020" / "state.pt", weights_only=True)
    optimizer = state["optimizer"]
    # Adam's moments for every parameter of every SAE, numbered as one process numbers them
    numbered = [i for group in optimizer["param_groups"] for i in group["params"]]
    assert sorted(optimizer["state"]) == sorted(numbered) and len(numbered) == 12
    from runner.load import load_trained

    family, _ = load_trained(spread)  # one process reads the spread run's folder
    assert torch.equal(family.saes["k4"].W_dec, whole["saes.k4.W_dec"])


def test_a_killed_rank_is_restarted_and_the_run_resumes_bit_for_bit(runs: dict[str, Future]) -> None:
    outcome = runs["restarted"].result()
    assert outcome["code"] == 0, outcome["err"][-4000:]
    assert outcome["err"].count("elastic restart 1: resuming from the newest checkpoint") == 1, outcome["err"][-4000:]
    _, spread = runs["spread"].result()
    assert summary(outcome["run_dir"])["progress"]["step"] == 20
    assert_same_weights(outcome["run_dir"], spread)
    assert metric_rows(outcome["run_dir"]) == metric_rows(spread)


def test_routed_rows_and_shared_metrics_match_one_process_for_two_hooks_and_unequal_batches(
    runs: dict[str, Future],
) -> None:
    proc = ok(runs["ranks"].result())  # the assertions are in tests/_spread_ranks.py, on each rank
    assert "rank 0: ok" in proc.stdout and "rank 1: ok" in proc.stdout


def test_each_rank_scores_its_own_sae_s_against_the_true_features_and_rank_0_logs_them_all(
    runs: dict[str, Future],
) -> None:
    _, run_dir = runs["synthetic"].result()
    last = summary(run_dir)["metrics"]
    assert 0 < last["val/k2/mmcs"] <= 1 and 0 < last["val/k4/mmcs"] <= 1  # k2 on rank 0, k4 on rank 1
    assert last["val/mmcs"] == pytest.approx((last["val/k2/mmcs"] + last["val/k4/mmcs"]) / 2)
    assert last["val/k4/recovered_0.5"] >= 0 and "val/fve" in last


def test_a_spread_run_resumed_from_its_distributed_checkpoint_is_bit_for_bit(runs: dict[str, Future]) -> None:
    _, whole = runs["synthetic"].result()
    resumed = runs["synthetic_resumed"].result()
    assert_same_weights(resumed, whole)
    assert metric_rows(resumed) == metric_rows(whole)
