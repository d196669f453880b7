#!/bin/sh
# The peers of benchmarks/sae_peers.py, each in a virtualenv of its own at the repository root (their dependencies
# would otherwise pin ours): .venv-sparsify (EleutherAI sparsify) and .venv-saelens (SAELens). torch comes first, as
# for runner, so that pip takes the local CPU wheel rather than a CUDA build. The versions are the ones measured.
set -e
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
for pair in sparsify:eai-sparsify==1.3.3 saelens:sae-lens==6.54.12; do
    name=${pair%%:*}
    "$PYTHON" -m venv ".venv-$name"
    ".venv-$name/bin/pip" install -q torch==2.13.0
    ".venv-$name/bin/pip" install -q "${pair#*:}"
done
echo "made .venv-sparsify and .venv-saelens"
