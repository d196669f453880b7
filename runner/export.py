"""`python -m runner.export`: the tool is runner.tools.export (this module keeps the documented command)."""

from __future__ import annotations

import sys

from runner.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
