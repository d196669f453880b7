"""The e2e tier: every test here is `slow` (subprocesses of the real CLI, torchrun, launchers, sweeps, benchmarks).

A module's runs are its `jobs(root, runs)` (see helpers.module_runs); its tests get them from the `runs` fixture."""

from __future__ import annotations

import signal
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
from helpers import JOB_TIMES, WORKERS, module_runs, run_in_background

E2E = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # each pytest-xdist worker would start every module's runs: twice the work, and the cores are full already
        raise pytest.UsageError(
            "tests/e2e runs in one process (its runs go on in the background, on every core): run `pytest -n auto "
            "tests/unit` and `pytest tests/e2e`"
        )
    # The tests press Ctrl-C on their children as a user at a terminal would (`features --serve` stops on it). A shell
    # starts its background jobs (`pytest ... &`) with SIGINT ignored and children inherit that: --serve then never
    # heard it and the test waited out its timeout. Python's own handler here gives the children the terminal's.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """This module's runs (queued when the session started, or now): name -> future of what its job returned. From
    the first e2e module on, WORKERS jobs run at once."""
    run_in_background(WORKERS)
    return module_runs(request.module, tmp_path_factory)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The slowest background jobs (wall time, WORKERS at once): where the tier's minutes go, which --durations,
    timing the tests that wait on them, does not show."""
    if JOB_TIMES:
        terminalreporter.section(f"slowest 25 of {len(JOB_TIMES)} e2e jobs ({WORKERS} at once)")
        for seconds, name in sorted(JOB_TIMES, reverse=True)[:25]:
            terminalreporter.write_line(f"{seconds:7.2f}s {name}")
        modules: Counter[str] = Counter()
        for seconds, name in JOB_TIMES:
            modules[name.partition(":")[0]] += seconds
        terminalreporter.write_line("by module: " + ", ".join(f"{m} {t:.0f}s" for m, t in modules.most_common()))
        terminalreporter.write_line(f"{sum(t for t, _ in JOB_TIMES):7.2f}s in all")
