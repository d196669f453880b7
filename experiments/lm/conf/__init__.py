"""The lm task's config options (model/gpt, data/text_bytes, experiment/lm, callbacks/perplexity...). A package so that
Hydra reads them from an installed runner too (pkg://experiments.lm.conf); hydra_plugins/runner_launchers/
search_path.py puts them on the search path beside runner/conf's groups."""
