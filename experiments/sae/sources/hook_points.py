"""Which modules a source model hooks (source.module, and a transcoder's source.target), checked from their names
alone before the model loads, and the order a forward must run them in."""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from runner import ConfigError
from runner.load import TRUSTED_TARGETS


def nearest_modules(name: str, modules: Sequence[str], most: int = 6) -> str:
    """`modules` as a refusal names them: all of a few, else the `most` nearest to the `name` given, closest first, and
    how many there are (a model's whole list runs to thousands of characters)."""
    named = [module for module in modules if module]
    if not named:
        return "it has none but itself"
    if len(named) <= most:
        return "it has " + ", ".join(named)
    nearest = difflib.get_close_matches(name, named, n=most, cutoff=0.0)
    return f"the nearest of its {len(named)} are " + ", ".join(nearest)


def hook_points(module: str | Sequence[str] | None) -> list[str]:
    """The hooked modules' names: one (`source.module=blocks.2`) or several (`source.module=[blocks.1,blocks.3]`)."""
    if module is None:
        raise ConfigError(
            "source.module is not set: name the module whose output the SAE reads, e.g. source.module=transformer.h.8 "
            "(GPT-2), model.layers.6 (Llama, Gemma, Qwen), gpt_neox.layers.3 (Pythia), blocks.2 (runner's GPT)"
        )
    names = [module] if isinstance(module, str) else [str(name) for name in module]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"source.module={names}: name one module, or several different ones")
    return names


def targets_of(target: str | Sequence[str], names: list[str]) -> list[str]:
    """The target modules of the hooked `names`: one (a transcoder's), or one per name (a cross-layer transcoder's)."""
    if not isinstance(target, str):
        targets = hook_points(target)
        if len(targets) == 1 == len(names):
            raise ConfigError(
                f"source.target={targets}: lists are a cross-layer transcoder's, of two or more layers; one "
                f"layer's transcoder names one module: source.module={names[0]} source.target={targets[0]} "
                "(+experiment=transcoder_lm)"
            )
        if both := [name for name in targets if name in names]:
            raise ConfigError(
                f"{', '.join(both)}: in both source.module and source.target; a layer's input (source.module) "
                "and its output (source.target) are different modules, e.g. blocks.2.mlp_norm and blocks.2.mlp"
            )
        if len(targets) != len(names):
            raise ConfigError(
                f"source.module={names} with source.target={targets}: a cross-layer transcoder reads each "
                "layer's MLP input and writes its output: give as many targets as modules, each layer's input "
                "in source.module and its output in source.target, in the order the model runs them"
            )
        return targets
    if not target:
        raise ConfigError(f"source.target={target}: name one module, whose output the transcoder predicts")
    if len(names) > 1:
        raise ConfigError(
            f"source.module={names} with source.target={target}: a transcoder reads one module for now; "
            "give one source.module (or leave source.target out for a family of SAEs, model=sae_multi)"
        )
    if target == names[0]:
        raise ConfigError(
            f"source.target={target} is source.module itself: a transcoder predicts another module's output "
            f"(e.g. source.module=blocks.2.mlp_norm source.target=blocks.2.mlp); an SAE has no source.target "
            "(source.target=null)"
        )
    return [target]


def check_order(names: list[str], targets: list[str], ran: list[str]) -> None:
    """A ConfigError unless the hooked modules that `ran` so far came in the order a splice needs."""
    # A transcoder's input must run before its target, and a cross-layer one's layers in the model's order: the
    # splice writes each target from inputs captured earlier in the same forward.
    if not targets:
        return
    inputs = names[: len(targets)]
    expected = [name for pair in zip(inputs, targets, strict=True) for name in pair]
    if ran != expected[: len(ran)]:
        raise ConfigError(
            f"source.module={inputs} and source.target={targets}: the model runs them as {ran}, not as "
            f"{expected[: len(ran)]}: name each layer's input (source.module) and output (source.target) in the "
            "order the model runs them, each input before its output and the layers first to last"
        )


def source_key(
    checkpoint: str,
    module: str | Sequence[str],
    trusted_targets: Sequence[str] = TRUSTED_TARGETS,
    skip_positions: int = 0,
    inputs: dict[str, Any] | None = None,
    target: str | Sequence[str] | None = None,
    shard: str | None = None,
) -> str:
    """What makes two SourceModels the same model hooked the same way: their arguments, as one comparable string."""
    plain = [str(checkpoint), hook_points(module), list(trusted_targets), skip_positions, inputs, target, shard]
    return json.dumps(plain, sort_keys=True, default=lambda value: OmegaConf.to_container(value) or str(value))
