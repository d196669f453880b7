"""benchmarks/common.py, what every benchmark's figures rest on: the worker processes' environment, the stamps."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)


def test_a_worker_gets_the_variables_its_caller_gives_it(tmp_path: Path) -> None:
    # lm.py gives each worker an empty compile cache and its threads, overhead.py the console's TTY setting: were the
    # defaults to overwrite them, every "compiled from cold" worker would share one warm cache
    out = tmp_path / "env.json"
    names = ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "OMP_WAIT_POLICY", "PYTHONPATH")
    probe = f"import json, os, sys; json.dump({{k: os.environ.get(k) for k in {names!r}}}, open(sys.argv[1], 'w'))"
    given = {"OMP_NUM_THREADS": "8", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    seen = common.spawn([sys.executable, "-c", probe, str(out)], out, env=given)
    assert {k: seen[k] for k in given} == given
    assert seen["PYTHONPATH"] == str(ROOT) and seen["OMP_WAIT_POLICY"]  # the defaults stay where not given
    assert common.spawn([sys.executable, "-c", probe, str(out)], out)["OMP_NUM_THREADS"] == "1"


def test_a_contender_s_gpu_peak_is_read_at_its_last_step_whatever_it_validates_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # runner validates after its last step and the peers' trainers do not: the side-by-side compares training's peaks
    allocator = {"peak_mb": 1302.0}
    monkeypatch.setattr(common, "peak_gpu_mb", lambda device: allocator["peak_mb"])
    stamps = common.Stamps(warmup=1, steps=4, segments=3)
    for step in range(1, 5):
        stamps.step(step)
    allocator["peak_mb"] = 2144.0  # a validation after the last step
    stamps.write(tmp_path / "stamps.json")
    figures = json.loads((tmp_path / "stamps.json").read_text())
    assert figures["peak_gpu_mb"] == 1302.0 and figures["per_step_s"] > 0


def test_the_last_warm_up_steps_count_what_a_step_launches(tmp_path: Path) -> None:
    # overhead.py's ops/step column: a step of two matmuls and an add launches 3 device ops (views are not counted);
    # the counting ends where the clock starts, so the timed steps pay nothing for it
    stamps = common.Stamps(warmup=8, steps=12, segments=2)
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    for step in range(1, 13):
        (a @ b @ b.t() + 1).view(-1)
        stamps.step(step)
        assert (stamps.counter is not None) == (3 <= step < 8)
    stamps.write(tmp_path / "stamps.json")
    assert json.loads((tmp_path / "stamps.json").read_text())["ops_per_step"] == 3.0
    short = common.Stamps(warmup=5, steps=8)  # too short a warm-up to count in: no figure rather than a wrong one
    for step in range(1, 9):
        short.step(step)
    short.write(tmp_path / "short.json")
    assert "ops_per_step" not in json.loads((tmp_path / "short.json").read_text())
