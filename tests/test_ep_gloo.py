"""Expert parallelism on CPU: 2 and 4 gloo processes against the single-process fp64 reference.

Processes are spawned once per world size (a module-scoped fixture): every scenario runs inside the
workers, which only call megamoe and save what it returned; all checks happen here in the parent, against
the reference of the same *global* problem (rank r owns tokens [r*T, (r+1)*T) and experts [r*E_l, (r+1)*E_l)).
"""

from __future__ import annotations

import importlib
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import megamoe
from megamoe import MoEConfig, MoELayer, build_schedule
from conftest import (
    assert_close_tight, assert_equal, init_gloo, leave_gloo, make_problem, run_gloo_workers, run_reference,
)
from test_schedule import SCHEDULE_TENSORS, brute_schedule

WORLD_SIZES = [2, 4]
T, H, I, K = 5, 8, 4, 2  # tokens per rank: T*k = 10, not a multiple of any block
SPAWN_TIMEOUT_S = 180


# --------------------------------------------------------------------------------------------- scenarios


def _routing(kind: str, world: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Global [W*T, k] routing, distinct experts per token."""
    local = num_experts // world
    if kind == "random":
        allowed = torch.arange(num_experts)
    elif kind == "skewed":  # everything to rank 0's experts
        allowed = torch.arange(local)
    elif kind == "empty-rank1":  # nothing for rank 1's experts
        allowed = torch.tensor([e for e in range(num_experts) if e // local != 1])
    else:
        raise ValueError(kind)
    picks = [allowed[torch.randperm(allowed.numel(), generator=gen)[:top_k]] for _ in range(world * T)]
    return torch.stack(picks)


def make_scenarios(world: int) -> dict:
    gen = torch.Generator().manual_seed(1234 + world)
    sc = {}
    # build_schedule: (routing, E, k, block_m, capacity_factor)
    for name, route, num_experts, top_k, block_m, cap in [
        ("random-B1", "random", 2 * world, K, 1, None),
        ("random-B4", "random", 2 * world, K, 4, None),
        ("random-B16", "random", 2 * world, K, 16, None),
        ("random-B128", "random", 2 * world, K, 128, None),
        ("El1-k1-B4", "random", world, 1, 4, None),
        ("skewed-B4", "skewed", 2 * world, K, 4, None),
        ("empty-rank1-B4", "empty-rank1", 2 * world, K, 4, None),
        ("skewed-cap0.5-B1", "skewed", 2 * world, K, 1, 0.5),
        ("skewed-cap1.0-B4", "skewed", 2 * world, K, 4, 1.0),
        ("random-cap2.0-B4", "random", 2 * world, K, 4, 2.0),
    ]:
        sc[f"schedule-{name}"] = dict(
            kind="schedule", ids=_routing(route, world, num_experts, top_k, gen), num_experts=num_experts,
            block_m=block_m, capacity_factor=cap,
        )
    # experts: global fp64 problem (+ config)
    for name, route, num_experts, top_k, shared, config in [
        ("random-noshared", "random", 2 * world, K, 0, {}),
        ("random-shared", "random", 2 * world, K, 4, {}),
        ("skewed-shared", "skewed", 2 * world, K, 4, {}),
        ("empty-rank1", "empty-rank1", 2 * world, K, 0, {}),
        ("El1-k1", "random", world, 1, 4, {}),
        ("overflow", "skewed", 2 * world, K, 0, dict(capacity_factor=0.5, block_m=1)),
        ("capacity-fits-B1", "random", 2 * world, K, 4, dict(capacity_factor=float(world), block_m=1)),
        ("random-shared-fp32", "random", 2 * world, K, 4, dict(dtype="float32")),
    ]:
        ids = _routing(route, world, num_experts, top_k, gen)
        p = make_problem(gen, world * T, H, I, num_experts, top_k, shared_intermediate=shared, topk_ids=ids)
        sc[f"experts-{name}"] = dict(kind="experts", problem=p.__dict__, config=config)
    # MoELayer: global fp64 parameters
    for name, score_func, norm, shared in [("softmax-norm-shared", "softmax", True, 4), ("sigmoid-nonorm", "sigmoid", False, 0)]:
        layer = MoELayer(H, I, 2 * world, K, shared_intermediate_size=shared, score_func=score_func, norm_topk_prob=norm,
                         dtype=torch.float64)
        with torch.no_grad():
            for prm in layer.parameters():
                prm.copy_(torch.randn(prm.shape, generator=gen, dtype=torch.float64) / prm.shape[-1] ** 0.5)
        sc[f"layer-{name}"] = dict(
            kind="layer", state=layer.state_dict(), score_func=score_func, norm=norm, shared=shared,
            num_experts=2 * world, x=torch.randn(world * T, H, generator=gen, dtype=torch.float64),
            d_out=torch.randn(world * T, H, generator=gen, dtype=torch.float64),
        )
    sc["errors"] = dict(kind="errors", num_experts=2 * world)
    sc["empty-batch"] = dict(kind="empty_batch", num_experts=2 * world)
    return sc


# --------------------------------------------------------------------------------------------- workers


def _run_schedule(sc, rank, world, group):
    ids = sc["ids"].view(world, T, -1)[rank]
    sched = build_schedule(ids, sc["num_experts"], group=group, config=MoEConfig(capacity_factor=sc["capacity_factor"]),
                           block_m=sc["block_m"])
    return {f: getattr(sched, f) for f in (*SCHEDULE_TENSORS, "num_rows", "num_local_experts", "world_size", "rank")}


def _local_problem(p: dict, rank: int, world: int, dtype: torch.dtype) -> dict:
    num_local = p["w_gate_up"].shape[0] // world
    tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * num_local, (rank + 1) * num_local)
    local = dict(x=p["x"][tok], topk_ids=p["topk_ids"][tok], topk_weights=p["topk_weights"][tok],
                 w_gate_up=p["w_gate_up"][exp], w_down=p["w_down"][exp], d_out=p["d_out"][tok],
                 shared_gate_up=p["shared_gate_up"], shared_down=p["shared_down"])
    return {n: (v.to(dtype).clone() if v is not None and v.is_floating_point() else v) for n, v in local.items()}


def _run_experts(sc, rank, world, group):
    config = dict(sc["config"])
    dtype = getattr(torch, config.pop("dtype", "float64"))
    p = _local_problem(sc["problem"], rank, world, dtype)
    names = [n for n in ("x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down") if p[n] is not None]
    runs = []
    for _ in range(2):
        leaves = {n: p[n].clone().requires_grad_() for n in names}
        out = megamoe.experts(
            leaves["x"], p["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
            shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"), group=group,
            config=MoEConfig(backend="torch", **config),
        )
        grads = torch.autograd.grad(out, list(leaves.values()), p["d_out"])
        runs.append({"out": out.detach(), **{f"d_{n}": g for n, g in zip(names, grads)}})
    return {"run1": runs[0], "run2": runs[1]}


def _run_layer(sc, rank, world, group):
    num_local = sc["num_experts"] // world
    layer = MoELayer(H, I, sc["num_experts"], K, shared_intermediate_size=sc["shared"], score_func=sc["score_func"],
                     norm_topk_prob=sc["norm"], group=group, dtype=torch.float64)
    state = dict(sc["state"])
    for n in ("w_gate_up", "w_down"):
        state[n] = state[n][rank * num_local : (rank + 1) * num_local]
    layer.load_state_dict(state)
    tok = slice(rank * T, (rank + 1) * T)
    x = sc["x"][tok].clone().requires_grad_()
    out = layer(x)
    out.backward(sc["d_out"][tok])
    return {"out": out.detach(), "d_x": x.grad, "tokens_per_expert": layer.tokens_per_expert,
            "aux_loss": layer.aux_loss.detach(), **{f"d_{n}": p.grad for n, p in layer.named_parameters()}}


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the parent checks type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _run_errors(sc, rank, world, group):
    num_experts = sc["num_experts"]
    ids = torch.zeros(T, K, dtype=torch.int64)
    ids[:, 1] = 1
    x = torch.randn(T, H, dtype=torch.float64)
    w_gate_up = torch.randn(num_experts // world, 2 * I, H, dtype=torch.float64)
    w_down = torch.randn(num_experts // world, H, I, dtype=torch.float64)
    weights = torch.rand(T, K, dtype=torch.float64)
    bad = ids.clone()
    bad[0, 0] = num_experts  # on every rank, so that no rank waits in a collective for the others
    # An int64 id beyond int32's range: the routing crosses the group as int32, where 2**32 + 1 used to wrap to
    # expert 1 (in range) and route silently.
    wide = ids.clone()
    wide[0, 0] = 2**32 + 1
    return {
        "schedule-indivisible": _error_of(lambda: build_schedule(ids, num_experts + 1, group=group)),
        "schedule-id-beyond-int32": _error_of(lambda: build_schedule(wide, num_experts, group=group)),
        "layer-indivisible": _error_of(lambda: MoELayer(H, I, num_experts + 1, K, group=group)),
        "experts-id-out-of-range": _error_of(
            lambda: megamoe.experts(x, bad, weights, w_gate_up, w_down, group=group, config=MoEConfig(backend="torch"))
        ),
        "layer-reference-with-group": _error_of(
            lambda: MoELayer(H, I, num_experts, K, group=group, config=MoEConfig(backend="reference"))
        ),
        "reference-with-group": _error_of(
            lambda: megamoe.experts(x, ids, weights, w_gate_up, w_down, group=group, config=MoEConfig(backend="reference"))
        ),
    }


# The backends of the empty-batch scenario; "triton" is its expert-parallel driver (backends/triton/ep.py),
# forced on CPU where "auto" would never pick it: at T = 0 it must neither launch a kernel nor touch
# symmetric memory, so it runs here.
EMPTY_BATCH_BACKENDS = ["torch", "triton"]
SHARED_I = 4


def _run_empty_batch(sc, rank, world, group):
    """T = 0 on every rank (a step without tokens): forward + backward and a no_grad forward per backend,
    {backend: {"out", "no_grad_out", "d_<name>"...} or {"error": ...}}; None where Triton is not installed."""
    autograd = importlib.import_module("megamoe.autograd")
    gen = torch.Generator().manual_seed(rank)
    num_local = sc["num_experts"] // world
    leaves = dict(x=torch.randn(0, H, generator=gen), topk_weights=torch.rand(0, K, generator=gen),
                  w_gate_up=torch.randn(num_local, 2 * I, H, generator=gen), w_down=torch.randn(num_local, H, I, generator=gen),
                  shared_gate_up=torch.randn(2 * SHARED_I, H, generator=gen), shared_down=torch.randn(H, SHARED_I, generator=gen))
    ids = torch.empty(0, K, dtype=torch.int64)

    def call(params):
        return megamoe.experts(params["x"], ids, params["topk_weights"], params["w_gate_up"], params["w_down"],
                               shared_gate_up=params["shared_gate_up"], shared_down=params["shared_down"], group=group)

    results = {}
    real_resolve = autograd.resolve_backend
    for backend in EMPTY_BATCH_BACKENDS:
        if backend not in autograd.BACKENDS:
            results[backend] = None
            continue
        autograd.resolve_backend = lambda config, x, group, _backend=backend: _backend
        try:
            params = {n: t.clone().requires_grad_() for n, t in leaves.items()}
            out = call(params)
            grads = torch.autograd.grad(out, list(params.values()), torch.ones_like(out))
            with torch.no_grad():
                no_grad_out = call(leaves)
            results[backend] = {"out": out.detach(), "no_grad_out": no_grad_out,
                                **{f"d_{n}": g for n, g in zip(params, grads)}}
        except Exception as e:  # noqa: BLE001 - reported by the parent's test of this backend
            results[backend] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        finally:
            autograd.resolve_backend = real_resolve
    return results


RUNNERS = {"schedule": _run_schedule, "experts": _run_experts, "layer": _run_layer, "errors": _run_errors,
           "empty_batch": _run_empty_batch}


def _worker(rank: int, world: int, port: int, in_path: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    group = dist.new_group(list(range(world)))
    results = {}
    try:
        for name, sc in torch.load(in_path, weights_only=False).items():
            try:
                results[name] = RUNNERS[sc["kind"]](sc, rank, world, group)
            except Exception as e:  # noqa: BLE001 - reported by the parent's test of this scenario
                results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        leave_gloo(rank, world)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ep(request, tmp_path_factory):
    """(world, scenarios, results[rank][scenario]) from one spawn of `world` gloo processes."""
    world = request.param
    scenarios = make_scenarios(world)
    tmp = tmp_path_factory.mktemp(f"ep_w{world}")
    in_path = str(tmp / "scenarios.pt")
    torch.save(scenarios, in_path)
    results = run_gloo_workers(_worker, world, (in_path, str(tmp)), tmp, SPAWN_TIMEOUT_S, f"world {world}")
    return world, scenarios, results


def _result(results, rank, name):
    res = results[rank].get(name)
    assert res is not None, f"rank {rank}: scenario {name} did not run"
    if isinstance(res, dict) and "error" in res:
        pytest.fail(f"rank {rank}: {name} raised {res['error']}\n{res['traceback']}")
    return res


# --------------------------------------------------------------------------------------------- tests

SCHEDULE_NAMES = [n for n in make_scenarios(2) if n.startswith("schedule-")]
EXPERTS_NAMES = [n for n in make_scenarios(2) if n.startswith("experts-") and n != "experts-overflow"]
LAYER_NAMES = [n for n in make_scenarios(2) if n.startswith("layer-")]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_schedule_matches_brute_force(ep, name):
    world, scenarios, results = ep
    sc = scenarios[name]
    ids_all = sc["ids"].view(world, T, -1).tolist()
    overflow = None
    for rank in range(world):
        got = _result(results, rank, name)
        expected = brute_schedule(ids_all, sc["num_experts"], rank, sc["block_m"], sc["capacity_factor"])
        assert (got["world_size"], got["rank"]) == (world, rank)
        assert got["num_rows"] == expected["num_rows"], f"rank {rank}: num_rows {got['num_rows']} != {expected['num_rows']}"
        assert got["num_local_experts"] == expected["num_local_experts"]
        for field in SCHEDULE_TENSORS:
            assert_equal(f"rank {rank}: Schedule.{field}", got[field], expected[field])
        overflow = got["overflow"] if overflow is None else overflow
        assert_equal(f"rank {rank}: overflow (identical on every rank)", got["overflow"], overflow)
    if "cap0.5" in name:
        assert int(overflow) > 0, "the skewed routing must overflow capacity 0.5"


def _check_rows_placed_once(ep, name):
    """Across ranks, every fitting (token, slot) of the group sits in exactly one receive row, where dest_row says."""
    world, scenarios, results = ep
    ids = scenarios[name]["ids"]
    pairs = ids.numel()
    seen = torch.zeros(pairs, dtype=torch.int64)
    for rank in range(world):
        res = _result(results, rank, name)
        src = res["row_src"].long()
        rows = (src >= 0).nonzero().flatten()
        seen.index_add_(0, src[rows], torch.ones_like(rows))
        for r in rows.tolist():  # dest_row/dest_rank on the token owner point back at this row
            owner, local = divmod(int(src[r]), T * ids.shape[1])
            owner_res = _result(results, owner, name)
            assert int(owner_res["dest_rank"].reshape(-1)[local]) == rank
            assert int(owner_res["dest_row"].reshape(-1)[local]) == r
    dropped = torch.cat([_result(results, r, name)["dest_row"].reshape(-1) for r in range(world)]) < 0
    assert_equal("times each fitting pair is placed", seen[~dropped], torch.ones(int((~dropped).sum()), dtype=torch.int64))
    assert_equal("times each dropped pair is placed", seen[dropped], torch.zeros(int(dropped.sum()), dtype=torch.int64))


@pytest.mark.parametrize("name", ["schedule-random-B4", "schedule-skewed-cap0.5-B1", "schedule-empty-rank1-B4"])
def test_schedule_rows_and_dest_are_inverse_across_ranks(ep, name):
    _check_rows_placed_once(ep, name)


@pytest.mark.parametrize("name", EXPERTS_NAMES)
def test_experts_match_single_process_reference(ep, name):
    world, scenarios, results = ep
    sc = scenarios[name]
    p = make_problem(torch.Generator(), 1, 1, 1, 1, 1)  # a Problem to fill with the global tensors
    p.__dict__.update(sc["problem"])
    ref = run_reference(p)  # the global problem, one process, fp64
    num_local = p.w_gate_up.shape[0] // world
    tol = 1e-5 if sc["config"].get("dtype") == "float32" else 1e-12
    for rank in range(world):
        res = _result(results, rank, name)
        tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * num_local, (rank + 1) * num_local)
        expected = {"out": ref["out"][tok], "d_x": ref["d_x"][tok], "d_topk_weights": ref["d_topk_weights"][tok],
                    "d_w_gate_up": ref["d_w_gate_up"][exp], "d_w_down": ref["d_w_down"][exp]}
        if p.shared_gate_up is not None:  # replicated: each rank's gradient comes from its own tokens
            mine = make_problem(torch.Generator(), 1, 1, 1, 1, 1)
            mine.__dict__.update({n: (v[tok] if n in ("x", "topk_ids", "topk_weights", "d_out") else v)
                                  for n, v in sc["problem"].items()})
            ref_mine = run_reference(mine)
            expected |= {"d_shared_gate_up": ref_mine["d_shared_gate_up"], "d_shared_down": ref_mine["d_shared_down"]}
        assert res["run1"].keys() == expected.keys(), f"rank {rank}: outputs {sorted(res['run1'])}"
        for tensor, want in expected.items():
            assert_close_tight(f"rank {rank}: {tensor}", res["run1"][tensor], want, tol)
            assert_equal(f"rank {rank}: {tensor} (run 2 vs run 1)", res["run2"][tensor], res["run1"][tensor])


def test_capacity_overflow_raises_on_every_rank(ep):
    world, _, results = ep
    for rank in range(world):
        res = results[rank]["experts-overflow"]
        assert "error" in res, f"rank {rank}: no error for an overflowing capacity"
        assert res["error"].startswith("CapacityOverflowError"), f"rank {rank}: {res['error']}"


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_layer_matches_single_process_layer(ep, name):
    world, scenarios, results = ep
    sc = scenarios[name]

    def single(x, d_out):
        layer = MoELayer(H, I, sc["num_experts"], K, shared_intermediate_size=sc["shared"], score_func=sc["score_func"],
                         norm_topk_prob=sc["norm"], dtype=torch.float64)
        layer.load_state_dict(sc["state"])
        x = x.clone().requires_grad_()
        out = layer(x)
        out.backward(d_out)
        return {"out": out.detach(), "d_x": x.grad, "tokens_per_expert": layer.tokens_per_expert,
                "aux_loss": layer.aux_loss.detach(), **{f"d_{n}": p.grad for n, p in layer.named_parameters()}}

    glob = single(sc["x"], sc["d_out"])
    num_local = sc["num_experts"] // world
    for rank in range(world):
        res = _result(results, rank, name)
        tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * num_local, (rank + 1) * num_local)
        mine = single(sc["x"][tok], sc["d_out"][tok])  # replicated router/shared expert: own tokens only
        assert_equal(f"rank {rank}: tokens_per_expert", res["tokens_per_expert"], mine["tokens_per_expert"])
        assert_close_tight(f"rank {rank}: aux_loss", res["aux_loss"], mine["aux_loss"], 1e-12)
        for tensor in ("out", "d_x"):
            assert_close_tight(f"rank {rank}: {tensor}", res[tensor], glob[tensor][tok], 1e-12)
        for tensor in ("d_w_gate_up", "d_w_down"):
            assert_close_tight(f"rank {rank}: {tensor}", res[tensor], glob[tensor][exp], 1e-12)
        for tensor in [t for t in mine if t.startswith(("d_router", "d_shared"))]:
            assert_close_tight(f"rank {rank}: {tensor}", res[tensor], mine[tensor], 1e-12)
        assert set(res) == set(mine), f"rank {rank}: {sorted(set(res) ^ set(mine))}"


@pytest.mark.parametrize(
    "case,exc,words",
    [
        ("schedule-indivisible", "ValueError", ["num_experts", "divisible"]),
        ("layer-indivisible", "ValueError", ["num_experts", "divisible"]),
        ("experts-id-out-of-range", "ValueError", ["topk_ids"]),
        ("schedule-id-beyond-int32", "ValueError", ["topk_ids", "2147483647", "[0, "]),
        ("reference-with-group", "ValueError", ["reference", "group"]),
        ("layer-reference-with-group", "ValueError", ["reference", "group of size"]),
    ],
)
def test_errors_under_a_group(ep, case, exc, words):
    world, _, results = ep
    for rank in range(world):
        message = _result(results, rank, "errors")[case]
        assert message.startswith(exc + ":"), f"rank {rank}: expected {exc}, got {message}"
        for word in words:
            assert word in message, f"rank {rank}: message does not mention {word!r}: {message}"


@pytest.mark.parametrize("backend", EMPTY_BATCH_BACKENDS)
def test_empty_batch_on_every_rank(ep, backend):
    """T = 0 on every rank (the ranks agree on T, so a step without tokens has none anywhere): on every rank
    an empty out (also under no_grad), d_x [0, H], d_topk_weights [0, k] and exact-zero weight gradients.
    The fused path's driver used to fail here, asking for a symmetric workspace of 0 token rows."""
    world, scenarios, results = ep
    num_local = scenarios["empty-batch"]["num_experts"] // world
    shapes = {"out": (0, H), "no_grad_out": (0, H), "d_x": (0, H), "d_topk_weights": (0, K),
              "d_w_gate_up": (num_local, 2 * I, H), "d_w_down": (num_local, H, I),
              "d_shared_gate_up": (2 * SHARED_I, H), "d_shared_down": (H, SHARED_I)}
    for rank in range(world):
        res = _result(results, rank, "empty-batch")[backend]
        if res is None:
            pytest.skip(f"the {backend} backend is not installed")
        if "error" in res:
            pytest.fail(f"rank {rank}: {backend} raised {res['error']}\n{res['traceback']}")
        assert res.keys() == shapes.keys(), f"rank {rank}: {sorted(res)}"
        for name, shape in shapes.items():
            assert_equal(f"rank {rank}: {name}", res[name], torch.zeros(shape))
