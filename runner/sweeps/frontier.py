"""The trade-off a sweep maps (an SAE's fidelity against its L0): the frontiers task packages register, each job's
point on them, and the table of the points by x (`python -m runner.report`, and the end of a sweep).

A task registers a `Frontier` under the entry point group `runner.frontiers` (pyproject.toml), so that the framework
names none of a task's metrics. A job that trains several models at once and logs each one's metrics as
SPLIT/NAME/METRIC beside SPLIT/METRIC (a family of SAEs: val/k16/l0 beside the family's mean val/l0) is a point per
model; any other job that reports the frontier's x is one point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runner.sweeps.results import short, varying

GROUP = "runner.frontiers"


@dataclass(frozen=True)
class Frontier:
    """What a task trades: its metric `x` (an SAE's val/l0) against each metric of `y` (val/fve, val/kl_spliced...),
    the way the field compares models; `log_x` draws x on a log scale (the L0 of k = 8, 16 ... 256)."""

    x: str
    y: tuple[str, ...]
    log_x: bool = False


@dataclass(frozen=True)
class Point:
    """One model on a frontier: its job, its name in the job's family ('' for a job's one model), the line it is
    drawn on, its x and the y values it reports, and its job's swept overrides (key -> value as a table shows it)."""

    job: str
    member: str
    line: str
    x: float
    y: dict[str, float]
    swept: dict[str, str] = field(default_factory=dict)


def registered() -> dict[str, Frontier]:
    """The frontiers that installed task packages register, by entry point name."""
    from importlib.metadata import entry_points

    return {point.name: point.load() for point in entry_points(group=GROUP)}


def _number(value: Any) -> float | None:
    # a finite number, from a metric or from an override's text ("16", "1e-3"); None for anything else
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def member_metric(metric: str, member: str) -> str:
    """`metric` as the family's model `member` logs it: val/l0 -> val/k16/l0 (member '': a job's one model's)."""
    split, _, name = metric.partition("/")
    return f"{split}/{member}/{name}" if member else metric


def members(row: dict[str, Any], x: str) -> list[str]:
    """The names of the models a job's row reports `x` of as SPLIT/NAME/METRIC (none for a job of one model)."""
    split, sep, name = x.partition("/")
    head, tail = f"{split}/", f"/{name}"
    if not sep:
        return []
    return [k[len(head) : -len(tail)] for k in row if k.startswith(head) and k.endswith(tail) and k != x]


def _ranks(values: list[float]) -> list[float]:
    # each value's rank, ties sharing their mean rank (a grid of k x width repeats every k)
    order = sorted(values)
    return [(order.index(v) + len(order) - 1 - order[::-1].index(v)) / 2 for v in values]


def _correlation(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    spread = math.sqrt(sum((v - ma) ** 2 for v in a) * sum((v - mb) ** 2 for v in b))
    return sum((u - ma) * (v - mb) for u, v in zip(a, b, strict=True)) / spread if spread else 0.0


def moving_key(rows: list[dict[str, Any]], x: str) -> str | None:
    """The swept override whose values follow `x` most closely over the jobs (rank correlation): what moves a job
    along the frontier (model.k in a sweep of k and width), so that the others name its lines; None if none is a
    number in every job that reports x."""
    have = [row for row in rows if _number(row.get(x)) is not None]
    best, score = None, 0.0
    for key in varying(rows):
        values = [_number(row.get(key)) for row in have]
        if len(have) < 2 or None in values:
            continue
        rho = abs(_correlation(_ranks(values), _ranks([_number(row[x]) for row in have])))
        if rho > score:
            best, score = key, rho
    return best


def points(rows: list[dict[str, Any]], frontier: Frontier, along: str | None = None) -> list[Point]:
    """Every job's points on `frontier`, in job order: a line per value of the swept overrides other than `along`
    (default: moving_key), and a family's models on one line per job."""
    swept = varying(rows)
    along = f"override:{along}" if along else moving_key(rows, frontier.x)
    found = []
    for row in rows:
        shown = {k.removeprefix("override:"): short(row.get(k)) for k in swept}
        others = " ".join(f"{k}={v}" for k, v in shown.items() if f"override:{k}" != along)
        family = members(row, frontier.x)
        for member in family or [""]:
            x = _number(row.get(member_metric(frontier.x, member)))
            if x is None:  # failed, or not validated yet
                continue
            values = {y: row.get(member_metric(y, member)) for y in frontier.y}
            ys = {y: float(v) for y, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            job = " ".join([f"{row['job']}:", *(f"{k}={v}" for k, v in shown.items())]) if shown else row["job"]
            found.append(Point(row["job"], member, job if family else others, x, ys, shown))
    return found


def table(name: str, frontier: Frontier, found: list[Point], jobs: int) -> Any:
    """A rich table of the points by x, a column per y that any point reports; `jobs`: how many the sweep has."""
    from rich.table import Table

    ys = [y for y in frontier.y if any(y in p.y for p in found)]
    family = any(p.member for p in found)
    swept = list(dict.fromkeys(k for p in found for k in p.swept))
    off = jobs - len({p.job for p in found})
    result = Table(
        title=f"frontier {name}: {len(found)} {'model' if family else 'job'}(s) by {frontier.x}",
        caption=f"{off} job(s) without {frontier.x}: failed or not validated yet" if off else None,
    )
    for column in ["job", *(["member"] if family else []), *swept, frontier.x, *ys]:
        result.add_column(column, no_wrap=True, justify="right" if column in (frontier.x, *ys) else "left")
    for p in sorted(found, key=lambda p: p.x):
        cells = [p.job, *([p.member] if family else []), *(p.swept.get(k, "") for k in swept)]
        result.add_row(*cells, short(p.x), *(short(p.y.get(y)) for y in ys))
    return result


def show_frontiers(
    console: Any, rows: list[dict[str, Any]], along: str | None = None
) -> list[tuple[str, Frontier, list[Point]]]:
    """Print the table of each registered frontier the jobs report; those frontiers with their points."""
    shown = []
    for name, frontier in registered().items():
        found = points(rows, frontier, along)
        if found:
            console.print(table(name, frontier, found, len(rows)))
            shown.append((name, frontier, found))
    return shown
