"""What the tools that write outputs meant for publishing or browsing (runner.tools.export's model card and cfg.json,
runner.tools.features' pages and Neuronpedia batches, runner.sae_eval's eval.json) quote of a run's config, and the
names they publish under.

A run folder is data, and what its outputs quote travels wherever they are uploaded, so a config's resolvers are never
resolved into them (`quoted_config`): references to the config's own keys resolve (`blocks.${source.layer}`,
`${oc.select:source.inputs,null}`: the run's own values, as it stored them), and any other resolver
(`${oc.env:HF_TOKEN}`, `${now:...}`) is quoted as the config's own text, unresolved. A hook point's name, which the
outputs use as a name (a folder, SAELens's hook_name), must be the config's own words: one that calls a resolver is
refused. The names a repository or Neuronpedia shows are never a local path (`publish_names`): the source's hub name
(`hf:gpt2` -> gpt2), else a folder's name, or what the user gives with model_name= and sae_set=."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, grammar_parser
from omegaconf.errors import GrammarParseError

from runner import ConfigError
from runner.config.confine import HUB, HUB_CACHED
from runner.config.trust import resolver_calls  # the build's own reading of OmegaConf's grammar
from runner.rundir import CONFIG, read_run_config

# Resolvers that only read the config itself: what they give is the run's own stored values
CONFIG_READERS = {"oc.select", "oc.dict.keys", "oc.dict.values"}
QUOTED = ("model", "data", "source", "imported")  # what the writers read of a config
MAX_VALUES = 10_000  # a reference repeats a subtree, so a few lines can stand for billions; a run quotes ~100
MAX_DEPTH = 64  # deeper is a cycle of references (a: {b: ${c}}, c: {d: ${a}})
NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"  # a part of a URL or a file name: no `/`, no `..`, no control character
NAMES = {"model_name": re.compile(f"{NAME}(/{NAME})?"), "sae_set": re.compile(NAME)}  # a model: a hub id, org/name


def _reads_config_only(text: str) -> bool:
    try:
        calls = list(resolver_calls(grammar_parser.parse(text, parser_rule="configValue")))
    except GrammarParseError:
        return False
    return all(name in CONFIG_READERS for name in calls)


def literal(text: str) -> str:
    """`text` escaped for OmegaConf, which then gives it back as written: `\\${` is a literal `${`, and the backslashes
    just before one are doubled to stay themselves."""
    return re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", text)


def _as_text(node: Any) -> Any:
    # the unresolved tree with each string that calls any other resolver escaped (`\${`): OmegaConf then gives its text
    if isinstance(node, dict):
        return {key: _as_text(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_as_text(value) for value in node]
    if isinstance(node, str) and "${" in node and not _reads_config_only(node):
        return literal(node)
    return node


def _value(parent: Any, key: Any, budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise ConfigError(
            f"the run's config refers to its own values in a cycle or over {MAX_VALUES:,} times: not a config runner "
            "wrote (nothing was written)"
        )
    try:
        value = parent[key]
    except Exception:  # a reference to a key that is not there, a value left ???: quoted as written
        return str(parent._get_node(key)._value())
    if isinstance(value, DictConfig):
        return None if value._is_none() else {k: _value(value, k, budget, depth + 1) for k in value.keys()}
    if isinstance(value, ListConfig):
        return None if value._is_none() else [_value(value, i, budget, depth + 1) for i in range(len(value))]
    return value


def plain(cfg: Any, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The config `cfg` (a DictConfig, or its unresolved container), or its `keys`, as plain data: references to its
    own keys resolved, every other resolver call quoted as its text."""
    tree = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    root, budget = OmegaConf.create(_as_text(tree)), [MAX_VALUES]
    return {key: _value(root, key, budget, 0) for key in (keys or list(root.keys())) if key in root}


def _names(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [] if value is None else [value]


def quoted_config(run_dir: Path, built: Any) -> dict[str, Any]:
    """What the writers quote of the run in `run_dir`: its .hydra/config.yaml (an SAE folder of SAELens or sparsify:
    `built`, the config it was attached with) as plain data (`plain`), its mappings only; a ConfigError if the hook
    point it names calls a resolver."""
    config = run_dir / CONFIG
    view = plain(read_run_config(run_dir) if config.is_file() else built, QUOTED)
    view = {key: value for key, value in view.items() if isinstance(value, dict)}
    for key in ("module", "target"):
        for name in _names((view.get("data") or {}).get(key)):
            if not isinstance(name, str) or "${" in name:
                where = config if config.is_file() else run_dir
                raise ConfigError(
                    f"data.{key} of {where} reads {name!r}: the outputs name the hook point with it, and a resolver's "
                    "value is never written into them (they may be published, and a resolver can read the "
                    f"environment): write the module's own name there, e.g. {key}: blocks.2 (nothing was written)"
                )
    return view


def checked_name(key: str, value: Any) -> str:
    """`value` of the option `key` (model_name, sae_set) if it is safe as a part of a URL or file name."""
    if not isinstance(value, str) or not NAMES[key].fullmatch(value):
        form = "one name or a hub id (org/name)" if key == "model_name" else "one name"
        example = "model_name=gpt2" if key == "model_name" else "sae_set=res-k32"
        raise ConfigError(
            f"{key}={value!r}: give {form} of letters, digits, '.', '_' and '-' (at most 96 each, starting with a "
            f"letter or digit), e.g. {example}: it becomes part of Neuronpedia's URLs and of the published files "
            "(nothing was written)"
        )
    return value


def _folder_name(path: str) -> str:
    # a folder's own name, never the path to it: Hydra's outputs/DATE/TIME gives DATE_TIME (the time alone is many
    # runs'); "" where that name is not the config's plain words
    folder = Path(os.path.abspath(path))
    if folder.suffix == ".safetensors":  # a run's weights file: the run
        folder = folder.parent
    name = folder.name
    if re.fullmatch(r"\d\d-\d\d-\d\d(-\d+)?", name) and re.fullmatch(r"\d{4}-\d\d-\d\d", folder.parent.name):
        name = f"{folder.parent.name}_{name}"
    if "${" in name:
        return ""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:96]


def publish_names(
    view: dict[str, Any],
    run_dir: Path,
    model_name: str | None = None,
    sae_set: str | None = None,
    used: tuple[str, ...] = ("model_name", "sae_set"),
) -> tuple[dict[str, str | None], str]:
    """The names the outputs of the run in `run_dir` (its quoted config `view`) are published under, {model_name,
    sae_set}, as given or by default (model_name None where the run read no model), and a line that says which of
    those the outputs use (`used`) were chosen by default and how to give others ("" when none was)."""
    checkpoint = (view.get("data") or {}).get("checkpoint")
    if model_name is not None and checkpoint is None:
        raise ConfigError(
            f"model_name={model_name}: this run read activations from a file or a generator, not a model: there is no "
            "model to name; leave model_name= out"
        )
    given = (("model_name", model_name), ("sae_set", sae_set))
    names = {key: None if value is None else checked_name(key, value) for key, value in given}
    said = []
    run = _folder_name(str(run_dir)) or "sae"
    if names["sae_set"] is None:
        names["sae_set"] = run
        said.append(f"sae_set={run} (the SAE's folder name)")
    if names["model_name"] is None and checkpoint is not None:
        text, how = str(checkpoint), "the source's folder name"
        hub = text.split(":", 1)[1] if text.startswith((HUB, HUB_CACHED)) else None
        if hub is not None and NAMES["model_name"].fullmatch(hub):
            names["model_name"], how = hub, "the source's hub name"
        else:
            names["model_name"] = _folder_name(text) if hub is None else ""
        if not names["model_name"] and "model_name" in used:  # another folder's name would misname the model
            raise ConfigError(
                f"the run's source model is {text!r} in its config, which names no model in plain words: give its "
                "name, model_name=NAME (e.g. model_name=gpt2; nothing was written)"
            )
        if names["model_name"]:
            said.insert(0, f"model_name={names['model_name']} ({how})")
        else:
            names["model_name"] = None
    said = [line for line in said if line.split("=")[0] in used]
    options = " ".join(f"{s.split('=')[0]}=NAME" for s in said)
    return names, (f"publishing as {' and '.join(said)}; give {options} to choose others" if said else "")
