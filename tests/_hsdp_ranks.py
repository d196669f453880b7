"""A callback for tests/e2e/test_hsdp.py: at the end of training, the final weights gathered whole on rank 0 and
written in one piece (runner.ckpt.state.model_weights, runner.ckpt.weights.save_weights): the reference the streamed
model.safetensors must equal byte for byte.

    +callbacks.gathered._target_=_hsdp_ranks.GatheredWeights     (writes RUN_DIR/gathered.safetensors)
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from runner.ckpt.state import model_weights
from runner.ckpt.weights import save_weights
from runner.run import Callback, Run


class GatheredWeights(Callback):
    """Writes the gathered final weights to `name` in the run folder (collective; rank 0 writes)."""

    def __init__(self, name: str = "gathered.safetensors") -> None:
        self.name = name

    def on_fit_end(self, run: Run) -> None:
        """Gather every tensor to rank 0 and write them as one safetensors file."""
        weights = model_weights(run)
        if run.strategy.is_main:
            save_weights(weights, Path(HydraConfig.get().runtime.output_dir) / self.name)
