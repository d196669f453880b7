"""benchmarks/synth_bench.py for a few steps: runner's TopK against SAELens's own trainer (its venv, .venv-saelens) on
the same SynthSAEBench batches, both rows scored by the one scorer on the same held-out samples."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
from helpers import ROOT, ok, python, read_json

SAELENS = ROOT / ".venv-saelens" / "bin" / "python"
pytestmark = pytest.mark.skipif(not SAELENS.exists(), reason="SAELens's venv (.venv-saelens) is not installed")
ARCHS = ("topk",)  # one architecture keeps it near 30 s; every other one takes the same path


def jobs(root: Path, runs: dict[str, Future]) -> dict[str, Callable[[], dict]]:
    """The module's runs (helpers.module_runs): the script on TopK, 6 steps, 2,048 scored samples."""
    if not SAELENS.exists():
        return {}

    def side_by_side() -> dict:
        out = root / "synth_bench.json"
        script = str(ROOT / "benchmarks" / "synth_bench.py")
        args = ["--steps", "6", "--only", *ARCHS, "--eval-samples", "2048", "--out", str(root), "--json", str(out)]
        proc = ok(python(script, *args, cwd=root, timeout=300))
        return {**read_json(out), "stdout": proc.stdout}

    return {"side_by_side": side_by_side}


def test_both_contenders_are_scored_by_one_scorer_on_the_same_samples(runs: dict[str, Future]) -> None:
    result = runs["side_by_side"].result()
    rows = result["rows"]
    assert {(r["contender"], r["arch"]) for r in rows} == {(c, a) for c in ("runner", "saelens") for a in ARCHS}
    assert {r["scorer"] for r in rows} == {"experiments.sae.evals.ground_truth.score_sae"}
    assert {(r["samples"], r["samples_sha256"]) for r in rows} == {(2048, rows[0]["samples_sha256"])}
    assert all(r["same_batches"] for r in rows)  # SAELens trained on runner's very batches
    for r in rows:
        for key in ("f1", "mcc", "uniqueness", "precision", "recall"):
            assert math.isfinite(r[key]) and 0 <= r[key] <= 1, (r["contender"], r["arch"], key, r[key])
        assert math.isfinite(r["explained_variance"]) and r["explained_variance"] <= 1
        assert 0 <= r["dead_latents"] <= 1024 and r["l0"] > 0 and r["seconds"] > 0
    table = result["stdout"]
    for r in rows:  # the printed table has every row
        assert f"| {r['contender']} | {r['arch']} | {r['l0']:.1f} | {r['f1']:.3f} | {r['mcc']:.3f} |" in table
