"""The e2e tier: every test here is `slow` (subprocesses of the real CLI, torchrun, launchers, sweeps, benchmarks)."""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.slow)
