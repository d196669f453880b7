#!/bin/sh
# The peers of benchmarks/sae_peers.py, each in a virtualenv of its own at the repository root (their dependencies
# would otherwise pin ours): .venv-sparsify (EleutherAI sparsify), .venv-saelens (SAELens) and .venv-circuit-tracer
# (circuit-tracer, whose loaders tests/e2e/test_circuit_tracer_load.py runs on runner's exported folders). torch
# comes first, as for runner, so that pip takes the local CPU wheel rather than a CUDA build. The versions are the ones measured.
#
# Quiet: one line per peer; pip's output goes to .venv-PEER/install.log (its tail is printed if pip fails), with no
# progress bar (on a busy machine pip's bar thread failed: "can't start new thread"). Resumable: a peer whose
# virtualenv finished with these versions is skipped (.venv-PEER/installed names them); one that was interrupted is
# completed, pip keeping what it had installed and its cache what it had downloaded.
# PYTHON: the interpreter that makes the virtualenvs (python3); PEERS_DIR: where they go (the repository root).
set -e
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
dir=${PEERS_DIR:-.}
for pair in sparsify:eai-sparsify==1.3.3 saelens:sae-lens==6.54.12 circuit-tracer:circuit-tracer==0.5.0; do
    name=${pair%%:*} spec="torch==2.13.0 ${pair#*:}"
    venv="$dir/.venv-$name"
    if [ "$(cat "$venv/installed" 2>/dev/null)" = "$spec" ]; then
        echo "$name: already installed ($spec)"
        continue
    fi
    echo "$name: installing $spec (log: $venv/install.log)"
    [ -x "$venv/bin/pip" ] || "$PYTHON" -m venv "$venv"
    pip="$venv/bin/pip install --progress-bar off --disable-pip-version-check -q"
    # torch alone first: the local CPU wheel, before the peer's requirements could pull a CUDA build
    if ! { $pip torch==2.13.0 && $pip "${pair#*:}"; } >"$venv/install.log" 2>&1; then
        tail -n 20 "$venv/install.log" >&2
        echo "$name: pip failed (above; all of it in $venv/install.log); run this script again to go on" >&2
        exit 1
    fi
    echo "$spec" >"$venv/installed"
done
echo "made .venv-sparsify, .venv-saelens and .venv-circuit-tracer"
