"""TensorBoard and MLflow: what they write is read back by their own readers (TensorBoard's event accumulator, an
MlflowClient on the store), a resumed run continues them, a sweep's jobs share one MLflow store, and neither failing
nor missing ever stops training (a missing package is a ConfigError naming the pip command)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import CrashAt, StopAt, jsonl, summary
from safetensors.torch import load_file

from runner import ConfigError
from runner.build import build
from runner.log.mlflow_logger import MlflowLogger, flat
from runner.log.tensorboard_logger import TensorBoardLogger
from runner.train import train

TINY = ["+experiment=digits", "trainer.max_duration=20st", "trainer.val_interval=10st", "trainer.log_interval=5st"]


def _events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(log_dir)).Reload()


def _scalars(events: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _jsonl_values(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if key in row]


def test_tensorboard_writes_every_metric_and_the_config_for_tensorboards_reader(
    compose_cfg: Callable, tmp_path: Path
) -> None:
    train(compose_cfg(*TINY, "logger=[jsonl,tensorboard]"))
    rows = jsonl(tmp_path / "run")
    events = _events(tmp_path / "run" / "tensorboard")
    keys = {key for row in rows for key in row} - {"step"}
    assert {"train/loss", "train/lr", "val/loss", "val/acc", "epoch"} <= keys
    for key in keys:
        assert _scalars(events, key) == [(s, pytest.approx(v, rel=1e-6)) for s, v in _jsonl_values(rows, key)], key
    assert [s for s, _ in _scalars(events, "train/loss")] == [5, 10, 15, 20]
    assert "config/text_summary" in events.Tags()["tensors"]
    (config,) = events.Tensors("config/text_summary")
    assert b"max_duration: 20st" in config.tensor_proto.string_val[0]


def test_a_resumed_run_replaces_what_tensorboard_got_after_the_checkpoint(
    compose_cfg: Callable, tmp_path: Path
) -> None:
    overrides = [*TINY, "logger=[jsonl,tensorboard]", "callbacks=none", "checkpoint.interval=10st"]
    with pytest.raises(RuntimeError, match="the node died"):
        train(compose_cfg(*overrides), extra_callbacks=[CrashAt(15)])  # steps 5, 10 (checkpoint), 15 logged
    train(compose_cfg(*overrides, "resume=auto"))
    events = _events(tmp_path / "run" / "tensorboard")
    # step 15 of the crashed launch is purged: each step once, with the values of the launch that kept it
    assert _scalars(events, "train/loss") == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in _jsonl_values(jsonl(tmp_path / "run"), "train/loss")
    ]
    assert [s for s, _ in _scalars(events, "train/loss")] == [5, 10, 15, 20]


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _only_run(uri: str, experiment: str = "runner") -> Any:
    client = _client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def test_mlflow_logs_params_metrics_and_the_final_weights_to_a_file_store_in_the_run_folder(
    compose_cfg: Callable, tmp_path: Path
) -> None:
    cfg = compose_cfg(*TINY, "logger=[jsonl,mlflow]")
    first = train(cfg, extra_callbacks=[StopAt(10)])
    assert first.stop_reason == "preempted"
    uri = (tmp_path / "run" / "mlruns").as_uri()
    run = _only_run(uri)
    assert run.info.status == "FINISHED" and run.data.tags["stop_reason"] == "preempted"
    assert run.info.run_name == f"{tmp_path.name}/run" and run.data.tags["experiment"] == "digits"
    assert "sweep" not in run.data.tags and run.data.tags["run_dir"] == str(tmp_path / "run")
    assert run.data.params["optimizer.lr"] == str(cfg.optimizer.lr)
    assert run.data.params["trainer.max_duration"] == "20st" and run.data.params["model.hidden"] == "[512, 512]"

    train(compose_cfg(*TINY, "logger=[jsonl,mlflow]", "resume=auto"))
    resumed = _only_run(uri)  # the same MLflow run, continued
    assert resumed.info.run_id == run.info.run_id and resumed.data.tags["stop_reason"] == "max_duration"
    client = _client(uri)
    rows = jsonl(tmp_path / "run")
    for key in ("train/loss", "val/loss"):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(history) == _jsonl_values(rows, key), key
    artifacts = Path(client.download_artifacts(run.info.run_id, "model.safetensors", str(tmp_path / "got")))
    final = load_file(tmp_path / "run" / "model.safetensors")
    assert load_file(artifacts).keys() == final.keys()
    assert artifacts.read_bytes() == (tmp_path / "run" / "model.safetensors").read_bytes()
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"model.safetensors", "summary.json"}


def test_a_sweeps_jobs_share_one_store_and_are_tagged_by_the_sweep(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "multirun" / "2026-01-02" / "03-04-05"
    for num in (0, 1):
        logger = MlflowLogger()
        logger.start(
            {
                "run_dir": str(sweep_dir / str(num)),
                "sweep": "2026-01-02/03-04-05",
                "sweep_dir": str(sweep_dir),
                "job": f"{num}: seed={num}",
                "experiment": "digits",
                "config": {"seed": num, "optimizer": {"lr": 0.1}},
            }
        )
        logger.log({"train/loss": 1.0 / (num + 1), "note": "not a number"}, step=5)
        logger.close({"stop_reason": "max_duration", "metrics": {}})
    client = _client((sweep_dir / "mlruns").as_uri())
    runs = client.search_runs(
        [client.get_experiment_by_name("runner").experiment_id], "tags.sweep = '2026-01-02/03-04-05'"
    )
    assert sorted((r.info.run_name, r.data.params["seed"]) for r in runs) == [("0: seed=0", "0"), ("1: seed=1", "1")]
    assert sorted(r.data.metrics["train/loss"] for r in runs) == [0.5, 1.0]


def test_config_params_are_flat_and_within_mlflows_limits() -> None:
    params = flat({"a": {"b": 1, "c": [1, 2], "d": {}}, "e:f": "x" * 7000, "g": None})
    assert params == {"a.b": "1", "a.c": "[1, 2]", "a.d": "{}", "e_f": "x" * 6000, "g": "None"}


@pytest.mark.parametrize("logger", ["tensorboard", "mlflow"])
def test_a_missing_package_is_a_config_error_naming_the_pip_command(
    logger: str, compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, logger, None)  # as if not installed: find_spec finds nothing, import fails
    with pytest.raises(
        ConfigError, match=rf"logger={logger} needs the {logger} package: pip install 'runner\[{logger}\]'"
    ):
        build(compose_cfg(*TINY, f"logger=[default,{logger}]"))


def test_tensorboard_failing_says_so_once_and_training_goes_on(
    compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr(SummaryWriter, "add_scalar", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    run = train(compose_cfg(*TINY, "logger=[jsonl,tensorboard]"))
    assert run.stop_reason == "max_duration" and run.progress.step == 20
    err = capsys.readouterr().err
    assert err.count("tensorboard: log failed (OSError: disk full); training goes on without tensorboard") == 1
    assert len(jsonl(tmp_path / "run")) == 4  # the other loggers kept every row


@pytest.mark.parametrize("broken", ["create_run", "log_batch", "log_artifact"])
def test_mlflow_failing_says_so_once_and_training_goes_on(
    broken: str, compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("the store is gone")

    if broken == "log_batch":  # the params at start go through; the first metrics fail
        real = MlflowClient.log_batch
        monkeypatch.setattr(
            MlflowClient, broken, lambda self, run_id, **kw: (fail if "metrics" in kw else real)(self, run_id, **kw)
        )
    else:
        monkeypatch.setattr(MlflowClient, broken, fail)
    run = train(compose_cfg(*TINY, "logger=[jsonl,mlflow]"))
    assert run.stop_reason == "max_duration" and run.progress.step == 20
    assert summary(tmp_path / "run")["stop_reason"] == "max_duration"
    action = {"create_run": "start", "log_batch": "log", "log_artifact": "close"}[broken]
    err = capsys.readouterr().err
    assert err.count(f"mlflow: {action} failed (OSError: the store is gone); training goes on without mlflow") == 1
    assert err.count("mlflow:") == 1


def test_a_tracking_uri_of_its_own_is_used(tmp_path: Path) -> None:
    uri = (tmp_path / "elsewhere").as_uri()
    logger = MlflowLogger(tracking_uri=uri, experiment_name="mine", tags={"team": "a"})
    logger.start({"run_dir": str(tmp_path / "run"), "config": {"seed": 0}})
    logger.close(None)
    run = _only_run(uri, "mine")
    assert run.info.status == "FAILED" and run.data.tags["team"] == "a"  # a run that failed is marked so
    assert not (tmp_path / "run" / "mlruns").exists()
    assert os.environ.get("MLFLOW_ALLOW_FILE_STORE") == "true"


def test_tensorboard_logger_closes_before_it_starts(tmp_path: Path) -> None:
    TensorBoardLogger(str(tmp_path / "tb")).close(None)  # a run that failed to build closes its loggers
    assert not (tmp_path / "tb").exists()


def test_only_rank_0_gets_the_loggers(compose_cfg: Callable, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from runner.distributed.strategies import Single

    monkeypatch.setattr(Single, "is_main", False)  # as another rank of the job builds it
    run = build(compose_cfg(*TINY, "logger=[default,tensorboard,mlflow]"))
    assert run.loggers == []
    assert not (tmp_path / "run" / "tensorboard").exists() and not (tmp_path / "run" / "mlruns").exists()
