"""megamoe.get_workspace / clear_workspaces: the public entry points of the EP workspace (CPU checks)."""

import inspect

import pytest

import megamoe

pytest.importorskip("triton")

SIZES = dict(num_tokens=4, hidden_size=8, top_k=2, num_rows=16)


@pytest.mark.parametrize("name, value", [("num_tokens", 0), ("hidden_size", -8), ("top_k", 1.5), ("num_rows", True)])
def test_bad_sizes_name_the_argument(name, value):
    sizes = dict(SIZES)
    sizes[name] = value
    with pytest.raises(ValueError, match=name):
        megamoe.get_workspace(None, device="cuda", **sizes)


def test_symmetric_memory_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        megamoe.get_workspace(None, device="cpu", **SIZES)


def test_argument_names_match_the_rest_of_the_api():
    """top_k (as MoELayer, build_schedule's Schedule) and comm_timeout_ms (as MoEConfig)."""
    params = inspect.signature(megamoe.get_workspace).parameters
    assert "top_k" in params and "comm_timeout_ms" in params
    assert "topk" not in params and "timeout_ms" not in params


def test_clear_and_unknown_attribute():
    megamoe.clear_workspaces()
    with pytest.raises(AttributeError, match="no_such_thing"):
        megamoe.no_such_thing  # noqa: B018
