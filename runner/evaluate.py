"""`python -m runner.evaluate`: the tool is runner.tools.evaluate (this module keeps the documented command)."""

from __future__ import annotations

import sys

from runner.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
