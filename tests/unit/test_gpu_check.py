"""benchmarks/gpu_check.py's CPU-side parts: the import check and its advice, the step plan, the report."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import ROOT

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_a_missing_package_is_named_with_the_way_to_bring_its_wheel() -> None:
    missing = gpu_check.missing_packages({"json": "json", "no_such_module_here": "hydra-core==1.3.2"})
    assert missing == ["hydra-core==1.3.2"]
    hint = gpu_check.wheels_hint(missing)
    assert "pip download --no-deps -d wheels hydra-core==1.3.2" in hint
    assert "pip install --no-index --no-deps wheels/*.whl" in hint and "antlr4-python3-runtime==4.9.3" in hint
    assert gpu_check.missing_packages() == []  # this machine has everything runner and its tests import


def test_the_plan_runs_the_gpu_tests_first_and_every_benchmark_on_the_device(tmp_path: Path) -> None:
    plan = gpu_check.steps("cuda", tmp_path, reps=2)
    names = [name for name, _, _ in plan]
    assert names[0] == "gpu tests" and plan[0][2][1:6] == ["-m", "pytest", "-m", "gpu or triton", "tests/unit"]
    benchmarks = {"overhead", "lm bf16", "sae usual bf16", "sae usual fp32", "sae preset", "checkpoint", "sae pipeline"}
    assert benchmarks | {"sae hf", "sae kernels bf16", "sae kernels fp32"} <= set(names)
    # a short lease measures the SAE kernels and the tiny step (eager and CUDA graphs) before anything else
    assert names[1:4] == ["sae kernels bf16", "sae kernels fp32", "overhead tiny graphs"]
    tiny = plan[3][2]
    assert {"hand_graphs", "runner_graphs", "hand", "runner"} <= set(tiny) and tiny[tiny.index("--sizes") + 1] == "tiny"
    for name, weight, command in plan[1:]:
        assert command[command.index("--device") + 1] == "cuda" and weight > 0, name
        assert Path(command[command.index("--json") + 1]).parent == tmp_path, name  # one folder


def test_the_first_steps_get_their_whole_time_and_a_short_budget_leaves_out_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, limits = {"now": 0.0}, []

    def run_step(name: str, command: list[str], limit_s: float, out: Path) -> dict:
        limits.append(limit_s)
        clock["now"] += min(limit_s, {"a": 40.0}.get(name, limit_s))  # a ends early; the others use all they get
        return {"step": name, "status": "ok"}

    monkeypatch.setattr(gpu_check, "run_step", run_step)
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock["now"])
    plan = [("a", 100.0, ["x"]), ("b", 100.0, ["x"]), ("c", 100.0, ["x"]), ("d", 100.0, ["x"])]
    results = gpu_check.run_plan(plan, 300.0, tmp_path)
    # a: 150 s allowed, 40 used; b: its 150; c: the 110 left; d: nothing left, not started (the weights' 400 s
    # squeezed into 300 would have cut every step short, the first ones too)
    assert limits == pytest.approx([150.0, 150.0, 110.0])
    assert [r["status"] for r in results] == ["ok", "ok", "ok", "not reached"] and results[3]["step"] == "d"


def test_the_report_names_the_device_and_every_step(tmp_path: Path) -> None:
    results = [
        {"step": "gpu tests", "status": "failed (1)", "seconds": 61.2, "log": "gpu-tests.log", "last": "1 failed"},
        {"step": "lm bf16", "status": "timeout", "seconds": 90.0, "log": "lm-bf16.log", "last": "a | b"},
    ]
    text = gpu_check.report(results, "NVIDIA H200", tmp_path)
    assert text.startswith("GPU check on NVIDIA H200")
    assert "| gpu tests | failed (1) | 61 | gpu-tests.log | 1 failed |" in text
    assert "| lm bf16 | timeout | 90 | lm-bf16.log | a / b |" in text  # a pipe in the output keeps the table whole
    assert (tmp_path / "report.md").read_text() == text
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == results


@pytest.mark.parametrize(("status", "code"), [("ok", 0), ("timeout", 0), ("failed (1)", 1)])
def test_a_step_that_times_out_is_marked_and_a_failure_fails_the_check(
    tmp_path: Path, status: str, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "steps", lambda device, out, reps: [("one", 1.0, ["true"])])
    monkeypatch.setattr(
        gpu_check, "run_step", lambda *a: {"step": "one", "status": status, "seconds": 1.0, "log": "x", "last": ""}
    )
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--device", "cpu", "--out", str(tmp_path)])
    assert gpu_check.main() == code


def test_a_step_runs_with_its_time_limit_and_keeps_its_output(tmp_path: Path) -> None:
    done = gpu_check.run_step("echo", [sys.executable, "-c", "print('first'); print('last line')"], 30, tmp_path)
    assert done["status"] == "ok" and done["last"] == "last line" and "first" in (tmp_path / "echo.log").read_text()
    slow = gpu_check.run_step(
        "slow", [sys.executable, "-c", "import time; print('began', flush=True); time.sleep(30)"], 1, tmp_path
    )
    assert slow["status"] == "timeout" and slow["seconds"] < 10


def test_the_archive_holds_the_figures_and_logs_but_not_the_activations_or_weights(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    (out / "peers" / "seed0").mkdir(parents=True)
    for name in ("report.md", "report.json", "gpu-tests.log", "peers/seed0/runner.json", "peers/seed0/rows.jsonl"):
        (out / name).write_text("x")
    (out / "acts768.npy").write_bytes(b"\0" * 64)
    (out / "peers" / "seed0" / "sparsify.safetensors").write_bytes(b"\0" * 64)
    assert gpu_check.archive(out, tmp_path / "check.tar.gz") == 5
    with tarfile.open(tmp_path / "check.tar.gz") as tar:
        names = sorted(tar.getnames())
    assert names == sorted(
        f"gpu-check/{n}"
        for n in ("gpu-tests.log", "peers/seed0/rows.jsonl", "peers/seed0/runner.json", "report.json", "report.md")
    )
