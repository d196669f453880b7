"""runner's configs: a package so that Hydra finds them in an installed runner (pkg://runner.conf)."""
