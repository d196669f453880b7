"""The README's figures are what the code gives: benchmarks/readme_figures.py runs the digits command the README
quotes and compares every figure quoted of it (the synthetic SAE table's rows take ~8 minutes: run the script without
--only before changing them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT, explain, python

pytestmark = pytest.mark.slow


def test_the_readme_s_digits_figures_are_what_the_code_gives(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    script = str(ROOT / "benchmarks" / "readme_figures.py")
    proc = python(script, "--only", "digits", "--dir", str(tmp_path), "--json", str(out), cwd=ROOT)
    assert proc.returncode == 0, explain(proc)
    figures = json.loads(out.read_text())["figures"]
    assert len(figures) == 8 and all(f["same"] for f in figures), figures
    # the quick start's run, `python -m runner +experiment=digits` as it is (tests/e2e/test_cli.py: other flags):
    # early stopping restored the best weights, on which the final metrics are measured
    summary = json.loads((tmp_path / "00" / "summary.json").read_text())
    assert summary["stop_reason"] == "early_stopping" and summary["metrics"]["val/acc"] >= 0.97, summary
    assert summary["metrics"]["val/loss"] == pytest.approx(summary["best"]["value"], rel=1e-5)
