"""The console logger: a startup table, a live bar in a terminal (plain lines elsewhere), validation lines, the
summary."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from runner.interfaces import Logger


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) and value != 0 else str(value)
    return str(value)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class ConsoleLogger(Logger):
    """A rich console: startup table, progress, validation lines, summary.

    In a terminal the progress is a live bar (step/total, loss, lr, samples/s, ETA) that rich redraws a few times a
    second from its own thread, whatever the step rate. Elsewhere (CI, SLURM logs, a pipe) it is a plain line every
    `every_s` seconds: a log file gets a readable history, not a redrawn bar's control codes.
    """

    beat_s: float | None = 1.0  # how often the heartbeat's thread looks at the pass (None: no thread)

    def __init__(
        self,
        show: tuple[str, ...] = ("train/loss", "train/lr", "train/samples_per_s", "train/tokens_per_s"),
        every_s: float = 30.0,
    ) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.show = tuple(show)
        self.every_s = every_s
        self.bar = None
        self.task = None
        self.total: int | None = None
        self.clock: tuple[float, int] = (0.0, 0)  # (time, step) this launch started at: the ETA's rate counts from it
        self.last_line = time.monotonic()  # a plain line comes every_s after this (start() sets it again)
        self.latest: dict[str, float] = {}  # the last value of each shown metric (train and val rows differ in step)
        self.run_dir: str | None = None
        self.pass_bars: dict[str, Any] = {}  # its bar's task under a training bar
        # A pass's lines outside a bar: every 10 s in a terminal (someone is watching), every `every_s` in a file.
        self.pass_every_s = min(every_s, 10.0) if self.console.is_terminal else every_s
        self._news: tuple[str, int, int | None, float, int] | None = None  # the pass: what, done, total, start, first
        self._last_news = 0.0  # when its last step ended
        self._lock = threading.Lock()  # the heartbeat's thread and the caller's share the pass's news and last_line
        self._closed = threading.Event()
        self._beating: threading.Thread | None = None

    def resume(self, step: int, state: dict[str, Any]) -> None:
        """A resumed launch starts at `step`: its rate (for the ETA) counts the steps it trains."""
        self.clock = (0.0, step)

    def start(self, info: dict[str, Any]) -> None:
        """Print the startup table and open the progress bar."""
        from rich import progress as rp
        from rich.table import Table

        table = Table(title="runner", show_header=False, box=None)
        for key in (
            "task",
            "parameters",
            "trainable_parameters",
            "parameters_on_rank_0",
            "device",
            "precision",
            "world_size",
            "threads",
            "wait_policy",
            "distributed",
            "compile",
            "activation_checkpointing",
            "global_batch",
            "total_steps",
            "max_duration",
        ):
            if key in info:
                table.add_row(key.replace("_", " "), _fmt(info[key]))
        self.console.print(table)
        self.run_dir = info.get("run_dir")
        self._print_run_dir()
        self.total = info.get("total_steps")
        self.clock = (time.monotonic(), self.clock[1])
        self.last_line = self.clock[0]
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
        stats = "  ".join(f"{k.split('/')[-1]} {_fmt(v)}" for k, v in self.latest.items())
        validated = any(k.startswith("val/") for k in metrics)
        if self.bar is not None:
            self.bar.update(self.task, completed=step, stats=stats)
        elif not validated:  # a validation prints its own line below
            self._plain_line(step, stats)
        if validated:
            shown = {
                **{k: v for k, v in self.latest.items() if k == "train/loss"},
                **{k: v for k, v in metrics.items() if k.startswith("val/")},
            }
            line = "  ".join(f"{k} {_fmt(v)}" for k, v in shown.items())
            epoch = f"epoch {metrics['epoch']:.2f}  " if "epoch" in metrics else ""  # a stream has no epochs
            self.console.print(f"step {step}  {epoch}{line}", highlight=False, soft_wrap=True)

    def working(self, what: str, done: int, total: int | None) -> None:
        """A long pass named `what` (a validation, a splice, a phase of a tool): `done` of `total` steps (0: it starts).
        Under a training bar, a second bar; otherwise a line every `pass_every_s`, and a heartbeat line as often while
        one step runs long (the line names the pass, its total, the time since its last step and its ETA)."""
        now = time.monotonic()
        if self.bar is not None:
            if what not in self.pass_bars:
                self.pass_bars[what] = self.bar.add_task(what, total=total, stats="")
            self.bar.update(self.pass_bars[what], completed=done, total=total)  # a pass may learn its length as it goes
            if done == total:
                self.bar.remove_task(self.pass_bars.pop(what))
            return
        with self._lock:
            news = self._news
            if news is None or news[0] != what or done < news[1]:  # a new pass: its clock starts at its first news
                news = (what, done, total, now, done)
            self._news = None if done == total else (what, done, total, news[3], news[4])
            self._last_news = now
            if done != total and now - self.last_line >= self.pass_every_s:
                self._pass_line(now)
        if self._news is not None and self.beat_s and (self._beating is None or not self._beating.is_alive()):
            self._beating = threading.Thread(target=self._beat_until_done, name="console-heartbeat", daemon=True)
            self._beating.start()

    def beat(self) -> None:
        """The heartbeat: while a pass runs and its last line is `pass_every_s` old, the line again, with how long
        its current step has run: a step that takes minutes still says where the pass is."""
        now = time.monotonic()
        with self._lock:
            if self._news is not None and now - self.last_line >= self.pass_every_s:
                self._pass_line(now)

    def _beat_until_done(self) -> None:
        # the heartbeat's thread: it ends with the pass (its last step, or close())
        while not self._closed.wait(self.beat_s) and self._news is not None:
            self.beat()

    def _pass_line(self, now: float) -> None:
        what, done, total, started, first = self._news
        self.last_line = now
        share = f"/{total} ({100 * done / total:.0f}%)" if total else ""
        elapsed = f"  elapsed {_duration(now - started)}"
        # the rate counts the steps since the pass's first news, up to now: a step that runs long slows it
        eta = f"  eta {_duration((total - done) * (now - started) / (done - first))}" if total and done > first else ""
        quiet = now - self._last_news
        running = f"  (step {done + 1} running for {_duration(quiet)})" if quiet >= self.pass_every_s else ""
        self.console.print(f"{what} {done}{share}{elapsed}{eta}{running}", highlight=False, soft_wrap=True)

    def _plain_line(self, step: int, stats: str) -> None:
        now = time.monotonic()
        if now - self.last_line < self.every_s:
            return
        start, first = self.clock
        self.last_line = now
        total = f"/{self.total} ({100 * step / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.total and step > first:
            eta = f"  eta {_duration((self.total - step) * (now - start) / (step - first))}"
        self.console.print(f"step {step}{total}  {stats}{eta}", highlight=False, soft_wrap=True)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Stop the bar and print the final summary."""
        from rich.table import Table

        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        with self._lock:
            self._news = None  # a pass cut short by an error: its heartbeat stops here
        self._closed.set()
        if summary is None:
            return
        table = Table(title=f"done: {summary['stop_reason']}", show_header=False, box=None)
        for key, value in summary["progress"].items():
            if key != "tokens" or value:  # data without tokens counts none
                table.add_row(key, _fmt(value))
        if summary.get("best"):
            best = summary["best"]
            table.add_row(f"best {best['monitor']}", f"{_fmt(best['value'])} at step {best['step']}")
        for key, value in sorted(summary["metrics"].items()):
            if key.startswith("val/"):
                table.add_row(key, _fmt(value))
        table.add_row("wall time", f"{summary['wall_time_s']:.1f} s")
        steady = summary.get("steady") or {}
        for key, name in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
            if key in steady:
                table.add_row(f"{name}, training", f"{steady[key]:.0f} (after the first log window)")
            if summary.get(key) is not None:
                table.add_row(f"{name}, whole run", f"{summary[key]:.0f} (wall time: start, validation included)")
        if "mfu" in steady:
            table.add_row("MFU, training", f"{steady['mfu']:.3f}")
        if summary.get("compile_time_s") is not None:
            table.add_row("compile time", f"{summary['compile_time_s']:.1f} s (the first step)")
        self.console.print(table)
        if summary.get("startup"):
            self.console.print(where_time_went(summary["startup"]), soft_wrap=True, highlight=False, markup=False)
        if summary.get("short_run"):  # a line of its own: the override it suggests must not be cut
            self.console.print(summary["short_run"]["message"], soft_wrap=True, highlight=False, markup=False)
        for line in summary.get("advice") or []:
            self.console.print(line, soft_wrap=True, highlight=False, markup=False)
        self._print_run_dir()

    def _print_run_dir(self) -> None:
        # On a line of its own and never wrapped or cut (a table cell is, to the console's width: 80 columns in a
        # pipe or a log file): it is what source.checkpoint=, resume and runner.tools.evaluate are given.
        if self.run_dir is not None:
            self.console.print(f"run dir {self.run_dir}", soft_wrap=True, highlight=False, markup=False)


def where_time_went(startup: dict[str, Any], most: int = 5) -> str:
    """One line from summary.json's `startup`: the launch's wall time, the training steps' share, the largest other
    phases (count and seconds)."""
    seconds = {
        name: (value["s"], value["count"]) if isinstance(value, dict) else (value, 1)
        for name, value in startup["phases"].items()
    }
    largest = sorted(seconds.items(), key=lambda item: -item[1][0])[:most]
    parts = [f"{name} {s:.1f} s" + (f" ({count}x)" if count > 1 else "") for name, (s, count) in largest if s >= 0.05]
    fraction = startup.get("training_fraction") or 0.0
    return (
        f"time: {startup['wall_s']:.1f} s, training steps {startup['training_s']:.1f} s ({fraction:.0%}); "
        f"{', '.join(parts)} (summary.json: startup)"
    )
