"""What runner's tools find on the SAE workbench's tasks, bound in one table (HOOKS) onto the coders, which know
nothing of formats, pages or folders (experiments/sae/coders/ imports nothing above it): `export` for
runner.tools.export (experiments/sae/formats/), `features` for runner.tools.features (experiments/sae/pages/), and
`SAE.load_from_disk(path)`, load_sae as SAELens and sparsify spell it (experiments/sae/api.py). The package's
__init__ imports this module, so the table is bound before any coder class is used; each hook imports what it
writes with only when called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from experiments.sae.coders.base import SAE
from experiments.sae.coders.clt import CrossLayerTranscoder
from experiments.sae.coders.multi import MultiSAE, members
from runner import ConfigError
from runner.rundir.outputs import within


def load_from_disk(cls: type[SAE], path: Any, **options: Any) -> SAE:
    """The SAE of a runner run, or of a SAELens or sparsify folder, as those tools spell it (experiments.sae.api
    .load_sae: `name=` one of a family, `hook=` one of a sparsify run's); refused if it is not a `cls`."""
    from experiments.sae.api import load_sae

    sae = load_sae(path, **options)
    if not isinstance(sae, cls):
        raise ConfigError(f"{path} holds a {type(sae).__name__}, not a {cls.__name__}: load it with SAE")
    return sae


def export_sae(
    sae: SAE, fmt: str, out: Any, cfg: Any, module: str | None = None, summary: dict | None = None
) -> list[Any]:
    """Write this SAE in another tool's folder layout (experiments/sae/formats/) for runner.tools.export; `cfg` is
    the run's config: its data's source (the hooked module, a transcoder's target, the source model) names the
    export's metadata; `module`, the one this SAE reads where the source hooks several; `summary`, the run's
    summary.json (a repository's model card quotes its metrics). The folders written."""
    from experiments.sae.formats import export, hub_card, sae_id

    # the run as trained has `source`; as load_trained rebuilds it, its data holds what `source` gave it
    source = cfg.get("source") or cfg.get("data") or {}
    names = {key: value if isinstance(value := source.get(key), str) else None for key in ("module", "target")}
    model, hook = source.get("checkpoint"), module or names["module"]
    args = (hook, str(model) if model else None, names["target"])
    if fmt == "hf":  # a repository: the SAELens folder named by its hook point, and the model card
        folder = export(sae, "saelens", within(out, sae_id(hook)), *args)
        hub_card(out, {folder: ""}, cfg, summary)
        return [out]
    rows = held_out_rows(cfg) if fmt == "circuit_tracer" and getattr(sae, "inference", None) == "topk" else None
    return [export(sae, fmt, out, *args, rows=rows, skip_positions=int(source.get("skip_positions") or 0))]


def held_out_rows(cfg: Any, rows: int = 4096) -> torch.Tensor:
    """Up to `rows` raw rows of the run's validation split (its own data config, `run_data` as runner.tools.export
    gives it, else `data`; built as runner.build does), what a TopK coder's circuit-tracer threshold is calibrated on
    (experiments/sae/formats/circuit_tracer_clt.py)."""
    from omegaconf import OmegaConf

    from runner.build import build_data

    data = build_data(OmegaConf.create({"data": cfg.get("run_data") or cfg.get("data") or {}}))
    loader = data.split_loader("val") if hasattr(data, "split_loader") else None
    if loader is None:
        raise ConfigError("format=circuit_tracer: a TopK coder is calibrated on the run's validation rows; it has none")
    got, seen = [], 0
    for batch in loader:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        got.append(x.float())
        seen += len(x)
        if seen >= rows:
            break
    return torch.cat(got)[:rows]


def export_family(family: MultiSAE, fmt: str, out: Any, cfg: Any, summary: dict | None = None) -> list[Any]:
    """Each SAE in its own folder under `out` (SAE.export), named as its weights file is; as a repository (hf),
    each SAELens folder named by its hook point (and its name, where several read one), under one model card."""
    if fmt != "hf":
        return [
            folder
            for name, sae in family.saes.items()
            for folder in sae.export(fmt, within(out, name), cfg, family.hook_of.get(name))
        ]
    from experiments.sae.formats import hub_card, sae_id

    hooks = [family.hook_of.get(name) for name in family.saes]
    folders = {}
    for name, sae, hook in zip(family.saes, family.saes.values(), hooks, strict=True):
        folder = sae_id(hook, name) if hooks.count(hook) == 1 and hook else f"{sae_id(hook, name)}.{name}"
        folders |= dict.fromkeys(sae.export("saelens", within(out, folder), cfg, hook), f"{name}/")
    hub_card(out, folders, cfg, summary)
    return [out]


def export_clt(clt: CrossLayerTranscoder, fmt: str, out: Any, cfg: Any, summary: dict | None = None) -> list[Any]:
    """circuit-tracer's CLT folder (experiments/sae/formats/circuit_tracer_clt.py; a TopK CLT converted to JumpReLU on
    the run's validation rows); SAELens and sparsify have no cross-layer transcoder format: refused."""
    if fmt == "circuit_tracer":
        from pathlib import Path

        from experiments.sae.formats.circuit_tracer_clt import write_clt

        source = cfg.get("source") or cfg.get("data") or {}
        names = {key: [m for m in source.get(key) or [] if isinstance(m, str)] for key in ("module", "target")}
        topk = any(getattr(coder, "inference", None) == "topk" for coder in clt.coders)
        model = source.get("checkpoint")
        rows = held_out_rows(cfg) if topk else None
        skip = int(source.get("skip_positions") or 0)
        write_clt(clt, Path(out), names["module"], str(model) if model else None, names["target"], rows, skip)
        return [out]
    raise ConfigError(
        f"--format {fmt}: neither SAELens nor sparsify loads cross-layer transcoders: give format=circuit_tracer "
        "(the run's model.safetensors holds every layer's coder: coders.<layer>.W_enc, W_dec [latents, later layers "
        "x d_out])"
    )


def sae_features(sae: SAE, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
    """Write this SAE's feature pages to `out` for runner.tools.features (experiments/sae/pages/dashboard.py);
    the pages."""
    from experiments.sae.pages.dashboard import write

    return write([("", sae)], cfg, run_dir, out, **options)


def family_features(family: MultiSAE, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
    """Every SAE's feature pages in the folder of its name under `out` (SAE.features), and a page linking them."""
    from experiments.sae.pages.dashboard import write

    return write(members(family), cfg, run_dir, out, rows_of=family.rows_of, **options)


def clt_features(clt: CrossLayerTranscoder, cfg: Any, run_dir: Any, out: Any, **options: Any) -> list[Any]:
    """Each layer's feature pages (its latents' contexts on its MLP input; the logit lens of what they write to
    their own layer) in a folder per layer under `out`, and a page linking them
    (experiments/sae/pages/dashboard.py)."""
    from experiments.sae.pages.dashboard import write

    def rows_of(rows: torch.Tensor, name: str) -> torch.Tensor:
        layer = int(name.removeprefix("layer"))
        return clt.split(rows)[0][layer].float() * clt.input_scale[layer]  # a coder works in normalised units

    family = [(f"layer{layer}/", coder) for layer, coder in enumerate(clt.coders)]
    return write(family, cfg, run_dir, out, rows_of=rows_of, **options)


# Each task root's tool hooks (runner.interfaces.Task: `export`, `features`); a subclass inherits its root's. An
# end-to-end run (experiments/sae/end_to_end.Spliced) hands both to its coder.
HOOKS: dict[type, dict[str, Callable[..., Any] | classmethod]] = {
    SAE: {"export": export_sae, "features": sae_features, "load_from_disk": classmethod(load_from_disk)},
    MultiSAE: {"export": export_family, "features": family_features},
    CrossLayerTranscoder: {"export": export_clt, "features": clt_features},
}
for _root, _hooks in HOOKS.items():
    for _name, _hook in _hooks.items():
        setattr(_root, _name, _hook)
