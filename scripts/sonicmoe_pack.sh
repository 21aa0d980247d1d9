#!/usr/bin/env bash
# Pack SonicMoE and its pinned CuTe DSL stack for a GPU machine without a package index
# (benchmarks/sonicmoe_ab.py's peer), on a machine that has one.
#
# Usage: scripts/sonicmoe_pack.sh SONIC_MOE_GIT QUACK_GIT [DEST] [PYTHON_TAG]
#   SONIC_MOE_GIT, QUACK_GIT: git directories (clones or bare mirrors) of Dao-AILab/sonic-moe and Dao-AILab/quack
#   DEST: where the pack goes (default .carry, git-ignored); PYTHON_TAG: the GPU machine's CPython (default 312)
# Writes DEST/peer/{sonicmoe,quack} (sonic-moe at 8565e84, quack at 3d0ab3ec, the commit its requirements pin)
# and DEST/dsl.tar.xz: nvidia-cutlass-dsl 4.2.1 with cuda-python / cuda-bindings 12.9.2 and cuda-pathfinder 1.1.0,
# unpacked from their wheels into one folder (~51 MB: under the 64 MiB a device run carries). On the GPU machine:
#   mkdir -p /tmp/dsl && tar -xJf DEST/dsl.tar.xz -C /tmp/dsl
#   export PYTHONPATH=/tmp/dsl:/tmp/dsl/nvidia_cutlass_dsl/python_packages:$PWD/DEST/peer:$PWD
# (ahead of any newer cuda-bindings installed there: the DSL of 4.2.1 needs the 12.x bindings).
set -euo pipefail
if [ $# -lt 2 ]; then sed -n '5,7p' "$0" >&2; exit 2; fi
sonic_git=$1 quack_git=$2 dest=${3:-.carry} py=${4:-312}
SONIC_COMMIT=8565e84 QUACK_COMMIT=3d0ab3ec
WHEELS="nvidia-cutlass-dsl==4.2.1 cuda-python==12.9.2 cuda-bindings==12.9.2 cuda-pathfinder==1.1.0"

mkdir -p "$dest/peer"
git -C "$sonic_git" archive "$SONIC_COMMIT" sonicmoe | tar -x -C "$dest/peer"
git -C "$quack_git" archive "$QUACK_COMMIT" quack | tar -x -C "$dest/peer"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2086  # WHEELS is a list of requirements
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$work/wheels" $WHEELS
mkdir "$work/unpacked"
for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/unpacked"; done
tar -C "$work/unpacked" -cf - . | xz -T0 -6 > "$dest/dsl.tar.xz"
du -sh "$dest/peer" "$dest/dsl.tar.xz"
