"""build_schedule against a brute-force construction in plain Python (exact), plus invariants and meta shapes.

Multi-rank placement through a real process group is in test_ep_gloo.py (it reuses `brute_schedule`).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import megamoe
from megamoe import MoEConfig, build_schedule
from conftest import assert_equal, routing

SCHEDULE_TENSORS = (
    "expert_counts", "expert_offsets", "row_src", "block_expert", "num_blocks", "dest_rank", "dest_row", "overflow",
)


def brute_schedule(ids_all: list, num_experts: int, rank: int, block_m: int, capacity_factor=None) -> dict:
    """Every Schedule field for `rank`, from the routing of all ranks (ids_all[s][t][j]), by plain loops.

    Rows of an owner rank: its local experts in order, each expert's pairs in (source rank, token, slot)
    order, each segment padded up to a multiple of block_m. Receive capacity R: the worst case over all
    routings (each non-empty expert can waste at most block_m - 1 rows), or, with a capacity factor c,
    ceil(c*T*k) rows rounded up to blocks plus one block per (possibly non-empty) local expert, whichever
    is smaller. Pairs whose row is >= R do not fit: they have dest_row -1 and count as overflow.
    """
    world = len(ids_all)
    num_tokens = len(ids_all[0])
    top_k = len(ids_all[0][0]) if num_tokens else 0
    num_local = num_experts // world
    pairs = world * num_tokens * top_k
    nonempty = min(num_local, pairs)
    worst_blocks = nonempty + (pairs - nonempty) // block_m  # nonempty experts with 1 row, the rest packed
    blocks = worst_blocks
    if capacity_factor is not None:
        blocks = min(worst_blocks, math.ceil(math.ceil(capacity_factor * num_tokens * top_k) / block_m) + nonempty)
    rows = blocks * block_m

    counts = [0] * num_experts
    for s in range(world):
        for t in range(num_tokens):
            for j in range(top_k):
                counts[ids_all[s][t][j]] += 1

    row_of = {}  # (s, t, j) -> row on its owner rank (before the capacity cut)
    starts = [[0] * (num_local + 1) for _ in range(world)]
    for owner in range(world):
        row = 0
        for local in range(num_local):
            starts[owner][local] = row
            expert = owner * num_local + local
            for s in range(world):
                for t in range(num_tokens):
                    for j in range(top_k):
                        if ids_all[s][t][j] == expert:
                            row_of[(s, t, j)] = row
                            row += 1
            while row % block_m:
                row += 1
        starts[owner][num_local] = row

    offsets = [min(v, rows) for v in starts[rank]]
    row_src = [-1] * rows
    overflow = 0
    for (s, t, j), row in row_of.items():
        if row >= rows:
            overflow += 1
        elif ids_all[s][t][j] // num_local == rank:
            row_src[row] = (s * num_tokens + t) * top_k + j
    block_expert = []
    for b in range(rows // block_m):
        start = b * block_m
        owner_of_block = -1
        for local in range(num_local):
            if offsets[local] <= start < offsets[local + 1]:
                owner_of_block = local
        block_expert.append(owner_of_block)
    dest_rank = [[ids_all[rank][t][j] // num_local for j in range(top_k)] for t in range(num_tokens)]
    dest_row = [
        [row_of[(rank, t, j)] if row_of[(rank, t, j)] < rows else -1 for j in range(top_k)] for t in range(num_tokens)
    ]

    def i32(v, shape=None):
        out = torch.tensor(v, dtype=torch.int32)
        return out.reshape(shape) if shape is not None else out

    return {
        "num_experts": num_experts, "num_local_experts": num_local, "world_size": world, "rank": rank,
        "num_tokens": num_tokens, "top_k": top_k, "block_m": block_m, "num_rows": rows,
        "expert_counts": i32(counts),
        "expert_offsets": i32(offsets),
        "row_src": i32(row_src, (rows,)),
        "block_expert": i32(block_expert, (rows // block_m,)),
        "num_blocks": i32([offsets[num_local] // block_m]),
        "dest_rank": i32(dest_rank, (num_tokens, top_k)),
        "dest_row": i32(dest_row, (num_tokens, top_k)),
        "overflow": i32(overflow),
    }


def assert_schedule_equals(sched: megamoe.Schedule, expected: dict) -> None:
    for name, value in expected.items():
        got = getattr(sched, name)
        if isinstance(value, torch.Tensor):
            assert_equal(f"Schedule.{name}", got.cpu(), value)
        else:
            assert got == value, f"Schedule.{name}: {got!r} != expected {value!r}"


def check_invariants(sched: megamoe.Schedule, topk_ids: torch.Tensor) -> None:
    """Single-rank invariants: every fitting pair in row_src exactly once, dest_row and row_src inverse maps."""
    num_tokens, top_k = topk_ids.shape
    row_src, dest_row = sched.row_src.long(), sched.dest_row.reshape(-1).long()
    real = row_src[row_src >= 0]
    fitting = (dest_row >= 0).nonzero().flatten()
    assert_equal("sorted real row_src", real.sort().values, fitting)
    assert_equal("row_src[dest_row]", row_src[dest_row[fitting]], fitting)
    real_rows = (row_src >= 0).nonzero().flatten()
    assert_equal("dest_row[row_src]", dest_row[row_src[real_rows]], real_rows)
    assert int(sched.overflow) == int((dest_row < 0).sum()), "overflow != number of dest_row == -1"
    # Each real row sits in its expert's segment, and in a block labelled with that expert.
    offsets = sched.expert_offsets.long()
    experts_of_rows = topk_ids.reshape(-1)[row_src[real_rows]]
    assert ((offsets[experts_of_rows] <= real_rows) & (real_rows < offsets[experts_of_rows + 1])).all(), "row outside segment"
    assert_equal("block_expert of real rows", sched.block_expert[real_rows // sched.block_m].long(), experts_of_rows)
    assert sched.num_rows % sched.block_m == 0
    assert_equal("expert_counts sum", sched.expert_counts.sum().reshape(1), torch.tensor([num_tokens * top_k]))


def single_rank_case(topk_ids, num_experts, block_m, capacity_factor=None):
    config = MoEConfig(capacity_factor=capacity_factor)
    sched = build_schedule(topk_ids, num_experts, config=config, block_m=block_m)
    expected = brute_schedule([topk_ids.tolist()], num_experts, 0, block_m, capacity_factor)
    assert_schedule_equals(sched, expected)
    check_invariants(sched, topk_ids)
    return sched


# (T, E, k, routing kind)
CASES = [
    (7, 4, 2, "random"),
    (1, 4, 1, "random"),  # T=1, k=1
    (1, 1, 1, "random"),  # E_l=1
    (9, 1, 1, "random"),  # E_l=1, all tokens on one expert
    (10, 6, 2, "empty"),  # odd experts never routed
    (13, 5, 3, "one"),  # expert 0 gets every token
    (33, 8, 4, "random"),  # T not a multiple of any block
    (5, 8, 2, "last"),
    (16, 4, 4, "random"),  # k = E
]


def case_id(case):
    num_tokens, num_experts, top_k, route = case
    return f"T{num_tokens}-E{num_experts}-k{top_k}-{route}"


@pytest.mark.parametrize("block_m", [1, 4, 16, 128], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_brute_force(rng, case, block_m):
    num_tokens, num_experts, top_k, route = case
    ids = routing(route, num_tokens, num_experts, top_k, rng)
    sched = single_rank_case(ids, num_experts, block_m)
    assert int(sched.overflow) == 0, "dropless schedule overflowed"


@pytest.mark.parametrize(
    "capacity_factor,route,expect_overflow",
    [(0.25, "one", True), (0.25, "random", True), (1.0, "random", False), (100.0, "one", False), (1e-6, "random", True)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("block_m", [1, 4, 16], ids=lambda b: f"B{b}")
def test_capacity(rng, capacity_factor, route, expect_overflow, block_m):
    # 128 pairs on one rank: c=0.25 leaves 32 rows + one block per expert (<= 96 rows), too few for any
    # routing; c=1.0 leaves all 128 rows + padding blocks, enough for every routing.
    num_tokens, num_experts, top_k = 64, 4, 2
    ids = routing(route, num_tokens, num_experts, top_k, rng)
    sched = single_rank_case(ids, num_experts, block_m, capacity_factor)
    assert (int(sched.overflow) > 0) == expect_overflow, f"overflow={int(sched.overflow)}"
    assert int((sched.dest_row < 0).sum()) == int(sched.overflow)


def test_capacity_rows_never_exceed_worst_case(rng):
    ids = routing("random", 8, 4, 2, rng)
    dropless = build_schedule(ids, 4, block_m=16)
    huge = build_schedule(ids, 4, config=MoEConfig(capacity_factor=1e6), block_m=16)
    assert huge.num_rows == dropless.num_rows
    for name in SCHEDULE_TENSORS:
        assert_equal(f"Schedule.{name}", getattr(huge, name), getattr(dropless, name))


@pytest.mark.parametrize("block_m", [1, 16, 128], ids=lambda b: f"B{b}")
def test_worst_case_routing_fits_dropless(block_m):
    """The routing that wastes the most padding (one pair on every expert but one, the rest on one expert)."""
    num_tokens, num_experts, top_k = 20, 8, 1
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int64)
    ids[: num_experts - 1, 0] = torch.arange(1, num_experts)
    sched = single_rank_case(ids, num_experts, block_m)
    assert int(sched.overflow) == 0


def test_int32_and_int64_ids_agree(rng):
    ids = routing("random", 11, 6, 3, rng)
    a = build_schedule(ids, 6, block_m=4)
    b = build_schedule(ids.to(torch.int32), 6, block_m=4)
    for name in SCHEDULE_TENSORS:
        assert_equal(f"Schedule.{name}", a.__getattribute__(name), b.__getattribute__(name))


def test_block_m_sources(rng):
    """The block_m argument wins over config.block_m, which wins over the default 128."""
    ids = routing("random", 5, 4, 2, rng)
    assert build_schedule(ids, 4).block_m == 128
    assert build_schedule(ids, 4, config=MoEConfig(block_m=8)).block_m == 8
    assert build_schedule(ids, 4, config=MoEConfig(block_m=8), block_m=2).block_m == 2


def test_non_contiguous_ids(rng):
    ids = routing("random", 9, 5, 3, rng)
    view = ids.t().contiguous().t()
    assert not view.is_contiguous()
    a, b = build_schedule(ids, 5, block_m=4), build_schedule(view, 5, block_m=4)
    for name in SCHEDULE_TENSORS:
        assert_equal(f"Schedule.{name}", getattr(b, name), getattr(a, name))


META_CASES = [(7, 4, 2, 16, None), (1, 1, 1, 1, None), (33, 8, 4, 128, None), (24, 4, 2, 4, 0.5), (64, 16, 2, 16, 1.25)]


@pytest.mark.parametrize("case", META_CASES, ids=lambda c: "T{}-E{}-k{}-B{}-cap{}".format(*c))
def test_meta_shapes(rng, case):
    """On `meta` (shapes only, no data) every field has the shape and dtype of the real schedule."""
    num_tokens, num_experts, top_k, block_m, cap = case
    config = MoEConfig(capacity_factor=cap)
    ids = routing("random", num_tokens, num_experts, top_k, rng)
    real = build_schedule(ids, num_experts, config=config, block_m=block_m)
    meta = build_schedule(ids.to("meta"), num_experts, config=config, block_m=block_m)
    assert meta.num_rows == real.num_rows
    for name in SCHEDULE_TENSORS:
        got, want = getattr(meta, name), getattr(real, name)
        assert got.device.type == "meta", f"Schedule.{name} left the meta device"
        assert got.shape == want.shape, f"Schedule.{name}: meta shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.dtype == torch.int32, f"Schedule.{name}: dtype {got.dtype} != int32"


INT32_CASES = [  # T, k, E, block_m, capacity_factor, what does not fit int32
    (2**30, 2, 8, None, None, "2147483648 (token, slot) pairs"),
    (2**31 - 1, 1, 2, 2, None, "2147483648 receive rows"),  # the pairs fit, their padded rows do not
    # the capped rows (~2**30) fit, but the placement kernels sum the padded segments in int32 before the cut
    (2**31 - 1, 1, 2, 2, 0.5, "2147483648 receive rows before any capacity"),
]


@pytest.mark.parametrize("case", INT32_CASES, ids=lambda c: "T{}-k{}-E{}-B{}-c{}".format(*c[:5]))
def test_sizes_beyond_int32_are_a_value_error(case):
    """More (token, slot) pairs or receive rows than int32 holds: a ValueError from the shapes alone (meta tensors),
    not flat source indices and rows that wrap (2**31 + 5 is -2147483643 in int32) and pairs placed wrong."""
    num_tokens, top_k, num_experts, block_m, capacity_factor, words = case
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=rf"topk_ids \[T={num_tokens}, k={top_k}\].*{re.escape(words)}.*2147483647"):
        build_schedule(ids, num_experts, block_m=block_m, config=MoEConfig(capacity_factor=capacity_factor))


def test_sizes_at_int32_limit_are_accepted():
    ids = torch.empty(2**31 - 1, 1, dtype=torch.int64, device="meta")
    assert build_schedule(ids, 1, block_m=1).num_rows == 2**31 - 1


def test_experts_beyond_int32_pairs_is_a_value_error():
    """megamoe.experts raises it before any work (here on meta, where its op runs the fake implementation)."""
    tokens, hidden, inter, experts = 2**30, 4, 3, 8
    x = torch.empty(tokens, hidden, device="meta")
    ids = torch.empty(tokens, 2, dtype=torch.int64, device="meta")
    weights = torch.empty(tokens, 2, device="meta")
    w_gate_up = torch.empty(experts, 2 * inter, hidden, device="meta")
    w_down = torch.empty(experts, hidden, inter, device="meta")
    with pytest.raises(ValueError, match="2147483648 \\(token, slot\\) pairs"):
        megamoe.experts(x, ids, weights, w_gate_up, w_down, config=MoEConfig(backend="torch"))


@pytest.mark.parametrize("block_m,capacity_factor,match", [
    (None, None, r"receive_rows: block_m must be a power of two in \[1, 1024\], got None"),
    (0, None, r"receive_rows: block_m .*got 0"),
    (3, None, r"receive_rows: block_m .*got 3"),
    (16, float("nan"), r"receive_rows: capacity_factor must be None or a finite number > 0, got nan"),
    (16, -1.0, r"receive_rows: capacity_factor .*got -1\.0"),
], ids=["block_m-None", "block_m-0", "block_m-3", "capacity-nan", "capacity-negative"])
def test_receive_rows_bad_arguments_name_them(block_m, capacity_factor, match):
    """receive_rows is how a user sizes the receive rows to declare with get_workspace (README). Each bad argument is
    a ValueError naming it; before, block_m None (MoEConfig's default, which leaves it to the backend) was a TypeError
    from its arithmetic, 0 a ZeroDivisionError, 3 and a negative capacity gave a number of rows, and a NaN capacity
    "cannot convert float NaN to integer"."""
    with pytest.raises(ValueError, match=match):
        megamoe.schedule.receive_rows(4, 2, 8, 2, block_m, capacity_factor)


@pytest.mark.parametrize("index,value,match", [
    (0, -5, r"receive_rows: num_tokens must be an int >= 0, got -5"),
    (0, 16.0, r"receive_rows: num_tokens .*float 16\.0, not an int"),
    (1, 0, r"receive_rows: top_k must be a positive int, got 0"),
    (2, 0, r"receive_rows: num_local_experts must be a positive int, got 0"),
    (3, 0, r"receive_rows: world_size must be a positive int, got 0"),
    (5, "2", r"receive_rows: capacity_factor must be None or a finite number > 0, got '2'"),
    (5, True, r"receive_rows: capacity_factor .*got True"),
], ids=["tokens-negative", "tokens-float", "top_k-0", "experts-0", "world-0", "capacity-str", "capacity-bool"])
def test_receive_rows_bad_sizes_name_them(index, value, match):
    """receive_rows' sizes and capacity as its block_m: a ValueError naming the bad one. Before, T = -5 gave -5120 rows,
    T = 16.0 a float number of rows, E_local = 0 rows for experts that do not exist, W = 0 or k = 0 no rows, a capacity
    of True the rows of a factor 1, and a capacity '2' Python's TypeError from its comparison."""
    args = [4, 2, 8, 2, 16, None]
    args[index] = value
    with pytest.raises(ValueError, match=match):
        megamoe.schedule.receive_rows(*args)


def test_receive_rows_capacity_beyond_the_floats_is_the_worst_case():
    """A capacity_factor that is an int too large for a float (finite, > 0) sizes the worst case, as any capacity at
    least that large does; it was an OverflowError from math.isfinite ("int too large to convert to float")."""
    assert megamoe.schedule.receive_rows(4, 2, 8, 2, 16, 10**400) == megamoe.schedule.receive_rows(4, 2, 8, 2, 16, None)


def test_readme_signature_of_build_schedule():
    """The signature the README's "Use it" shows is build_schedule's: each parameter shown of the same kind, with the
    same default (was: group and config shown as positional, which build_schedule takes by keyword only)."""
    import inspect
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = re.search(r"`megamoe\.build_schedule\(([^)]*)\)`", readme).group(1)
    namespace: dict = {}
    exec(f"def shown({shown}): pass", namespace)
    actual = inspect.signature(build_schedule).parameters
    for name, param in inspect.signature(namespace["shown"]).parameters.items():
        assert (param.kind, param.default) == (actual[name].kind, actual[name].default), name
