"""What SourceModel.run and SourceModel.compare put in a module's place: a Splice (the modules it reads and those it
writes, each from the rows read so far in the forward), or a Replacement, the shorter forms that stand for one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Rows = Callable[[torch.Tensor], torch.Tensor]  # kept rows [n, d] of a module's output -> their replacement


@dataclass(frozen=True)
class Splice:
    """What compare() puts in the model for one run: each module of `writes` outputs, at the kept positions, the rows
    [n, d] its function gives from `captured`, the kept rows of the `reads` modules that have run so far in this
    forward, in the forward's order (a transcoder reads an MLP's input and writes its output; a cross-layer one reads
    every layer's, each captured when it runs, so from the stream the earlier writes already changed). A function
    must not call a module the Splice hooks: its hook would run again inside (use a copy)."""

    reads: Sequence[str]
    writes: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]


# What compare() puts in a module's place: nothing (the clean model), a function of the first hooked module's output,
# (module name, function of its output), or a Splice.
Replacement = Rows | tuple[str, Rows] | Splice | None


def as_splice(replace: Replacement, name: str) -> Splice | None:
    """A replacement as a Splice: a function alone replaces module `name`'s output by a function of it."""
    if replace is None or isinstance(replace, Splice):
        return replace
    at, fn = replace if isinstance(replace, tuple) else (name, replace)
    return Splice([at], {at: lambda captured: fn(captured[at])})
