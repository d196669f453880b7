"""runner: a Hydra-configured PyTorch experiment runner."""

import gc
import importlib.util
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# When the package was first imported: `python -m runner` imports it first, so the command's imports are timed from
# here (runner.timeline). The process's own start is no measure: a shell that runs it last execs it in its own process.
IMPORTED_AT = time.perf_counter()

# Every `python -m runner.<tool>` (generate, features, evaluate, export, sae_eval, ...) gets `python -m runner`'s
# OpenMP wait policy, chosen from the machine's load (runner/waits.py): on a busy machine runner.tools.generate ran at 4
# tokens/s with spinning threads, ~200 with sleeping ones. Chosen here because the package is imported before the
# tool, and so before torch; sys.argv[0] is "-m" only while `-m` looks for its module, so a library import (a
# notebook's `import runner`) changes nothing. A user's own value wins.
if sys.argv[:1] == ["-m"] and "torch" not in sys.modules:
    from runner import waits

    waits.choose()


class ConfigError(ValueError):
    """A configuration the run cannot start with; the CLI prints the message without a traceback and exits 2."""


def check_whole(value: Any, name: str) -> int:
    """`value` if it is a whole number >= 1 (not a bool), else a ConfigError naming the setting."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def require(module: str, extra: str, option: str) -> None:
    """A ConfigError naming the pip command when `option` needs the optional package `module` (runner[`extra`])."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{option} needs the {module} package: pip install 'runner[{extra}]'")


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, back as it was after: for startup work that makes many objects
    which live as long as the process (importing torch, building a run), where each collection walks them all again
    and frees nothing. benchmarks/startup.py: a quarter of a run's start, most of it in torch._dynamo's import."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
