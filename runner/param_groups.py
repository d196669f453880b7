"""The optimizer's parameter groups: which parameters decay, and optimizer.lr_scale's learning-rate multiples."""

from __future__ import annotations

import fnmatch
import math
from typing import Any

from torch import nn

from runner import ConfigError


def _names(name: str, pattern: str) -> bool:
    # `W_enc` names model.coder.W_enc (and DDP's module.W_enc): the command line's dict keys take no `*`.
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def param_groups(task: nn.Module, lr_scale: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Weight decay for matrices and embeddings only (biases and norm gains, 1-D, are not decayed); `lr_scale` maps
    parameter names (fnmatch globs, matched against the whole name or its last parts; first match wins) to a multiple
    of the optimizer's lr for those parameters."""
    lr_scale = dict(lr_scale or {})
    bad = {k: v for k, v in lr_scale.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0}
    if bad or not all(map(math.isfinite, lr_scale.values())):
        raise ConfigError(f"optimizer.lr_scale's values must be finite numbers >= 0, got {lr_scale}")
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    matched = set()
    for name, p in task.named_parameters():
        if not p.requires_grad:
            continue
        pattern = next((pattern for pattern in lr_scale if _names(name, pattern)), None)
        matched.add(pattern)
        groups.setdefault((float(lr_scale.get(pattern, 1.0)), p.ndim < 2), []).append(p)
    unmatched = [pattern for pattern in lr_scale if pattern not in matched]
    if unmatched:
        names = [name for name, p in task.named_parameters() if p.requires_grad]
        raise ConfigError(
            f"optimizer.lr_scale names {unmatched}, which match none of the trained parameters "
            f"({', '.join(names[:12])}{', ...' if len(names) > 12 else ''}): the keys are fnmatch globs on these names "
            "or their last parts, e.g. optimizer.lr_scale={W_enc:0.5}"
        )
    # The unscaled decayed group first: the loop logs param_groups[0]'s lr.
    order = sorted(groups, key=lambda key: (key[0] != 1.0, key[1]))
    return [
        {"params": groups[key]}
        | ({"weight_decay": 0.0} if key[1] else {})
        | ({"lr_scale": key[0]} if key[0] != 1.0 else {})
        for key in order
    ]
