"""The benchmark scripts run end to end in a tiny smoke mode, so that they do not rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_loop_overhead_smoke(tmp_path: Path) -> None:
    result = _run("loop_overhead.py", "--steps", "20", "--reps", "1", "--sizes", "tiny", tmp_path=tmp_path)
    assert result["tiny"]["max_weight_diff"] == 0.0  # the runner does the same arithmetic as the hand loop
    assert result["tiny"]["hand_us"] > 0 and result["tiny"]["runner_us"] > 0


def test_sae_throughput_smoke(tmp_path: Path) -> None:
    result = _run("sae_throughput.py", "--steps", "4", "--reps", "1", "--batch", "256", tmp_path=tmp_path)
    assert result["max_decoder_diff"] == 0.0
    assert result["hand_samples_per_s"] > 0 and result["runner_samples_per_s"] > 0
