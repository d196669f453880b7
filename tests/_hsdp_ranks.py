"""A callback for tests/e2e/test_hsdp.py: the weights gathered whole on rank 0 and written in one piece
(runner.ckpt.state.model_weights, runner.ckpt.weights.save_weights). At the end of training, the reference the streamed
model.safetensors must equal byte for byte; at its start, what the ranks read of an init_from file.

    +callbacks.gathered._target_=_hsdp_ranks.GatheredWeights     (writes RUN_DIR/gathered.safetensors)
    +callbacks.initial._target_=_hsdp_ranks.GatheredWeights +callbacks.initial.name=initial.safetensors
    +callbacks.initial.at=start
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from runner.ckpt.state import model_weights
from runner.ckpt.weights import save_weights
from runner.run import Callback, Run


class GatheredWeights(Callback):
    """Writes the gathered weights to `name` in the run folder at the end of training, or with at=start before its
    first step (collective; rank 0 writes)."""

    def __init__(self, name: str = "gathered.safetensors", at: str = "end") -> None:
        if at not in ("start", "end"):
            raise ValueError(f"at={at!r}: start or end")
        self.name, self.at = name, at

    def on_fit_start(self, run: Run) -> None:
        """With at=start: the weights the run begins from."""
        if self.at == "start":
            self._write(run)

    def on_fit_end(self, run: Run) -> None:
        """With at=end: the final weights."""
        if self.at == "end":
            self._write(run)

    def _write(self, run: Run) -> None:
        # every tensor gathered to rank 0, written as one safetensors file
        weights = model_weights(run)
        if run.strategy.is_main:
            save_weights(weights, Path(HydraConfig.get().runtime.output_dir) / self.name)
