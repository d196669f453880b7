"""A frozen model read through forward hooks on named modules (SourceModel): its activations for an input batch, and
its validation loss with a module's output replaced (what splicing an SAE in costs). Beside it in this package: the
frozen model and its loss (frozen.py), the names it hooks (hook_points.py), what may replace a module's output
(replacements.py) and what that costs over the validation split (costs.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from experiments.sae.sources import costs
from experiments.sae.sources.frozen import FrozenModel
from experiments.sae.sources.hook_points import check_order, hook_points, nearest_modules, source_key, targets_of
from experiments.sae.sources.replacements import (
    Replacement,
    Rows,
    Splice,  # noqa: F401 - where callers import it from
    as_splice,
)
from experiments.sae.sources.sharded import batch_slice, every_slice, sharded, sharded_build
from runner import ConfigError
from runner.data import batch_size_of, to_device
from runner.load import TRUSTED_TARGETS


class _Captured(Exception):
    """Raised by the capturing hook: what follows the hooked module is not needed."""


class SourceModel(FrozenModel):
    """A frozen model (FrozenModel: the data it reads, its loss) and forward hooks on one or several of its modules.

    A module whose output is a sequence [B, T, d] (a transformer block: the residual stream after it) gives one
    activation per position from `skip_positions` on: the first position's stream (the first token, attended to by
    everything) is an outlier the field leaves out of training and of splicing. A transformers source also leaves out
    its tokenizer's special tokens wherever they are (`mask`). Several modules give their activations of the same
    positions side by side, [rows, d_1 + d_2 + ...], in the order named (`widths`). A `target` (a transcoder's: the
    module whose output it predicts from `module`'s) is hooked after them: the rows are [module's | target's]."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        device: torch.device | str = "cpu",
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        inputs: dict[str, Any] | None = None,
        target: str | Sequence[str] | None = None,
        shard: str | None = None,
    ) -> None:
        if shard not in (None, "fsdp"):
            raise ConfigError(f"source.shard={shard!r}: null (every rank holds the whole model) or fsdp")
        if isinstance(skip_positions, bool) or not isinstance(skip_positions, int) or skip_positions < 0:
            raise ConfigError(
                f"source.skip_positions={skip_positions!r}: give how many first positions to leave out, >= 0"
            )
        hook_points(module)  # before the model loads (minutes for a large one): a module not given is said at once
        self.key = source_key(checkpoint, module, trusted_targets, skip_positions, inputs, target, shard)
        with sharded_build(shard, device, checkpoint) as device:  # a run's model: sharded before its weights are read
            super().__init__(checkpoint, device, trusted_targets, inputs)
        modules = dict(self.model.named_modules())
        self.names, self.target = hook_points(module), target
        self.targets = [] if target is None else targets_of(target, self.names)
        self.names += self.targets
        for name in self.names:
            if name not in modules:
                names = nearest_modules(name, list(modules))
                raise ConfigError(
                    f"{self._option(name)}={name!r} is not a module of {type(self.model).__name__}: {names}"
                    + self._read_instead()
                )
        self.skip = skip_positions
        self.name = self.names[0]  # the module that splicing replaces unless told another
        self.widths: dict[str, int] = {}  # each module's width, known from the first activations
        self.ranks = sharded(self, shard)  # (rank, world size) when the model is sharded over the ranks

    def _option(self, name: str) -> str:
        # the override that names a hooked module, for the messages that refuse it
        return "source.target" if name in self.targets else "source.module"

    def mask(self, batch: Any) -> torch.Tensor | None:
        """[B, T]: which positions of a batch give rows (a transformers source); None: all from skip_positions on."""
        return None if self.pretrained is None else self.pretrained.mask(batch, self.skip)

    def row_mask(self, batch: Any) -> torch.Tensor:
        """[B, T]: True where a position of a batch of windows gives a row (`mask`, or all from skip_positions on)."""
        mask = self.mask(batch)
        if mask is None:
            mask = torch.ones(batch["tokens"][:, :-1].shape, dtype=torch.bool)
            mask[:, : self.skip] = False
        return mask

    def positions(self, batch: Any, width: int) -> torch.Tensor:
        """The flat indices (window x `width` + position) of the positions that give an input batch's rows, in order."""
        mask = self.mask(batch)
        if mask is None:
            windows = batch["tokens"].shape[0]
            return (torch.arange(windows)[:, None] * width + torch.arange(self.skip, width)).flatten()
        return mask.flatten().nonzero().squeeze(1).cpu()

    def _kept(
        self,
        out: torch.Tensor,
        mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        name: str | None = None,
    ) -> torch.Tensor:
        name = name or self.name
        if mask is not None:
            if out.shape[:2] != mask.shape:
                raise ConfigError(
                    f"{name} outputs {list(out.shape)}, not the stream of the source's {list(mask.shape)} "
                    f"positions [windows, positions, d]: hook a block ({self._option(name)})"
                )
            # `rows`: the mask's flat indices, counted on the host; a mask on the GPU would be read back to count
            return out[mask] if rows is None else out.flatten(0, 1).index_select(0, rows)
        if out.ndim == 3 and self.skip >= out.shape[1]:
            raise ConfigError(
                f"source.skip_positions={self.skip} leaves none of the {out.shape[1]} positions of the source's "
                f"windows: give fewer (the field leaves out 1, the first)"
            )
        if out.ndim == 3:
            return out[:, self.skip :]
        if self.skip:
            raise ConfigError(
                f"source.skip_positions={self.skip}, but {name} outputs {list(out.shape)}, not sequences "
                "[batch, positions, d]: set source.skip_positions=0"
            )
        return out

    def _spliced(
        self, out: torch.Tensor, replace: Rows, mask: torch.Tensor | None = None, name: str | None = None
    ) -> torch.Tensor:
        if mask is not None:  # masked positions keep the model's own stream
            new = out.clone()
            new[mask] = replace(self._kept(out, mask, name=name)).to(out.dtype)
            return new
        kept = self._kept(out, name=name)
        new = replace(kept.flatten(0, -2)).to(out.dtype).view_as(kept)  # a CLT's writes come in float32
        return torch.cat([out[:, : self.skip], new], dim=1) if out.ndim == 3 and self.skip else new

    @contextlib.contextmanager
    def _hook(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
        def hook(_module: torch.nn.Module, _inputs: Any, out: Any) -> Any:
            if isinstance(out, tuple):  # (hidden states, cache...) of older transformers blocks
                new = fn(out[0])
                return None if new is None else (new, *out[1:])
            return fn(out)

        handle = self.model.get_submodule(name).register_forward_hook(hook)  # a Splice's may be any module
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def observing(self, names: Sequence[str], batch: Any) -> Iterator[dict[str, torch.Tensor]]:
        """Within: a forward of `batch` records the kept rows [n, d] of the `names` modules' outputs (not detached)."""
        seen: dict[str, torch.Tensor] = {}
        mask = self.mask(batch)

        def record(name: str) -> Callable[[torch.Tensor], None]:
            return lambda out: seen.__setitem__(name, self._kept(out, mask, name=name).flatten(0, -2))

        with contextlib.ExitStack() as hooks:
            for name in names:
                hooks.enter_context(self._hook(name, record(name)))
            yield seen

    def to(self, device: torch.device) -> SourceModel:
        """Move the frozen model to `device`, where its inputs then go (a sharded model is on its rank's already)."""
        if self.ranks is None:
            self.device = torch.device(device)
            self.model.to(self.device)
        return self

    @torch.no_grad()
    def activations(self, batch: Any) -> torch.Tensor:
        """The modules' outputs for one input batch, as [rows, d] (several: side by side); the model's forward stops
        once the last of them ran (the blocks after it, the head and the loss are never computed). Sharded over
        ranks (source.shard=fsdp), each rank runs its slice of the batch and every rank gets every slice's rows."""
        if self.ranks is None or batch_size_of(batch) < self.ranks[1]:
            return self._activations(batch)  # a batch too small to slice: every rank runs it whole, in step
        rank, world = self.ranks
        return every_slice(self._activations(batch_slice(batch, rank, world, batch_size_of(batch))), world)

    def _activations(self, batch: Any) -> torch.Tensor:
        captured: dict[str, torch.Tensor] = {}
        shapes: dict[str, torch.Size] = {}  # each output's: all but the width are the positions it covers
        # The kept positions are read off the inputs as the loader gave them (on the host) and go along as indices:
        # picking rows by a mask on the GPU would wait for it at every refill of an SAE's ring, a step that does not log
        mask = self.mask(batch)
        rows = None if mask is None else to_device(mask.flatten().nonzero().squeeze(1), self.device)
        batch = to_device(batch, self.device)

        def grab(name: str) -> Callable[[torch.Tensor], None]:
            def hook(out: torch.Tensor) -> None:
                shapes[name] = out.shape
                first = next(iter(shapes))
                if shapes[name][:-1] != shapes[first][:-1]:  # rows side by side must be the same positions
                    raise ConfigError(
                        f"{self._option(name)}={name} outputs {list(out.shape)} but {self._option(first)}={first} "
                        f"outputs {list(shapes[first])}: not the same positions, so their rows do not pair up; "
                        f"hook modules whose outputs are the same [batch, positions, d] (a transcoder: an MLP's input "
                        f"and its output, e.g. source.module=blocks.2.mlp_norm source.target=blocks.2.mlp)"
                    )
                captured[name] = self._kept(out.detach(), mask, rows, name).flatten(0, -2)
                check_order(self.names, self.targets, list(captured))
                if len(captured) == len(self.names):
                    raise _Captured

            return hook

        with contextlib.ExitStack() as hooks, contextlib.suppress(_Captured):
            for name in self.names:
                hooks.enter_context(self._hook(name, grab(name)))
            self.loss(batch)
        if self.ranks is not None:
            # a forward cut short never reached the root's post-forward, which frees its gathered parameters (the
            # embedding): free them here, or every rank would keep them whole
            self.model.reshard()
        if len(captured) < len(self.names):  # the forward ended without running them
            idle = ", ".join(name for name in self.names if name not in captured)
            raise ConfigError(
                f"source.module={idle}: the validation_step of {type(self.model).__name__} never runs it, so it gives "
                "no activations: hook a module that validation runs through"
            )
        self.widths = {name: captured[name].shape[-1] for name in self.names}
        return captured[self.name] if len(self.names) == 1 else torch.cat([captured[n] for n in self.names], dim=-1)

    def compare(
        self, replacements: dict[str, Replacement], working: Callable[[int, int | None], None] | None = None
    ) -> dict[str, dict]:
        """Over the validation split, for each named replacement of a module's output (None: the clean model; a
        function: of the first hooked module's; (module, function): of that module's; a Splice: the outputs it
        writes, from those it reads): the model's mean validation loss ("ce") and, when the model's output is logits,
        the KL divergence of its next-token distribution from the clean model's ("kl", nats per token, over the same
        tokens as the loss). `working(done, total)` hears after each batch how far the pass has got."""
        return self.costs(replacements, working).means()

    def costs(
        self,
        replacements: dict[str, Replacement],
        working: Callable[[int, int | None], None] | None = None,
        clean_runs: costs.CleanRuns | None = None,
        batches: range | None = None,
    ) -> costs.BatchCosts:
        """compare()'s losses and KL divergences per validation batch, over the batches numbered in `batches`;
        `clean_runs` keeps the clean model's outputs between calls (costs.CleanRuns)."""
        return costs.batch_costs(
            self.run, self.data.val_loader(), self.device, replacements, working, clean_runs, batches
        )

    def run(self, batch: Any, replace: Replacement) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss of one batch with the replacement's modules' outputs replaced, and the model's logits (None: not a
        tensor); under autograd when grad is enabled (objectives.Spliced trains a coder through it)."""
        splice = as_splice(replace, self.name)
        if splice is None:
            return self.loss(batch)
        mask, captured = self.mask(batch), {}

        def at(name: str) -> Callable[[torch.Tensor], torch.Tensor | None]:
            def hook(out: torch.Tensor) -> torch.Tensor | None:
                if name in splice.reads:  # before it is written: a module read and written reads the model's own
                    captured[name] = self._kept(out, mask, name=name).flatten(0, -2)
                if name not in splice.writes:
                    return None
                return self._spliced(out, lambda _own: splice.writes[name](captured), mask, name)

            return hook

        with contextlib.ExitStack() as hooks:
            for name in dict.fromkeys([*splice.reads, *splice.writes]):
                hooks.enter_context(self._hook(name, at(name)))
            return self.loss(batch)

    @torch.no_grad()
    def output_of(self, name: str, tokens: torch.Tensor) -> torch.Tensor:
        """Module `name`'s whole output [B, T, d] for the input tokens [B, T], every position (no mask); the forward
        stops there."""
        captured: dict[str, torch.Tensor] = {}

        def grab(out: torch.Tensor) -> None:
            captured[name] = out.detach()
            raise _Captured

        with self._hook(name, grab), contextlib.suppress(_Captured):
            self.loss({"tokens": torch.cat([tokens, tokens[:, -1:]], dim=1).to(self.device)})  # it reads [:, :-1]
        return captured[name]


def hooked_source(data: Any, device: torch.device) -> SourceModel:
    """The source model that a hooked run's `data` config (the keys of experiments.sae.sources.hooked's data options)
    reads, on `device`; a transcoder's rows hold its target's columns too."""
    trusted = list(data.get("trusted_targets") or TRUSTED_TARGETS)
    skip, inputs = int(data.get("skip_positions", 0)), data.get("inputs")
    return SourceModel(data.checkpoint, data.module, device, trusted, skip, inputs, data.get("target"))
