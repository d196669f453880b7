"""Weights & Biases: one run per job, grouped by sweep, offline when it must be, never the reason training stops."""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from runner.interfaces import Logger
from runner.log import say_lost


def has_api_key() -> bool:
    """Whether wandb could authenticate without asking: WANDB_API_KEY, an identity token, or `wandb login`'s netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or Path.home() / ".netrc"
    try:
        return netrc.netrc(str(path)).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _say(message: str) -> None:
    print(f"wandb: {message}", file=sys.stderr, flush=True)


class WandbLogger(Logger):
    """Logs to wandb from rank 0; unset name/group/job_type come from the run (sweep folder, experiment, job).

    The mode is `mode` if set, else WANDB_MODE, else online when an API key is there and offline otherwise. An
    online start that fails (no network) goes offline; if wandb cannot start at all, or fails later, training goes
    on without it and says so once. Offline runs are written under `dir` (the job's run folder).
    """

    def __init__(
        self,
        project: str = "runner",
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        job_type: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        mode: str | None = None,
        dir: str | None = None,
        init_timeout: float = 30.0,
    ) -> None:
        self.kwargs: dict[str, Any] = {
            "project": project,
            "entity": entity,
            "name": name,
            "group": group,
            "job_type": job_type,
            "tags": list(tags or []),
            "notes": notes,
            "dir": dir,
        }
        self.mode = mode
        self.init_timeout = init_timeout
        self.run: Any = None

    def state_dict(self) -> dict[str, Any]:
        """The run id, so that a resumed run continues the same wandb run."""
        return {"id": self.run.id} if self.run is not None else {}

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Continue the checkpointed wandb run."""
        if state.get("id"):
            self.kwargs.update(id=state["id"], resume="allow")

    def _names(self, info: dict[str, Any]) -> dict[str, Any]:
        # In a sweep: group = the sweep folder, so its jobs sit together and never merge into one run; the name
        # says which job. Alone: the run folder's DATE/TIME, which is what the user sees on disk.
        run_dir = info.get("run_dir")
        folder = "/".join(Path(run_dir).parts[-2:]) if run_dir else None
        return {
            "name": self.kwargs["name"] or info.get("job") or folder,
            "group": self.kwargs["group"] or info.get("sweep"),
            "job_type": self.kwargs["job_type"] or info.get("experiment") or "train",
        }

    def _init(self, mode: str, info: dict[str, Any]) -> Any:
        import wandb

        if wandb.run is not None:  # a previous job in this process left its run open: never log into it
            wandb.run.finish()
        settings = wandb.Settings(silent=True, console="off", init_timeout=self.init_timeout)
        kwargs = {**self.kwargs, **self._names(info), "mode": mode}
        return wandb.init(config=info.get("config"), settings=settings, **kwargs)

    def start(self, info: dict[str, Any]) -> None:
        """Open the wandb run with the resolved config; fall back to offline, then to no wandb, with one line."""
        if self.kwargs["dir"]:
            self.kwargs["dir"] = str(Path(self.kwargs["dir"]).resolve())
            Path(self.kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        mode, why = self.mode or os.environ.get("WANDB_MODE"), None
        if mode is None:
            mode = "online" if has_api_key() else "offline"
            why = None if mode == "online" else "no API key (set WANDB_API_KEY or run `wandb login`)"
        try:
            self.run = self._init(mode, info)
        except Exception as error:  # wandb raises its own errors, timeouts and OS errors: any of them is "no wandb"
            if mode != "online":
                _say(f"could not start ({type(error).__name__}: {error}); training goes on without wandb")
                return
            why = f"could not reach the server ({type(error).__name__}: {str(error).splitlines()[0]})"
            try:
                self.run = self._init("offline", info)
            except Exception as again:
                _say(f"could not start ({type(again).__name__}: {again}); training goes on without wandb")
                return
        if self.run.settings.mode == "offline" or why:
            where = Path(self.run.dir).resolve().parent
            _say(f"{why + ': ' if why else ''}logging offline to {where}; upload it with `wandb sync {where}`")
        elif self.run.url:
            _say(f"run {self.run.url}")

    def _lost(self, action: str, error: Exception) -> None:
        say_lost("wandb", action, error)
        self.run = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log at the optimizer step."""
        if self.run is None:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as error:
            self._lost("log", error)

    def log_histograms(self, values: dict[str, list[float]], step: int) -> None:
        """One wandb.Histogram per key at the optimizer step."""
        if self.run is None:
            return
        try:
            import wandb

            self.run.log({key: wandb.Histogram(numbers) for key, numbers in values.items()}, step=step)
        except Exception as error:
            self._lost("log", error)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Record the summary and finish the run (exit code 1 if it failed), so the next job gets its own run."""
        if self.run is None:
            return
        try:
            if summary is not None:
                best = summary.get("best") or {}
                extra = {f"best/{best['monitor']}": best["value"], "best/step": best["step"]} if best else {}
                self.run.summary.update({"stop_reason": summary["stop_reason"], **summary["metrics"], **extra})
            self.run.finish(exit_code=0 if summary is not None else 1)
        except Exception as error:
            self._lost("finish", error)
        self.run = None
