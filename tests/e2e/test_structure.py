"""Every project module imports on its own, first, in a fresh process (a subprocess: the unit tier's
tests/unit/test_structure.py checks the rest of the code's shape in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, project_modules

MODULES = project_modules()

# Run by a fresh interpreter with torch and Hydra only: each module is imported first in a forked child of it, where no
# project module is loaded yet, so an import-order dependency (a cycle hidden by who imported first) fails. Forking
# the test worker itself, with everything the tier has loaded, took three times as long.
_FORK_EACH = """
import importlib, json, os, sys
import hydra, torch  # the heavy third-party packages, imported once
failures = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        for loaded in [m for m in sys.modules if m.split(".")[0] in ("runner", "experiments", "hydra_plugins")]:
            del sys.modules[loaded]
        try:
            importlib.import_module(module)
            code, message = 0, b""
        except BaseException as error:
            code, message = 1, f"{type(error).__name__}: {error}".encode()
        os.write(write, message)
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failures[module] = message
print(json.dumps(failures))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_every_module_imports_alone_in_a_fresh_process(tmp_path: Path) -> None:
    # and a module that fails alone is reported, with its error: the check can fail
    (tmp_path / "fails_alone.py").write_text("raise ImportError('needs runner.build imported first')\n")
    done = subprocess.run(
        [sys.executable, "-c", _FORK_EACH, *MODULES, "fails_alone"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert failures == {"fails_alone": "ImportError: needs runner.build imported first"}
