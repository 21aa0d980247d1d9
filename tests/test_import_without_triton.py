"""`import megamoe` without Triton (a CPU-only or macOS install): the package's public names, star import
included, must not fail on the EP workspace API, which needs the Triton backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_star_import_and_hasattr_without_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if Triton were not installed\n"
        "import megamoe\n"
        "assert 'triton' not in megamoe.autograd.BACKENDS\n"
        "namespace = {}\n"
        "exec('from megamoe import *', namespace)\n"
        "assert 'experts' in namespace and 'MoELayer' in namespace\n"
        "assert not hasattr(megamoe, 'get_workspace') and not hasattr(megamoe, 'clear_workspaces')\n"
        "try:\n"
        "    megamoe.get_workspace\n"
        "except AttributeError as e:\n"
        "    assert 'get_workspace' in str(e) and 'Triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('megamoe.get_workspace resolved without Triton')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
