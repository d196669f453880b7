#!/bin/sh
# The peers (and runner's own missing packages) on a machine with no internet, such as a lent GPU machine:
#
#   sh benchmarks/peers/offline.sh download DIR HAVE   # here, with internet and install.sh's virtualenvs
#   sh benchmarks/peers/offline.sh install DIR         # there, from the repository root, with DIR carried along
#
# download: wheels for that machine's Python (PY, default 3.12; x86-64 Linux) of hydra-core, omegaconf, antlr4 and
# torchdata into DIR/base, and of each peer's packages (its virtualenv's `pip freeze`) into DIR/sparsify and
# DIR/saelens, leaving out torch and the names in the file HAVE (what that machine already has: one name a line).
# install: DIR/base into that machine's python3; each peer into /tmp/PEER-site, with .venv-PEER/bin/python a script
# that runs python3 with that folder first on its path, where benchmarks/sae_peers.py and gpu_check.py look for it.
# Used on an NVIDIA H200 (Python 3.12, torch 2.11) on 2026-11-26: 45 MB of wheels, sparsify and SAELens both ran.
set -e
cd "$(dirname "$0")/../.."
what=$1 dir=$2
case $what in
download)
    have=$3
    [ -f "$have" ] || { echo "give the file of package names the other machine has (one a line)" >&2; exit 2; }
    tags="--only-binary=:all: --python-version ${PY:-3.12} --implementation cp"
    for m in 28 27 17; do tags="$tags --platform manylinux_2_${m}_x86_64"; done
    tags="$tags --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
    fetch() {  # a wheel for that machine, else one built here from the sdist (pure-Python packages)
        python3 -m pip download -q --no-deps $tags -d "$1" "$2" 2>/dev/null ||
            python3 -m pip wheel -q --no-deps -w "$1" "$2"
    }
    mkdir -p "$dir/base"
    for p in hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 torchdata==0.11.0; do
        fetch "$dir/base" "$p"
    done
    normal() { tr 'A-Z_.' 'a-z--'; }
    normal <"$have" | sort -u >"$dir/have.txt"
    for peer in sparsify saelens; do
        mkdir -p "$dir/$peer"
        ".venv-$peer/bin/python" -m pip freeze | grep '==' | while IFS= read -r line; do
            name=$(echo "${line%%==*}" | normal)
            [ "$name" = torch ] || grep -qx "$name" "$dir/have.txt" || fetch "$dir/$peer" "$line"
        done
    done
    du -sh "$dir"
    ;;
install)
    py=$(command -v python3)
    quiet="-q --no-index --no-deps --no-compile --no-cache-dir"
    "$py" -m pip install $quiet "$dir"/base/*.whl
    for peer in sparsify saelens; do
        "$py" -m pip install $quiet --target "/tmp/$peer-site" "$dir/$peer"/*.whl
        mkdir -p ".venv-$peer/bin"
        printf '#!/bin/sh\nPYTHONPATH=/tmp/%s-site${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$peer" "$py" \
            >".venv-$peer/bin/python"
        chmod +x ".venv-$peer/bin/python"
    done
    ;;
*)
    echo "usage: sh benchmarks/peers/offline.sh download DIR HAVE | install DIR" >&2
    exit 2
    ;;
esac
