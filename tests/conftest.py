"""Shared fixtures: run the real CLI (`python -m runner ...`) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from runner.build import build
from runner.run import Run

CONF_DIR = (Path(__file__).resolve().parents[1] / "conf").resolve()
CLI_TIMEOUT_S = 300  # generous: the machine may be shared; a healthy run takes a few seconds


def _has_run_dir(overrides: tuple[str, ...]) -> bool:
    return any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides)


def cli(
    *overrides: str,
    cwd: str | Path,
    run_dir: str | Path | None = None,
    timeout: float = CLI_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m runner *overrides` in `cwd`; add hydra.run.dir=`run_dir` unless the overrides set one.

    WANDB_MODE is offline and HYDRA_FULL_ERROR is unset, so errors look as a user sees them; `env` adds variables.
    The runner and experiments packages are installed editable, so they import from any working directory.
    """
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, "WANDB_MODE": "offline", **(env or {})}
    args = list(overrides)
    if run_dir is not None and not _has_run_dir(overrides):
        args.append(f"hydra.run.dir={run_dir}")
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def run_cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    """`run_cli(*overrides, cwd=tmp_path)`: the CLI with hydra.run.dir=<tmp_path>/run unless the caller sets one."""

    def _run(
        *overrides: str, cwd: str | Path = tmp_path, timeout: float = CLI_TIMEOUT_S
    ) -> subprocess.CompletedProcess:
        return cli(*overrides, cwd=cwd, run_dir=tmp_path / "run", timeout=timeout)

    return _run


@pytest.fixture(scope="session")
def run_cli_in() -> Callable[..., subprocess.CompletedProcess]:
    """Session-scoped variant for module fixtures: `run_cli_in(directory, *overrides)` runs in `directory` with
    hydra.run.dir=<directory>/run unless the overrides set one."""

    def _run(directory: Path, *overrides: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return cli(*overrides, cwd=directory, run_dir=directory / "run", timeout=timeout)

    return _run


def compose_job(run_dir: Path, *overrides: str) -> DictConfig:
    """The job config as the CLI would see it, with ${hydra:runtime.output_dir} resolving to `run_dir`. Hydra's
    choices stay available through HydraConfig.get().runtime.choices."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True
        )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # the job config of a real run has no hydra node
    return cfg


@pytest.fixture
def compose_cfg(tmp_path: Path) -> Iterator[Callable[..., DictConfig]]:
    """`compose_cfg(*overrides, run_dir=None)`: compose_job() in `run_dir` (default <tmp_path>/run)."""
    yield lambda *overrides, run_dir=None: compose_job(run_dir or tmp_path / "run", *overrides)
    HydraConfig.instance().cfg = None


@pytest.fixture
def built(compose_cfg: Callable[..., DictConfig]) -> Iterator[Callable[..., tuple[DictConfig, Run]]]:
    """`built(*overrides)`: compose and build a run; its loggers are closed when the test ends."""
    runs: list[Run] = []

    def _build(*overrides: str) -> tuple[DictConfig, Run]:
        cfg = compose_cfg(*overrides)
        run = build(cfg)
        runs.append(run)
        return cfg, run

    yield _build
    for run in runs:
        for logger in run.loggers:
            logger.close(None)
