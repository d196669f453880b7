"""MLflow: one run per job with the config as params, metrics by step and the final weights as artifacts; a sweep's
jobs share a store and a tag. Never the reason training stops."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from runner import require
from runner.interfaces import Logger
from runner.log import say_lost, scalars
from runner.rundir import MODEL, MODEL_PART, SUMMARY

# MLflow's limits (mlflow.utils.validation): keys, values and entries per log_batch call
_KEY, _VALUE, _PARAMS, _METRICS = 250, 6000, 100, 1000
_BAD_KEY = re.compile(r"[^\w\-. /]")  # what a param or metric name may not hold


def flat(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys ("optimizer.lr"), values as text within MLflow's limits."""
    if isinstance(config, dict) and config:
        return {k: v for key, value in config.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    key = _BAD_KEY.sub("_", prefix.rstrip("."))[:_KEY]
    return {key: str(config)[:_VALUE]}


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class MlflowLogger(Logger):
    """Logs to MLflow from rank 0 through MlflowClient (never the global active run a user's code may hold).

    tracking_uri null: a `file:` store in the run folder (`mlruns/`), or in a sweep the sweep folder's, which all its
    jobs share. Each job is a run of `experiment_name`, named by the job (its overrides) or the run folder, tagged
    `sweep` (the sweep folder's DATE/TIME), `job`, `experiment` and `run_dir`. A resumed run continues the same
    MLflow run. If MLflow cannot start or fails later, training goes on without it and says so once.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str = "runner",
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        log_model: bool = True,
    ) -> None:
        require("mlflow", "mlflow", "logger=mlflow")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.log_model = log_model
        self.client: Any = None
        self.run_id: str | None = None
        self.run_dir: Path | None = None

    def state_dict(self) -> dict[str, Any]:
        """The run id, so that a resumed run continues the same MLflow run."""
        return {"run_id": self.run_id} if self.run_id else {}

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Continue the checkpointed MLflow run."""
        self.run_id = state.get("run_id")

    def store(self, info: dict[str, Any]) -> str:
        """The tracking URI: the configured one, else a file store in the sweep folder or the run folder."""
        if self.tracking_uri:
            return self.tracking_uri
        folder = info.get("sweep_dir") or info.get("run_dir") or "."
        return (Path(folder).resolve() / "mlruns").as_uri()

    def start(self, info: dict[str, Any]) -> None:
        """Open (or, resuming, reopen) the run and log the flattened config as its params."""
        self.run_dir = Path(info["run_dir"]) if info.get("run_dir") else None
        try:
            self._start(info)
        except Exception as error:  # MLflow's own errors, a store it cannot write, a server it cannot reach
            self._lost("start", error)

    def _start(self, info: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.store(info)
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked (it wants a database); a folder of plain files is what a
            # run folder should hold, and any MLflow (`mlflow ui --backend-store-uri <it>`) reads it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if self.run_id is not None:  # resuming: the params are there already (and may not be logged again changed)
            self.client.update_run(self.run_id, status="RUNNING")
            return
        folder = "/".join(self.run_dir.parts[-2:]) if self.run_dir else None
        tags = {"sweep": info.get("sweep"), "job": info.get("job"), "experiment": info.get("experiment")}
        tags = {**{k: str(v) for k, v in tags.items() if v is not None}, "run_dir": str(self.run_dir), **self.tags}
        run = self.client.create_run(
            self._experiment_id(), run_name=self.run_name or info.get("job") or folder, tags=tags
        )
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flat(info["config"]).items()] if info.get("config") else []
        for chunk in _chunks(params, _PARAMS):
            self.client.log_batch(self.run_id, params=chunk)

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.experiment_name)
        except Exception:  # another job of the sweep created it in between
            return self.client.get_experiment_by_name(self.experiment_name).experiment_id

    def _lost(self, action: str, error: Exception) -> None:
        say_lost("mlflow", action, error)
        self.client = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log the numeric metrics at the optimizer step."""
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_BAD_KEY.sub("_", k), v, now, step) for k, v in scalars(metrics).items()]
        try:
            for chunk in _chunks(rows, _METRICS):
                self.client.log_batch(self.run_id, metrics=chunk)
        except Exception as error:
            self._lost("log", error)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Attach the final weights and summary.json, tag the stop reason, and end the run (FAILED without a
        summary)."""
        if self.client is None:
            return
        try:
            if summary is not None:
                self.client.set_tag(self.run_id, "stop_reason", str(summary["stop_reason"]))
                for path in self._artifacts():
                    self.client.log_artifact(self.run_id, str(path))
            self.client.set_terminated(self.run_id, status="FINISHED" if summary is not None else "FAILED")
        except Exception as error:
            self._lost("close", error)
        self.client = None

    def _artifacts(self) -> list[Path]:
        if self.run_dir is None:
            return []
        weights = [self.run_dir / MODEL, *sorted(self.run_dir.glob(MODEL_PART.format("*")))] if self.log_model else []
        return [path for path in [*weights, self.run_dir / SUMMARY] if path.is_file()]
