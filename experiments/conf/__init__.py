"""The digits task's config options (experiments/digits.py is one module, so its groups sit at the experiments
package's root): model/mlp, model/digits_mlp, data/digits, experiment/digits, hparams_search/digits_optuna. A package
so that Hydra reads them from an installed runner too (pkg://experiments.conf); hydra_plugins/runner_launchers/
search_path.py puts them on the search path beside runner/conf's groups."""
