"""Whether a run ended while its monitored metric was still improving: summary.json's `short_run` and the console's
last lines then say the run may be short, with a longer trainer.max_duration to try (trainer.short_run_tolerance)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from runner.durations import Duration
from runner.run import Run, StopReason

# The end of the run that is judged: its last quarter, or its last half where the quarter holds fewer than
# MIN_VALIDATIONS (a preset that validates every 0.25dur has two validations in its last quarter, three in its half).
WINDOWS = (("quarter", 0.25), ("half", 0.5))
# Two validations are one difference, as likely noise as a trend.
MIN_VALIDATIONS = 3
# Late in training a metric moves roughly linearly in log(steps), so the next length worth measuring is one doubling:
# it costs one more run of the same length and shows whether the gain goes on before anyone commits 4x.
FACTOR = 2


def still_improving(
    history: Sequence[Sequence[float]], mode: str, final_step: int, tolerance: float
) -> dict[str, Any] | None:
    """The end of `history` ([step, value] per validation) when the metric still improved there under `mode`; else None.

    Improving means both the least-squares line through the window's validations and its last value against its first
    gain more than `tolerance` x the metric's size (the larger magnitude of the two): a metric that rose and fell
    back says nothing, and neither does a noisy plateau whose last validation happens to beat its first.
    """
    end = _end(history, final_step)
    if end is None:
        return None
    name, window = end
    steps, values = zip(*window, strict=True)
    if not all(math.isfinite(v) for v in values) or steps[-1] == steps[0]:
        return None
    mean_s, mean_v = sum(steps) / len(steps), sum(values) / len(values)
    slope = sum((s - mean_s) * (v - mean_v) for s, v in window) / sum((s - mean_s) ** 2 for s in steps)
    better = 1.0 if mode == "max" else -1.0
    change = values[-1] - values[0]
    gain = min(better * slope * (steps[-1] - steps[0]), better * change)
    if gain <= tolerance * max(abs(values[0]), abs(values[-1])):
        return None
    return {
        "window": name,
        "steps": [steps[0], steps[-1]],
        "validations": len(window),
        "first": values[0],
        "last": values[-1],
        "change": change,
    }


def _end(history: Sequence[Sequence[float]], final_step: int) -> tuple[str, list[tuple[float, float]]] | None:
    # The validations of the run's end: those of the first window in WINDOWS that holds MIN_VALIDATIONS of them.
    for name, share in WINDOWS:
        window = [(s, v) for s, v in history if s >= final_step * (1 - share)]
        if len(window) >= MIN_VALIDATIONS:
            return name, window
    return None


def short_run(run: Run) -> dict[str, Any] | None:
    """summary.json's `short_run`: what says a run that trained its whole max_duration may be short, or None.

    A run stopped early (early stopping, a signal, max_time) ended for another reason: it says nothing.
    """
    monitor, tolerance = run.settings.monitor, run.settings.short_run_tolerance
    if monitor is None or tolerance is None or run.stop_reason != StopReason.MAX_DURATION:
        return None
    mode = run.state.best.mode
    found = still_improving(run.state.monitored, mode, run.progress.step, tolerance)
    if found is None:
        return None
    now = run.progress.max_duration
    longer = Duration(now.value * FACTOR, now.unit)  # in the unit the user wrote: 1ep -> 2ep, not 392st
    message = (
        f"{monitor} was still {'rising' if mode == 'max' else 'falling'} over the last {found['window']} "
        f"({found['first']:.4g} -> {found['last']:.4g}, {found['change']:+.2g}): the run may be short; "
        f"try trainer.max_duration={longer} ({FACTOR}x)"
    )
    return {
        "monitor": monitor,
        "mode": mode,
        **found,
        "max_duration": str(now),
        "suggested_max_duration": str(longer),
        "message": message,
    }
