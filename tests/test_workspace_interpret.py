"""The expert-parallel workspace reused across shapes, run by Triton's interpreter on CPU.

The same subprocess pattern as tests/test_triton_interpret.py (whose problem helpers and exactly-sized
one-rank CPU workspace this file reuses). get_workspace runs for real, on CPU tensors standing in for
symmetric memory (each peer table holds host addresses, which the interpreter dereferences):
- ep.py forward + backward on get_workspace's workspace (receive rows only for the directions whose whole
  exchanges use them) and on views of one allocated for larger shapes (what a smaller T gets): bitwise the
  run on an exactly-sized workspace, for both directions of dispatch and combine;
- the routing exchange on two simulated ranks: each rank's (T, T*k, R) travels with its routing, so a
  peer that called with another T fails the device assert (at once, on the CPU) instead of its stale or
  foreign routing being read as if it were this call's.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import INTERPRET, INTERPRETER_WARNINGS, interpreted, interpreter_suite

pytestmark = INTERPRETER_WARNINGS
test_interpreter_suite = interpreter_suite(__file__)

if INTERPRET:
    from megamoe.backends.triton import ep
    from megamoe.backends.triton.comm import exchange
    from megamoe.backends.triton.comm import workspace as ws_module
    from megamoe.config import MoEConfig
    from megamoe.schedule import build_schedule, receive_rows
    from test_triton_interpret import CASES, RecordingBarrier, fake_workspace, make_problem, run_ep

CASE = "T37-H48-I40-E5-k3-shared"
DIRECTIONS = {"pull-push": ("pull", "push"), "push-pull": ("push", "pull")}
GROUP = types.SimpleNamespace(group_name="interpreted")


@pytest.fixture
def cpu_workspaces(monkeypatch):
    """get_workspace over CPU buffers of `world` simulated ranks: this process is rank 0; each buffer's peer
    table holds every rank's copy (rank r's at index r), kept in `copies[id(rank 0's tensor)]`."""
    import torch.distributed as dist

    copies = {}

    def setup(world: int):
        def symmetric(shape, dtype, device, group_name):
            del device, group_name
            ranks = [torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype) for _ in range(world)]
            copies[id(ranks[0])] = ranks
            return ws_module._Buffer(ranks[0], RecordingBarrier(), torch.tensor([t.data_ptr() for t in ranks]))

        monkeypatch.setattr(ws_module, "_symmetric", symmetric)
        monkeypatch.setattr(ws_module, "_WORKSPACES", {})
        monkeypatch.setattr(dist, "get_rank", lambda group: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda group: world)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # device="cuda" is the current device's index
        return copies

    return setup


@interpreted
@pytest.mark.parametrize("directions", list(DIRECTIONS))
def test_ep_on_views_of_a_larger_workspace(directions, cpu_workspaces, monkeypatch):
    T, H, I, E, k, routing, shared, block_m = CASES[CASE]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, torch.float16, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).half()
    dispatch, combine = DIRECTIONS[directions]
    config = MoEConfig(dispatch=dispatch, combine=combine)
    s = build_schedule(ids, E, block_m=block_m, config=config)
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    exact, _ = run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config)

    cpu_workspaces(1)
    # ep.py's call, on the stand-in group (run_ep passes none) and the device get_workspace insists on.
    monkeypatch.setattr(ep, "get_workspace",
                        lambda group, **sizes: ws_module.get_workspace(GROUP, **dict(sizes, device="cuda")))
    first, _ = run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config)
    (held,) = ws_module._WORKSPACES.values()
    # Receive rows only for the whole exchanges that use them: push dispatch (rows_in), pull combine (rows_out).
    rows = s.num_rows if directions == "push-pull" else 0
    assert held.sizes == ws_module.WorkspaceSizes(T, T * k, rows), held.sizes
    # The declared maximum: more tokens, slots and receive rows than this call has.
    ws_module.get_workspace(GROUP, device="cuda", num_tokens=2 * T, hidden_size=H, top_k=k + 1,
                            num_rows=3 * s.num_rows, dtype=x.dtype)
    (held,) = ws_module._WORKSPACES.values()
    views, _ = run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config)
    assert list(ws_module._WORKSPACES.values()) == [held], "the smaller call allocated"
    names = ["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_sgu", "d_sd"]
    for name, a, b, c in zip(names, views, first, exact):
        assert torch.equal(b, c), f"{name}: differs on get_workspace's workspace"
        assert torch.equal(a, c), f"{name}: differs on views of a larger workspace"


def _publish_as_peer(ws, peer: int, shapes: tuple[int, int, int], ids_TK: torch.Tensor, copies) -> None:
    """What rank `peer`'s gather_routing publishes: its (T, T*k, R), then its ids, into its copy."""
    theirs = copies[id(ws_module._WORKSPACES[next(iter(ws_module._WORKSPACES))].ids.local)][peer]
    payload = torch.cat([torch.tensor(shapes, dtype=torch.int32), ids_TK.reshape(-1).to(torch.int32)])
    theirs[: payload.numel()] = payload


@interpreted
def test_routing_exchange_checks_every_peers_shapes(cpu_workspaces, monkeypatch):
    """... and its barriers wait on the routing exchange's own channel (named in a timeout's report)."""
    world, num_experts, k = 2, 8, 2
    copies = cpu_workspaces(world)
    monkeypatch.setattr(RecordingBarrier, "channels", [])
    gen = torch.Generator().manual_seed(0)

    def call(num_tokens):
        rows = receive_rows(num_tokens, k, num_experts // world, world, 16, None)
        ws = ws_module.get_workspace(GROUP, device="cuda", num_tokens=num_tokens, hidden_size=8, top_k=k,
                                     num_rows=rows, dtype=torch.float16)
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)]).to(torch.int32)
        return ws, ids, (num_tokens, num_tokens * k, rows)

    # The first call allocates for T = 9; a later T = 5 reads both ranks' routing from views of it.
    for num_tokens in (9, 5):
        ws, mine, shapes = call(num_tokens)
        theirs = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])
        _publish_as_peer(ws, 1, shapes, theirs, copies)
        got = exchange.gather_routing(ws, mine, shapes[2])
        assert torch.equal(got, torch.cat([mine, theirs.to(torch.int32)])), f"T={num_tokens}: wrong routing gathered"
    assert RecordingBarrier.channels == [ws_module.BARRIER_CHANNELS["routing"]] * 4, RecordingBarrier.channels

    # The peer called with T = 9 (its routing and shapes still in its buffer) while this rank calls with 5.
    ws, mine, shapes = call(5)
    _, _, their_shapes = call(9)
    _publish_as_peer(ws, 1, their_shapes, torch.zeros(9, k, dtype=torch.int32), copies)
    with pytest.raises(RuntimeError, match="called with different T, k or receive rows"):
        exchange.gather_routing(ws, mine, shapes[2])
