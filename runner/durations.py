"""Duration strings ('500st', '3ep', '1e6sa', '2e7tok', '0.25dur'), which every interval of a run is written in, and
wall-clock times ('23h50m'). TrainingProgress (runner.progress) answers questions about them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from runner import ConfigError

UNITS = {"st": "optimizer steps", "ep": "epochs", "sa": "samples", "tok": "tokens", "dur": "fraction of max_duration"}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(st|ep|sa|tok|dur)\s*$")


class DurationError(ConfigError):
    """A duration string that cannot be parsed or does not fit this run."""


@dataclass(frozen=True)
class Duration:
    """A length of training: a non-negative value and one of the units in UNITS."""

    value: float
    unit: str

    def __str__(self) -> str:
        value = int(self.value) if self.value == int(self.value) else self.value
        return f"{value}{self.unit}"


def parse_duration(text: str | Duration) -> Duration:
    """Parse '500st', '3ep', '1e6sa', '2e7tok' or '0.25dur' into a Duration."""
    if isinstance(text, Duration):
        return text
    match = _DURATION.match(str(text))
    if not match:
        units = ", ".join(f"{u} ({name})" for u, name in UNITS.items())
        raise DurationError(
            f"cannot read duration {text!r}: write a number followed by one unit, e.g. '500st', "
            f"'3ep', '1e6sa', '0.25dur'. Units: {units}."
        )
    value, unit = float(match.group(1)), match.group(2)
    if not math.isfinite(value) or value >= 2**62:
        raise DurationError(f"duration {text!r} is too large to count (at most 2^62 {UNITS[unit]}): e.g. '1e12{unit}'")
    if unit == "st" and value != int(value):
        raise DurationError(f"duration {text!r}: optimizer steps must be a whole number")
    if unit == "dur" and value > 1:
        raise DurationError(f"duration {text!r}: a fraction of max_duration must be at most 1")
    return Duration(value, unit)


def is_duration(value: object) -> bool:
    """Whether `value` is written as a duration: a string of a number and one of the UNITS ('500st', '0.25dur')."""
    return isinstance(value, str) and bool(_DURATION.match(value))


def parse_time(text: str | float) -> float:
    """Seconds in a wall-clock duration: '23h50m', '90m', '1d', '45s', '1h30m15s', or a number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(
        r"\s*(?:(\d+(?:\.\d+)?)d)?\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*"
        r"(?:(\d+(?:\.\d+)?)s)?\s*",
        str(text),
    )
    if not match or not any(match.groups()):
        raise ConfigError(f"cannot read the time {text!r}: write e.g. '23h50m', '90m', '1d', '45s'")
    days, hours, minutes, seconds = (float(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
