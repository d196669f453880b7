"""runner from Python: the calls a researcher makes in a notebook, each the same code the tools run.

    from runner import api

    model, cfg = api.load("outputs/2026-11-28/10-00-00")         # a finished run: its model (frozen) and config
    for row in api.metrics("outputs/2026-11-28/10-00-00"): ...   # what the run logged, row by row

A task package adds its own calls (the SAE workbench: experiments.sae.api). Every call reads a run folder as data
under the same trust rules as the tools (runner.load): a config names only runner's classes, or those of the packages
in `trusted` (default: runner.load.trusted_here()).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from runner import ConfigError
from runner.load import Attach


def load(
    path: str | Path,
    *,
    weights: str | Path | None = None,
    trusted: Sequence[str] | None = None,
    **attach: Any,
) -> tuple[nn.Module, Any]:
    """A finished run's model, frozen in eval mode, and its config; or a foreign folder (an SAE of SAELens or
    sparsify) attached to the model it reads (`attach`: runner.load.Attach's source=, hook=, module=, target=,
    skip_positions=, inputs=)."""
    from runner.load import load_model, trusted_here

    if unknown := sorted(set(attach) - set(Attach.keys())):
        raise ConfigError(f"{', '.join(unknown)}: not an option of load; give weights=, trusted=, or {Attach.keys()}")
    return load_model(path, tuple(trusted or trusted_here()), Attach(**attach), weights=weights)


def metrics(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, in the order it logged them (of a running run, those written so far)."""
    from runner.rundir import METRICS, read_jsonl

    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: the run logged no metrics.jsonl (logger=none?)")
    yield from read_jsonl(path)
