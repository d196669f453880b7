"""wandb: offline runs inside the job folder with the config and the history, the run id kept across a resume, and
wandb failing (no key, no network, a broken init) never stops training. One run per sweep job: tests/test_sweep.py."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import StopAt

from runner.log.wandb_logger import WandbLogger, has_api_key
from runner.train import train

TINY = ["+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=10st", "trainer.log_interval=5st"]
WANDB = "logger=[console,jsonl,wandb]"


def records(path: Path) -> Iterator[Any]:
    """The protobuf records of a `.wandb` file: wandb's LevelDB-style log (32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    if len(data) < 7:  # still being written
        return
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # the padded end of a block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def offline_run(folder: Path) -> dict[str, Any]:
    """What the one offline run under `folder/wandb` holds: run facts, config, history rows by step, summary, exit."""
    (run_dir,) = (folder / "wandb").glob("offline-run-*")
    return read_run(run_dir)


def read_run(run_dir: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """What an offline run folder (`wandb/offline-run-*`) holds, once its exit record is there.

    In the process that logged it, wandb's service may still be flushing the file when finish() returns (the service
    outlives the run); a process that has exited has written all of it.
    """
    deadline = time.monotonic() + timeout_s
    while (out := _read_log(run_dir))["exit"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return out


def _read_log(run_dir: Path) -> dict[str, Any]:
    (log,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"dir": run_dir, "history": {}, "summary": {}, "exit": None}
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            out.update(id=r.run_id, name=r.display_name, group=r.run_group, job_type=r.job_type, project=r.project)
            out["config"] = {i.key: json.loads(i.value_json) for i in r.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out["history"].setdefault(row["_step"], {}).update(row)
        elif kind == "summary":
            out["summary"].update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def jsonl(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")


def same_history(run: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Every metrics.jsonl value is in wandb's history at the same optimizer step."""
    assert {row["step"] for row in rows} == set(run["history"])
    for row in rows:
        for key, value in row.items():
            if key != "step":
                assert run["history"][row["step"]][key] == value, (row["step"], key)


@pytest.mark.slow
def test_a_run_logs_offline_in_its_folder_and_a_resumed_run_continues_it(
    offline: None, compose_cfg: Callable, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [*TINY, "logger=[jsonl,wandb]", "callbacks=[checkpoint]", "callbacks.checkpoint.interval=1000st"]
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
    done = json.loads((tmp_path / "run" / "summary.json").read_text())
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


@pytest.mark.slow
def test_without_a_network_it_falls_back_to_offline(
    no_credentials: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    logger = _start(tmp_path, init_timeout=3)
    try:
        assert logger.run.settings.mode == "offline"
    finally:
        logger.close(None)
    run = offline_run(tmp_path / "run")
    assert run["exit"] == 1 and run["config"]["lr"] == 0.1  # a failed run is marked failed in wandb
    err = capsys.readouterr().err
    assert "wandb: could not reach the server (CommError: " in err and f"`wandb sync {run['dir']}`" in err
