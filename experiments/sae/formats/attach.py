"""An SAE from elsewhere (experiments/sae/formats/folders.py) attached to the model it reads: what runner's tools
(runner.tools.features, runner.tools.evaluate, runner.sae_eval) need to treat it as one of runner's own runs, the SAE
and a config whose data hooks the source model (LiveActivations) and whose callbacks splice the SAE into it
(SpliceEval).

The source is a transformers folder (or hf:NAME) or a runner run. The module an SAE reads is found from the hook
point its folder names (`module_for`): a module of the model by its own name (SAELens's metadata for transformers
models, or sparsify's names, relative to the model's base: `layers.6` is `model.layers.6`), or a TransformerLens name
(`blocks.6.hook_resid_post` is the 7th block's output, `hook_resid_pre` the one before's, `hook_mlp_out` its MLP's:
saelens.py's table). `module=` (and a transcoder's `target=`) name it instead, where the folder says nothing that
fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from experiments.sae.formats.folders import read_folder
from experiments.sae.formats.saelens import PARTS, RESID_PRE, TL_HOOK
from experiments.sae.sources import pretrained
from experiments.sae.sources.hook_points import nearest_modules
from runner import ConfigError
from runner.load import TRUSTED_TARGETS, load_trained
from runner.tools.published import literal

# The stacks of blocks of the models runner reads, where TransformerLens's blocks.N (saelens.TL_HOOK) is found
STACKS = ("blocks", "transformer.h", "model.layers", "gpt_neox.layers", "model.decoder.layers", "transformer.layers")
# What the attached run's data reads by default: the rows a tool looks at come from the source's own windows
DATA = {"batch_size": 1024, "buffer_size": 65536, "samples_per_epoch": 65536}
CONTEXT = 128  # a transformers source's window, where the SAE's folder names none (SAELens: its context_size)


def module_for(hook: str, modules: list[str]) -> str | None:
    """The module of a model (its `modules`' names) whose output is the hook point `hook`: the module itself, a
    TransformerLens name, or a name relative to the model's base; None where none or several fit."""
    if hook in modules:
        return hook
    found = TL_HOOK.fullmatch(hook)
    stack = next((s for s in STACKS if f"{s}.0" in modules), None)
    if found and stack:
        layer, kind = int(found.group(1)), found.group(2)
        if kind == RESID_PRE:
            layer -= 1  # a block's input is the one before's output (the first's is the embedding's)
        block = f"{stack}.{layer}"
        if kind in PARTS:
            return next((f"{block}.{p}" for p in PARTS[kind] if f"{block}.{p}" in modules), None)
        return block if layer >= 0 and block in modules else None
    ends = [name for name in modules if name.endswith("." + hook)]
    return ends[0] if len(ends) == 1 else None


def _model(source: str, trusted: tuple[str, ...]) -> nn.Module:
    # the source model, to name its modules: a transformers one built without its weights
    return pretrained.meta_model(source) if pretrained.is_pretrained(source) else load_trained(source, trusted)[0]


def _pick(given: str | None, hook: str | None, modules: list[str], key: str, facts: dict[str, Any]) -> str:
    # the module named on the command line, else the one the folder's hook point makes
    if given is not None:
        if given not in modules:
            raise ConfigError(f"{key}={given} is not a module of the source model: {nearest_modules(given, modules)}")
        return given
    found = module_for(hook, modules) if hook else None
    if found is None:
        said = f"names the hook point {hook!r}, which fits no module" if hook else "names no hook point"
        raise ConfigError(
            f"the {facts['format']} SAE's folder {said} of the source model: name it, {key}=MODULE, one of "
            f"{_some(modules)}"
        )
    return found


def _some(modules: list[str]) -> str:
    shown = [name for name in modules if name][:12]
    return ", ".join(shown) + (", ..." if len(modules) > 13 else "")


def attached(
    path: str | Path,
    source: str | None = None,
    hook: str | None = None,
    module: str | None = None,
    target: str | None = None,
    skip_positions: int | None = None,
    inputs: dict[str, Any] | None = None,
    trusted: tuple[str, ...] = TRUSTED_TARGETS,
) -> tuple[nn.Module, DictConfig]:
    """The SAE in the SAELens or sparsify folder `path` (`hook` picks one of a sparsify run's) and a config of a run
    that trained it on `source`'s `module` (a transcoder: to predict `target`'s output), as load_trained returns;
    `inputs`: a transformers source's text (experiments/sae/sources/pretrained.py INPUTS)."""
    sae, facts = read_folder(path, hook)
    if not source:
        model = f", trained on {facts['model']}" if facts.get("model") else ""
        raise ConfigError(
            f"{path} is a {facts['format']} SAE (hook point {facts['hook']}{model}): give the model it reads, "
            "source=FOLDER (a transformers model saved by save_pretrained, hf:NAME, or a runner run)"
        )
    model = _model(source, trusted)
    modules = [name for name, _ in model.named_modules()]
    if facts.get("transcoder") and facts["format"] == "sparsify":
        # sparsify's transcoder reads its hook point's input and predicts its output; runner hooks outputs only
        target = _pick(target, facts["hook"], modules, "target", facts)
        if module is None:
            raise ConfigError(
                f"{path} is a sparsify transcoder of {target}, which reads that module's input: name the module whose "
                f"output it is, module=MODULE (e.g. the norm before an MLP), one of {_some(modules)}"
            )
    elif sae.transcoder:
        target = _pick(target, facts.get("hook_out"), modules, "target", facts)
    module = _pick(module, facts["hook"], modules, "module", facts)
    if skip_positions is None:  # a transformers model's BOS is masked as a special token; a runner GPT's is not
        skip_positions = 0 if pretrained.is_pretrained(source) else 1
    where: dict[str, Any] = {
        "checkpoint": str(source),
        "module": module,
        "target": target if sae.transcoder else None,
        "skip_positions": skip_positions,
        "trusted_targets": list(trusted),
    }
    if inputs is not None and not isinstance(inputs, dict):
        raise ConfigError(f"inputs={inputs!r}: give a mapping, e.g. 'inputs={{paths: [corpus/*.txt], context: 64}}'")
    if pretrained.is_pretrained(source):  # windows as long as the SAE was trained on, as the model reads at most
        longest = pretrained.max_positions(model.config) or CONTEXT
        where["inputs"] = {"context": min(facts.get("context_size") or CONTEXT, longest), **(inputs or {})}
    elif inputs:
        raise ConfigError("inputs= is a transformers source's text; a runner run reads its own data: leave it out")
    return sae, _config(sae, facts, path, where)


def load(path: str | Path, trusted: tuple[str, ...], attach: Any) -> tuple[nn.Module, DictConfig]:
    """`attached` with the options of a runner.load.Attach (its call through the `runner.folders` entry point)."""
    return attached(path, trusted=tuple(trusted), **attach.given())


def _config(sae: nn.Module, facts: dict[str, Any], path: str | Path, where: dict[str, Any]) -> DictConfig:
    # the config of a run that trained `sae` reading `where`: data that hooks the source, the splice, and what the
    # folder says
    return OmegaConf.create(
        {
            "model": sae.spec,
            "data": {"_target_": "experiments.sae.sources.hooked.LiveActivations", **where, **DATA},
            "callbacks": {"sae_splice": {"_target_": "experiments.sae.evals.splice.SpliceEval", **where}},
            "source": {k: v for k, v in where.items() if k != "trusted_targets"},
            # a folder's text is data: ${oc.env:HF_TOKEN} in its cfg.json is never resolved into what the tools write
            "imported": {
                k: literal(v) if isinstance(v, str) else v
                for k, v in {"folder": str(path), **facts}.items()
                if v is not None
            },
        }
    )
