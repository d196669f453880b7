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
from runner import ConfigError
from runner.outdir import within
from runner.trust import buildable


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
    ) -> None:
        super().__init__()
        if base is None and (ks or widths):
            raise ConfigError("model.ks / model.widths vary model.base: give model.base (an SAE config)")
        makers = family(base, ks, widths, saes)
        self.hook_of: dict[str, str] = {}  # SAE name -> the module it reads, with several hooked modules
        self.columns: dict[str, tuple[int, int]] = {}  # SAE name -> its module's columns of the rows
        if not hooks:
            self.saes = nn.ModuleDict({name: make(d_in=d_in) for name, make in makers.items()})
            return
        built, start = {}, 0
        for module, width in hooks.items():
            for name, make in makers.items():
                member = f"{hook_name(module)}_{name}"
                built[member] = make(d_in=width)
                self.hook_of[member], self.columns[member] = module, (start, start + width)
            start += width
        self.saes = nn.ModuleDict(built)

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
        """Each SAE's constraint and dead-latent clock."""
        for sae in self.saes.values():
            sae.after_optimizer_step()

    def export(self, fmt: str, out: Any, cfg: Any, summary: dict | None = None) -> list[Any]:
        """Each SAE in its own folder under `out` (SAE.export), named as its weights file is; as a repository (hf),
        each SAELens folder named by its hook point (and its name, where several read one), under one model card."""
        if fmt != "hf":
            return [
                folder
                for name, sae in self.saes.items()
                for folder in sae.export(fmt, within(out, name), cfg, self.hook_of.get(name))
            ]
        from experiments.sae.formats import hub_card, sae_id

        hooks = [self.hook_of.get(name) for name in self.saes]
        folders = {}
        for name, sae, hook in zip(self.saes, self.saes.values(), hooks, strict=True):
            folder = sae_id(hook, name) if hooks.count(hook) == 1 and hook else f"{sae_id(hook, name)}.{name}"
            folders |= dict.fromkeys(sae.export("saelens", within(out, folder), cfg, hook), f"{name}/")
        hub_card(out, folders, cfg, summary)
        return [out]

    def features(self, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
        """Every SAE's feature pages in the folder of its name under `out` (SAE.features), and a page linking them."""
        from experiments.sae.pages.dashboard import write

        return write(members(self), cfg, run_dir, out, rows_of=self.rows_of, **options)

    def logged(self, metrics: dict[str, float]) -> None:
        """Tell each SAE the last logged row, under its own prefix (SAE.logged)."""
        for name, sae in self.saes.items():
            sae.logged(metrics, prefix=f"{name}/")

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """The sum of the SAEs' losses, and each SAE's metrics under its name."""
        out: dict[str, torch.Tensor] = {}
        losses = []
        for name, sae in self.saes.items():
            step = sae.training_step(self.rows_of(batch, name))
            losses.append(step["loss"])
            out.update({f"{name}/{key}": value for key, value in step.items()})
        out["loss"] = torch.stack(losses).sum()
        return out

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Each SAE's validation statistics under its name."""
        return {
            f"{name}/{k}": v
            for name, sae in self.saes.items()
            for k, v in sae.validation_step(self.rows_of(batch, name)).items()
        }

    def validation_summary(self, means: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each SAE's metrics under its name, their sum as `loss` and their mean under every other shared name."""
        per_sae = {}
        for name, sae in self.saes.items():
            mine = {key.split("/", 1)[1]: value for key, value in means.items() if key.startswith(f"{name}/")}
            summary = getattr(sae, "validation_summary", None)
            per_sae[name] = summary(mine) if summary is not None else mine
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
    if isinstance(task, MultiSAE):
        return [(f"{name}/", sae) for name, sae in task.saes.items()]
    return [("", task)]
