"""Live activations from a named module of a frozen model trained by runner, served through a shuffling ring buffer
(experiments.sae.buffer), and the spliced model's losses."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from experiments.sae.buffer import ActivationBuffer, HookedActivations
from experiments.sae.cache import SHARD_ROWS, cached, identity
from experiments.sae.multi import combined, hook_name, members
from runner import ConfigError, check_whole
from runner.build import build_data
from runner.data import DataModule, TensorData, batch_size_of, to_device
from runner.run import Callback
from runner.trained import TRUSTED_TARGETS, load_trained

# What compare() puts in a module's place: nothing (the clean model), a function of the first hooked module's output,
# or (module name, function).
Replacement = Callable[[torch.Tensor], torch.Tensor] | tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None


class _Captured(Exception):
    """Raised by the capturing hook: what follows the hooked module is not needed."""


def hook_points(module: str | Sequence[str]) -> list[str]:
    """The hooked modules' names: one (`source.module=blocks.2`) or several (`source.module=[blocks.1,blocks.3]`)."""
    names = [module] if isinstance(module, str) else [str(name) for name in module]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"source.module={names}: name one module, or several different ones")
    return names


class SourceModel:
    """A frozen runner-trained model, the data it was trained on, and forward hooks on one or several of its modules.

    A module whose output is a sequence [B, T, d] (a transformer block: the residual stream after it) gives one
    activation per position from `skip_positions` on: the first position's stream (the first token, attended to by
    everything) is an outlier the field leaves out of training and of splicing. Several modules give their
    activations of the same positions side by side, [rows, d_1 + d_2 + ...], in the order named (`widths`)."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        device: torch.device | str = "cpu",
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
    ) -> None:
        if isinstance(skip_positions, bool) or not isinstance(skip_positions, int) or skip_positions < 0:
            raise ConfigError(
                f"source.skip_positions={skip_positions!r}: give how many first positions to leave out, >= 0"
            )
        self.model, cfg = load_trained(checkpoint, trusted_targets)
        self.device = torch.device(device)
        self.model.to(self.device)
        modules = dict(self.model.named_modules())
        self.names = hook_points(module)
        for name in self.names:
            if name not in modules:
                names = ", ".join(n for n in modules if n)
                raise ConfigError(f"source.module={name!r} is not a module of {type(self.model).__name__}: {names}")
        self.modules, self.skip = {name: modules[name] for name in self.names}, skip_positions
        self.name = self.names[0]  # the module that splicing replaces unless told another
        self.widths: dict[str, int] = {}  # each module's width, known from the first activations
        self.data: DataModule = build_data(cfg)

    def _kept(self, out: torch.Tensor) -> torch.Tensor:
        if out.ndim == 3 and self.skip >= out.shape[1]:
            raise ConfigError(
                f"source.skip_positions={self.skip} leaves none of the {out.shape[1]} positions of the source's "
                f"windows: give fewer (the field leaves out 1, the first)"
            )
        if out.ndim == 3:
            return out[:, self.skip :]
        if self.skip:
            raise ConfigError(
                f"source.skip_positions={self.skip}, but {self.name} outputs {list(out.shape)}, not sequences "
                "[batch, positions, d]: set source.skip_positions=0"
            )
        return out

    def _spliced(self, out: torch.Tensor, replace: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        kept = self._kept(out)
        new = replace(kept.flatten(0, -2)).view_as(kept)
        return torch.cat([out[:, : self.skip], new], dim=1) if out.ndim == 3 and self.skip else new

    @contextlib.contextmanager
    def _hook(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
        handle = self.modules[name].register_forward_hook(lambda _m, _i, out: fn(out))
        try:
            yield
        finally:
            handle.remove()

    def to(self, device: torch.device) -> SourceModel:
        """Move the frozen model to `device`, where its inputs then go."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    @torch.no_grad()
    def activations(self, batch: Any) -> torch.Tensor:
        """The modules' outputs for one input batch, as [rows, d] (several: side by side); the model's forward stops
        once the last of them ran (the blocks after it, the head and the loss are never computed)."""
        captured: dict[str, torch.Tensor] = {}

        def grab(name: str) -> Callable[[torch.Tensor], None]:
            def hook(out: torch.Tensor) -> None:
                captured[name] = self._kept(out.detach()).flatten(0, -2)
                if len(captured) == len(self.names):
                    raise _Captured

            return hook

        with contextlib.ExitStack() as hooks, contextlib.suppress(_Captured):
            for name in self.names:
                hooks.enter_context(self._hook(name, grab(name)))
            self.model.validation_step(to_device(batch, self.device))
        self.widths = {name: captured[name].shape[-1] for name in self.names}
        return captured[self.name] if len(self.names) == 1 else torch.cat([captured[n] for n in self.names], dim=-1)

    @torch.no_grad()
    def compare(self, replacements: dict[str, Replacement]) -> dict[str, dict]:
        """Over the validation split, for each named replacement of a module's output (None: the clean model; a
        function: of the first hooked module's; (module, function): of that module's): the model's mean validation
        loss ("ce") and, when the model's output is logits, the KL divergence of its next-token distribution from the
        clean model's ("kl", nats per token, over the same tokens as the loss)."""
        sums = {name: torch.zeros(2, dtype=torch.float64) for name in replacements}
        count, has_logits = 0, True
        for batch in self.data.val_loader():
            batch = to_device(batch, self.device)
            size = batch_size_of(batch)
            clean = self._run(batch, None)
            for name, replace in replacements.items():
                loss, logits = clean if replace is None else self._run(batch, replace)
                has_logits = has_logits and logits is not None
                kl = _kl(clean[1], logits) if has_logits else torch.zeros((), dtype=torch.float64)
                sums[name] += torch.stack([loss.double().cpu(), kl.cpu()]) * size
            count += size
        means = {name: (total / count).tolist() for name, total in sums.items()}
        return {name: {"ce": ce, **({"kl": kl} if has_logits else {})} for name, (ce, kl) in means.items()}

    def _run(self, batch: Any, replace: Replacement) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The loss of one batch with the module's output replaced, and the model's own output (logits) when it is a
        # tensor: the root module's forward hook sees what validation_step computed its loss from.
        outputs: list[Any] = []
        name, fn = replace if isinstance(replace, tuple) else (self.name, replace)
        root = self.model.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        try:
            with self._hook(name, (lambda out: self._spliced(out, fn)) if fn else (lambda out: None)):
                loss = self.model.validation_step(batch)["loss"]
        finally:
            root.remove()
        logits = outputs[-1] if outputs and torch.is_tensor(outputs[-1]) and outputs[-1].is_floating_point() else None
        return loss, logits


def _kl(clean: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(clean || other) of the distributions given by logits [..., vocab], averaged over positions, in float64."""
    p = clean.double().log_softmax(-1)
    q = other.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean()


class HookedData(DataModule):
    """Train on live activations of `module` in the model of run `checkpoint`; validate on its validation inputs.

    With `cache` (a folder: experiments.sae.cache), the training activations are the first `cache_rows` (default
    samples_per_epoch) of the source's stream, written there once and read back memory-mapped, in the sampler's
    shuffled order; validation activations are computed live either way."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        buffer_size: int = 16384,
        samples_per_epoch: int = 65536,
        d: int | None = None,
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        cache: str | None = None,
        cache_rows: int | None = None,
        cache_dtype: str = "float32",
        cache_shard_rows: int = SHARD_ROWS,
        **loader,
    ) -> None:
        if cache_rows is not None:
            check_whole(cache_rows, "data.cache_rows")
        check_whole(cache_shard_rows, "data.cache_shard_rows")
        if cache is None and loader.get("num_workers", 0) != 0:
            raise ConfigError("activations_hooked keeps its buffer in this process: set data.num_workers=0")
        if cache is None and buffer_size < 2 * loader.get("batch_size", 1):
            raise ConfigError(
                f"data.buffer_size={buffer_size} must hold at least two batches "
                f"(2 x data.batch_size={loader.get('batch_size')}): half of it is refilled at a time"
            )
        source = SourceModel(checkpoint, module, trusted_targets=trusted_targets, skip_positions=skip_positions)
        if source.data.val_loader() is None:
            raise ConfigError(
                f"the source run {checkpoint} has no validation split, which the SAE validates (and splices) on: "
                "train the source with one (the lm data: data.val_every > 0 with at least that many files)"
            )
        val = torch.cat([source.activations(batch).cpu() for batch in source.data.val_loader()])
        several = len(source.names) > 1
        if d is not None and (several or val.shape[1] != d):
            widths = " + ".join(map(str, source.widths.values()))
            raise ConfigError(
                f"{', '.join(source.names)} output{'' if several else 's'} {widths} features but model.d_in={d}: "
                "leave model.d_in out, the SAEs take their modules' widths"
            )
        if cache is None:
            train = HookedActivations(ActivationBuffer(source, buffer_size, loader.get("seed", 0)), samples_per_epoch)
        else:
            hooked = source.names[0] if not several else source.names
            key = identity(checkpoint, hooked, skip_positions, cache_dtype, val.shape[1])
            train = cached(cache, source, key, cache_rows or samples_per_epoch, cache_shard_rows)
            loader["shuffle"] = True  # the cache holds the rows in the source's order; the sampler shuffles them
        super().__init__({"train": train, "val": TensorData(val)}, **loader)
        # The SAE's width is the module's; with several modules, a family (model=sae_multi) takes each one's width
        # and columns, and a single SAE, given no width, says to use one.
        self.model_args = {"hooks": dict(source.widths)} if several else {"d_in": val.shape[1]}
        if cache is not None:
            self.info = {"activation_cache": str(cache), "cached_rows": len(train)}

    def train_loader(
        self, rank: int = 0, world_size: int = 1, device: torch.device | None = None, accumulate: int = 1
    ) -> DataLoader:
        """The training loader; on a GPU the source runs there and the ring lives there (no copies of activations)."""
        device = torch.device(device or "cpu")
        train = self.splits["train"]
        if device.type == "cuda" and isinstance(train, HookedActivations):
            train.buffer.to(device)
            device = torch.device("cpu")  # the loader's device only decides pinning: these batches are born on the GPU
        return super().train_loader(rank, world_size, device, accumulate)


class SpliceEval(Callback):
    """Callback: the source model's validation loss with the SAE's reconstruction spliced into `module` (positions
    from `skip_positions` on), the KL divergence of its next-token distribution from the clean model's, and the
    fraction of loss recovered against two ablations of those positions: zero, (L_zero - L_sae) / (L_zero - L_clean),
    and their mean activation, (L_mean - L_sae) / (L_mean - L_clean). Each SAE of a family (model=sae_multi) gets its
    own, as val/<name>/<metric>, and the unprefixed metrics are their means."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
    ) -> None:
        self.checkpoint, self.module, self.trusted_targets = checkpoint, module, list(trusted_targets)
        self.skip = skip_positions
        self.source: SourceModel | None = None
        self.ablated: dict[str, dict] = {}
        self.provides = tuple(
            f"val/{name}"
            for name in (
                "ce_clean",
                "ce_zero_ablated",
                "ce_mean_ablated",
                "kl_zero_ablated",
                "kl_mean_ablated",
                "ce_spliced",
                "kl_spliced",
                "loss_recovered",
                "loss_recovered_mean",
            )
        )

    def on_validation_end(self, run, metrics: dict[str, float]) -> None:
        """Add the clean, ablated and spliced losses, the KL divergences and the fractions of loss recovered."""
        if self.source is None:
            self.source = SourceModel(self.checkpoint, self.module, run.device, self.trusted_targets, self.skip)
            acts = torch.cat([self.source.activations(b) for b in self.source.data.val_loader()])
            means = dict(zip(self.source.names, acts.mean(0).split(list(self.source.widths.values())), strict=True))
            ablations: dict[str, Replacement] = {"clean": None}
            for name, mean in means.items():
                ablations[f"{name}:zero"] = (name, torch.zeros_like)
                ablations[f"{name}:mean"] = (name, lambda out, mean=mean: mean.expand_as(out))
            self.ablated = self.source.compare(ablations)
        clean = self.ablated["clean"]
        family, hook_of = members(run.task), getattr(run.task, "hook_of", {})
        for _, sae in family:
            sae.eval()  # inference behaviour (BatchTopK's threshold), as validation used
        where = {prefix: hook_of.get(prefix.rstrip("/"), self.source.name) for prefix, _ in family}
        spliced = self.source.compare({prefix: (where[prefix], _through(sae)) for prefix, sae in family})
        for _, sae in family:
            sae.train()
        metrics["val/ce_clean"] = clean["ce"]
        # the ablations of the (first) hooked module, and with several, of each one under its name
        several = [(f"{hook_name(m)}/", m) for m in self.source.names] if len(self.source.names) > 1 else []
        for at, module in [("", self.source.name), *several]:
            for name in ("zero", "mean"):
                ablated = self.ablated[f"{module}:{name}"]
                metrics.update({f"val/{at}{what}_{name}_ablated": value for what, value in ablated.items()})
        per_sae = {}
        for prefix, got in spliced.items():
            zero, mean = self.ablated[f"{where[prefix]}:zero"], self.ablated[f"{where[prefix]}:mean"]
            per_sae[prefix] = {
                "ce_spliced": got["ce"],
                **({"kl_spliced": got["kl"]} if "kl" in got else {}),
                "loss_recovered": (zero["ce"] - got["ce"]) / (zero["ce"] - clean["ce"]),
                "loss_recovered_mean": (mean["ce"] - got["ce"]) / (mean["ce"] - clean["ce"]),
            }
        for prefix, values in per_sae.items():
            metrics.update({f"val/{prefix}{name}": value for name, value in values.items()})
        if len(per_sae) > 1:
            metrics.update({f"val/{name}": value for name, value in combined(per_sae).items()})


def _through(sae: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda acts: sae(acts.float()).to(acts.dtype)
