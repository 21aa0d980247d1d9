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


def test_a_triton_too_old_for_the_kernels_leaves_the_torch_backend_and_says_why():
    """With a Triton older than the Gluon API the kernels use (3.5's Gluon lacks SharedLinearLayout, so the
    kernel modules fail while imported), `import megamoe` still works, "auto" has the torch backend, and
    backend="triton" is a ValueError naming the versions (here a 3.6 install reporting "3.5.1")."""
    pytest.importorskip("triton")
    _run(
        "import triton\n"
        "triton.__version__ = '3.5.1'\n"
        "import torch, megamoe\n"
        "assert sorted(megamoe.autograd.BACKENDS) == ['torch'], megamoe.autograd.BACKENDS\n"
        "x = torch.randn(4, 8)\n"
        "w_gu, w_d = torch.randn(2, 6, 8), torch.randn(2, 8, 3)\n"
        "ids, w = torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1)\n"
        "assert megamoe.experts(x, ids, w, w_gu, w_d).shape == (4, 8)\n"
        "try:\n"
        "    megamoe.experts(x, ids, w, w_gu, w_d, config=megamoe.MoEConfig(backend='triton'))\n"
        "except ValueError as e:\n"
        "    assert 'triton >= 3.6' in str(e) and '3.5.1' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('backend=triton ran on a Triton reported as 3.5.1')\n"
    )
