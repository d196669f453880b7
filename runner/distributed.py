"""Where the process runs: device choice and model wrapping (one process here; torchrun, DDP, FSDP extend it)."""

from __future__ import annotations

import torch
from torch import nn

from runner import ConfigError


def pick_device(device: str = "auto") -> torch.device:
    """'auto' means CUDA when there is one, else CPU; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"distributed.device={device} but this torch sees no CUDA device; use auto or cpu")
    return chosen


class Single:
    """One process on one device."""

    rank = 0
    local_rank = 0
    world_size = 1
    is_main = True

    def __init__(self, device: str = "auto") -> None:
        self.device = pick_device(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """One process needs no wrapper."""
        return model

    def close(self) -> None:
        """Nothing to tear down."""
