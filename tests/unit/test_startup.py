"""Where a launch's time goes (summary.json's `startup`, runner/timeline.py), and the start-up work a run no longer
does twice: one source model for an SAE's data and its splice, the clean model run once, validations during
training sized apart from the last, no second pass over weights validation has just evaluated."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_LM, finished_run, jsonl, make_run, summary

from experiments.sae.evals.splice import SpliceEval
from experiments.sae.sources import costs
from experiments.sae.sources.source import SourceModel
from runner import ConfigError
from runner.loop import fit, weights_version
from runner.precision import FP32
from runner.run import Callback, Run, StopReason
from runner.timeline import TRAINING, Timeline
from runner.train import train
from runner.validation import batches_of, evaluate_loader, share

SMALL = ["source.layer=1", "model.n_latents=64", "model.k=4", "data.batch_size=64", "data.buffer_size=512"]
SMALL += ["data.samples_per_epoch=1024", "trainer.max_duration=8st", "trainer.val_interval=4st", "logger=[jsonl]"]


class Clock:
    """time.perf_counter for a Timeline, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_counted_once_each_with_nested_ones_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("runner.timeline.time.perf_counter", clock)
    timeline = Timeline()
    with timeline.phase("build"):
        clock.now += 1
        with timeline.phase("source model"):
            clock.now += 5
        clock.now += 2
    with timeline.phase(TRAINING):
        clock.now += 3
        timeline.lap("first step")
        clock.now += 10
        for _ in range(2):
            with timeline.phase("validation"):
                clock.now += 4
    clock.now += 0.5  # claimed by no phase
    table = timeline.table()
    assert table["phases"] == {
        "build": 3.0,
        "source model": 5.0,
        "first step": 3.0,
        "validation": {"s": 8.0, "count": 2},
    }
    assert table["training_s"] == 10.0 and table["other_s"] == 0.5 and table["wall_s"] == 29.5
    assert table["training_fraction"] == pytest.approx(10 / 29.5, abs=1e-4)


def test_a_command_counts_its_imports_and_composition(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("runner.timeline.time.perf_counter", clock)
    timeline = Timeline()
    timeline.command_started(imported_at=94.0, config_s=1.5)  # runner imported 6 s ago, composed in the last 1.5
    timeline.begin()  # the run's own start keeps what the command measured
    clock.now += 2
    table = timeline.table()
    assert table["phases"] == {"imports": 4.5, "config": 1.5} and table["wall_s"] == 8.0
    timeline.begin()  # the next job of a sweep in this process starts afresh
    assert timeline.table()["phases"] == {}


def test_the_clean_model_runs_once_while_its_outputs_fit_the_budget() -> None:
    calls: list[str] = []

    def run(batch: torch.Tensor, replace: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("clean" if replace is None else "other")
        logits = batch * (1.0 if replace is None else 0.5)
        return logits.square().mean(), logits

    loader = [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    halve = {"half": lambda rows: rows}
    cached = costs.CleanRuns(budget_mb=1)
    first = costs.batch_costs(run, loader, torch.device("cpu"), halve, clean_runs=cached)
    assert calls.count("clean") == 4
    again = costs.batch_costs(run, loader, torch.device("cpu"), halve, clean_runs=cached)
    assert calls.count("clean") == 4 and again.means() == first.means()  # the same numbers, no clean forward
    # over the budget, nothing is kept (a partial set would still need the model) and every pass runs it
    tight = costs.CleanRuns(budget_mb=2 * 3 * 8 * 4 * 1.5 / 2**20)
    costs.batch_costs(run, loader, torch.device("cpu"), halve, clean_runs=tight)
    assert tight.runs is None
    # the first k batches' means are the means of a pass over k batches alone
    two = costs.batch_costs(run, loader[:2], torch.device("cpu"), {"clean": None, **halve})
    whole = costs.batch_costs(run, loader, torch.device("cpu"), {"clean": None, **halve})
    assert whole.means(2) == two.means() and whole.means() != two.means()
    rest = costs.batch_costs(run, loader, torch.device("cpu"), {"clean": None, **halve}, batches=range(2, 4))
    two.extend(rest)
    assert two.means() == whole.means()


def test_weights_version_tells_a_copy_into_the_weights_apart() -> None:
    model = torch.nn.Linear(3, 2)
    before = weights_version(model)
    assert weights_version(model) == before
    with torch.no_grad():
        model.weight.copy_(model.weight)  # the same values: still other weights than validation saw, for all it knows
    assert weights_version(model) != before


def test_during_training_must_name_a_share_of_the_batches() -> None:
    for bad in (0, -0.5, True):
        with pytest.raises(ConfigError, match="during_training"):
            SpliceEval("unused", "blocks.1", during_training=bad)


@pytest.fixture(scope="module")
def four_batch_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT whose validation split is 4 batches of 4 windows."""
    directory = tmp_path_factory.mktemp("lm4")
    finished_run(directory, *TINY_LM, "data.val_batch_size=4")
    return directory


def test_an_sae_run_builds_its_source_once_and_says_where_its_time_went(
    compose_cfg: Callable, four_batch_lm: Path, tmp_path: Path
) -> None:
    lm_run = four_batch_lm
    overrides = ["+experiment=sae_lm", f"source.checkpoint={lm_run}", *SMALL, f"run_dir={tmp_path}"]
    overrides += ["callbacks.sae_splice.during_training=1"]
    run = train(compose_cfg(*overrides))
    table = summary(tmp_path)["startup"]
    phases = table["phases"]
    assert isinstance(phases["source model"], float)  # one build, no count: the splice reads the data's own source
    assert phases["validation"]["count"] == 2 and "splice setup" in phases and "first step" in phases
    assert "final validation" not in phases  # the last validation evaluated the weights the run ends with
    claimed = sum(v["s"] if isinstance(v, dict) else v for v in phases.values())
    assert claimed + table["training_s"] + table["other_s"] == pytest.approx(table["wall_s"], abs=0.01)
    assert 0 < table["training_fraction"] < 1

    # Before the last validation the splice read the first of the source's validation batches, the clean model
    # and the ablations over that same batch; the last read them all: each the known answer of a pass of its own.
    source = SourceModel(str(lm_run), "blocks.1", skip_positions=1)
    assert len(source.data.val_loader()) == 4
    whole = source.compare({"clean": None, "zero": torch.zeros_like})
    source.data.limit_val_batches = 1
    first = source.compare({"clean": None, "zero": torch.zeros_like})
    rows = [row for row in jsonl(tmp_path) if "val/ce_clean" in row]
    assert [row["step"] for row in rows] == [4, 8]
    for row, want in zip(rows, (first, whole), strict=True):
        assert row["val/ce_clean"] == pytest.approx(want["clean"]["ce"], rel=1e-6)
        assert row["val/ce_zero_ablated"] == pytest.approx(want["zero"]["ce"], rel=1e-6)
    assert rows[0]["val/ce_clean"] != rows[1]["val/ce_clean"]
    assert run.state.metrics["val/ce_clean"] == rows[1]["val/ce_clean"]


class Validations(Callback):
    """Each validation's metrics by step; asks to stop (as early stopping would) after the one at `stop_at`."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.seen: dict[int, dict[str, float]] = {}
        self.stop_at = stop_at

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        self.seen[run.progress.step] = dict(metrics)
        if run.progress.step == self.stop_at:
            run.request_stop(StopReason.EARLY_STOPPING)


def _loss_over(run: Run, batches: int) -> float:
    return evaluate_loader(run.task, itertools.islice(run.val_loader, batches), FP32(), torch.device("cpu"))["val/loss"]


@pytest.mark.parametrize("stop_at", [None, 8])
def test_validations_before_the_last_read_their_share_and_the_run_ends_on_the_whole_split(stop_at: int | None) -> None:
    seen = Validations(stop_at)
    run = make_run(callbacks=[seen], max_duration="20st", val_interval="8st")
    run.settings = dataclasses.replace(run.settings, val_during_training=1)  # one of the split's two batches
    assert len(run.val_loader) == 2
    calls: list[int] = []
    original = run.task.validation_step
    run.task.validation_step = lambda batch: calls.append(1) or original(batch)
    fit(run)
    # at 8 (and 16) the first batch; at 20, the end of the run, both; the final pass only where the run stopped early
    assert len(calls) == (1 + 1 + 2 if stop_at is None else 1 + 2)
    assert sorted(seen.seen) == ([8, 16, 20] if stop_at is None else [8])
    if stop_at is not None:  # the weights of step 8 are the run's last: the same ones, over one batch and over both
        assert seen.seen[8]["val/loss"] == pytest.approx(_loss_over(run, 1), rel=1e-12)
        assert seen.seen[8]["val/loss"] != run.state.metrics["val/loss"]
    assert run.state.metrics["val/loss"] == pytest.approx(_loss_over(run, 2), rel=1e-12)
    with pytest.raises(ConfigError, match="val_during_training"):
        share(0, "trainer.val_during_training")
    assert [batches_of(8, v) for v in (None, 0.25, 0.01, 3, 1.0)] == [8, 2, 1, 3, 8]


def test_a_timeline_travels_with_a_pickled_job() -> None:
    # joblib and submitit pickle the command's main() with the globals it names
    import pickle

    timeline = pickle.loads(pickle.dumps(Timeline()))
    with timeline.phase("build"):
        pass
    assert set(timeline.table()["phases"]) == {"build"}
