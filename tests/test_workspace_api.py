"""megamoe.get_workspace / clear_workspaces: the public entry points of the EP workspace, and its sizing and
caching (CPU checks)."""

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


@pytest.mark.parametrize("dtype", ["bf16", "torch.bfloat16", "float64"])
def test_bad_dtype_names_the_argument(dtype):
    """dtype is part of the cache key and the buffers' dtype: a string (or float64, which the fused path never
    runs) is a TypeError naming it, not an error from inside torch's allocation."""
    import torch

    bad = getattr(torch, dtype) if dtype == "float64" else dtype
    with pytest.raises(TypeError, match=r"dtype must be one of .*got " + ("torch.float64" if dtype == "float64" else f"'{dtype}'")):
        megamoe.get_workspace(None, device="cuda", dtype=bad, **SIZES)


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


# ----------------------------------------------------------------------------------------------------
# One workspace per (group, device, hidden size, dtype), sized for the largest shapes asked for: the sizing
# and caching logic, with CPU tensors standing in for symmetric memory (the real one needs GPUs).


@pytest.fixture
def cpu_symmetric(monkeypatch):
    """get_workspace on CPU tensors: _symmetric returns NaN/-7-filled CPU buffers (each peer table holds the
    buffer's own address, as a group of one) and counts its calls; rank 0 of 2 ranks; empty cache."""
    import types

    import torch
    import torch.distributed as dist

    from megamoe.backends.triton.comm import workspace as ws_module

    calls = []

    def symmetric(shape, dtype, device, group_name):
        calls.append((shape, dtype, group_name))
        local = torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype)
        return ws_module._Buffer(local, types.SimpleNamespace(), torch.tensor([local.data_ptr()]))

    monkeypatch.setattr(ws_module, "_symmetric", symmetric)
    monkeypatch.setattr(ws_module, "_WORKSPACES", {})
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # device="cuda" is the current device's index
    return ws_module, calls, types.SimpleNamespace(group_name="g0")


def _get(ws_module, group, num_tokens, top_k, num_rows, hidden_size=8, dtype=None, comm_timeout_ms=1000):
    import torch

    return ws_module.get_workspace(group, device="cuda", num_tokens=num_tokens, hidden_size=hidden_size, top_k=top_k,
                                   num_rows=num_rows, dtype=dtype or torch.bfloat16, comm_timeout_ms=comm_timeout_ms)


def _shapes(ws) -> dict:
    names = ("tokens", "weights", "ids", "pairs", "rows_in", "rows_out")
    return {name: tuple(getattr(ws, name).local.shape) for name in names}


def test_smaller_shapes_reuse_the_workspace(cpu_symmetric):
    """A call with a smaller T (or k, or R) allocates nothing: views of the leading elements, shaped for the
    call, at the same addresses, with the same peer tables and handles."""
    import torch

    from megamoe.backends.triton.comm.workspace import ROUTING_HEADER, WorkspaceSizes

    ws_module, calls, group = cpu_symmetric
    big = _get(ws_module, group, num_tokens=16, top_k=4, num_rows=96)
    allocated = len(calls)
    assert allocated == 6, calls
    small = _get(ws_module, group, num_tokens=5, top_k=2, num_rows=32, comm_timeout_ms=250)
    assert len(calls) == allocated, "a smaller call allocated"
    assert _shapes(small) == dict(tokens=(5, 8), weights=(5, 2), ids=(ROUTING_HEADER + 10,), pairs=(10, 8),
                                  rows_in=(32, 8), rows_out=(32, 8))
    assert small.sizes == WorkspaceSizes(tokens=5, pairs=10, rows=32)
    assert small.comm_timeout_ms == 250 and big.comm_timeout_ms == 1000
    for name in ("tokens", "weights", "ids", "pairs", "rows_in", "rows_out"):
        a, b = getattr(big, name), getattr(small, name)
        assert b.local.data_ptr() == a.local.data_ptr(), f"{name}: not a view of the workspace's first elements"
        assert b.peer_ptrs is a.peer_ptrs and b.handle is a.handle, name
    assert ws_module.workspace_bytes(group) == WorkspaceSizes(16, 64, 96).nbytes(8, torch.bfloat16)


def test_a_larger_shape_grows_the_one_workspace(cpu_symmetric):
    """A call that does not fit allocates one workspace sized for it and every earlier call (each size the
    largest seen), replacing the smaller one: the group holds one workspace, whatever the sequence of T."""
    import torch

    from megamoe.backends.triton.comm.workspace import WorkspaceSizes

    ws_module, calls, group = cpu_symmetric
    for num_tokens, top_k, num_rows in [(8, 2, 64), (16, 1, 32), (4, 8, 48), (8, 2, 80), (3, 1, 16)]:
        _get(ws_module, group, num_tokens, top_k, num_rows)
    want = WorkspaceSizes(tokens=16, pairs=32, rows=80)
    held = list(ws_module._WORKSPACES.values())
    assert len(held) == 1 and held[0].sizes == want, [ws.sizes for ws in held]
    assert len(calls) == 6 * 4, "allocated on the first call and on the three that did not fit, not on the last"
    assert ws_module.workspace_bytes(group) == want.nbytes(8, torch.bfloat16)
    expected = (16 * 8 + 32 * 8 + 2 * 80 * 8) * 2 + 4 * 32 + 4 * (3 + 32)
    assert want.nbytes(8, torch.bfloat16) == expected


def test_a_declared_maximum_is_never_exceeded(cpu_symmetric):
    """get_workspace with the largest shapes first (the declared maximum): later calls never allocate."""
    ws_module, calls, group = cpu_symmetric
    _get(ws_module, group, num_tokens=64, top_k=8, num_rows=1024)
    allocated = len(calls)
    for num_tokens in range(1, 65, 7):
        _get(ws_module, group, num_tokens, top_k=8, num_rows=16 * num_tokens)
    assert len(calls) == allocated


def test_one_workspace_per_group_hidden_size_and_dtype(cpu_symmetric):
    import types

    import torch

    ws_module, _, group = cpu_symmetric
    other_group = types.SimpleNamespace(group_name="g1")
    _get(ws_module, group, 4, 2, 16)
    _get(ws_module, group, 4, 2, 16, comm_timeout_ms=5)  # the timeout is the view's, not the workspace's
    assert len(ws_module._WORKSPACES) == 1
    _get(ws_module, group, 4, 2, 16, hidden_size=16)
    _get(ws_module, group, 4, 2, 16, dtype=torch.float16)
    _get(ws_module, other_group, 4, 2, 16)
    assert len(ws_module._WORKSPACES) == 4
    assert ws_module.workspace_bytes(other_group) == ws_module.WorkspaceSizes(4, 8, 16).nbytes(8, torch.bfloat16)


def test_no_receive_rows_for_the_default_directions(cpu_symmetric):
    """num_rows=0 (ep.py's pull dispatch with push combine, which use neither rows_in nor rows_out): four
    symmetric buffers, empty receive rows; a later call with receive rows (push dispatch, pull combine)
    grows the workspace."""
    import torch

    ws_module, calls, group = cpu_symmetric
    ws = _get(ws_module, group, num_tokens=4, top_k=2, num_rows=0)
    assert len(calls) == 4 and ws.rows_in.local.shape == ws.rows_out.local.shape == (0, 8)
    assert ws_module.workspace_bytes(group) == ws_module.WorkspaceSizes(4, 8, 0).nbytes(8, torch.bfloat16)
    grown = _get(ws_module, group, num_tokens=4, top_k=2, num_rows=32)
    assert len(calls) == 4 + 6 and grown.rows_in.local.shape == (32, 8)


def test_device_without_index_is_the_current_device(cpu_symmetric):
    """get_workspace(device="cuda") (the declaring call the README shows) and the layer's own call, which passes
    x.device ("cuda:N": a CUDA tensor's device always has an index), are one workspace: the second allocates
    nothing (before, "cuda" and "cuda:0" were two cache keys, so the declared maximum was allocated twice)."""
    import torch

    ws_module, calls, group = cpu_symmetric
    declared = _get(ws_module, group, num_tokens=16, top_k=2, num_rows=0)
    allocated = len(calls)
    layer = ws_module.get_workspace(group, device=torch.device("cuda", 0), num_tokens=8, hidden_size=8, top_k=2,
                                    num_rows=0, dtype=torch.bfloat16, comm_timeout_ms=1000)
    assert len(calls) == allocated and len(ws_module._WORKSPACES) == 1
    assert layer.tokens.local.data_ptr() == declared.tokens.local.data_ptr()


@pytest.mark.parametrize("group", [None, "g0", 0])
def test_group_must_be_a_process_group(group):
    """Without a process group there is nothing to rendezvous with: a TypeError naming the argument (was an
    AttributeError on group.group_name)."""
    with pytest.raises(TypeError, match=r"get_workspace: group must be the expert-parallel .*ProcessGroup"):
        megamoe.get_workspace(group, device="cuda:0", **SIZES)


@pytest.mark.parametrize("value", [0, -5, 2**31])
def test_bad_comm_timeout_names_the_argument(value):
    """comm_timeout_ms bounds every barrier of the returned workspace: MoEConfig's limits (was taken as given)."""
    with pytest.raises(ValueError, match="comm_timeout_ms"):
        megamoe.get_workspace(None, device="cuda", comm_timeout_ms=value, **SIZES)


def test_group_created_again_under_a_cached_name_gets_its_own_workspace(cpu_symmetric):
    """A workspace is cached by its group's name, and a group destroyed and created again can come back under the
    same name (the default group is "0" after every init_process_group): its symmetric memory must be its own, set
    up with the new group, not the destroyed group's."""
    import types

    ws_module, calls, group = cpu_symmetric
    first = _get(ws_module, group, num_tokens=4, top_k=2, num_rows=0)
    assert _get(ws_module, group, num_tokens=4, top_k=2, num_rows=0).tokens.local.data_ptr() == first.tokens.local.data_ptr()
    allocated = len(calls)
    again = types.SimpleNamespace(group_name=group.group_name)  # another group object, the same name
    second = _get(ws_module, again, num_tokens=4, top_k=2, num_rows=0)
    assert len(calls) == 2 * allocated, "the recreated group's workspace was not allocated"
    assert second.tokens.local.data_ptr() != first.tokens.local.data_ptr()
    assert len(ws_module._WORKSPACES) == 1, "the destroyed group's workspace is still cached"


def test_readme_declaring_call_names_the_whole_cache_key():
    """The README's get_workspace call, which declares the maximum, passes every part of the cache key but the group:
    device, hidden_size and dtype. dtype defaults to bf16, so an fp16 or fp32 layer that followed a call without it
    declared a bf16 workspace that it never uses, and allocated its own at its first step anyway."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    call = re.search(r"`megamoe\.get_workspace\(([^`]*)\)`", readme).group(1)
    assert {"device", "hidden_size", "dtype"} <= set(re.findall(r"(\w+)=", call)), call


def test_readme_workspace_table_is_the_sizing():
    """The README's table of workspace sizes per GPU (bf16, EP=2 and EP=8; default directions / push dispatch or pull
    combine) is what get_workspace allocates for each workload: WorkspaceSizes.nbytes, with R the fused path's receive
    rows (schedule.receive_rows at its block_m, dropless) where receive rows are used and none otherwise."""
    import re
    from pathlib import Path

    import torch

    from megamoe.backends.triton.comm.workspace import WorkspaceSizes
    from megamoe.backends.triton.configs import block_m_for
    from megamoe.bench.workloads import WORKLOADS
    from megamoe.schedule import receive_rows

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    header = ("| workload | H | T | k | EP=2: default / push dispatch or pull combine "
              "| EP=8: default / push dispatch or pull combine |")
    rows = readme.split(header, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]  # below the |---| line
    assert len(rows) == 6
    for row in rows:
        name, hidden, tokens, top_k, *sizes = (cell.strip() for cell in row.strip("| ").split("|"))
        w = WORKLOADS[name]
        assert (int(hidden), int(tokens), int(top_k)) == (w.hidden, w.tokens_per_gpu, w.top_k), name
        block_m = block_m_for(w.hidden, w.intermediate, torch.bfloat16)
        for world_size, shown in zip((2, 8), sizes):
            num_rows = receive_rows(w.tokens_per_gpu, w.top_k, w.num_experts // world_size, world_size, block_m, None)
            gib = [WorkspaceSizes(w.tokens_per_gpu, w.tokens_per_gpu * w.top_k, rows).nbytes(w.hidden, torch.bfloat16)
                   / 2**30 for rows in (0, num_rows)]
            assert shown == f"{gib[0]:.2f} / {gib[1]:.2f} GiB", (name, world_size)
