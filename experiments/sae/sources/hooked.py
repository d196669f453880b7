"""Live activations from a named module of a frozen model trained by runner (experiments.sae.sources.source), served
through a shuffling ring buffer (experiments.sae.sources.buffer), and the spliced model's losses."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from experiments.sae.coders.multi import combined, from_every_rank, hook_name, members, spread_over_ranks
from experiments.sae.metrics import loss_recovered
from experiments.sae.sources.buffer import ActivationBuffer, HookedActivations
from experiments.sae.sources.cache import SHARD_ROWS, cached, identity
from experiments.sae.sources.sharded import source_parameters
from experiments.sae.sources.source import Replacement, SourceModel, Splice
from runner import ConfigError, check_whole
from runner.data import DataModule, TensorData
from runner.run import Callback
from runner.trained import TRUSTED_TARGETS
from runner.trust import buildable


@buildable("data")
class HookedData(DataModule):
    """Train on live activations of `module` in the model of run `checkpoint` (or of a transformers model reading
    `inputs`: experiments.sae.sources.pretrained); validate on its validation inputs. With a `target` (a transcoder),
    each row is `module`'s activation then `target`'s at the same position, [rows, d_in + d_out], from one forward.

    With `cache` (a folder: experiments.sae.sources.cache), the training activations are the first `cache_rows` (default
    samples_per_epoch) of the source's stream, written there once and read back memory-mapped, in the sampler's
    shuffled order; validation activations are computed live either way.

    With `tokens`, training batches are the source's own windows instead (its training split, batched and shuffled
    here), for a coder trained through the model (experiments/sae/end_to_end.py), which the data hands the source to
    (model_args["source"]: one copy of the model); validation still reads activation rows."""

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
        inputs: dict | None = None,
        target: str | Sequence[str] | None = None,
        tokens: bool = False,
        shard: str | None = None,
        **loader,
    ) -> None:
        if shard is not None and (cache is not None or tokens):
            raise ConfigError(
                f"source.shard={shard} runs the source on every rank in step; "
                f"{'source.cache' if cache is not None else 'data.tokens'} runs it elsewhere: set source.shard=null"
            )
        if tokens and cache is not None:
            raise ConfigError(
                f"source.cache={cache} with data.tokens=true: an end-to-end coder trains on the source's windows, "
                "through the model, so there are no training activations to cache: set source.cache=null"
            )
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
        source = SourceModel(checkpoint, module, "cpu", trusted_targets, skip_positions, inputs, target, shard)
        if source.data.val_loader() is None:
            raise ConfigError(
                f"the source run {checkpoint} has no validation split, which the SAE validates (and splices) on: "
                "train the source with one (the lm data: data.val_every >= 2 and 2 files or more in data.paths)"
            )
        val = torch.cat([source.activations(batch).cpu() for batch in source.data.val_loader()])
        read = [name for name in source.names if name not in source.targets]  # what an SAE (or transcoder) reads
        several = len(read) > 1 and not source.targets
        if d is not None and (several or source.widths[source.name] != d):
            widths = " + ".join(str(source.widths[name]) for name in read)
            raise ConfigError(
                f"{', '.join(read)} output{'' if several else 's'} {widths} features but model.d_in={d}: "
                "leave model.d_in out, the SAEs take their modules' widths"
            )
        if tokens:  # the source's own windows, for a coder trained through the model (experiments/sae/end_to_end.py)
            train = source.data.splits["train"]
            loader["tokens_per_sample"] = source.data.tokens_per_sample
        elif cache is None:
            train = HookedActivations(ActivationBuffer(source, buffer_size, loader.get("seed", 0)), samples_per_epoch)
        else:
            hooked = source.names if len(source.names) > 1 else source.name  # a transcoder's target too
            hf = source.pretrained  # a transformers source: its weight files and the text it read name the cache too
            weights, facts = (hf.weight_files(), hf.inputs) if hf else (None, None)
            key = identity(checkpoint, hooked, skip_positions, cache_dtype, val.shape[1], weights, facts)
            train = cached(cache, source, key, cache_rows or samples_per_epoch, cache_shard_rows)
            loader["shuffle"] = True  # the cache holds the rows in the source's order; the sampler shuffles them
        super().__init__({"train": train, "val": TensorData(val)}, **loader)
        # The SAE's width is the module's; with several modules, a family (model=sae_multi) takes each one's width
        # and columns, and a single SAE, given no width, says to use one. A transcoder's output is the target's.
        self.model_args = {"hooks": dict(source.widths)} if several else {"d_in": source.widths[source.name]}
        if len(source.targets) == 1:
            self.model_args["d_out"] = source.widths[source.targets[0]]
        elif source.targets:  # a cross-layer transcoder's layers: their inputs alike, their outputs alike
            self.model_args = {
                "layers": len(read),
                **_same_width(source, read, "d_in"),
                **_same_width(source, source.targets, "d_out"),
            }
        if tokens:
            self.model_args["source"] = source
        if cache is not None:
            self.info = {"activation_cache": str(cache), "cached_rows": len(train)}
        if source.ranks is not None:  # run.json says what each rank holds of the source (rank 0's, as every rank's)
            self.info["source_parameters"] = source_parameters(source.model)

    def train_loader(
        self, rank: int = 0, world_size: int = 1, device: torch.device | None = None, accumulate: int = 1
    ) -> DataLoader:
        """The training loader; on a GPU the source runs there and the ring lives there (no copies of activations)."""
        device = torch.device(device or "cpu")
        train = self.splits["train"]
        if isinstance(train, HookedActivations) and world_size > 1:  # every rank's ring alike, each keeping its share
            step = self.batch_size * world_size  # the rows every rank takes at once: its share and the others'
            if 2 * step > train.buffer.capacity or len(train) % (step * accumulate):
                raise ConfigError(
                    f"data.buffer_size={train.buffer.capacity} and data.samples_per_epoch={len(train)} on {world_size} "
                    f"processes: every rank takes the {step} rows of all ranks' micro-batches (data.batch_size="
                    f"{self.batch_size} each) from a ring alike, so the ring must hold two such takes and an epoch be "
                    f"whole global batches of {step * accumulate}: e.g. data.buffer_size={max(2 * step, 16384)} "
                    f"data.samples_per_epoch={max(1, len(train) // (step * accumulate)) * step * accumulate}"
                )
            train.rank, train.world_size = rank, world_size
        if device.type == "cuda" and isinstance(train, HookedActivations):
            train.buffer.to(device)
            device = torch.device("cpu")  # the loader's device only decides pinning: these batches are born on the GPU
        return super().train_loader(rank, world_size, device, accumulate)


def _same_width(source: SourceModel, names: list[str], key: str) -> dict[str, int]:
    widths = {source.widths[name] for name in names}
    if len(widths) > 1:
        raise ConfigError(
            f"{', '.join(names)} output {sorted(widths)} features: a cross-layer transcoder's layers need one {key}; "
            "hook modules of the same width at every layer"
        )
    return {key: widths.pop()}


@buildable("callback")
class SpliceEval(Callback):
    """Callback: the source model's validation loss with the SAE's reconstruction spliced into `module` (positions
    from `skip_positions` on), the KL divergence of its next-token distribution from the clean model's, and the
    fraction of loss recovered against two ablations of those positions: zero, (L_zero - L_sae) / (L_zero - L_clean),
    and their mean activation, (L_mean - L_sae) / (L_mean - L_clean). Each SAE of a family (model=sae_multi) gets its
    own, as val/<name>/<metric>, and the unprefixed metrics are their means. With a `target` (a transcoder), the
    target's output is what is replaced, by the transcoder of `module`'s, and what is ablated; the metrics keep
    their names."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        inputs: dict | None = None,
        target: str | Sequence[str] | None = None,
        shard: str | None = None,
    ) -> None:
        self.checkpoint, self.module, self.trusted_targets = checkpoint, module, list(trusted_targets)
        self.skip, self.inputs, self.target, self.shard = skip_positions, inputs, target, shard
        self.source: SourceModel | None = None
        self.ablated: dict[str, dict] = {}
        self.noted: set[tuple[str, str]] = set()  # the recovered fractions said to be undefined
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

    def on_fit_start(self, run) -> None:
        """Refuse a sharded source beside a family spread over ranks: each rank splices its own SAEs, one forward
        each, and a sharded model's forwards must run on every rank in step."""
        if self.shard and spread_over_ranks(run.task):
            raise ConfigError(
                "source.shard=fsdp with distributed=spread: callbacks.sae_splice splices each rank's own SAEs, so the "
                "ranks would run different numbers of forwards through the sharded source; set source.shard=null "
                "(or leave sae_splice out)"
            )

    def on_validation_end(self, run, metrics: dict[str, float]) -> None:
        """Add the clean, ablated and spliced losses, the KL divergences and the fractions of loss recovered."""
        if self.source is None:
            self.source = SourceModel(
                self.checkpoint,
                self.module,
                run.device,
                self.trusted_targets,
                self.skip,
                self.inputs,
                self.target,
                self.shard,
            )
            acts = torch.cat([self.source.activations(b) for b in self.source.data.val_loader()])
            means = dict(zip(self.source.names, acts.mean(0).split(list(self.source.widths.values())), strict=True))
            targets = self.source.targets
            if targets:  # a transcoder replaces its target: that is the module ablated
                means = {name: means[name] for name in targets}
            ablations: dict[str, Replacement] = {"clean": None}
            if len(targets) > 1:  # a CLT's replacement model replaces every layer's output at once: so are they ablated
                zero = {t: lambda captured, t=t: torch.zeros_like(captured[t]) for t in targets}
                mean = {t: lambda captured, t=t, m=means[t]: m.expand_as(captured[t]) for t in targets}
                ablations.update({"targets:zero": Splice(targets, zero), "targets:mean": Splice(targets, mean)})
                means = {}
            for name, mean in means.items():
                ablations[f"{name}:zero"] = (name, torch.zeros_like)
                ablations[f"{name}:mean"] = (name, lambda out, mean=mean: mean.expand_as(out))
            self.ablated = self.source.compare(ablations, functools.partial(run.working, "ablations"))
        clean = self.ablated["clean"]
        family, hook_of = members(run.task), getattr(run.task, "hook_of", {})
        for _, sae in family:
            sae.eval()  # inference behaviour (BatchTopK's threshold), as validation used
        targets = self.source.targets
        written = "targets" if len(targets) > 1 else (targets or [self.source.name])[0]
        where = {prefix: hook_of.get(prefix.rstrip("/"), written) for prefix, _ in family}
        spliced = {prefix: self._splice(where[prefix], sae) for prefix, sae in family}
        spliced = self.source.compare(spliced, functools.partial(run.working, "splicing"))
        for _, sae in family:
            sae.train()
        metrics["val/ce_clean"] = clean["ce"]
        # the ablations of the (first) hooked module, and with several, of each one under its name
        names = [] if targets or len(self.source.names) == 1 else self.source.names
        for at, module in [("", written), *((f"{hook_name(m)}/", m) for m in names)]:
            for name in ("zero", "mean"):
                ablated = self.ablated[f"{module}:{name}"]
                metrics.update({f"val/{at}{what}_{name}_ablated": value for what, value in ablated.items()})
        per_sae = {}
        for prefix, got in spliced.items():
            per_sae[prefix] = {"ce_spliced": got["ce"], **({"kl_spliced": got["kl"]} if "kl" in got else {})}
            for name, suffix in (("zero", ""), ("mean", "_mean")):
                value, why = loss_recovered(self.ablated[f"{where[prefix]}:{name}"]["ce"], got["ce"], clean["ce"])
                per_sae[prefix][f"loss_recovered{suffix}"] = value
                if why and run.strategy.is_main and (prefix, name) not in self.noted:
                    self.noted.add((prefix, name))  # once a run: the ablations are measured once
                    print(f"note: val/{prefix}loss_recovered{suffix} is NaN: {name} ablation of {where[prefix]}: "
                          f"{why}. Read val/{prefix}kl_spliced and ce_spliced instead", file=sys.stderr)  # fmt: skip
        per_sae = from_every_rank(run, per_sae)  # distributed=spread: each rank spliced its own SAEs
        for prefix, values in per_sae.items():
            metrics.update({f"val/{prefix}{name}": value for name, value in values.items()})
        if len(per_sae) > 1:
            metrics.update({f"val/{name}": value for name, value in combined(per_sae).items()})

    def _splice(self, at: str, sae: nn.Module) -> Replacement:
        # an SAE replaces its module's output by its reconstruction; a transcoder writes the target's from the input's
        targets = self.source.targets
        if not targets:
            return at, _through(sae)
        if len(targets) > 1:  # a cross-layer transcoder: every layer's output from the inputs captured so far
            inputs = self.source.names[: len(targets)]
            return Splice(inputs, sae.splice_writes(inputs, targets))
        read, through = self.source.name, _through(sae)
        return Splice([read], {at: lambda captured: through(captured[read])})


def _through(sae: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda acts: sae(acts.float()).to(acts.dtype)
