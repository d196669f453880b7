"""k annealing for TopK-style SAEs (sparsify's `k_decay_steps`): a callback that sets each coder's k from the
optimizer steps done, so that a resumed run takes its step's k with nothing to checkpoint."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from experiments.sae.coders.multi import members
from runner import ConfigError
from runner.progress import parse_duration
from runner.run import Callback

if TYPE_CHECKING:
    from runner.run import Run


def annealed_k(start: int, final: int, steps: int, done: int) -> int:
    """The k after `done` optimizer steps of a linear anneal from `start` down to `final` over `steps` steps."""
    if done >= steps:
        return final
    f = done / steps
    # sparsify's arithmetic and rounding (Python's round: halves to even), so the two schedules agree step for step
    return max(final, round(start * (1 - f) + final * f))


_MULTIPLE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*\*\s*(d_in|k)\s*$")


def _coders(task: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    # Every coder with its metric prefix: a family's SAEs (members), a cross-layer transcoder's layers (layer<i>/)
    found = []
    for prefix, sae in members(task):
        layers = getattr(sae, "coders", None)
        found += [(f"{prefix}layer{i}/", c) for i, c in enumerate(layers)] if layers is not None else [(prefix, sae)]
    return found


class KAnneal(Callback):
    """Anneals the k of TopK-style SAEs (TopK, BatchTopK, Matryoshka; each SAE of a family, each layer of a
    cross-layer transcoder) from `start` down to the k each was configured with, linearly over `duration`, as
    sparsify's `k_decay_steps`: after s optimizer steps of the n that `duration` lasts, k = round(start (1 - s/n) +
    k s/n), and k itself from step n on.

    `start`: an absolute k (an integer, in [k, n_latents]), or a multiple of the SAE's input width ('10*d_in',
    sparsify's default start) or of its own k ('4*k'); a multiple is capped at n_latents, as sparsify caps its start.
    The k is a function of the steps done, set at fit start (a resumed run takes its step's k) and after every
    optimizer step: nothing to checkpoint, and a resume is exact. Validation uses the k in force, so a validation
    before the anneal ends scores a denser code: the run's best val/fve (checkpoint.keep_best, early stopping) can
    fall there (+experiment=sae: best val/fve 0.989 at L0 514, in a run that ends at 0.950). BatchTopK's k is a
    per-row average (the batch keeps its top k x rows); its inference threshold is a running mean of the smallest kept
    value, which follows k down with a lag of some 1 / (1 - threshold_momentum) steps: end the anneal well before the
    run ends. AuxK's k_aux does not change. Each log row at step s gets train/k (train/<name>/k for a family's SAEs,
    train/layer<i>/k for a cross-layer transcoder's layers): the k that step trained with, in a row of its own.
    """

    def __init__(self, start: int | str = "10*d_in", duration: str = "0.5dur") -> None:
        self.start, self.duration = self._read_start(start), parse_duration(duration)
        if self.duration.value <= 0:
            raise ConfigError(f"callbacks.sae_k_anneal.duration={duration} must be longer than zero, e.g. 0.5dur")
        self.steps = 0  # the duration in optimizer steps, once the run's progress resolves it
        self.schedule: dict[str, tuple[torch.nn.Module, int, int]] = {}  # prefix -> (coder, start, final k)

    @staticmethod
    def _read_start(start: int | str) -> tuple[float, str | None]:
        # (value, None) for an absolute k, (multiple, 'd_in' or 'k') for a multiple
        if isinstance(start, int) and not isinstance(start, bool):
            return float(start), None
        match = _MULTIPLE.match(start) if isinstance(start, str) else None
        if match is None:
            raise ConfigError(
                f"callbacks.sae_k_anneal.start={start!r}: give an integer k (e.g. 256) or a multiple of the input "
                "width or of k: 10*d_in (sparsify's default), 4*k"
            )
        return float(match.group(1)), match.group(2)

    def on_fit_start(self, run: Run) -> None:
        """Resolve the duration and each coder's start, refuse what cannot anneal, and set the k of this step."""
        steps = run.progress.steps_for(self.duration)
        if steps is None:
            raise ConfigError(
                f"callbacks.sae_k_anneal.duration={self.duration}: its length in optimizer steps is not known in "
                "advance for this data; give it in steps (e.g. 2000st) or as a fraction of max_duration (0.5dur)"
            )
        total = run.progress.total_steps()
        if steps < 1 or (total is not None and steps > total):
            raise ConfigError(
                f"callbacks.sae_k_anneal.duration={self.duration} is {steps} optimizer steps; it must last at least "
                f"one and at most the run's {total}, or the run ends with another k than model.k (e.g. 0.5dur)"
            )
        self.steps = steps
        for prefix, coder in _coders(run.task):
            if prefix not in self.schedule:  # the configured k, read once: later it is the annealed one
                self.schedule[prefix] = (coder, *self._ends(prefix, coder))
        self._set(run.progress.step)

    def _ends(self, prefix: str, coder: torch.nn.Module) -> tuple[int, int]:
        # (start, final k) of one coder, refused when it has no k or the start does not fit
        what = f"the SAE {prefix[:-1]!r}" if prefix else "the model"
        final = getattr(coder, "k", None)
        if final is None:
            raise ConfigError(
                f"callbacks.sae_k_anneal anneals a TopK-style SAE's k (model=sae_topk, sae_batchtopk, "
                f"sae_matryoshka), but {what} is a {type(coder).__name__} with no k: leave sae_k_anneal out of "
                "callbacks=[...]"
            )
        value, of = self.start
        n = coder.n_latents
        if of is None and value > n:
            raise ConfigError(
                f"callbacks.sae_k_anneal.start={int(value)} is above {what}'s n_latents={n}: give at most {n}, or a "
                "multiple such as 10*d_in (capped at n_latents)"
            )
        start = int(value) if of is None else min(n, round(value * (coder.d_in if of == "d_in" else final)))
        if start < final:
            raise ConfigError(
                f"callbacks.sae_k_anneal.start={self._text()} gives k={start} for {what}, below its k={final}: "
                f"the anneal goes down to k, so start at {final} or more (e.g. 10*d_in, 4*k)"
            )
        return start, final

    def _text(self) -> str:
        value, of = self.start
        return f"{int(value)}" if of is None else f"{value:g}*{of}"

    def _set(self, done: int) -> None:
        for coder, start, final in self.schedule.values():
            coder.k = annealed_k(start, final, self.steps, done)

    def on_optimizer_step(self, run: Run) -> None:
        """The k of the next step."""
        self._set(run.progress.step)

    def on_step_end(self, run: Run) -> None:
        """At a step that logs, each coder's k that step trained with (train/k), to every logger."""
        p, stop = run.progress, run.stop_reason
        if not (p.ticked(run.settings.log_interval) or p.finished or (stop is not None and not stop.resumable)):
            return
        used = {
            f"train/{prefix}k": annealed_k(start, final, self.steps, p.step - 1)
            for prefix, (_, start, final) in self.schedule.items()
        }
        for logger in run.loggers:
            logger.log(used, p.step)
