"""`python -m runner.report`: the tool is runner.tools.report (this module keeps the documented command)."""

from __future__ import annotations

import sys

from runner.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
