"""The spliced model's losses, measured at each validation (callbacks=sae_splice): the source model's validation loss
with the SAE's reconstruction in place of its module's output, against the clean model and two ablations."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

from experiments.sae.coders.multi import combined, from_every_rank, hook_name, members, spread_over_ranks
from experiments.sae.metrics import loss_recovered
from experiments.sae.sources.costs import BatchCosts, CleanRuns
from experiments.sae.sources.source import Replacement, SourceModel, Splice, source_key
from runner import ConfigError
from runner.config.trust import buildable
from runner.load import TRUSTED_TARGETS
from runner.run import Callback
from runner.timeline import phase
from runner.validation import batches_of, share

PROVIDES = (
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


@buildable("callback")
class SpliceEval(Callback):
    """Callback: the source model's validation loss with the SAE's reconstruction spliced into `module` (positions
    from `skip_positions` on), the KL divergence of its next-token distribution from the clean model's, and the
    fraction of loss recovered against two ablations of those positions: zero, (L_zero - L_sae) / (L_zero - L_clean),
    and their mean activation, (L_mean - L_sae) / (L_mean - L_clean). Each SAE of a family (model=sae_multi) gets its
    own, as val/<name>/<metric>, and the unprefixed metrics are their means. With a `target` (a transcoder), the
    target's output is what is replaced, by the transcoder of `module`'s, and what is ablated; the metrics keep
    their names. `limit_batches` caps the source's validation batches the splice and ablations read, as
    data.limit_val_batches caps validation's (a fraction of the split, or batches per rank; None: all).

    Validations before the last read the first `during_training` of those batches (a fraction, or a number of
    batches; None: all), the clean model and the ablations over the same batches; the last validation of a run that
    trains its whole max_duration, and runner.evaluate, read them all. The source model is the run's own data's
    when it reads the same model hooked the same way (built once), and the clean model's outputs are computed once
    a run and kept while they fit in `clean_cache_mb` (on the CPU)."""

    def __init__(
        self,
        checkpoint: str,
        module: str | Sequence[str],
        trusted_targets: Sequence[str] = TRUSTED_TARGETS,
        skip_positions: int = 0,
        inputs: dict | None = None,
        target: str | Sequence[str] | None = None,
        shard: str | None = None,
        limit_batches: float | int | None = None,
        clean_cache_mb: float = 1024,
        during_training: float | int | None = None,
    ) -> None:
        self.during = share(during_training, "callbacks.sae_splice.during_training")
        self.checkpoint, self.module, self.trusted_targets = checkpoint, module, list(trusted_targets)
        self.limit_batches = limit_batches
        self.skip, self.inputs, self.target, self.shard = skip_positions, inputs, target, shard
        self.source: SourceModel | None = None
        self.clean = CleanRuns(clean_cache_mb)
        self.ablations: dict[str, Replacement] = {}
        self.ablated = BatchCosts()  # the clean and ablated models' costs of the batches measured so far
        self.noted: set[tuple[str, str]] = set()  # the recovered fractions said to be undefined
        self.provides = tuple(f"val/{name}" for name in PROVIDES)

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
            with phase("splice setup"):  # once a run: the source on the run's device, what the ablations replace
                self._ablate(run)
        batches = self._batches(run)
        if batches > len(self.ablated):  # the clean and ablated models over the batches not measured yet
            more = range(len(self.ablated), batches)
            working = functools.partial(run.working, "ablations")
            with phase("splice ablations"):
                self.ablated.extend(self.source.costs(self.ablations, working, self.clean, more))
        ablated = self.ablated.means(batches)
        clean = ablated["clean"]
        family, hook_of = members(run.task), getattr(run.task, "hook_of", {})
        for _, sae in family:
            sae.eval()  # inference behaviour (BatchTopK's threshold), as validation used
        targets = self.source.targets
        written = "targets" if len(targets) > 1 else (targets or [self.source.name])[0]
        where = {prefix: hook_of.get(prefix.rstrip("/"), written) for prefix, _ in family}
        spliced = {prefix: self._splice(where[prefix], sae) for prefix, sae in family}
        working = functools.partial(run.working, "splicing")
        spliced = self.source.costs(spliced, working, self.clean, range(batches)).means()
        for _, sae in family:
            sae.train()
        metrics["val/ce_clean"] = clean["ce"]
        # the ablations of the (first) hooked module, and with several, of each one under its name
        names = [] if targets or len(self.source.names) == 1 else self.source.names
        for at, module in [("", written), *((f"{hook_name(m)}/", m) for m in names)]:
            for name in ("zero", "mean"):
                costs = ablated[f"{module}:{name}"]
                metrics.update({f"val/{at}{what}_{name}_ablated": value for what, value in costs.items()})
        per_sae = {p: self._recovered(run, p, where[p], got, ablated) for p, got in spliced.items()}
        per_sae = from_every_rank(run, per_sae)  # distributed=spread: each rank spliced its own SAEs
        for prefix, values in per_sae.items():
            metrics.update({f"val/{prefix}{name}": value for name, value in values.items()})
        if len(per_sae) > 1:
            metrics.update({f"val/{name}": value for name, value in combined(per_sae).items()})

    def _batches(self, run) -> int:
        # How many of the source's validation batches this validation reads: all at the end of training (and in
        # runner.evaluate, which has no progress), the first `during` of them before.
        total = len(self.source.data.val_loader())
        progress = getattr(run, "progress", None)
        return total if progress is None or progress.finished else batches_of(total, self.during)

    def _ablate(self, run) -> None:
        # Once a run: the source model on the run's device, and the replacements that ablate (zero and mean ablation
        # of each hooked module: with a transcoder, of its target; with a cross-layer one, of every target at once).
        where = (self.checkpoint, self.module, self.trusted_targets, self.skip, self.inputs, self.target, self.shard)
        frozen = getattr(getattr(run, "data", None), "frozen", None)  # hooked.Frozen: the data's own source
        if frozen is not None and frozen.source.key == source_key(*where):
            self.source = frozen.source.to(run.device)
        else:
            self.source = SourceModel(self.checkpoint, self.module, run.device, *where[2:])
            frozen = None
        # the data's validation rows are the activations of the batches the splice reads, when it read as many
        same_rows = frozen is not None and self.source.data.limit_val_batches == self.limit_batches
        # the source's own split, read at every validation: sized as validation is (debug=fast's two batches)
        self.source.data.limit_val_batches = self.limit_batches
        if same_rows:  # averaged where they are (the CPU): only the mean goes to the run's device
            mean = frozen.val.tensors[0].mean(0).to(run.device)
        else:
            mean = torch.cat([self.source.activations(b) for b in self.source.data.val_loader()]).mean(0)
        means = dict(zip(self.source.names, mean.split(list(self.source.widths.values())), strict=True))
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
        self.ablations = ablations

    def _recovered(
        self, run, prefix: str, where: str, got: dict[str, float], ablated: dict[str, dict]
    ) -> dict[str, float]:
        # one SAE's spliced loss and KL, and the fractions of loss it recovers against each ablation of `where`, over
        # the same batches
        clean = ablated["clean"]
        values = {"ce_spliced": got["ce"], **({"kl_spliced": got["kl"]} if "kl" in got else {})}
        for name, suffix in (("zero", ""), ("mean", "_mean")):
            value, why = loss_recovered(ablated[f"{where}:{name}"]["ce"], got["ce"], clean["ce"])
            values[f"loss_recovered{suffix}"] = value
            if why and run.strategy.is_main and (prefix, name) not in self.noted:
                self.noted.add((prefix, name))  # once a run: the ablations are measured once
                print(f"note: val/{prefix}loss_recovered{suffix} is NaN: {name} ablation of {where}: "
                      f"{why}. Read val/{prefix}kl_spliced and ce_spliced instead", file=sys.stderr)  # fmt: skip
        return values

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
