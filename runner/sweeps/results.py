"""Sweep results: one row per job folder (read from the files the job wrote), results.csv, and the leaderboard.

A row is built from a job's own files only (`.hydra/overrides.yaml`, `.hydra/config.yaml`, `summary.json`, and
`metrics.jsonl` while it runs), so the sweep's callback, `python -m runner.report` and a half-finished sweep all agree.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.run import Best, StopReason
from runner.rundir import CONFIG, METRICS, OVERRIDES, SUMMARY, write_atomic

FIRST = ["job", "status", "stop_reason", "monitor", "mode", "best", "best_step", "step", "wall_time_s"]
LAST = ["error", "overrides", "dir"]


class Unreadable(Exception):
    """A job file that is there but is not what runner writes: not UTF-8, not JSON or YAML, or of another shape."""


_KINDS = {list: "a list", dict: "a mapping", str: "a string", int: "a number", float: "a number", bool: "true/false"}


def _parsed(job_dir: Path, name: str, kind: type) -> Any:
    # The file's JSON (summary.json) or YAML (.hydra/*.yaml) value, which must be a `kind`; None if not written yet
    # (a job still running). The run writes these atomically (write_atomic): one that does not parse is damaged.
    import yaml

    path = job_dir / name
    try:
        text = path.read_text(encoding="utf-8")
        value = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise Unreadable(f"{name} is not UTF-8 text") from None
    except OSError as error:
        raise Unreadable(f"{name} cannot be read ({error.strerror or error})") from None
    except (ValueError, yaml.YAMLError) as error:
        raise Unreadable(f"{name} is not valid {path.suffix[1:].upper()} ({' '.join(str(error).split())})") from None
    if value is not None and not isinstance(value, kind):
        raise Unreadable(f"{name} holds {_KINDS.get(type(value), type(value).__name__)}, not {_KINDS[kind]}")
    return value


def _curve(job_dir: Path) -> tuple[list[dict[str, Any]], int]:
    # The rows of metrics.jsonl and how many lines before the last could not be read (the last may be half-written
    # by a job still running; an earlier one is damage). Read as bytes: one bad line loses that line, not the file.
    try:
        lines = (Path(job_dir) / METRICS).read_bytes().splitlines()
    except OSError:
        return [], 0
    rows, bad = [], 0
    for i, line in enumerate(lines):
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif line.strip() and i < len(lines) - 1:
            bad += 1
    return rows, bad


def read_curve(job_dir: Path) -> list[dict[str, Any]]:
    """The rows of a job's metrics.jsonl; a line that is not a JSON object (a half-written last one) is skipped."""
    return _curve(job_dir)[0]


def _key(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def job_row(job_dir: Path) -> dict[str, Any]:
    """One job's row: overrides, status, stop reason, best and final metrics, wall time, error. A job whose files
    cannot be read has the status `unreadable` and the reason as its error."""
    job_dir = Path(job_dir)
    try:
        row = _row(job_dir)
    except (Unreadable, ConfigError) as why:
        row = {"job": job_dir.name, "status": "unreadable", "error": str(why)}
    return {**row, "dir": str(job_dir)}


def _mapping(summary: dict[str, Any], key: str) -> dict[str, Any]:
    value = summary.get(key)
    if value is not None and not isinstance(value, dict):
        raise Unreadable(f"{SUMMARY}'s `{key}` is {_KINDS.get(type(value), type(value).__name__)}, not a mapping")
    return value or {}


def _row(job_dir: Path) -> dict[str, Any]:
    config = _parsed(job_dir, CONFIG, dict) or {}
    overrides = _parsed(job_dir, OVERRIDES, list) or []
    if not all(isinstance(o, str) for o in overrides):
        raise Unreadable(f"{OVERRIDES} is not a list of KEY=VALUE strings")
    monitor, mode = config.get("monitor", "val/loss"), config.get("mode", "min")
    if not isinstance(monitor, str):
        raise Unreadable(f"{CONFIG}'s monitor is {monitor!r}, not a metric name")
    best = Best(mode)  # ConfigError if the config's mode is neither min nor max
    row: dict[str, Any] = {"job": job_dir.name, "monitor": monitor, "mode": mode, "overrides": " ".join(overrides)}
    row.update({f"override:{k}": v for k, v in map(_key, overrides)})
    summary = _parsed(job_dir, SUMMARY, dict)
    if summary is None:
        curve, bad = _curve(job_dir)
        if bad:
            raise Unreadable(f"{METRICS} has {bad} line(s) that are not JSON objects")
        for r in curve:
            if isinstance(r.get(monitor), (int, float)) and math.isfinite(r[monitor]):
                best.update(r[monitor], r.get("step", 0))
        latest: dict[str, Any] = {}
        for r in curve:
            latest.update(r)
        row.update(status="running", step=latest.get("step"), best=best.value)
        row.update({k: v for k, v in latest.items() if "/" in k})
        return row
    reason = summary.get("stop_reason")
    if reason is not None and not isinstance(reason, str):
        raise Unreadable(f"{SUMMARY}'s stop_reason is {reason!r}, not a string")
    best_of, progress, metrics = (_mapping(summary, key) for key in ("best", "progress", "metrics"))
    row.update(
        status=StopReason.status_of(reason),
        stop_reason=reason,
        best=best_of.get("value"),
        best_step=best_of.get("step"),
        step=progress.get("step"),
        wall_time_s=summary.get("wall_time_s"),
        error=summary.get("error"),
    )
    row.update(metrics)
    return row


def find_jobs(path: str | Path) -> list[Path]:
    """The job folders of a sweep (its numbered subfolders, in job order), or [path] for a single run folder."""
    path = Path(path)
    if (path / ".hydra").is_dir() or (path / SUMMARY).is_file() or (path / METRICS).is_file():
        return [path]
    jobs = [p for p in path.iterdir() if p.is_dir() and (p / ".hydra").is_dir()] if path.is_dir() else []
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def collect(path: str | Path) -> list[dict[str, Any]]:
    """Every job's row under `path` (a sweep folder or one run folder)."""
    return [job_row(job) for job in find_jobs(path)]


def varying(rows: list[dict[str, Any]]) -> list[str]:
    """The override columns whose value differs between jobs (none for a single job: nothing to tell apart)."""
    keys = list(dict.fromkeys(k for row in rows for k in row if k.startswith("override:")))
    return [k for k in keys if len({str(row.get(k)) for row in rows}) > 1]


def to_csv(rows: list[dict[str, Any]]) -> str:
    """results.csv's text: the swept overrides, status, best and final metrics, wall time, error, folder."""
    metrics = sorted({k for row in rows for k in row if "/" in k and not k.startswith("override:")})
    overrides = [k for k in dict.fromkeys(k for row in rows for k in row) if k.startswith("override:")]
    columns = [FIRST[0], *(k.removeprefix("override:") for k in overrides), *FIRST[1:], *metrics, *LAST]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        cells = [row.get("job"), *(row.get(k) for k in overrides)]
        cells += [row.get(k) for k in FIRST[1:] + metrics + LAST]
        writer.writerow(["" if c is None else c for c in cells])
    return out.getvalue()


def write_csv(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write results.csv atomically: a reader (`runner.tools.report` on a live sweep, say) never sees half a file."""
    return write_atomic(path, to_csv(rows).encode())


def rank(rows: list[dict[str, Any]], metric: str = "best", mode: str = "min") -> list[dict[str, Any]]:
    """Rows best first by `metric`; rows without a finite value (failed, diverged, not validated yet) last."""

    order = Best(mode)

    def key(row: dict[str, Any]) -> tuple[int, float]:
        value = row.get(metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return (1, 0.0)
        return (0, order.key(value))

    return sorted(rows, key=key)


def short(value: Any) -> str:
    """A value as a table shows it: numbers (also an override's "0.0012132675491046139") to 4 significant digits."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return f"{number:.4g}" if len(value) > 6 and any(c in value for c in ".eE") else value
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table_console() -> Any:
    """A rich console on stdout for the leaderboard: a terminal's own width; 200 columns in a log file or a pipe,
    where rich's default of 80 would cut the override columns down to ellipses."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def leaderboard(rows: list[dict[str, Any]], metric: str = "best", mode: str = "min", top: int | None = None) -> Any:
    """A rich table of the jobs, best first by `metric` ("best" = each job's best monitored value), and their errors."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    monitor = next((row["monitor"] for row in rows if row.get("monitor")), "monitor")
    title = f"best {monitor}" if metric == "best" else metric
    swept = varying(rows)
    table = Table(title=f"{len(rows)} job(s), by {title} ({mode})")
    for column in ["job", *(k.removeprefix("override:") for k in swept), "status", title, "at step", "wall s"]:
        table.add_column(column, no_wrap=True, justify="right" if column in (title, "at step", "wall s") else "left")
    styles = {"failed": "red", "unreadable": "red", "diverged": "yellow", "running": "cyan", "stopped": "yellow"}
    for row in rank(rows, metric, mode)[:top]:
        wall = row.get("wall_time_s")
        table.add_row(
            row["job"],
            *(short(row.get(k)) for k in swept),
            row.get("status", ""),
            short(row.get(metric)),
            short(row.get("best_step") if metric == "best" else row.get("step")),
            f"{wall:.1f}" if isinstance(wall, (int, float)) else "",
            style=styles.get(row.get("status", "")),
        )
    # Errors are long: a line each under the table, not a column that squeezes the others.
    errors = [
        Text(f"job {row['job']}: {' '.join(str(row['error']).split())}", style="red")
        for row in rows
        if row.get("error")
    ]
    return Group(table, *errors)
