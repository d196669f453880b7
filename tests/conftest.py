"""Fixtures shared by both tiers (helper functions live in helpers.py: test files import that, never this file)."""

from __future__ import annotations

import copy
import gc
import io
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

if not torch.cuda.is_available():
    # Triton's kernels (experiments/sae/coders/kernels.py) run in its interpreter on the CPU, against the torch path;
    # it must be set before they are defined. Where CUDA is, they (and Inductor's) compile and run on the GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import (
    CONF_DIR,
    SAE_LM,
    TINY_LM,
    compose_job,
    deadline,
    finished_run,
    module_runs,
    run_in_background,
    stop_runs,
)
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._utils import get_yaml_loader

from runner.build import build
from runner.run import Run

E2E = Path(__file__).resolve().parent / "e2e"


@pytest.fixture(autouse=True)
def _syncs_allowed_after_each_test() -> Iterator:
    """A test that made syncs errors (helpers.SyncsAreErrors) and failed half-way must not leave the mode on: every
    later test's pageable copy to the GPU would raise (the first GPU run saw 9 failures from one leak)."""
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module", autouse=True)
def _what_lives_on_is_frozen() -> None:
    """What is left when a module starts (modules torch, Hydra and the tests imported, the session's fixtures) lives
    on: frozen, it is not walked again by each of the collector's full passes (there were 42 in the unit tier, 0.4 s
    each, walking torch's objects), only what the tests make is."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _one_thread_and_e2e_runs_in_the_background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator:
    """In-process tests run on one intra-op thread (tiny models gain nothing from more), and the runs of the e2e
    modules whose selected tests need them start in the background on the other core (helpers.module_runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    items = [item for item in request.session.items if E2E in item.path.parents and "runs" in item.fixturenames]
    modules = dict.fromkeys(item.module for item in items)
    for module in modules:
        module_runs(module, tmp_path_factory)
    run_in_background(1 if modules else 0)
    yield
    stop_runs()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _yaml_parsed_once() -> Iterator:
    """Hydra parses every option file again at each composition (about 25 a config, and the unit tier composes
    thousands of times): a file's YAML is parsed once and copied after, keyed by the text itself, so an edited file
    is parsed anew. A path (a run folder's config, read by runner's own code) is read as it always is."""
    load = OmegaConf.load
    parsed: dict[str, Any] = {}

    def cached(file_: Any) -> DictConfig | ListConfig:
        if not hasattr(file_, "read"):
            return load(file_)
        text = file_.read()
        text = text.decode() if isinstance(text, bytes) else text  # a zipped package's file
        if text not in parsed:
            loaded = load(io.StringIO(text))  # its errors exactly as OmegaConf gives them
            parsed[text] = yaml.load(io.StringIO(text), Loader=get_yaml_loader())
            return loaded
        obj = copy.deepcopy(parsed[text])
        if obj is None:  # OmegaConf.load's own cases: an empty file, a lone word
            return OmegaConf.create()
        return OmegaConf.create({obj: None} if isinstance(obj, str) else obj)

    OmegaConf.load = staticmethod(cached)
    yield
    OmegaConf.load = staticmethod(load)


@pytest.fixture(scope="session", autouse=True)
def _cache_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """In-process runs encode their text corpora (experiments/lm) into a folder of the session, not ~/.cache."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


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


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb logs offline (no network, no key needed)."""
    monkeypatch.setenv("WANDB_MODE", "offline")


@pytest.fixture
def launcher_for(tmp_path: Path) -> Iterator[Callable]:
    """`launcher_for(*overrides)`: the launcher a `-m` sweep with these overrides gets, set up as the sweeper sets it
    up (sweep folder <tmp_path>/sweep). Hydra's logging setup in launch() is undone afterwards."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    from runner.__main__ import main  # (also registers the config's resolvers)

    handlers, level = logging.root.handlers[:], logging.root.level

    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            hydra = GlobalHydra.instance().hydra
            cfg = hydra.compose_config(
                "config", [*overrides, f"hydra.sweep.dir={tmp_path}/sweep"], run_mode=RunMode.MULTIRUN
            )
            context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
            return Plugins.instance().instantiate_launcher(config=cfg, hydra_context=context, task_function=main)

    yield make
    logging.root.handlers[:], logging.root.level = handlers, level


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`trained_once(folder, *overrides)`: `folder` (made, empty) becomes the finished run folder that
    finished_run(folder, *overrides) leaves, as a copy of the one this process trained the first time it was asked for
    those overrides: the same files (training is seeded: the same weights, bit for bit), one training per worker
    instead of one per caller."""
    trained: dict[tuple[str, ...], Path] = {}

    def copy(folder: Path, *overrides: str) -> Path:
        if overrides not in trained:
            trained[overrides] = tmp_path_factory.mktemp("trained_once")
            finished_run(trained[overrides], *overrides)
        shutil.copytree(trained[overrides], folder, dirs_exist_ok=True)
        return folder

    return copy


@pytest.fixture(scope="session")
def _lm_trained(trained_once: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's one TINY_LM folder that the SAE trained once (sae_lm_run) reads, copied to each module."""
    return trained_once(tmp_path_factory.mktemp("lm_trained"), *TINY_LM)


@pytest.fixture(scope="module")
def sae_lm_run(
    lm_run: Path, _lm_trained: Path, trained_once: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A finished SAE (SAE_LM) on lm_run's residual stream after block 1; one per test module: a copy of the one the
    worker trained on _lm_trained (the same weights as lm_run's, bit for bit), its source.checkpoint made lm_run."""
    directory = trained_once(
        tmp_path_factory.mktemp("sae_lm"), "+experiment=sae_lm", f"source.checkpoint={_lm_trained}", *SAE_LM
    )
    config = directory / ".hydra" / "config.yaml"
    text = config.read_text(encoding="utf-8")
    assert text.count(f"checkpoint: {_lm_trained}\n") == 1, text
    config.write_text(text.replace(f"checkpoint: {_lm_trained}\n", f"checkpoint: {lm_run}\n"), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def lm_run(trained_once: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished tiny GPT run folder (helpers.TINY_LM), as load_trained reads it: model.safetensors and
    .hydra/config.yaml; one folder per test module (a copy of the one run the worker trained), a source for the SAE
    experiments."""
    yield trained_once(tmp_path_factory.mktemp("lm"), *TINY_LM)


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Iterator[Callable]:
    """`run_cli(*args)`: `python -m runner *args` in this process (runner.__main__.cli); (exit code, stderr)."""
    import hydra._internal.utils as hydra_utils

    from runner.__main__ import cli

    monkeypatch.setattr(hydra_utils, "run_and_report", hydra_utils.run_and_report)  # cli() wraps it: undone after
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    handlers, level = logging.root.handlers[:], logging.root.level

    def run(*args: str) -> tuple[object, str]:
        monkeypatch.setattr(sys, "argv", ["runner", *args])
        with pytest.raises(SystemExit) as exited, deadline(300):  # a hang fails the test, whatever the load
            cli()
        return exited.value.code, capsys.readouterr().err

    yield run
    logging.root.handlers[:], logging.root.level = handlers, level
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
