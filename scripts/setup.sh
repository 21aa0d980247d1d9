# Sourced by scripts/bench.sh and scripts/test.sh: a virtual environment with megamoe and its test tools.
# Reuses a torch that is already installed (GPU machines); otherwise installs torch 2.13.0: a CPU build where pip
# finds one (a local wheel, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), else PyPI's CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv --system-site-packages .venv
fi
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# megamoe (editable) and the test extra, again only when pyproject.toml changed: a set-up machine runs the
# scripts offline (pip's isolated build would fetch setuptools from the index on every call).
stamp=.venv/megamoe-pyproject.sha256
if ! sha256sum --status -c "$stamp" 2>/dev/null; then
    python -m pip install -q -e ".[test]"
    sha256sum pyproject.toml > "$stamp"
fi
