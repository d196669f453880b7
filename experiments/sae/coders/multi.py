"""Several SAEs trained on the same batches: one activation pass (a hooked model's forward, a file read, a synthetic
draw) feeds them all.

Their losses are summed, so each SAE's gradient is exactly its own (no parameter is shared) and each keeps its own
optimizer state (Adam's moments are per parameter). Metrics come per SAE as `<name>/<metric>`; at validation the
unprefixed `loss` is their sum (what is trained) and every other unprefixed metric their mean, so that one `monitor`
works whatever the family. The run writes one weights file per SAE, `model.<name>.safetensors` (runner/train.py,
`parts`), beside the whole family's model.safetensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from experiments.sae.coders.base import SAE
from experiments.sae.coders.spread import Spread, placement
from runner import ConfigError
from runner.config.trust import buildable


def family(
    base: Callable[..., SAE],
    ks: Sequence[int] | None = None,
    widths: Sequence[int] | None = None,
    saes: dict[str, Callable[..., SAE]] | None = None,
) -> dict[str, Callable[..., SAE]]:
    """Constructors by name: `base` for every (width, k) of the lists (named k<k>, n<width> or n<width>_k<k>), and
    the named constructors of `saes` (any architecture)."""
    made: dict[str, Callable[..., SAE]] = {}
    for key, values in (("ks", ks), ("widths", widths)):
        if values and len(set(values)) < len(values):
            raise ConfigError(f"model.{key}={list(values)} names a value twice: each SAE of the family needs its own")
    for n, k in itertools.product(widths or [None], ks or [None]):
        if n is None and k is None:
            continue
        name = "_".join(part for part in (n and f"n{n}", k and f"k{k}") if part)
        settings = {key: value for key, value in (("n_latents", n), ("k", k)) if value is not None}
        made[name] = _with(base, **settings)
    for name, make in (saes or {}).items():
        if name in made:
            raise ConfigError(f"model.saes.{name}: the name is already taken by an SAE of model.ks/model.widths")
        made[name] = make
    if not made:
        raise ConfigError("model=sae_multi trains no SAE: give model.ks, model.widths or model.saes")
    for name in made:
        if not name.isidentifier():
            raise ConfigError(f"model.saes: {name!r} is not a usable SAE name (letters, digits, _)")
    return made


def _with(make: Callable[..., SAE], **settings: Any) -> Callable[..., SAE]:
    return lambda **kwargs: make(**settings, **kwargs)


def hook_name(module: str) -> str:
    """A hooked module's name as an SAE or metric name: blocks.1 -> blocks_1."""
    return module.replace(".", "_")


@buildable("model", base="model", saes="model")
class MultiSAE(nn.Module):
    """Several SAEs, each built with the data's width `d_in`, trained together on each batch.

    With `hooks` (the data's, when the source hooks several modules: name -> width), the family is made for each
    hooked module, its SAEs named `<module>_<name>` (blocks_1_k32), each built with its module's width and trained on
    its module's columns of the rows (the modules' activations of the same positions, side by side)."""

    def __init__(
        self,
        d_in: int | None = None,
        base: Callable[..., SAE] | None = None,
        ks: Sequence[int] | None = None,
        widths: Sequence[int] | None = None,
        saes: dict[str, Callable[..., SAE]] | None = None,
        hooks: dict[str, int] | None = None,
        distribute: bool | None = None,
    ) -> None:
        super().__init__()
        if base is None and (ks or widths):
            raise ConfigError("model.ks / model.widths vary model.base: give model.base (an SAE config)")
        makers = family(base, ks, widths, saes)
        self.hook_of: dict[str, str] = {}  # SAE name -> the module it reads, with several hooked modules
        self.columns: dict[str, tuple[int, int]] = {}  # SAE name -> its module's columns of the rows
        plan: dict[str, tuple[Callable[..., SAE], int | None]] = {}  # SAE name -> (constructor, d_in)
        key = {name: f"model.saes.{name}" if name in (saes or {}) else "model.base" for name in makers}
        self.settings_key: dict[str, str] = {}  # SAE name -> where its settings are in the config (advice says it)
        if not hooks:
            plan = {name: (make, d_in) for name, make in makers.items()}
            self.settings_key = dict(key)
        start = 0
        for module, width in (hooks or {}).items():
            for name, make in makers.items():
                member = f"{hook_name(module)}_{name}"
                plan[member], self.settings_key[member] = (make, width), key[name]
                self.hook_of[member], self.columns[member] = module, (start, start + width)
            start += width
        self.spread: Spread | None = None
        owners = dict.fromkeys(plan, 0)
        self.distribute = bool(distribute)  # distributed=spread asks it (runner.build); one process: no change
        if distribute and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            with torch.device("meta"):  # sizes only: no memory, no random numbers drawn
                sizes = [sum(p.numel() for p in make(d_in=d).parameters()) for make, d in plan.values()]
            owners = dict(zip(plan, placement(sizes, torch.distributed.get_world_size()), strict=True))
            self.spread = Spread(owners, {name: self.columns.get(name) for name in plan})
        rank = self.spread.rank if self.spread is not None else 0
        # Each SAE from a seed of its own (one draw of the run's generator for all), so that it starts alike on
        # whichever rank builds it; the SAEs other ranks train stay on the meta device: names and shapes, no memory.
        seed = int(torch.randint(2**62, ()))
        built = {}
        for i, (name, (make, width)) in enumerate(plan.items()):
            if owners[name] != rank:
                with torch.device("meta"):
                    built[name] = make(d_in=width)
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + i)
                built[name] = make(d_in=width)
            built[name].sees_global_batch = self.spread is not None
        self.saes = nn.ModuleDict(built)
        self.mine = [name for name in plan if owners[name] == rank]

    def _apply(self, fn: Callable, recurse: bool = True) -> MultiSAE:
        # .to(), .float() and the like move this rank's SAEs: the others' meta placeholders have no data to move
        for name in self.mine:
            self.saes[name]._apply(fn, recurse)
        return self

    def rows_of(self, batch: Any, name: str) -> Any:
        """The batch as SAE `name` reads it: its module's columns (every column with one hooked module)."""
        if name not in self.columns:
            return batch
        start, end = self.columns[name]
        if isinstance(batch, (tuple, list)):
            return type(batch)(t[..., start:end] for t in batch)
        return batch[..., start:end]

    @property
    def parts(self) -> dict[str, str]:
        """Each SAE's name and the prefix of its weights in the state dict (one weights file each)."""
        return {name: f"saes.{name}." for name in self.saes}

    def after_optimizer_step(self) -> None:
        """Each SAE's constraint and dead-latent clock (this rank's)."""
        for name in self.mine:
            self.saes[name].after_optimizer_step()

    def advice(self, metrics: dict[str, float]) -> list[str]:
        """Each SAE's own end-of-run advice, read under its prefix (SAE.advice)."""
        return [
            line
            for name, sae in self.saes.items()
            for line in sae.advice(metrics, prefix=f"{name}/", key=self.settings_key[name])
        ]

    def logged(self, metrics: dict[str, float]) -> None:
        """Tell each SAE the last logged row, under its own prefix (SAE.logged)."""
        for name in self.mine:
            self.saes[name].logged(metrics, prefix=f"{name}/")

    def _steps(self, kind: str, batch: Any) -> dict[str, dict[str, Any]]:
        # Each SAE's outputs of its `kind` step on its rows. Spread over ranks: this rank's SAEs run on every rank's
        # rows, and every SAE's outputs reach every rank (detached: an SAE's gradient is its own rank's).
        if self.spread is None:
            return {name: getattr(sae, kind)(self.rows_of(batch, name)) for name, sae in self.saes.items()}
        rows = self.spread.rows(batch)
        own = {name: getattr(self.saes[name], kind)(rows[name]) for name in self.mine}
        shared = self.spread.share(kind, own)
        if kind == "training_step":
            # the family's loss, the same on every rank, with the gradient of this rank's SAEs' losses (x - x: 0)
            mine = torch.stack([own[name]["loss"] for name in self.mine]).sum()
            shared[self.mine[0]]["loss"] = shared[self.mine[0]]["loss"] + (mine - mine.detach())
        return shared

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """The sum of the SAEs' losses, and each SAE's metrics under its name."""
        per_sae = self._steps("training_step", batch)
        out = {f"{name}/{key}": value for name, step in per_sae.items() for key, value in step.items()}
        out["loss"] = torch.stack([step["loss"] for step in per_sae.values()]).sum()
        return out

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Each SAE's validation statistics under its name."""
        per_sae = self._steps("validation_step", batch)
        return {f"{name}/{k}": v for name, step in per_sae.items() for k, v in step.items()}

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each SAE's metrics under its name, their sum as `loss` and their mean under every other shared name."""
        per_sae = {}
        for name in self.mine:  # spread over ranks: each rank summarises its own SAEs, then every rank has all
            mine = {key.split("/", 1)[1]: value for key, value in means.items() if key.startswith(f"{name}/")}
            summary = getattr(self.saes[name], "validation_summary", None)
            per_sae[name] = summary(mine) if summary is not None else mine
        if self.spread is not None:
            per_sae = self.spread.share("validation_summary", per_sae)
        return {
            **{f"{name}/{key}": value for name, metrics in per_sae.items() for key, value in metrics.items()},
            **combined(per_sae),
        }


def combined(per_sae: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Metrics every SAE has, across SAEs: `loss` summed, the others averaged."""
    shared = set.intersection(*(set(metrics) for metrics in per_sae.values()))
    out = {}
    for key in sorted(shared):
        values = [metrics[key] for metrics in per_sae.values()]
        total = sum(values[1:], values[0])
        out[key] = total if key == "loss" else total / len(values)
    return out


def members(task: nn.Module) -> list[tuple[str, SAE]]:
    """The SAEs of a task with their metric prefixes: ('', task) for one SAE, ('<name>/', sae) for each of a
    MultiSAE's; a wrapper's (experiments/sae/end_to_end.Spliced: its `coder`) are its coder's."""
    if isinstance(getattr(task, "coder", None), nn.Module):
        return members(task.coder)
    if isinstance(task, MultiSAE):  # spread over ranks: this rank's
        return [(f"{name}/", task.saes[name]) for name in task.mine]
    return [("", task)]


def spread_over_ranks(task: nn.Module) -> bool:
    """Whether a task's SAEs are spread over the ranks (distributed=spread): each rank holds only its own."""
    return any(getattr(sae, "sees_global_batch", False) for _, sae in members(task))


def from_every_rank(run: Any, per_sae: dict[str, Any]) -> dict[str, Any]:
    """Values by SAE prefix from the run's SAEs on this rank, with every other rank's where the family is spread over
    the ranks (elsewhere every rank has all of them already)."""
    if not spread_over_ranks(run.task):
        return per_sae
    return {prefix: values for part in run.strategy.gather(per_sae) for prefix, values in part.items()}
