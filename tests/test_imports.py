"""What `import megamoe` loads, checked in a fresh interpreter (this process has imported everything by now).

`import megamoe` (and megamoe.parallel, which it imports) must not load the Hugging Face adapter or
transformers: megamoe.parallel recognises patched modules through megamoe.integrations._patch_attr, not
through megamoe.integrations.hf. Importing megamoe.integrations.hf is what registers
experts_implementation="megamoe" with transformers (README, "Hugging Face models").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_import_megamoe_loads_neither_the_hf_adapter_nor_transformers():
    _run(
        "import sys\n"
        "import megamoe, megamoe.parallel\n"
        "loaded = [m for m in ('transformers', 'megamoe.integrations.hf', 'megamoe.integrations.hf_families')"
        " if m in sys.modules]\n"
        "assert not loaded, f'import megamoe loaded {loaded}'\n"
    )


def test_importing_the_hf_adapter_registers_megamoe():
    pytest.importorskip("transformers.integrations.moe", reason="transformers >= 5 (its experts interface) is not installed")
    _run(
        "import megamoe\n"
        "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
        "assert 'megamoe' not in ALL_EXPERTS_FUNCTIONS, 'registered before megamoe.integrations.hf was imported'\n"
        "import megamoe.integrations.hf as hf\n"
        "assert hf.is_registered() and ALL_EXPERTS_FUNCTIONS['megamoe'] is hf.megamoe_experts_forward\n"
        "import megamoe.parallel\n"
        "assert megamoe.parallel._HF_PATCH_ATTR == hf._PATCH_ATTR\n"
    )
