"""`from runner.trust import buildable`, as projects that `runner init` wrote import it: runner.config.trust."""

from __future__ import annotations

from runner.config.trust import buildable

__all__ = ["buildable"]
