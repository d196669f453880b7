"""`python -m runner.generate`: the tool is runner.tools.generate (this module keeps the documented command)."""

from __future__ import annotations

import sys

from runner.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
