"""The SAE workbench's config options: code types and presets (model/sae_*, clt, spliced), its data, callbacks and
experiments (sae, sae_lm, transcoder_lm, clt_lm...). A package so that Hydra reads them from an installed runner too
(pkg://experiments.sae.conf); hydra_plugins/runner_launchers/search_path.py puts them on the search path beside
runner/conf's groups."""
