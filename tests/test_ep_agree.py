"""Ranks of an expert-parallel group that disagree fail fast and clearly (2 gloo processes on CPU).

Ranks that pass different T, k, E_local, H, dtype, block_m or capacity_factor, or a rank whose topk_ids
hold an out-of-range expert id, must each get a ValueError on every rank, naming the field and each rank's
value (or the failing rank and id), within seconds: not a SIGABRT (gloo size mismatch), not a hang until
the process-group timeout, not an IndexError on routing gathered from a peer. megamoe.autograd's
check_ranks_agree does it (see its docstring); build_schedule range-checks the gathered routing.

One spawn runs every scenario in order (a module-scoped fixture); the EP group has a 10 s timeout, so a
scenario that hangs fails its elapsed-time check instead of blocking CI. The collectives stay in step
through the errors: a good call after all of them still matches the single-process reference.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import megamoe
from megamoe import MoEConfig, build_schedule
from megamoe.autograd import AGREE_FIELDS, _raise_on_disagreement, check_ranks_agree, rank_signature
from conftest import assert_close_tight, init_gloo, leave_gloo, run_gloo_workers

WORLD = 2
T, H, I, K, E_LOCAL = 5, 8, 4, 2, 2
GROUP_TIMEOUT_S = 10  # a hang shows up as a scenario slower than FAST_S, or as this timeout's error
FAST_S = 5.0
SPAWN_TIMEOUT_S = 240
PAYLOAD = len(AGREE_FIELDS) + 3  # int64s each rank contributes to the agreement exchange


def _inputs(rank: int, *, tokens=T, top_k=K, hidden=H, dtype=torch.float64, e_local=E_LOCAL, bad_id=None, seed=0):
    """Rank `rank`'s share of a global problem (the same on every rank for the default sizes)."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = e_local * WORLD
    x = torch.randn(WORLD * tokens, hidden, generator=gen, dtype=torch.float64)
    picks = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(WORLD * tokens)]
    ids = torch.stack(picks) if picks else torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.rand(WORLD * tokens, top_k, generator=gen, dtype=torch.float64)
    w_gate_up = torch.randn(num_experts, 2 * I, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, I, generator=gen, dtype=torch.float64) / I**0.5
    tok, exp = slice(rank * tokens, (rank + 1) * tokens), slice(rank * e_local, (rank + 1) * e_local)
    mine = dict(x=x[tok], topk_ids=ids[tok].clone(), topk_weights=weights[tok], w_gate_up=w_gate_up[exp], w_down=w_down[exp])
    if bad_id is not None:
        mine["topk_ids"][bad_id[0], bad_id[1]] = bad_id[2]
    mine = {n: v.to(dtype) if v.is_floating_point() else v for n, v in mine.items()}
    return mine, dict(x=x, topk_ids=ids, topk_weights=weights, w_gate_up=w_gate_up, w_down=w_down)


def _experts(group, inputs, config=None):
    """Forward + backward of megamoe.experts (torch backend unless config says otherwise)."""
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("x", "topk_weights", "w_gate_up", "w_down")}
    out = megamoe.experts(leaves["x"], inputs["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"],
                          leaves["w_down"], group=group, config=config or MoEConfig(backend="torch"))
    out.square().sum().backward()
    return out.detach()


# Mismatch scenarios: rank 1's arguments (rank 0 always passes the defaults) -> the fields the error names.
MISMATCHES = {
    "T-0-vs-5": (dict(tokens=0), {}, ["T (tokens per rank): rank 0 has 5, rank 1 has 0", "same T and k"]),
    "T-3-vs-5": (dict(tokens=3), {}, ["T (tokens per rank): rank 0 has 5, rank 1 has 3"]),
    "k": (dict(top_k=1), {}, ["k (experts per token): rank 0 has 2, rank 1 has 1", "same T and k"]),
    "H": (dict(hidden=16), {}, ["H (hidden size): rank 0 has 8, rank 1 has 16"]),
    "dtype": (dict(dtype=torch.float32), {}, ["dtype: rank 0 has float64, rank 1 has float32"]),
    "E_local": (dict(e_local=3), {}, ["E_local (experts per rank, w_gate_up.shape[0]): rank 0 has 2, rank 1 has 3"]),
    "block_m": ({}, dict(block_m=4), ["block_m (as resolved): rank 0 has 16, rank 1 has 4"]),
    "capacity_factor": ({}, dict(capacity_factor=2.0), ["MoEConfig.capacity_factor: rank 0 has None, rank 1 has 2.0"]),
    "T-and-H": (dict(tokens=3, hidden=16), {}, ["rank 0 has 5, rank 1 has 3", "rank 0 has 8, rank 1 has 16"]),
}


def _timed(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn()
        error = None
    except Exception as e:  # noqa: BLE001 - the parent checks type and message
        value, error = None, f"{type(e).__name__}: {e}"
    return {"error": error, "elapsed": time.monotonic() - start, "value": value}


class _Recorder:
    """Counts the collectives megamoe issues: (op, dtype, numel of this rank's input)."""

    def __init__(self):
        self.calls: list[tuple[str, str, int]] = []
        self._real = {}

    def __enter__(self):
        for name in ("all_gather_single", "all_gather_into_tensor", "all_to_all_single"):
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._real[name] = real

            def wrapper(out, inp, *args, _name=name, _real=real, **kwargs):
                self.calls.append((_name, str(inp.dtype), inp.numel()))
                return _real(out, inp, *args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)


def _scenarios(rank: int, group) -> dict:
    """Every scenario, in order; each returns a dict saved for the parent."""
    results = {}

    def run(name, fn):
        dist.barrier()  # on the default group: every rank starts the scenario together
        results[name] = _timed(fn)

    for name, (rank1_args, rank1_config, _) in MISMATCHES.items():
        inputs, _ = _inputs(rank, **(rank1_args if rank == 1 else {}))
        config = MoEConfig(backend="torch", **(rank1_config if rank == 1 else {}))
        run(f"mismatch-{name}", lambda: _experts(group, inputs, config))

    # One rank's bad expert id: every rank raises, before any exchange of rows.
    for name, bad in [("rank1-too-large", (1, 0, 99) if rank == 1 else None),
                      ("rank0-negative", (4, 1, -3) if rank == 0 else None),
                      ("both", (2, 1, 4) if rank == 0 else (0, 0, 7))]:
        inputs, _ = _inputs(rank, bad_id=bad)
        run(f"bad-id-{name}", lambda: _experts(group, inputs))

    # After a good call, rank 1 alone changes T (a short last batch): the torch path checks every call.
    good, _ = _inputs(rank)
    short, _ = _inputs(rank, tokens=0 if rank == 1 else T)
    run("late-change-first", lambda: _experts(group, good))
    run("late-change-second", lambda: _experts(group, short))

    # build_schedule alone (no agreement exchange) range-checks the routing gathered from every rank.
    bad_ids = _inputs(rank, bad_id=(3, 1, 2 * WORLD) if rank == 1 else None)[0]["topk_ids"]

    def schedule_only():
        build_schedule(bad_ids, E_LOCAL * WORLD, group=group)  # raises; nothing to return otherwise

    run("build_schedule-bad-id", schedule_only)

    # The collectives of two good calls of the torch path.
    def count_torch():
        per_call = []
        for _ in range(2):
            with _Recorder() as rec:
                _experts(group, good)
            per_call.append(rec.calls)
        return per_call

    run("collectives-torch", count_torch)

    # Still in step after every error above: a good call against the reference.
    run("good-after-errors", lambda: _experts(group, good, MoEConfig(backend="torch")))

    # torch.compile(fullgraph=True) over megamoe.experts with a group: the check runs inside the custom op.
    def compiled_call(inputs):
        fn = torch.compile(
            lambda x, ids, w, a, b: megamoe.experts(x, ids, w, a, b, group=group, config=MoEConfig(backend="torch")),
            fullgraph=True,
        )
        return fn(inputs["x"], inputs["topk_ids"], inputs["topk_weights"], inputs["w_gate_up"], inputs["w_down"])

    compiled_short, _ = _inputs(rank, tokens=3 if rank == 1 else T)
    run("compile-good", lambda: compiled_call(good))
    run("compile-mismatch", lambda: compiled_call(compiled_short))

    # The fused path's mode (backend "triton": once per (group, signature)), on a group of its own, last:
    # its divergence case leaves rank 1's gather pending on that group.
    fused_group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    fused = MoEConfig(backend="triton", block_m=16, comm_timeout_ms=1000)

    def check(inputs, config):
        with _Recorder() as rec:
            check_ranks_agree(fused_group, inputs["x"], inputs["topk_ids"], inputs["w_gate_up"], inputs["w_down"], config)
        return rec.calls

    run("fused-first", lambda: check(good, fused))
    run("fused-second", lambda: check(good, fused))
    fused_mismatch, _ = _inputs(rank, top_k=1 if rank == 1 else K)
    run("fused-mismatch-both-new", lambda: check(fused_mismatch, dataclasses.replace(fused, block_m=32)))
    run("fused-bad-id-new-signature", lambda: check(_inputs(rank, bad_id=(0, 0, 50) if rank == 0 else None)[0],
                                                    dataclasses.replace(fused, block_m=64)))
    # Rank 0 calls with its checked signature (skips: no collective), rank 1 with a new one alone: rank 1
    # must give up after comm_timeout_ms (1 s) instead of waiting for the process-group timeout.
    diverged, _ = _inputs(rank, tokens=0 if rank == 1 else T)
    run("fused-diverged", lambda: check(diverged, fused))
    return results


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        results = _scenarios(rank, group)
    except Exception as e:  # noqa: BLE001 - reported by every test
        results = {"worker": {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)  # rank 1's gather on the fused test group is still pending, by design


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_agree")
    results = run_gloo_workers(_worker, WORLD, (str(tmp),), tmp, SPAWN_TIMEOUT_S, "agreement checks")
    for rank, res in enumerate(results):
        assert "worker" not in res, f"rank {rank}: {res['worker']['error']}"
    return results


def _error(results, rank, name) -> str:
    res = results[rank][name]
    assert res["error"] is not None, f"rank {rank}: {name} raised nothing"
    return res["error"]


def _fast(results, rank, name) -> None:
    elapsed = results[rank][name]["elapsed"]
    assert elapsed < FAST_S, f"rank {rank}: {name} took {elapsed:.1f}s (a hang until the group timeout?)"


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatch_is_a_value_error_on_every_rank(agree, name):
    words = MISMATCHES[name][2]
    for rank in range(WORLD):
        message = _error(agree, rank, f"mismatch-{name}")
        assert message.startswith("ValueError: "), f"rank {rank}: {message}"
        assert "ranks disagree on" in message, f"rank {rank}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: message does not say {word!r}: {message}"
        _fast(agree, rank, f"mismatch-{name}")


def test_bad_id_on_one_rank_fails_every_rank(agree):
    failing = _error(agree, 1, "bad-id-rank1-too-large")
    assert failing.startswith("ValueError: topk_ids must hold expert ids in [0, 4), found 99 (token 1, slot 0)"), failing
    peer = _error(agree, 0, "bad-id-rank1-too-large")
    assert peer.startswith("ValueError: rank 1 of the expert-parallel group passed topk_ids with expert id 99"), peer
    assert "(its token 1, slot 0)" in peer and "[0, 4)" in peer, peer
    failing = _error(agree, 0, "bad-id-rank0-negative")
    assert "found -3 (token 4, slot 1)" in failing, failing
    assert "rank 0 of the expert-parallel group passed topk_ids with expert id -3" in _error(agree, 1, "bad-id-rank0-negative")
    for rank in range(WORLD):
        _fast(agree, rank, "bad-id-rank1-too-large")
        _fast(agree, rank, "bad-id-rank0-negative")


def test_bad_ids_on_both_ranks(agree):
    rank0, rank1 = _error(agree, 0, "bad-id-both"), _error(agree, 1, "bad-id-both")
    assert "found 4 (token 2, slot 1)" in rank0 and "rank 1 of the group passed out-of-range ids too" in rank0, rank0
    assert "found 7 (token 0, slot 0)" in rank1 and "rank 0 of the group passed out-of-range ids too" in rank1, rank1


def test_a_rank_changing_t_alone_after_warm_up(agree):
    for rank in range(WORLD):
        assert agree[rank]["late-change-first"]["error"] is None, agree[rank]["late-change-first"]["error"]
        message = _error(agree, rank, "late-change-second")
        assert message.startswith("ValueError: ") and "rank 0 has 5, rank 1 has 0" in message, message
        _fast(agree, rank, "late-change-second")


def test_build_schedule_range_checks_the_gathered_routing(agree):
    """No IndexError on a peer's routing: every rank raises a ValueError naming the rank and the id."""
    failing, peer = _error(agree, 1, "build_schedule-bad-id"), _error(agree, 0, "build_schedule-bad-id")
    assert failing.startswith("ValueError: topk_ids must hold expert ids in [0, 4), found 4 (token 3, slot 1)"), failing
    assert peer.startswith("ValueError: rank 1 of the expert-parallel group passed topk_ids with expert id 4"), peer
    for rank in range(WORLD):
        _fast(agree, rank, "build_schedule-bad-id")


def test_torch_path_exchanges_once_per_call(agree):
    """One small int64 all-gather per call, before the routing gather; nothing else added (the torch path
    checks every call: its host syncs every forward anyway, and a rank may change T alone)."""
    for rank in range(WORLD):
        res = agree[rank]["collectives-torch"]
        assert res["error"] is None, res["error"]
        for calls in res["value"]:
            agreement = [c for c in calls if c[1] == "torch.int64" and c[2] == PAYLOAD and "gather" in c[0]]
            assert len(agreement) == 1, f"rank {rank}: {calls}"
            assert calls[0] == agreement[0], f"rank {rank}: the agreement exchange is not first: {calls}"
            routing = [c for c in calls if c[1] == "torch.int32" and "gather" in c[0]]
            assert len(routing) == 1 and routing[0][2] == T * K, f"rank {rank}: {calls}"
            assert [c[0] for c in calls].count("all_to_all_single") == 4, f"rank {rank}: {calls}"
            assert len(calls) == 6, f"rank {rank}: {calls}"


def test_still_in_step_after_the_errors(agree):
    _, glob = _inputs(0)
    want = megamoe.reference.experts(glob["x"], glob["topk_ids"], glob["topk_weights"], glob["w_gate_up"], glob["w_down"])
    for rank in range(WORLD):
        res = agree[rank]["good-after-errors"]
        assert res["error"] is None, res["error"]
        assert_close_tight(f"rank {rank}: out", res["value"], want[rank * T : (rank + 1) * T], 1e-12)


def test_compiled_experts_check_too(agree):
    _, glob = _inputs(0)
    want = megamoe.reference.experts(glob["x"], glob["topk_ids"], glob["topk_weights"], glob["w_gate_up"], glob["w_down"])
    for rank in range(WORLD):
        res = agree[rank]["compile-good"]
        assert res["error"] is None, res["error"]
        assert_close_tight(f"rank {rank}: compiled out", res["value"], want[rank * T : (rank + 1) * T], 1e-12)
        message = _error(agree, rank, "compile-mismatch")
        assert message.startswith("ValueError: ") and "rank 0 has 5, rank 1 has 3" in message, message


def test_fused_mode_checks_once_per_signature(agree):
    for rank in range(WORLD):
        first, second = agree[rank]["fused-first"], agree[rank]["fused-second"]
        assert first["error"] is None and second["error"] is None, (first["error"], second["error"])
        assert len(first["value"]) == 1 and first["value"][0][2] == PAYLOAD, first["value"]
        assert second["value"] == [], f"rank {rank}: the second call exchanged again: {second['value']}"
        message = _error(agree, rank, "fused-mismatch-both-new")
        assert "k (experts per token): rank 0 has 2, rank 1 has 1" in message, message
        message = _error(agree, rank, "fused-bad-id-new-signature")
        assert message.startswith("ValueError: ") and "50" in message, message


def test_fused_mode_rank_with_a_new_signature_alone_gives_up_after_comm_timeout(agree):
    res = agree[0]["fused-diverged"]
    assert res["error"] is None and res["value"] == [], res  # rank 0's signature was checked: no collective
    message = _error(agree, 1, "fused-diverged")
    assert message.startswith("RuntimeError: ") and "comm_timeout_ms=1000" in message and "T=0" in message, message
    assert 0.9 < agree[1]["fused-diverged"]["elapsed"] < FAST_S, agree[1]["fused-diverged"]["elapsed"]


# --------------------------------------------------------------------------------------------- no processes


def _rows(field: int, values: list[int]) -> list[list[int]]:
    """Gathered payloads of len(values) ranks: the default signature, field `field` set per rank, ids fine."""
    inputs, _ = _inputs(0)
    base = list(rank_signature(inputs["x"], inputs["topk_ids"], inputs["w_gate_up"], inputs["w_down"],
                               MoEConfig(backend="torch", block_m=16)))
    return [base[:field] + [value] + base[field + 1 :] + [0, 0, 0] for value in values]


def test_message_groups_ranks_by_value():
    with pytest.raises(ValueError) as info:
        _raise_on_disagreement(_rows(0, [5, 5, 5, 0]), 3, 8, K)
    assert "ranks disagree on T (tokens per rank): ranks 0, 1, 2 have 5, rank 3 has 0;" in str(info.value)
    _raise_on_disagreement(_rows(0, [5, 5, 5, 5]), 1, 8, K)  # agreement: nothing raised


def test_signature_resolves_auto_directions_on_the_fused_path():
    """dispatch/combine count only on the fused path, and "auto" equals what it resolves to."""
    inputs, _ = _inputs(0)
    args = (inputs["x"], inputs["topk_ids"], inputs["w_gate_up"], inputs["w_down"])
    assert rank_signature(*args, MoEConfig(backend="torch", block_m=16, dispatch="push"))[-2:] == (-1, -1)
    if "triton" in megamoe.autograd.BACKENDS:
        auto = rank_signature(*args, MoEConfig(backend="triton", block_m=16))
        explicit = rank_signature(*args, MoEConfig(backend="triton", block_m=16, dispatch="pull", combine="push"))
        assert auto == explicit
