"""End-to-end objectives (Braun et al. 2024, "Identifying Functionally Important Features with End-to-End Sparse
Dictionary Learning"; sparsify's `loss_fn: kl | ce`): a coder trained by what splicing it into the frozen source model
costs, not (only) by how well it reconstructs its input.

Each training batch is a batch of the source's own windows (data=activations_spliced). A clean forward, without
gradients, gives the model's next-token distributions; a second forward replaces the hooked module's output (an SAE's
module, a transcoder's target) by the coder's prediction at the kept positions, and the loss is the KL divergence of
the spliced distributions from the clean ones (`kl`) or the spliced model's own next-token loss (`ce`), backpropagated
through the frozen later layers into the coder alone. `recon_coeff` adds the coder's normalised reconstruction error,
and `downstream` with `downstream_coeff` the normalised errors of later modules' outputs against their clean values
(Braun et al.'s e2e+ds). The coder's own terms (AuxK, an L1 penalty) are always added: they belong to its code type.

The source model is the data's (one copy, frozen and in eval mode); it is no submodule here, so its weights get no
gradient, no optimizer state and no place in checkpoints. Validation reads activation rows, as any coder's does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from experiments.sae.coders.base import SAE
from experiments.sae.objectives import batch_errors
from experiments.sae.sources.replay import recording, replaying
from experiments.sae.sources.source import SourceModel, Splice
from runner import ConfigError
from runner.compile import class_name
from runner.config.trust import buildable

LOSSES = ("kl", "ce")


@buildable("model", coder="model")
class Spliced(nn.Module):
    """A coder (an SAE or a transcoder) trained through the source model it is spliced into."""

    def __init__(
        self,
        coder: Callable[..., SAE] | None = None,
        source: SourceModel | None = None,
        loss: str = "kl",
        recon_coeff: float = 0.0,
        downstream: Sequence[str] = (),
        downstream_coeff: float = 0.0,
        d_in: int | None = None,
        d_out: int | None = None,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ConfigError(f"model.loss={loss!r}: give kl (the clean model's next-token distribution) or ce")
        if source is None:
            raise ConfigError(
                f"model.loss={loss} trains the coder through the model it is spliced into, and this data has no "
                "model: activations from a file (data=activations_file) or synthetic data cannot be spliced "
                "anywhere. Train on a model's own windows with data=activations_spliced and source.checkpoint=<a "
                "runner lm run or hf:NAME> (+experiment=sae_lm_kl), or train on reconstruction alone with an "
                "SAE model option (model=sae_topk, the default)"
            )
        if coder is None:
            raise ConfigError("model.coder: give the code type (an SAE config, e.g. the sae_lm preset's)")
        for name, value in (("recon_coeff", recon_coeff), ("downstream_coeff", downstream_coeff)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"model.{name}={value!r}: give a weight >= 0")
        if len(source.targets) > 1 or len(source.names) - len(source.targets) > 1:
            raise ConfigError(
                f"model.loss={loss}: one coder at a time is spliced (one source.module, and at most one "
                f"source.target); got source.module={source.names[: len(source.names) - len(source.targets)]}"
            )
        self.coder = coder(d_in=d_in, d_out=d_out)
        self.loss, self.recon_coeff = loss, float(recon_coeff)
        self.downstream, self.downstream_coeff = [str(name) for name in downstream], float(downstream_coeff)
        if self.downstream and not self.downstream_coeff:
            raise ConfigError(f"model.downstream={self.downstream} with model.downstream_coeff=0: give it a weight")
        modules = dict(source.model.named_modules())
        if unknown := [name for name in self.downstream if name not in modules]:
            raise ConfigError(f"model.downstream: {unknown} are not modules of {type(source.model).__name__}")
        source.model.eval().requires_grad_(False)
        self.source = source  # a plain object: nn.Module does not register it (nor its model)
        self.read = source.names[0]
        self.written = (source.targets or [self.read])[0]  # what the coder's prediction replaces
        self.to_compile: tuple[list[str], dict[str, Any]] | None = None  # compile=blocks, at the first step

    def to(self, *args: Any, **kwargs: Any) -> Spliced:
        """Move the coder, and the source model with it (the data made it on the CPU)."""
        super().to(*args, **kwargs)
        self.source.to(self.coder.W_dec.device)
        return self

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """The spliced model's KL from the clean one (or its CE), plus the weighted reconstruction terms."""
        source, out, clean_logits, prefix = self.source, {}, None, contextlib.nullcontext()
        replayed: set[str] = set()
        if self.loss == "kl" or self.downstream:  # the spliced CE needs no clean forward
            with torch.no_grad(), source.observing(self.downstream, batch) as clean:
                with recording(source.model, self.written) as recorded:
                    _, clean_logits = source.loss(batch)
            prefix = replaying(recorded)  # the spliced pass is the clean one up to the spliced module: not run again
            replayed = set(recorded.outputs)
        if self.to_compile is not None:
            self._compile_source(replayed)

        def predict(captured: dict[str, torch.Tensor]) -> torch.Tensor:
            # the coder's step on the rows of this forward (the target's clean output beside a transcoder's input)
            rows = captured[self.read]
            if source.targets:
                rows = torch.cat([rows, captured[self.written]], -1)
            metrics, prediction = self.coder.step(rows, train=True)
            out.update(metrics)
            return prediction

        reads = [self.read, *source.targets]
        with source.observing(self.downstream, batch) as spliced, prefix:
            ce, logits = source.run(batch, Splice(reads, {self.written: predict}))
        if logits is None and self.loss == "kl":
            raise ConfigError(
                f"model.loss=kl: {type(source.model).__name__}'s validation_step gives no logits to compare; use "
                "model.loss=ce"
            )
        kl = _kl(clean_logits, logits) if clean_logits is not None and logits is not None else None
        terms = out["loss"] - out["recon_loss"]  # the code type's own (AuxK, L1)
        loss = (kl if self.loss == "kl" else ce) + self.recon_coeff * out["recon_loss"] + terms
        if self.downstream:
            errors = [batch_errors(spliced[name].float(), clean[name].float()) for name in self.downstream]
            out["downstream_loss"] = sum(sse / sst for sse, sst in errors) / len(errors)
            loss = loss + self.downstream_coeff * out["downstream_loss"]
        out.update({"loss": loss, "ce": ce.detach(), **({"kl": kl.detach()} if kl is not None else {})})
        return out

    def compile_frozen(self, units: list[str] | None, options: dict[str, Any]) -> str:
        """compile=blocks (runner/compile.py): torch.compile the source model's modules of the classes `units` that
        the splice leaves whole, at the first step, once its clean pass has shown which modules it replays."""
        if units is None:
            raise ConfigError(
                "compile=model compiles the task's forward, and an end-to-end coder has none: its step runs the "
                "frozen source model, whose blocks after the splice point compile=blocks compiles"
            )
        self.to_compile = (list(units), dict(options))
        return f"the source's {', '.join(units)} the splice leaves whole, at the first step"

    def _compile_source(self, replayed: set[str]) -> None:
        # Not a replayed module (the spliced pass does not run it), nor one around a module the step hooks: their
        # hooks change every step (each a new closure), and a compiled module would be traced again for each.
        units, options = self.to_compile
        self.to_compile = None
        hooked = [self.read, self.written, *self.source.targets, *self.downstream]

        def within(name: str, outer: str) -> bool:
            return name == outer or name.startswith(outer + ".")

        for name, module in self.source.model.named_modules():
            if class_name(module) not in units or any(within(name, r) for r in replayed):
                continue
            if not any(within(h, name) for h in hooked):
                module.compile(**options)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """The coder's statistics on activation rows (experiments/sae/coders/base.py)."""
        return self.coder.validation_step(batch)

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The coder's validation metrics."""
        return self.coder.validation_summary(means)

    def after_optimizer_step(self) -> None:
        """The coder's constraint and dead-latent clock."""
        self.coder.after_optimizer_step()

    def logged(self, metrics: dict[str, float]) -> None:
        """Tell the coder the last logged row (SAE.logged)."""
        self.coder.logged(metrics)

    def export(self, fmt: str, out: Any, cfg: Any, summary: dict | None = None) -> list[Any]:
        """The coder in another tool's layout (SAE.export): what it was trained by does not change what it is."""
        return self.coder.export(fmt, out, cfg, summary=summary)

    def features(self, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
        """The coder's feature pages (SAE.features)."""
        return self.coder.features(cfg, run_dir, out, **options)


def _kl(clean: torch.Tensor, spliced: torch.Tensor) -> torch.Tensor:
    """KL(clean || spliced) of next-token distributions from logits [..., vocab], averaged over positions, in float32
    (the validation's is in float64: experiments/sae/sources/costs.py)."""
    p = clean.float().log_softmax(-1)
    return (p.exp() * (p - spliced.float().log_softmax(-1))).sum(-1).mean()
