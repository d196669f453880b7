"""The SAE workbench's old dotted names, read as the new ones: a run folder written before a module or class moved
names it by the old one, and still loads as the same model; a class whose options changed shape is read as the class
and options that build the same thing now (UPGRADED). runner reads these tables through the `runner.renamed` and
`runner.upgraded` entry point groups (pyproject.toml), never by importing the workbench."""

from __future__ import annotations

RENAMED = {
    "experiments.sae.base": "experiments.sae.coders.base",
    "experiments.sae.model": "experiments.sae.coders.activations",
    "experiments.sae.jumprelu": "experiments.sae.coders.jumprelu",
    "experiments.sae.matryoshka": "experiments.sae.coders.matryoshka",
    "experiments.sae.multi": "experiments.sae.coders.multi",
    "experiments.sae.clt": "experiments.sae.coders.clt",
    "experiments.sae.hooked": "experiments.sae.sources.hooked",
    "experiments.sae.files": "experiments.sae.sources.files",
    "experiments.sae.data": "experiments.sae.sources.synthetic",
    "experiments.sae.hooked.SpliceEval": "experiments.sae.evals.splice.SpliceEval",
    "experiments.sae.sources.hooked.SpliceEval": "experiments.sae.evals.splice.SpliceEval",
}

_HOOKED = "experiments.sae.sources.hooked."
_CACHE_KEYS = ("cache", "cache_rows", "cache_dtype", "cache_shard_rows")
_RING_KEYS = ("buffer_size", "samples_per_epoch", "shard")


def hooked_data(node: dict) -> dict:
    """A HookedData node, whose flags chose one of three pipelines, as the data option they chose: `tokens` true is
    SourceWindows; a `cache` folder, CachedActivations (its `cache_rows` were `samples_per_epoch` when unset);
    neither, LiveActivations. The options the chosen class does not take go (they were refused or unused beside it)."""
    node = dict(node)
    tokens, cache = node.pop("tokens", False), node.get("cache")
    if tokens is True:
        drop, name = (*_CACHE_KEYS, *_RING_KEYS), "SourceWindows"
    elif cache is not None:
        if node.get("cache_rows") is None and "samples_per_epoch" in node:
            node["cache_rows"] = node["samples_per_epoch"]
        drop, name = _RING_KEYS, "CachedActivations"
    else:
        drop, name = _CACHE_KEYS, "LiveActivations"
    return {**{k: v for k, v in node.items() if k not in drop}, "_target_": _HOOKED + name}


UPGRADED = {_HOOKED + "HookedData": hooked_data}

# Command-line keys of the SAE presets that became something else, and how to say them now
OPTIONS = {
    "source.cache": (
        "activations written once to a folder are a data option of their own: data=activations_lm_cached "
        "data.cache=DIR under +experiment=sae_lm, sae_hf or transcoder_lm; data=activations_cached data.cache=DIR "
        "under +experiment=sae_digits"
    ),
}
