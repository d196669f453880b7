"""The frozen model a source reads, the data it reads, and its validation loss of a batch: a model trained by runner
(a run folder: its own data) or a transformers causal LM (experiments.sae.sources.pretrained: text it is given)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from experiments.sae.sources import pretrained
from runner import ConfigError
from runner.build import build_data
from runner.data import DataModule
from runner.load import TRUSTED_TARGETS, load_trained
from runner.timeline import phase


class FrozenModel:
    """A frozen model on `device`, the data it reads (`data`: its validation split is what compare() reads), and its
    validation loss of a batch (`loss`); `pretrained` is the transformers source, None for a runner run."""

    def __init__(
        self,
        checkpoint: str,
        device: torch.device | str = "cpu",
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        inputs: dict[str, Any] | None = None,
    ) -> None:
        self.pretrained: pretrained.Pretrained | None = None
        self.checkpoint, self.read = str(checkpoint), (None, None)
        with phase("source model"):
            if pretrained.is_pretrained(checkpoint):
                self.pretrained = pretrained.load(str(checkpoint), inputs)
                self.model, self.data = self.pretrained.model, self.pretrained.data
            elif inputs:
                raise ConfigError(
                    f"source.inputs is the text a transformers model reads; {checkpoint} is a runner run, which reads "
                    "its own data: leave source.inputs out"
                )
            else:
                self.model, cfg = load_trained(checkpoint, trusted_targets)
                self.data: DataModule = build_data(cfg)
                # what that run read, when it read another model's activations: the way out if it is no source
                self.read = cfg.data.get("checkpoint"), cfg.data.get("module")
            self.device = torch.device(device)
            self.model.to(self.device)

    def loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's validation loss of a batch, and its output (logits) when that is a tensor."""
        # for a runner task, the root module's forward hook sees what validation_step computed its loss from
        if self.pretrained is not None:
            return self.pretrained.loss(batch)
        outputs: list[Any] = []
        root = self.model.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        try:
            out = self.model.validation_step(batch)
        finally:
            root.remove()
        if "loss" not in out:
            raise ConfigError(self._no_loss(out))
        loss = out["loss"]
        logits = outputs[-1] if outputs and torch.is_tensor(outputs[-1]) and outputs[-1].is_floating_point() else None
        return loss, logits

    def _read_instead(self) -> str:
        # An SAE's run given as a source (an SAE on an SAE: a KeyError inside the source's forward before): the model
        # that run read its activations from is the one to give
        inner, module = self.read
        if inner is None:
            return ""
        preset = " with +experiment=sae_hf" if pretrained.is_pretrained(inner) else ""
        return f"; an SAE's run? give the model it read: source.checkpoint={inner} source.module={module}{preset}"

    def _no_loss(self, out: dict[str, Any]) -> str:
        # an SAE's validation gives reconstruction statistics, and calls no module (its weights hang off the root)
        return (
            f"source.checkpoint={self.checkpoint}: the validation_step of its {type(self.model).__name__} gives no "
            f"loss (only {', '.join(out)}), and an SAE's source is a model whose loss it is spliced into"
            + (self._read_instead() or ": give the run of a model whose validation gives its loss (+experiment=lm)")
        )
