"""`python -m runner +experiment=synth_sae_bench` then `python -m runner.sae_eval RUN evals=[ground_truth]`: the run
logs SynthSAEBench's metrics at validation, and the evaluation rebuilds the run's world from its config and scores the
SAE on fresh samples of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.sae.evals.ground_truth import KEYS

TINY = ["data.splits.num_features=512", "data.splits.d=32", "data.splits.roots=4", "data.splits.n_val=512"]
TINY += ["model.n_latents=128", "model.k=4", "trainer.max_duration=30st", "data.batch_size=256", "logger=[jsonl]"]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_a_synth_bench_run_logs_the_benchmark_and_sae_eval_scores_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    root = Path(__file__).resolve().parents[2]
    done = _run("runner", "+experiment=synth_sae_bench", f"run_dir={run_dir}", *TINY, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # run_dir= is Hydra's run folder too: one folder with the console's log, no outputs/<date>/<time> beside it
    assert (run_dir / "runner.log").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    assert not (tmp_path / "outputs").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in reversed(rows) if "val/gt_mcc" in r)
    assert all(f"val/gt_{k}" in logged for k in KEYS)
    assert 0 < logged["val/gt_mcc"] <= 1 and 0 < logged["val/gt_f1"] <= 1 and logged["val/gt_l0"] <= 4
    done = _run("runner.sae_eval", str(run_dir), "evals=[ground_truth]", "tokens=2000", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((run_dir / "evals" / "eval.json").read_text())["evals"]["ground_truth"]
    assert result["samples"] == 2000 and set(result["metrics"]) == set(KEYS)
    # the same decoder against the same world: MCC and uniqueness read no samples, so they equal the run's last ones
    assert result["metrics"]["mcc"] == logged["val/gt_mcc"]
    assert result["metrics"]["uniqueness"] == logged["val/gt_uniqueness"]
    assert "ground_truth/metrics/f1" in done.stdout
