"""The frontier figures of `python -m runner.report` (runner.sweeps.frontier finds the points): each y of a registered
frontier against its x, a point per job (or per model of a family), in plots/frontier_NAME.png."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from runner.rundir import write_png
from runner.sweeps.frontier import Frontier, Point

PANEL_SIZE, PLOT_DPI = (4.5, 3.5), 100
MAX_LEGEND = 12  # more lines than this: no legend (the table names every point)
Drawn = dict[str, dict[str, list[tuple[float, float]]]]  # y -> line -> its (x, y) points


def plot_frontier(found: list[Point], frontier: Frontier, path: Path) -> Drawn:
    """Draw each y of `frontier` that a point reports against x, a panel per y and a line per group of points (by x);
    what was drawn, y -> line -> its (x, y) points ({}: nothing to draw, no file)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    ordered = sorted(found, key=lambda p: p.x)
    drawn: Drawn = {}
    for y in frontier.y:
        for p in ordered:
            if math.isfinite(p.y.get(y, math.nan)):
                drawn.setdefault(y, {}).setdefault(p.line, []).append((p.x, p.y[y]))
    if not drawn:
        return {}
    fig, axes = plt.subplots(1, len(drawn), figsize=(PANEL_SIZE[0] * len(drawn), PANEL_SIZE[1]), squeeze=False)
    try:
        for i, (ax, (y, lines)) in enumerate(zip(axes.flat, drawn.items(), strict=True)):
            for line, xy in lines.items():
                xs, ys = zip(*xy, strict=True)
                ax.plot(xs, ys, marker="o", label=line or None)
            for p in ordered:  # a family's models by name: their line is the whole family
                if p.member and y in p.y:
                    ax.annotate(p.member, (p.x, p.y[y]), fontsize="x-small", xytext=(3, 3), textcoords="offset points")
            if frontier.log_x and all(p.x > 0 for p in ordered):
                ax.set_xscale("log", base=2)  # a sweep of k doubles it: a tick per doubling, read as 8, 16, 32
                ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xlabel(frontier.x)
            ax.set_title(y, fontsize="medium")
            ax.grid(alpha=0.3)
            if i == 0 and any(lines) and len(lines) <= MAX_LEGEND:  # a sweep of k alone: one line, nothing to name
                ax.legend(fontsize="x-small")
        fig.tight_layout()
        write_png(path, fig, PLOT_DPI)
    finally:
        plt.close(fig)
    return drawn


def draw_frontiers(console: Any, shown: list[tuple[str, Frontier, list[Point]]], plots: Path) -> None:
    """One figure per frontier in `plots`, as runner.sweeps.frontier.show_frontiers found them."""
    for name, frontier, found in shown:
        path = plots / f"frontier_{name}.png"
        if plot_frontier(found, frontier, path):
            console.print(f"frontier: {path} ({len(found)} point(s))", highlight=False, soft_wrap=True)
        else:
            print(f"frontier {name}: no point reports any of {', '.join(frontier.y)}", file=sys.stderr)
