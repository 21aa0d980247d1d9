"""What `import megamoe` loads, checked in a fresh interpreter (this process has imported everything by now).

`import megamoe` (and megamoe.parallel, which it imports) must not load the Hugging Face adapter or
transformers: megamoe.parallel recognises patched modules through megamoe.integrations._patch_attr, not
through megamoe.integrations.hf. Importing megamoe.integrations.hf is what registers
experts_implementation="megamoe" with transformers (README, "Hugging Face models"). Also, on the source: each
module imports only the layers docs/design.md ("Layers of the code") puts at or above its own.
"""

from __future__ import annotations

import ast
import re
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


def _design_layers() -> dict[str, int]:
    """{module path under megamoe/ (a file, or a folder ending in /): its row} of docs/design.md's table of layers."""
    design = (REPO / "docs" / "design.md").read_text()
    table = design.split("| layer | modules | imports from megamoe |", 1)[1].split("\n\n", 1)[0]
    layers = {}
    for row, line in enumerate(table.strip().splitlines()[1:]):  # below the |---| line
        modules = line.split("|")[2]
        for path in re.findall(r"`([\w/]+(?:\.py|/))`", modules):
            if (REPO / "megamoe" / path).exists():
                layers[path] = row
    return layers


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(megamoe module, imported at call time) for each import of a megamoe module in the file at path."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text())
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_functions = {id(node) for function in functions for node in ast.walk(function)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(name, id(node) in in_functions) for name in names if name.startswith("megamoe")]
    return found


def test_each_layer_imports_only_the_layers_above_it():
    """docs/design.md, "Layers of the code": each module imports only modules of its own row or the rows above, but for
    the two imports it names, made inside a call (megamoe.experts' of parallel.check_active_ddp_leaves_experts_alone
    and megamoe.reference.experts' of megamoe.experts under autocast)."""
    layers = _design_layers()
    assert {"config.py", "schedule.py", "autograd.py", "layer.py", "parallel.py", "bench/"} <= set(layers), layers

    def row(module: str) -> int | None:
        path = module.removeprefix("megamoe.").replace(".", "/")
        rows = [r for name, r in layers.items() if f"{path}.py" == name or f"{path}/".startswith(name)]
        return rows[0] if rows else None

    at_call_time = {("autograd", "parallel"), ("reference", "autograd")}
    upward = []
    for path in sorted((REPO / "megamoe").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for imported, in_a_call in _imports(path):
            imported = next((m for m in (imported, imported.rsplit(".", 1)[0]) if row(m) is not None), imported)
            source, target = row(module), row(imported)
            if source is None or target is None or target <= source:
                continue
            pair = (module.removeprefix("megamoe."), imported.removeprefix("megamoe."))
            if not (in_a_call and pair in at_call_time):
                upward.append(pair)
    assert upward == []
