"""runner: a Hydra-configured PyTorch experiment runner."""


class ConfigError(ValueError):
    """A configuration the run cannot start with; the CLI prints the message without a traceback and exits 2."""
