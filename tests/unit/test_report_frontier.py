"""The frontier of `python -m runner.report`: a sweep of k and width, or one run's family of SAEs, as a table
of L0 against FVE, spliced KL and dead fraction sorted by L0, and plots/frontier_sae.png with a point per model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import summary

from experiments.sae.metrics import FRONTIER
from runner.sweeps.callback import SweepResults
from runner.sweeps.frontier import points, registered
from runner.sweeps.results import collect
from runner.tools.frontier import plot_frontier
from runner.tools.report import main
from runner.train import train

PNG = b"\x89PNG\r\n\x1a\n"
WIDTHS, KS = (1024, 4096), (8, 16, 32)


def write_job(
    sweep: Path, job: int | str, overrides: list[str], metrics: dict[str, float], error: str | None = None
) -> None:
    """A finished job folder as a sweep's job writes it: .hydra/config.yaml and overrides.yaml, summary.json."""
    folder = sweep / str(job)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("monitor: val/fve\nmode: max\n", encoding="utf-8")
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides), encoding="utf-8")
    done = {
        "stop_reason": "failed" if error else "max_duration",
        "progress": {"step": 0 if error else 1500},
        "metrics": metrics,
        "best": None if error else {"monitor": "val/fve", "value": metrics["val/fve"], "step": 1500},
        "wall_time_s": 12.5,
        "error": error,
    }
    (folder / "summary.json").write_text(json.dumps(done), encoding="utf-8")


def sae(n: int, k: int) -> dict[str, float]:
    """Known numbers of an SAE of width n and k: L0 just under k (a hair more for the wider one), FVE up with both."""
    return {
        "val/loss": 0.1,
        "val/l0": k - 0.16 + (0.1 if n == 4096 else 0.0),
        "val/fve": 0.5 + k / 100 + (0.05 if n == 4096 else 0.0),
        "val/kl_spliced": 1.0 / k,
        "val/dead_fraction": 0.01 if n == 1024 else 0.2,
        "val/faint_fraction": 0.0 if n == 1024 else 0.05,
    }


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Six jobs, width-major (model.n_latents=1024,4096 model.k=8,16,32), then one that failed before validating."""
    folder = tmp_path / "sweep"
    for job, (n, k) in enumerate((n, k) for n in WIDTHS for k in KS):
        write_job(folder, job, ["+experiment=sae_lm", f"model.n_latents={n}", f"model.k={k}"], sae(n, k))
    write_job(folder, 6, ["+experiment=sae_lm", "model.n_latents=1024", "model.k=64"], {}, error="out of memory")
    return folder


def table(out: str, title: str) -> list[list[str]]:
    """The cells of each row of the printed table whose title starts with `title` (its header left out)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title))
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("└"):
            return rows
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip().strip("│").split("│")])
    raise AssertionError(f"no end to the table {title!r}")


def test_the_sae_workbench_registers_its_frontier() -> None:
    assert registered().get("sae") is FRONTIER, "runner.frontiers is not installed: pip install -e . again"


def test_a_sweep_of_k_and_width_is_a_table_sorted_by_l0(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(sweep), "--no-plot"]) == 0
    out = capsys.readouterr().out
    rows = table(out, "frontier sae: 6 job(s) by val/l0")
    # job, model.n_latents, model.k, val/l0, val/fve, val/kl_spliced, val/dead_fraction, val/faint_fraction: loss
    # recovered was not logged
    assert [row[0] for row in rows] == ["0", "3", "1", "4", "2", "5"]
    assert rows[0] == ["0", "1024", "8", "7.84", "0.58", "0.125", "0.01", "0"]
    assert rows[-1] == ["5", "4096", "32", "31.94", "0.87", "0.03125", "0.2", "0.05"]
    assert "1 job(s) without val/l0: failed or not validated yet" in out
    assert "val/loss_recovered" not in out and not (sweep / "plots").exists()


def test_the_plot_has_a_line_per_width_and_a_point_per_job(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    assert main([str(sweep)]) == 0
    path = sweep / "plots" / "frontier_sae.png"
    assert f"frontier: {path} (6 point(s))" in capsys.readouterr().out
    assert path.read_bytes().startswith(PNG)
    # model.k moves L0 (the report finds it), so each width is a line through its three jobs, by L0
    drawn = plot_frontier(points(collect(sweep), FRONTIER), FRONTIER, path)
    assert list(drawn) == ["val/fve", "val/kl_spliced", "val/dead_fraction", "val/faint_fraction"]
    assert list(drawn["val/fve"]) == ["model.n_latents=1024", "model.n_latents=4096"]
    wide = [sae(4096, k) for k in KS]
    assert drawn["val/fve"]["model.n_latents=4096"] == [(m["val/l0"], m["val/fve"]) for m in wide]
    # --along names the key that moves along the lines: here a line per k, across the two widths
    along = plot_frontier(points(collect(sweep), FRONTIER, along="model.n_latents"), FRONTIER, path)
    assert list(along["val/fve"]) == ["model.k=8", "model.k=16", "model.k=32"]
    assert all(len(line) == 2 for line in along["val/fve"].values())


def test_along_must_be_a_swept_key(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(sweep), "--along", "model.d_in"]) == 2
    err = capsys.readouterr().err
    assert "--along model.d_in: not a key this sweep varies; it varies: model.n_latents, model.k" in err


def test_a_sweep_that_reports_no_frontier_gets_none(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for job, lr in enumerate(("1e-3", "3e-3")):
        write_job(tmp_path, job, [f"optimizer.lr={lr}"], {"val/loss": 0.5 - job / 10, "val/fve": 0.1})
    assert main([str(tmp_path)]) == 0
    assert "frontier" not in capsys.readouterr().out and not (tmp_path / "plots" / "frontier_sae.png").exists()


def test_the_end_of_a_sweep_prints_its_frontier(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    from omegaconf import OmegaConf

    SweepResults().on_multirun_end(OmegaConf.create({"mode": "max", "hydra": {"sweep": {"dir": str(sweep)}}}))
    rows = table(capsys.readouterr().out, "frontier sae: 6 job(s) by val/l0")
    assert [row[0] for row in rows] == ["0", "3", "1", "4", "2", "5"]


def family(k: int) -> dict[str, float]:
    return {f"val/k{k}/{key.removeprefix('val/')}": value for key, value in sae(1024, k).items()}


def test_a_family_of_one_run_is_a_point_per_sae(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    metrics = {**family(32), **family(8), **family(16), **sae(1024, 16)}  # unprefixed: the family's means
    write_job(tmp_path, "run", ["+experiment=sae_lm", "model=sae_multi", "model.ks=[8,16,32]"], metrics)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    rows = table(out, "frontier sae: 3 model(s) by val/l0")
    assert [row[:3] for row in rows] == [["run", "k8", "7.84"], ["run", "k16", "15.84"], ["run", "k32", "31.84"]]
    path = run / "plots" / "frontier_sae.png"
    assert f"frontier: {path} (3 point(s))" in out and path.read_bytes().startswith(PNG)
    drawn = plot_frontier(points(collect(run), FRONTIER), FRONTIER, path)
    assert drawn["val/fve"] == {"run": [(sae(1024, k)["val/l0"], sae(1024, k)["val/fve"]) for k in KS]}


def test_a_real_family_reports_each_sae_by_its_l0(
    compose_cfg: Callable, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tiny = ["+experiment=sae", "model=sae_multi", "model.ks=[4,2]", "model.base.n_latents=64"]
    tiny += ["data.splits.d=16", "data.splits.n_features=32", "data.batch_size=128", "data.splits.n_val=256"]
    tiny += ["trainer.max_duration=10st", "trainer.val_interval=10st", "checkpoint=none", "logger=jsonl"]
    train(compose_cfg(*tiny))
    run = tmp_path / "run"
    assert main([str(run), "--no-plot"]) == 0
    rows = table(capsys.readouterr().out, "frontier sae: 2 model(s) by val/l0")
    got: dict[str, Any] = summary(run)["metrics"]
    assert [row[1] for row in rows] == sorted(["k2", "k4"], key=lambda name: got[f"val/{name}/l0"])
    for row in rows:
        assert float(row[2]) == pytest.approx(got[f"val/{row[1]}/l0"], rel=1e-3)
        assert float(row[3]) == pytest.approx(got[f"val/{row[1]}/fve"], rel=1e-3, abs=1e-4)
