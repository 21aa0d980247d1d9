#!/usr/bin/env bash
# The kernels' ahead-of-time compile tests (sm_90a and sm_100a, no GPU needed) against the newest Triton the
# project tracks, in a virtual environment of its own (.venv-triton-next), so that an API change between
# Triton releases (Triton 3.8 renamed the Gluon copies, 3.9 removed the old names) shows up here before a
# user's upgrade meets it. The main suite (scripts/test.sh) runs the pinned Triton. Needs the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_NEXT=3.9.0
if [ ! -x .venv-triton-next/bin/python ]; then
    python3 -m venv .venv-triton-next
fi
.venv-triton-next/bin/python -m pip install -q "torch==2.13.0" "triton==${TRITON_NEXT}" "numpy<2.4" pytest pytest-timeout
PYTHONPATH="$PWD" exec .venv-triton-next/bin/python -m pytest -q tests/test_triton_compile.py tests/test_gluon_*_compile.py "$@"
