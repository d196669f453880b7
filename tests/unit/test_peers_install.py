"""benchmarks/peers/install.sh: quiet (a line per peer, pip's output in a log, no progress bar) and resumable (a peer
whose virtualenv finished is skipped; an interrupted one is completed), run against a stand-in python whose
virtualenvs hold a pip that records its arguments and fails where told."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from helpers import ROOT

STUB = """#!/bin/sh
# "python -m venv DIR": DIR/bin/pip records its arguments in $PIP_LOG, fails on a package named in $FAIL_ON
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
cat >"$3/bin/pip" <<'PIP'
#!/bin/sh
echo "$*" >>"$PIP_LOG"
echo "Collecting packages ... downloading"
case "$*" in *"$FAIL_ON"*) echo "ERROR: no such version"; exit 1;; esac
PIP
chmod +x "$3/bin/pip"
"""


def _install(tmp_path: Path, fail_on: str = "no-such-package") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(tmp_path / "python"), "PEERS_DIR": str(tmp_path), "FAIL_ON": fail_on}
    env["PIP_LOG"] = str(tmp_path / "pip.log")
    script = ROOT / "benchmarks" / "peers" / "install.sh"
    return subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_the_peers_install_is_quiet_and_goes_on_where_it_stopped(tmp_path: Path) -> None:
    (tmp_path / "python").write_text(STUB)
    (tmp_path / "python").chmod(0o755)
    failed = _install(tmp_path, fail_on="sae-lens")
    assert failed.returncode == 1
    assert failed.stdout.splitlines() == [
        f"sparsify: installing torch==2.13.0 eai-sparsify==1.3.3 (log: {tmp_path}/.venv-sparsify/install.log)",
        f"saelens: installing torch==2.13.0 sae-lens==6.54.12 (log: {tmp_path}/.venv-saelens/install.log)",
    ]  # pip's own lines are in the logs, not on the console
    assert "ERROR: no such version" in failed.stderr and "run this script again to go on" in failed.stderr
    calls = (tmp_path / "pip.log").read_text().splitlines()
    assert all("--progress-bar off" in call for call in calls) and len(calls) == 4  # torch first, then the peer
    (tmp_path / "pip.log").unlink()
    again = _install(tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[0] == "sparsify: already installed (torch==2.13.0 eai-sparsify==1.3.3)"
    calls = (tmp_path / "pip.log").read_text().splitlines()
    # the finished peer is left alone: saelens and circuit-tracer, torch first for each
    assert len(calls) == 4 and all("sparsify" not in call for call in calls)
    assert (tmp_path / ".venv-saelens" / "installed").read_text().strip() == "torch==2.13.0 sae-lens==6.54.12"
