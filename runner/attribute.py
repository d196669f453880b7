"""`python -m runner.attribute`: attribution graphs of the SAE workbench (experiments/sae/circuits/cli.py),
registered as the `attribute` tool of the `runner.tools` entry point group, so that the framework keeps the command
without importing the task."""

from __future__ import annotations

import sys

from runner.tools.cli import run_task_tool


def main(argv: list[str] | None = None) -> int:
    """The registered tool's command; exit 2 with one line if no installed package registers it."""
    return run_task_tool("attribute", argv)


if __name__ == "__main__":
    sys.exit(main())
