"""wandb: offline runs inside the job folder with the config and the history, the run id kept across a resume, and
wandb failing (no key, no network, a broken init) never stops training. One run per sweep job:
tests/e2e/test_sweep.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import StopAt, jsonl, offline_run, read_run, same_history, summary

from runner.log.wandb_logger import WandbLogger, has_api_key
from runner.train import train

TINY = ["+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=10st", "trainer.log_interval=5st"]


def test_a_run_logs_offline_in_its_folder_and_a_resumed_run_continues_it(
    offline: None, compose_cfg: Callable, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [*TINY, "logger=[jsonl,wandb]", "callbacks=none", "checkpoint.interval=1000st"]
    cfg = compose_cfg(*overrides)
    first = train(cfg, extra_callbacks=[StopAt(10)])
    assert first.stop_reason == "preempted"
    (before,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    assert f"wandb: logging offline to {before}; upload it with `wandb sync {before}`" in capsys.readouterr().err
    run = read_run(before)
    # a single run: named by its folder, no group, job_type = the experiment, the resolved config
    assert (run["name"], run["group"], run["job_type"]) == (f"{tmp_path.name}/run", "", "digits")
    assert run["config"]["optimizer"]["lr"] == cfg.optimizer.lr and run["config"]["run_dir"] == str(tmp_path / "run")
    assert run["config"]["trainer"]["max_duration"] == "20st" and run["summary"]["stop_reason"] == "preempted"
    same_history(run, jsonl(tmp_path / "run"))  # steps 5 and 10

    second = train(compose_cfg(*overrides, "resume=auto"))
    assert second.stop_reason == "max_duration"
    (after,) = set((tmp_path / "run" / "wandb").glob("offline-run-*")) - {before}
    resumed = read_run(after)
    assert resumed["id"] == run["id"]  # one wandb run, two launches: `wandb sync` uploads both into it
    same_history(resumed, jsonl(tmp_path / "run")[2:])  # steps 15 and 20, after the checkpoint's step
    done = summary(tmp_path / "run")
    assert resumed["summary"]["stop_reason"] == "max_duration" and resumed["exit"] == 0
    assert resumed["summary"]["best/val/loss"] == done["best"]["value"]


def test_a_broken_wandb_init_never_stops_training(
    offline: None, compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import wandb

    def refuse(**kwargs: Any) -> None:
        raise wandb.errors.UsageError("wandb is broken here")

    monkeypatch.setattr(wandb, "init", refuse)
    run = train(compose_cfg(*TINY, "logger=[jsonl,wandb]"))
    assert run.stop_reason == "max_duration" and run.progress.step == 20
    err = capsys.readouterr().err
    assert "wandb: could not start (UsageError: wandb is broken here); training goes on without wandb" in err


def test_wandb_failing_while_logging_says_so_once_and_training_goes_on(
    offline: None, compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import wandb

    real_init = wandb.init

    def init_then_break(**kwargs: Any) -> Any:
        run = real_init(**kwargs)
        monkeypatch.setattr(run, "log", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
        return run

    monkeypatch.setattr(wandb, "init", init_then_break)
    run = train(compose_cfg(*TINY, "logger=[jsonl,wandb]"))
    assert run.stop_reason == "max_duration"
    err = capsys.readouterr().err
    assert err.count("wandb: log failed (OSError: disk full); training goes on without wandb") == 1
    assert len(jsonl(Path(run.loggers[0].path).parent)) == 4  # the other loggers kept every row


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))


def test_an_api_key_is_found_in_the_environment_or_the_netrc(
    no_credentials: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert not has_api_key()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert has_api_key()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert not has_api_key()  # a key for another host is not one for this host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert has_api_key()


def _start(tmp_path: Path, **kwargs: Any) -> WandbLogger:
    logger = WandbLogger(dir=str(tmp_path / "run"), **kwargs)
    logger.start({"run_dir": str(tmp_path / "run"), "config": {"lr": 0.1}, "experiment": "digits"})
    return logger


def test_without_an_api_key_it_logs_offline_and_says_how_to_sync(
    no_credentials: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    logger = _start(tmp_path)
    try:
        assert logger.run.settings.mode == "offline"
    finally:
        logger.close({"stop_reason": "max_duration", "metrics": {}})
    where = offline_run(tmp_path / "run")["dir"]
    err = capsys.readouterr().err
    assert "wandb: no API key (set WANDB_API_KEY or run `wandb login`): " in err
    assert f"logging offline to {where}; upload it with `wandb sync {where}`" in err


def test_without_a_network_it_falls_back_to_offline(
    no_credentials: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    logger = _start(tmp_path, init_timeout=1)
    try:
        assert logger.run.settings.mode == "offline"
    finally:
        logger.close(None)
    run = offline_run(tmp_path / "run")
    assert run["exit"] == 1 and run["config"]["lr"] == 0.1  # a failed run is marked failed in wandb
    err = capsys.readouterr().err
    assert "wandb: could not reach the server (CommError: " in err and f"`wandb sync {run['dir']}`" in err
