"""A rank of an expert-parallel group that fails locally makes its peers fail within seconds (3 gloo processes).

tests/test_ep_agree.py covers ranks that reach the agreement check with different shapes or bad ids. Here a
rank does not reach it: it rejects its own arguments (a TypeError or ValueError in megamoe.experts' checks),
or never calls at all. Its peers must not wait for the process-group timeout:
- a rank whose arguments are rejected still joins the agreement exchange, saying so, and raises its own
  error; every peer raises a ValueError naming it, at once, on the group's first call as on later ones;
- a peer that never arrives: after the group's first check, the others give up after
  MoEConfig.comm_timeout_ms (the torch path checks every call; the fused path's check of a new shape too).

One spawn runs every scenario in order, each on a process group of its own (a scenario that leaves a
collective pending cannot disturb the next), with a 10 s process-group timeout: a rank waiting for it shows
up as a scenario slower than FAST_S.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import megamoe
from megamoe import MoEConfig, MoELayer
from megamoe.autograd import check_ranks_agree, group_hosts
from conftest import assert_close_tight, init_gloo, leave_gloo, run_gloo_workers

WORLD = 3
T, H, I, K, E_LOCAL = 4, 8, 4, 2, 2
GROUP_TIMEOUT_S = 10
FAST_S = 5.0
COMM_TIMEOUT_MS = 1000
SPAWN_TIMEOUT_S = 240
TORCH = MoEConfig(backend="torch", comm_timeout_ms=COMM_TIMEOUT_MS)


def _global_problem() -> dict:
    gen = torch.Generator().manual_seed(3)
    num_experts = E_LOCAL * WORLD
    return dict(
        x=torch.randn(WORLD * T, H, generator=gen, dtype=torch.float64),
        topk_ids=torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(WORLD * T)]),
        topk_weights=torch.rand(WORLD * T, K, generator=gen, dtype=torch.float64),
        w_gate_up=torch.randn(num_experts, 2 * I, H, generator=gen, dtype=torch.float64) / H**0.5,
        w_down=torch.randn(num_experts, H, I, generator=gen, dtype=torch.float64) / I**0.5,
    )


def _local(rank: int) -> dict:
    p = _global_problem()
    tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    return dict(x=p["x"][tok], topk_ids=p["topk_ids"][tok], topk_weights=p["topk_weights"][tok],
                w_gate_up=p["w_gate_up"][exp], w_down=p["w_down"][exp])


# How a rank spoils its own arguments: (what it changes, the start of its own error).
REJECTIONS = {
    "weights-dtype": (dict(topk_weights=torch.float16), "TypeError: topk_weights must be float32"),
    "ids-dtype": (dict(topk_ids=torch.float32), "TypeError: topk_ids must be int32 or int64"),
    "w_down-shape": (dict(w_down="transposed"), "ValueError: w_down must be [E_local, H, I]"),
    "layer-x": ({}, f"ValueError: x must be [..., H={H}]"),  # MoELayer's check (the scenario cuts x itself)
    # MoELayer's check of the logits (the scenario puts a router of E + 1 experts in the layer's place)
    "layer-router": ({}, f"ValueError: router must give [T, E={E_LOCAL * WORLD}] logits"),
}


def _spoiled(inputs: dict, rejection: str) -> dict:
    (name, how), = REJECTIONS[rejection][0].items()
    spoiled = dict(inputs)
    spoiled[name] = inputs[name].transpose(1, 2) if how == "transposed" else inputs[name].to(how)
    return spoiled


def _experts(group, inputs, config=TORCH) -> torch.Tensor:
    return megamoe.experts(inputs["x"], inputs["topk_ids"], inputs["topk_weights"], inputs["w_gate_up"],
                           inputs["w_down"], group=group, config=config)


def _timed(fn) -> dict:
    start = time.monotonic()
    try:
        value, error = fn(), None
    except Exception as e:  # noqa: BLE001 - the parent checks type and message
        value, error = None, f"{type(e).__name__}: {e}"
    return {"error": error, "elapsed": time.monotonic() - start, "value": value}


def _scenarios(rank: int) -> dict:
    results = {}
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    groups = {name: dist.new_group(list(range(WORLD)), timeout=timeout)
              for name in ("first", "warm", "router", "fused", "absent-torch", "absent-fused", "empty-fused")}
    good = _local(rank)

    def run(name, fn):
        dist.barrier()  # on the default group: every rank starts the scenario together
        results[name] = _timed(fn)

    # The group's first call: rank 1 rejects its topk_weights before any exchange.
    run("first-call", lambda: _experts(groups["first"], _spoiled(good, "weights-dtype") if rank == 1 else good))

    # After a good call, a rank rejects its arguments: one rank, then two at once.
    warm = groups["warm"]
    run("warm-good", lambda: _experts(warm, good))
    run("warm-one", lambda: _experts(warm, _spoiled(good, "ids-dtype") if rank == 2 else good))
    spoil = {0: "w_down-shape", 1: "weights-dtype"}
    run("warm-two", lambda: _experts(warm, _spoiled(good, spoil[rank]) if rank in spoil else good))
    # MoELayer's own check of x: rank 1 passes the wrong hidden size.
    layer = MoELayer(H, I, E_LOCAL * WORLD, K, group=warm, config=TORCH, dtype=torch.float64)
    run("warm-layer", lambda: layer(good["x"][:, : H - 1] if rank == 1 else good["x"]))
    # The collectives are still in step: a good call matches the reference.
    run("warm-after", lambda: _experts(warm, good))
    # A router that scores another number of experts than E, on rank 1 only: the layer's routing rejects it.
    layer = MoELayer(H, I, E_LOCAL * WORLD, K, group=groups["router"], config=TORCH, dtype=torch.float64)
    run("router-good", lambda: layer(good["x"]))
    if rank == 1:
        layer.router = torch.nn.Linear(H, E_LOCAL * WORLD + 1, bias=False, dtype=torch.float64)
    run("router-wrong", lambda: layer(good["x"]))

    # Peers on the fused path's check of a new shape (called directly, after the group's host gather that
    # megamoe.experts runs first: the fused path needs GPUs) learn of a rank that rejected its arguments too.
    fused = MoEConfig(backend="triton", block_m=16, comm_timeout_ms=COMM_TIMEOUT_MS)

    def fused_check():
        if rank == 0:
            return _experts(groups["fused"], _spoiled(good, "ids-dtype"))
        group_hosts(groups["fused"].group_name, good["x"].device)
        return check_ranks_agree(groups["fused"], good["x"], good["topk_ids"], good["w_gate_up"], good["w_down"], fused)

    run("fused-peers", fused_check)

    # A peer that never arrives, after the group's first check: the others give up after comm_timeout_ms.
    # Last on their groups: the peers' gathers stay pending.
    absent = groups["absent-torch"]
    run("absent-torch-warm", lambda: _experts(absent, good))
    run("absent-torch", lambda: None if rank == 1 else _experts(absent, good))
    # The timed-out ranks' gathers are pending: their next call on the group must not issue another collective
    # (it would pair with a late peer's), but raise at once.
    run("absent-torch-again", lambda: None if rank == 1 else _experts(absent, good))
    absent = groups["absent-fused"]

    def fused_new_shape(tokens):
        x, ids = good["x"][:tokens], good["topk_ids"][:tokens]
        return check_ranks_agree(absent, x, ids, good["w_gate_up"], good["w_down"], fused)

    run("absent-fused-warm", lambda: fused_new_shape(T))
    run("absent-fused", lambda: None if rank == 1 else fused_new_shape(T - 1))

    # The empty batch on the fused path: after a T = 0 call everyone checked, rank 0 alone calls with T = 0
    # again while its peers are on a checked shape (which skips the check): it must not return as if its
    # peers had an empty batch too, but fail after comm_timeout_ms.
    empty = groups["empty-fused"]

    def fused_empty():
        return check_ranks_agree(empty, good["x"][:0], good["topk_ids"][:0], good["w_gate_up"], good["w_down"], fused)

    run("empty-fused-warm", fused_empty)
    run("empty-fused-alone", lambda: fused_empty() if rank == 0 else None)
    return results


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        results = _scenarios(rank)
    except Exception as e:  # noqa: BLE001 - reported by every test
        results = {"worker": {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)  # gathers stay pending on the "absent" groups, by design


@pytest.fixture(scope="module")
def fail_fast(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_fail_fast")
    results = run_gloo_workers(_worker, WORLD, (str(tmp),), tmp, SPAWN_TIMEOUT_S, "local failures")
    for rank, res in enumerate(results):
        assert "worker" not in res, f"rank {rank}: {res['worker']['error']}"
    return results


def _error(results, rank: int, name: str) -> str:
    res = results[rank][name]
    assert res["error"] is not None, f"rank {rank}: {name} raised nothing"
    return res["error"]


def _fast(results, rank: int, name: str) -> None:
    elapsed = results[rank][name]["elapsed"]
    assert elapsed < FAST_S, f"rank {rank}: {name} took {elapsed:.1f}s (a wait for the process-group timeout?)"


def _assert_peers_name(results, name: str, failing: dict[int, str]) -> None:
    """Each failing rank raises its own error; every other rank a ValueError naming the failing ranks."""
    for rank in range(WORLD):
        message = _error(results, rank, name)
        if rank in failing:
            assert message.startswith(REJECTIONS[failing[rank]][1]), f"rank {rank}: {message}"
        else:
            ranks = ", ".join(map(str, sorted(failing)))
            assert message.startswith("ValueError: "), f"rank {rank}: {message}"
            assert f"rank{'s' if len(failing) > 1 else ''} {ranks} of the expert-parallel group rejected" in message, (
                f"rank {rank}: {message}")
        _fast(results, rank, name)


def test_rejected_arguments_on_the_first_call(fail_fast):
    _assert_peers_name(fail_fast, "first-call", {1: "weights-dtype"})
    message = _error(fail_fast, 0, "first-call")
    assert "TypeError" in message, f"the peers' error says which kind of error the failing rank raised: {message}"


def test_rejected_arguments_after_warm_up(fail_fast):
    for rank in range(WORLD):
        assert fail_fast[rank]["warm-good"]["error"] is None, fail_fast[rank]["warm-good"]["error"]
    _assert_peers_name(fail_fast, "warm-one", {2: "ids-dtype"})
    _assert_peers_name(fail_fast, "warm-two", {0: "w_down-shape", 1: "weights-dtype"})
    _assert_peers_name(fail_fast, "warm-layer", {1: "layer-x"})


def test_rejected_router_after_warm_up(fail_fast):
    for rank in range(WORLD):
        assert fail_fast[rank]["router-good"]["error"] is None, fail_fast[rank]["router-good"]["error"]
    _assert_peers_name(fail_fast, "router-wrong", {1: "layer-router"})


def test_still_in_step_after_rejections(fail_fast):
    p = _global_problem()
    want = megamoe.reference.experts(p["x"], p["topk_ids"], p["topk_weights"], p["w_gate_up"], p["w_down"])
    for rank in range(WORLD):
        res = fail_fast[rank]["warm-after"]
        assert res["error"] is None, res["error"]
        assert_close_tight(f"rank {rank}: out", res["value"], want[rank * T : (rank + 1) * T], 1e-12)


def test_fused_path_peers_learn_of_rejected_arguments(fail_fast):
    _assert_peers_name(fail_fast, "fused-peers", {0: "ids-dtype"})


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_absent_peer_fails_the_others_after_comm_timeout(fail_fast, path):
    for rank in range(WORLD):
        warm = fail_fast[rank][f"absent-{path}-warm"]
        assert warm["error"] is None, warm["error"]
    assert fail_fast[1][f"absent-{path}"]["error"] is None
    for rank in (0, 2):
        message = _error(fail_fast, rank, f"absent-{path}")
        assert message.startswith("RuntimeError: "), f"rank {rank}: {message}"
        assert f"comm_timeout_ms={COMM_TIMEOUT_MS}" in message, f"rank {rank}: {message}"
        elapsed = fail_fast[rank][f"absent-{path}"]["elapsed"]
        assert COMM_TIMEOUT_MS / 1000 * 0.9 < elapsed < FAST_S, f"rank {rank}: gave up after {elapsed:.1f}s"


def test_group_out_of_step_after_a_timeout_raises_at_once(fail_fast):
    """After its agreement exchange timed out (the gather left pending), a rank's next call on that group raises
    at once, saying the group is out of step, instead of issuing a collective that would pair with the pending
    one (a late peer's check with the stale gather, its routing gather with this rank's new check)."""
    for rank in (0, 2):
        assert "out of step" in _error(fail_fast, rank, "absent-torch"), rank
        message = _error(fail_fast, rank, "absent-torch-again")
        assert message.startswith("RuntimeError: ") and "is out of step" in message, f"rank {rank}: {message}"
        elapsed = fail_fast[rank]["absent-torch-again"]["elapsed"]
        assert elapsed < COMM_TIMEOUT_MS / 1000 / 2, f"rank {rank}: took {elapsed:.2f}s"


def test_fused_path_empty_batch_alone_fails_not_returns(fail_fast):
    """T = 0 is checked on every call of the fused path: a rank alone with an empty batch raises after
    comm_timeout_ms instead of returning an empty result while its peers wait at their routing exchange."""
    for rank in range(WORLD):
        warm = fail_fast[rank]["empty-fused-warm"]
        assert warm["error"] is None, warm["error"]
    message = _error(fail_fast, 0, "empty-fused-alone")
    assert message.startswith("RuntimeError: ") and f"comm_timeout_ms={COMM_TIMEOUT_MS}" in message, message
    elapsed = fail_fast[0]["empty-fused-alone"]["elapsed"]
    assert COMM_TIMEOUT_MS / 1000 * 0.9 < elapsed < FAST_S, f"rank 0: gave up after {elapsed:.1f}s"


def test_message_names_every_rejecting_rank_first():
    """No processes: of 4 gathered payloads, ranks 1 and 3 rejected their arguments (rank 2 also disagrees on
    T): the verdict names the rejecting ranks and their errors' types, before any disagreement."""
    from megamoe.autograd import AGREE_FIELDS, REJECTION_TYPES, _REJECTED, _raise_on_disagreement

    fine = [T, K, E_LOCAL] + [0] * (len(AGREE_FIELDS) - 3) + [0, 0, 0]
    rejected = [-1] * len(AGREE_FIELDS) + [_REJECTED, REJECTION_TYPES.index(TypeError), 0]
    rows = [fine, rejected, [T + 1] + fine[1:], [-1] * len(AGREE_FIELDS) + [_REJECTED, 0, 0]]
    with pytest.raises(ValueError) as info:
        _raise_on_disagreement(rows, 0, E_LOCAL * 4, K)
    message = str(info.value)
    assert message.startswith("megamoe.experts: ranks 1, 3 of the expert-parallel group rejected their arguments "
                              "before the exchange (rank 1 a TypeError, rank 3 a ValueError;"), message
    assert "disagree" not in message, message
