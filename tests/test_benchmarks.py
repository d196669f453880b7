"""The benchmark scripts run end to end in a tiny smoke mode, so that they do not rot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, tmp_path: Path, timeout: int = 300) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_overhead_smoke(tmp_path: Path) -> None:
    result = _run("overhead.py", "--steps", "30", "--warmup", "5", "--reps", "1", "--sizes", "tiny", tmp_path=tmp_path)
    tiny = result["sizes"]["tiny"]
    assert set(tiny["contenders"]) == {"hand", "runner", "lightning", "runner_usual", "lightning_usual"}
    # The same arithmetic in every contender: a correctness check, not only a speed one.
    assert tiny["losses_agree"], tiny
    losses = {row["final_loss"] for row in tiny["contenders"].values()}
    assert max(losses) - min(losses) < 1e-5
    for row in tiny["contenders"].values():
        assert row["us_per_step"]["median"] > 0 and row["peak_rss_mb"] > 100
    assert tiny["contenders"]["hand"]["ratio_to_hand"]["median"] == 1.0


def test_startup_smoke(tmp_path: Path) -> None:
    result = _run("startup.py", "--steps", "3", "--reps", "1", tmp_path=tmp_path)
    for name in ("hand", "runner", "runner_usual"):
        row = result["contenders"][name]
        assert 0 < row["to_first_step_s"]["median"] < row["wall_s"]["median"]
    assert 0 < result["imports_hydra_s"]["median"] <= result["imports_all_s"]["median"]
    assert result["compose_compose_s"]["median"] > 0


def test_sae_throughput_smoke(tmp_path: Path) -> None:
    result = _run("sae_throughput.py", "--steps", "4", "--reps", "1", "--batch", "256", tmp_path=tmp_path)
    assert result["max_decoder_diff"] == 0.0
    assert result["hand_samples_per_s"] > 0 and result["runner_samples_per_s"] > 0


def test_checkpoint_smoke(tmp_path: Path) -> None:
    result = _run("checkpoint.py", "--sizes", "5", "--reps", "2", "--dir", str(tmp_path), tmp_path=tmp_path)
    row = result["sizes"]["5.0"]
    assert 3 < row["state_mb"] < 8
    assert 0 < row["blocked_ms"] and 0 < row["sync_ms"] and row["written_ms"] >= row["blocked_ms"]
    assert row["resume_ms"] > 0


def test_ddp_smoke(tmp_path: Path) -> None:
    # DDP with no_sync accumulation, runner and hand-written, and their one-process baselines: four jobs, two of them
    # torchrun with 2 processes (all nine take over a minute of startup on 2 busy cores)
    result = _run("ddp.py", "--smoke", "--contenders", "ddp_acc", "hand_ddp_acc", tmp_path=tmp_path, timeout=600)
    rows = result["contenders"]
    assert set(rows) == {"ddp_acc", "single_acc", "hand_ddp_acc", "hand_single_acc"}
    assert rows["ddp_acc"]["layout"] == "2 x 32 x 4" and rows["single_acc"]["layout"] == "1 x 64 x 4"
    assert set(result["ratios"]) == {
        *("ddp_acc / single_acc", "hand_ddp_acc / hand_single_acc"),
        *("single_acc / hand_single_acc", "ddp_acc / hand_ddp_acc"),
    }
    assert result["losses_agree"] and result["ranks_agree"]
    for row in rows.values():
        assert math.isfinite(row["ms_per_step"]["median"]) and row["ms_per_step"]["median"] > 0
        assert math.isfinite(row["ratio_to_baseline"]["median"]) and row["ratio_to_baseline"]["median"] > 0
        assert 0 < row["to_first_step_s"]["median"] < row["wall_s"]["median"]
        assert row["rank_peak_rss_mb"] > 100
