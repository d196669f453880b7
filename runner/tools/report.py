"""`python -m runner.report DIR`: leaderboard, results.csv and metric curves of a sweep (running or done) or a run
(one figure of every metric it logged: plots/curves.png), and the frontier a task registers (runner.sweeps.frontier:
an SAE's FVE against its L0) as a table and plots/frontier_NAME.png."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runner import ConfigError
from runner.rundir import write_png
from runner.rundir.outputs import make_dir, output_folder
from runner.sweeps.frontier import show_frontiers
from runner.sweeps.results import (
    collect,
    find_jobs,
    leaderboard,
    read_curve,
    short,
    table_console,
    varying,
    write_csv,
)
from runner.tools.cli import as_flags
from runner.tools.frontier import draw_frontiers

PLOT_SIZE, PLOT_DPI = (8.0, 5.0), 100  # 800 x 500 pixels
MAX_LEGEND = 20  # more jobs than this: lines without labels (the leaderboard says which is which)
SPLITS = ("train", "val", "test")  # a run's curves draw train/X, val/X and test/X in one panel


def _label(row: dict[str, Any], swept: list[str]) -> str:
    parts = [f"{k.removeprefix('override:')}={short(row.get(k))}" for k in swept]
    return f"{row['job']}: {' '.join(parts)}" if parts else row["job"]


def plot(rows: list[dict[str, Any]], metric: str, path: Path) -> int:
    """Draw `metric` against the optimizer step, one line per job; the number of jobs that have it (0: no file)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    swept = varying(rows)
    curves = []
    for row in rows:
        points = [
            (r["step"], r[metric])
            for r in read_curve(Path(row["dir"]))
            if isinstance(r.get(metric), (int, float)) and isinstance(r.get("step"), int)
        ]
        if points:
            curves.append((row, points))
    if not curves:
        return 0
    fig, ax = plt.subplots(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    try:
        for row, points in curves:
            steps, values = zip(*points, strict=True)
            label = _label(row, swept) if len(curves) <= MAX_LEGEND else None
            ax.plot(steps, values, marker="." if len(points) < 30 else None, label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric}: {len(curves)} job(s)")
        ax.grid(alpha=0.3)
        if len(curves) <= MAX_LEGEND:
            ax.legend(fontsize="small")
        write_png(path, fig, PLOT_DPI)
    finally:
        plt.close(fig)
    return len(curves)


def _panels(curve: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    # panel -> its lines -> (step, value): train/loss and val/loss share the panel "loss"; others (train/lr,
    # sys/peak_memory_mb) have one of their own
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in curve:
        if not isinstance(row.get("step"), int):
            continue
        for key, value in row.items():
            if "/" not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            split, name = key.split("/", 1)
            panel = name if split in SPLITS else key
            panels.setdefault(panel, {}).setdefault(key, []).append((row["step"], value))
    return panels


def plot_run(run_dir: Path, path: Path) -> int:
    """Draw every metric one run logged against the optimizer step, one panel per metric (its train and val lines
    together); the number of panels (0: nothing logged yet, no file)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    panels = _panels(read_curve(run_dir))
    if not panels:
        return 0
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.0 * columns, 3.0 * rows), dpi=PLOT_DPI, squeeze=False)
    try:
        for i, (ax, (panel, lines)) in enumerate(zip(axes.flat, panels.items(), strict=False)):
            for key, points in lines.items():
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="." if len(points) < 30 else None, label=key)
            ax.set_title(panel if len(lines) > 1 else next(iter(lines)), fontsize="medium")
            ax.grid(alpha=0.3)
            if len(lines) > 1:
                ax.legend(fontsize="small")
            if i + columns >= len(panels):  # the lowest panel of its column
                ax.set_xlabel("optimizer step")
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(str(run_dir))
        fig.tight_layout()
        write_png(path, fig, PLOT_DPI)
    finally:
        plt.close(fig)
    return len(panels)


OPTIONS = ("metric", "mode", "top", "plot", "out", "along")  # also KEY=VALUE (runner.tools.cli), and no_plot=true


def main(argv: list[str] | None = None) -> int:
    """Print the leaderboard and frontiers of DIR, write its results.csv and plots; the exit code (2: nothing to
    report)."""
    args = _parser().parse_args(as_flags(sys.argv[1:] if argv is None else argv, OPTIONS, ("no_plot",)))
    try:
        rows = _jobs(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    monitor = rows[0].get("monitor") or "val/loss"
    config_mode = next((r["mode"] for r in rows if r.get("mode")), "min")
    mode = args.mode or (config_mode if args.metric in ("best", monitor) else "min")
    console = table_console()
    console.print(leaderboard(rows, metric=args.metric, mode=mode, top=args.top))
    out = args.out or args.dir
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"results: {write_csv(rows, out / 'results.csv')}", highlight=False, soft_wrap=True)
    frontiers = show_frontiers(console, rows, args.along)
    if args.no_plot:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'runner[report]')", file=sys.stderr)
        return 0
    try:  # the plots folder resolved inside DIR (or --out): a link at plots/ is replaced, never followed
        plots = make_dir(output_folder(args.dir, args.out, ".", "--out ") / "plots")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if find_jobs(args.dir) == [args.dir] and not args.plot:  # one run: all its curves in one figure
        _draw_run(console, args.dir, plots / "curves.png")
    else:
        _draw_jobs(console, rows, args.plot or list(dict.fromkeys([monitor, "train/loss"])), plots)
    draw_frontiers(console, frontiers, plots)
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line: DIR and the options of OPTIONS (KEY=VALUE as well, runner.tools.cli)."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.report",
        description="Leaderboard, results.csv and metric curves of a sweep (running or done) or of one run.",
    )
    parser.add_argument("dir", type=Path, help="a sweep folder (outputs/multirun/DATE/TIME) or one run folder")
    parser.add_argument(
        "--metric", default="best", help="sort by: 'best' (each job's best monitored value) or a final metric name"
    )
    parser.add_argument("--mode", choices=["min", "max"], help="default: the config's mode for 'best', else min")
    parser.add_argument("--top", type=int, default=None, help="show only the N best jobs")
    parser.add_argument(
        "--plot",
        nargs="+",
        metavar="METRIC",
        help="curves to draw (default: the monitor, train/loss; of one run: every metric, in plots/curves.png)",
    )
    parser.add_argument("--no-plot", action="store_true", help="no plots")
    parser.add_argument("--out", type=Path, help="where results.csv and plots/ go (default: DIR)")
    parser.add_argument(
        "--along",
        metavar="KEY",
        help="the swept key that moves jobs along a frontier; the others name its lines (default: the one whose "
        "values follow the frontier's x most closely)",
    )
    return parser


def _jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of the jobs under args.dir, or a ConfigError saying why there is nothing to report."""
    if not args.dir.is_dir():
        raise ConfigError(f"{args.dir} is not a folder: give a sweep folder or a run folder")
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top {args.top}: show the N best jobs, N >= 1 (leave --top out for all)")
    out = args.out or args.dir
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder for results.csv and plots/")
    rows = collect(args.dir)
    if not rows:
        raise ConfigError(f"no runs under {args.dir} (no job folder with a .hydra/ folder or metrics)")
    if args.metric != "best" and not any(args.metric in row for row in rows):
        known = sorted({k for row in rows for k in row if "/" in k and not k.startswith("override:")})
        raise ConfigError(f"no job has a metric {args.metric!r}; known: best, {', '.join(known)}")
    swept = [key.removeprefix("override:") for key in varying(rows)]
    if args.along is not None and args.along not in swept:
        raise ConfigError(f"--along {args.along}: not a key this sweep varies; it varies: {', '.join(swept) or 'none'}")
    return rows


def _draw_run(console: Any, run_dir: Path, path: Path) -> None:
    """One run's curves, every metric in one figure at `path`."""
    drawn = plot_run(run_dir, path)
    if drawn:
        console.print(f"curves: {path} ({drawn} metrics)", highlight=False, soft_wrap=True)
    else:
        print(f"curves: {run_dir} has logged no metrics yet", file=sys.stderr)


def _draw_jobs(console: Any, rows: list[dict[str, Any]], metrics: list[str], plots: Path) -> None:
    """One figure per metric in `plots`, a line per job."""
    for metric in metrics:
        path = plots / f"{metric.replace('/', '_')}.png"
        drawn = plot(rows, metric, path)
        if drawn:
            console.print(f"plot: {path} ({drawn} job(s))", highlight=False, soft_wrap=True)
        else:
            print(f"plot {metric}: no job has logged it yet", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
