"""Fuzzed command lines: a few hundred bad overrides, made deterministically from the keys of the real composed configs
(digits, sae, lm), each taken through what the CLI does before the first step (Hydra's composition, the threads, the
checks, build, resume), in this process. Each must start or be refused as a configuration error (exit 2), never raise
anything else (a traceback, exit 1)."""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import compose_job
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig

from runner import ConfigError
from runner.build import build
from runner.sweeps.job import threads_per_job
from runner.train import resume

SEED = 20240601
CASES_PER_EXPERIMENT = 40  # ~140 cases, ~20 s of one core on AVX2 (a composition and build are ~150 ms)
# What the CLI turns into one paragraph and exit code 2 (runner.__main__: ConfigError, and Hydra's composition errors).
REFUSED = (ConfigError, ConfigCompositionException, MissingConfigException, OverrideParseException)
JSON_DIR = Path(sysconfig.get_paths()["stdlib"]) / "json"
# Each experiment at its smallest: two steps, no loggers (they open files and wandb), small data.
EXPERIMENTS = {
    "digits": ["+experiment=digits", "trainer.max_duration=2st", "logger=none"],
    "sae": ["+experiment=sae", "trainer.max_duration=2st", "logger=none", "data.splits.n_val=256"],
    "lm": [
        "+experiment=lm",
        f"data.paths=[{JSON_DIR / '*.py'}]",
        "data.val_every=2",
        "data.val_windows=4",
        "model.n_layer=1",
        "model.d_model=16",
        "model.n_head=2",
        "model.seq_len=16",
        "logger=none",
        "trainer.max_duration=2st",
    ],
}
SCALARS = ["abc", "null", "0", "-1", "1e99", "nan", "inf", "-inf", "[1,2]", "{a: 1}", "true", "''"]
LISTS = ["[]", "[0]", "[-1]", "[abc]", "[null]", "[1e99]", "abc", "3"]
UNKNOWN = ["+model.nope=1", "+data.nope=1", "+optimizer.nope=1", "+scheduler.nope=1", "+trainer.nope=1", "+nope=1"]
SKIPPED = ("hydra", "logger")  # Hydra's own node; loggers open files and services


def _leaves(node: DictConfig, path: str = "") -> Iterator[tuple[str, object]]:
    # (dotted key, its node) of every value that is not a mapping: scalars, interpolations, lists
    for key in node.keys():
        child = f"{path}.{key}" if path else str(key)
        value = node._get_node(key)
        if isinstance(value, DictConfig):
            yield from _leaves(value, child)
        else:
            yield child, value


def _cases(name: str, bad_paths: list[str]) -> list[str]:
    """The experiment's overrides to try: every key with bad values of its kind, sampled with a fixed seed."""
    cfg = compose_job(Path("/nonexistent-run-dir"), *EXPERIMENTS[name])
    HydraConfig.instance().cfg = None
    cases: list[str] = []
    for key, value in _leaves(cfg):
        if key.startswith(SKIPPED):
            continue
        last = key.rpartition(".")[2]
        if last.startswith("_"):
            cases += [f"{key}=nope.Nothing"] if last == "_target_" else []
            continue
        values = LISTS if isinstance(value, ListConfig) else SCALARS
        cases += [f"{key}={v}" for v in values] + [f"{key}={p}" for p in bad_paths]
    chosen = random.Random(f"{SEED}:{name}").sample(cases, min(CASES_PER_EXPERIMENT, len(cases)))
    return chosen + UNKNOWN


def _start(overrides: list[str], run_dir: Path) -> None:
    # what the CLI does before training: compose, the threads (runner.__main__), build and resume (runner.train)
    try:
        cfg = compose_job(run_dir, *overrides)
        threads_per_job(cfg.get("threads"), 1)
        run = build(cfg)
        try:
            resume(run, cfg)
        finally:
            for logger in run.loggers:
                logger.close(None)
            run.strategy.close()
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_bad_overrides_start_or_are_refused_as_configuration_errors(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths the cases give (data.cache_dir=abc) land here
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.py").write_text("print('not data')\n")
    bad_paths = ["/nonexistent/x", str(tmp_path / "folder"), str(tmp_path / "file.py"), "/proc/x"]
    failures, outcomes = [], {"started": 0, "refused": 0}
    for i, case in enumerate(_cases(name, bad_paths)):
        try:
            _start([*EXPERIMENTS[name], case], tmp_path / f"run{i}")
            outcomes["started"] += 1
        except REFUSED as error:
            assert str(error).strip(), case
            outcomes["refused"] += 1
        except Exception as error:  # noqa: BLE001 - every other exception is a failure, listed together
            failures.append(f"{case}: {type(error).__name__}: {str(error)[:300]}")
    assert not failures, "\n".join(failures)
    assert all(outcomes.values()), outcomes  # both happen: the cases reach the checks, and some values are fine
