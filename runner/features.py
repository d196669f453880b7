"""`python -m runner.features`: the tool is runner.tools.features (this module keeps the documented command)."""

from __future__ import annotations

import sys

from runner.tools.features import main

if __name__ == "__main__":
    sys.exit(main())
