"""megamoe.get_workspace / clear_workspaces: the public entry points of the EP workspace (CPU checks)."""

import pytest

import megamoe

pytest.importorskip("triton")


@pytest.mark.parametrize("name, value", [("num_tokens", 0), ("hidden_size", -8), ("topk", 1.5), ("num_rows", True)])
def test_bad_sizes_name_the_argument(name, value):
    sizes = dict(num_tokens=4, hidden_size=8, topk=2, num_rows=16)
    sizes[name] = value
    with pytest.raises(ValueError, match=name):
        megamoe.get_workspace(None, device="cuda", **sizes)


def test_symmetric_memory_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        megamoe.get_workspace(None, device="cpu", num_tokens=4, hidden_size=8, topk=2, num_rows=16)


def test_clear_and_unknown_attribute():
    megamoe.clear_workspaces()
    with pytest.raises(AttributeError, match="no_such_thing"):
        megamoe.no_such_thing  # noqa: B018
