#!/usr/bin/env bash
# The kernels' ahead-of-time compile tests (sm_90a and sm_100a, no GPU needed) against the other Triton releases
# the project tracks, each in a virtual environment of its own (.venv-triton-X.Y.Z): 3.7.1 (what torch 2.12 and 2.13
# install) and 3.8.0 (torch 2.14's), what users of those torch releases run, and 3.9.0, the newest, so that an API
# change between releases (Triton 3.8 renamed the Gluon copies, 3.9 removed the old names) shows up here before a
# user's upgrade meets it.
# The main suite (scripts/test.sh) runs the pinned Triton. Needs the package index. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
for version in 3.7.1 3.8.0 3.9.0; do
    venv=".venv-triton-${version}"
    if [ ! -x "${venv}/bin/python" ]; then
        python3 -m venv "${venv}"
    fi
    "${venv}/bin/python" -m pip install -q "torch==2.13.0" "numpy<2.4" pytest pytest-timeout
    # Then the Triton under test on its own: torch's Linux wheels on PyPI pin the one they were built with (2.13.0:
    # triton==3.7.1), so asked for in one command with torch, 3.8.0 and 3.9.0 cannot resolve. Triton needs nothing else.
    "${venv}/bin/python" -m pip install -q --no-deps "triton==${version}"
    echo "compile tests under Triton ${version}"
    PYTHONPATH="$PWD" "${venv}/bin/python" -m pytest -q tests/test_triton_compile.py tests/test_gluon_*_compile.py "$@"
done
