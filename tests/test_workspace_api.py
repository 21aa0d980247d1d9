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


def test_workspace_bytes_counts_this_groups_buffers(monkeypatch):
    """The bench reports the EP workspace apart from the allocator's peak: the sum of this rank's buffers of
    the group's cached workspaces (none cached, or no group: 0)."""
    import dataclasses
    import types

    import torch

    from megamoe.backends.triton.comm import workspace as ws_module

    def buffer(*shape, dtype=torch.bfloat16):
        return ws_module._Buffer(torch.empty(*shape, dtype=dtype), handle=None, peer_ptrs=torch.empty(0))

    fields = dict(rank=0, world_size=2, comm_timeout_ms=1000, tokens=buffer(4, 8), weights=buffer(4, 2, dtype=torch.float32),
                  ids=buffer(4, 2, dtype=torch.int32), pairs=buffer(8, 8), rows_in=buffer(16, 8), rows_out=buffer(16, 8))
    mine = ws_module.Workspace(group_name="g0", **fields)
    other = dataclasses.replace(mine, group_name="g1")
    monkeypatch.setattr(ws_module, "_WORKSPACES", {("g0",): mine, ("g1",): other})
    want = 2 * (4 * 8 + 8 * 8 + 16 * 8 + 16 * 8) + 4 * (4 * 2) + 4 * (4 * 2)
    assert mine.nbytes == want
    assert ws_module.workspace_bytes(types.SimpleNamespace(group_name="g0")) == want
    assert ws_module.workspace_bytes(None) == 0
    assert ws_module.workspace_bytes(types.SimpleNamespace(group_name="g2")) == 0
