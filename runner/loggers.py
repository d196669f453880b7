"""Loggers share one tiny interface: start(info), log(metrics, step), close(summary). Console, metrics.jsonl, wandb."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


class Logger:
    """Base class: a logger overrides what it needs."""

    def start(self, info: dict[str, Any]) -> None:
        """Called once before training with facts about the run (parameters, batch, steps, config...)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics at an optimizer step."""

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and release; `summary` is what summary.json holds (None if the run failed)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run continues this log (e.g. a wandb run id)."""
        return {}

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Before start(): the run resumes after `step` from a checkpoint that held state_dict()."""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) and value != 0 else str(value)
    return str(value)


class ConsoleLogger(Logger):
    """A rich console: startup table, a live bar (step/total, loss, lr, samples/s, ETA), validation lines, summary."""

    def __init__(self, show: tuple[str, ...] = ("train/loss", "train/lr", "train/samples_per_s")) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.show = tuple(show)
        self.bar = None
        self.task = None
        self.latest: dict[str, float] = {}  # the last value of each shown metric (train and val rows differ in step)

    def start(self, info: dict[str, Any]) -> None:
        """Print the startup table and open the progress bar."""
        from rich import progress as rp
        from rich.table import Table

        table = Table(title="runner", show_header=False, box=None)
        for key in (
            "task",
            "parameters",
            "device",
            "precision",
            "world_size",
            "distributed",
            "global_batch",
            "total_steps",
            "max_duration",
            "run_dir",
        ):
            if key in info:
                table.add_row(key.replace("_", " "), _fmt(info[key]))
        self.console.print(table)
        if self.console.is_terminal:
            # Auto-refresh at a few Hz from rich's thread: a refresh costs ~0.5 ms, an update() a few microseconds.
            self.bar = rp.Progress(
                rp.TextColumn("{task.description}"),
                rp.BarColumn(),
                rp.MofNCompleteColumn(),
                rp.TextColumn("{task.fields[stats]}"),
                rp.TimeRemainingColumn(),
                console=self.console,
                refresh_per_second=4,
                transient=False,
            )
            self.task = self.bar.add_task("train", total=info.get("total_steps"), stats="")
            self.bar.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Update the bar; print a line per validation."""
        self.latest.update((k, metrics[k]) for k in self.show if k in metrics)
        if self.bar is not None:
            stats = "  ".join(f"{k.split('/')[-1]} {_fmt(v)}" for k, v in self.latest.items())
            self.bar.update(self.task, completed=step, stats=stats)
        if any(k.startswith("val/") for k in metrics):
            shown = {
                **{k: v for k, v in self.latest.items() if k == "train/loss"},
                **{k: v for k, v in metrics.items() if k.startswith("val/")},
            }
            line = "  ".join(f"{k} {_fmt(v)}" for k, v in shown.items())
            self.console.print(
                f"step {step}  epoch {metrics.get('epoch', 0):.2f}  {line}", highlight=False, soft_wrap=True
            )

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Stop the bar and print the final summary."""
        from rich.table import Table

        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if summary is None:
            return
        table = Table(title=f"done: {summary['stop_reason']}", show_header=False, box=None)
        for key, value in summary["progress"].items():
            table.add_row(key, _fmt(value))
        if summary.get("best"):
            best = summary["best"]
            table.add_row(f"best {best['monitor']}", f"{_fmt(best['value'])} at step {best['step']}")
        for key, value in sorted(summary["metrics"].items()):
            if key.startswith("val/"):
                table.add_row(key, _fmt(value))
        table.add_row("wall time", f"{summary['wall_time_s']:.1f} s")
        table.add_row("samples/s", f"{summary['samples_per_s']:.0f}")
        self.console.print(table)


class JsonlLogger(Logger):
    """Writes one JSON object per logged step to `path`, flushed at once so a crash loses nothing logged.

    A new run starts a new file; a resumed run keeps the rows up to the checkpoint's step and appends after them.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.file = None
        self.resumed_at: int | None = None

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Keep rows up to `step`; later ones belong to the interrupted attempt and are written again."""
        self.resumed_at = step

    def start(self, info: dict[str, Any]) -> None:
        """Open the file (truncated after the resume step when resuming)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resumed_at is not None and self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line)["step"] <= self.resumed_at:
                        kept.append(line + "\n")
                except (ValueError, KeyError):  # a row cut in half by the crash
                    continue
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self.file = self.path.open("a" if self.resumed_at is not None else "w", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write {'step': step, **metrics} as one line."""
        if self.file is None:
            self.start({})
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()


class WandbLogger(Logger):
    """Weights & Biases; imported only when this logger is configured. `mode: offline` works without a network."""

    def __init__(
        self,
        project: str = "runner",
        name: str | None = None,
        mode: str | None = None,
        dir: str | None = None,
        tags: list[str] | None = None,
    ) -> None:
        self.kwargs = {
            "project": project,
            "name": name,
            "mode": mode or os.environ.get("WANDB_MODE"),
            "dir": dir,
            "tags": list(tags or []),
        }
        self.run = None

    def state_dict(self) -> dict[str, Any]:
        """The run id, so that a resumed run continues the same wandb run."""
        return {"id": self.run.id} if self.run is not None else {}

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """Continue the checkpointed wandb run."""
        if state.get("id"):
            self.kwargs.update(id=state["id"], resume="allow")

    def start(self, info: dict[str, Any]) -> None:
        """Open the wandb run with the resolved config."""
        import wandb

        from runner import ConfigError

        if self.kwargs["dir"]:
            Path(self.kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(config=info.get("config"), **self.kwargs)
        except (wandb.errors.UsageError, wandb.errors.CommError) as error:
            raise ConfigError(
                f"wandb could not start: {error}. Log in with `wandb login`, or run offline with "
                "WANDB_MODE=offline (or logger.wandb.mode=offline)"
            ) from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log at the optimizer step."""
        self.run.log(metrics, step=step)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Record the summary and finish the run (exit code 1 if it failed)."""
        if self.run is None:
            return
        if summary is not None:
            self.run.summary.update({"stop_reason": summary["stop_reason"], **summary["metrics"]})
        self.run.finish(exit_code=0 if summary is not None else 1)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write `data` as indented JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(device: str, world_size: int) -> dict[str, Any]:
    """What run.json records: command line, git state, versions, host, device, world size."""
    import hydra

    commit = _git("rev-parse", "HEAD")
    return {
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "git": {"commit": commit, "dirty": bool(_git("status", "--porcelain")) if commit else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "hydra": hydra.__version__},
        "hostname": socket.gethostname(),
        "device": device,
        "world_size": world_size,
    }
