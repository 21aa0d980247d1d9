"""Every Triton kernel, and the whole forward/backward, run by Triton's interpreter on CPU.

Triton reads TRITON_INTERPRET when a kernel is *defined*, so these tests must run in a process where it
was set before megamoe's kernels were imported. Two ways:

    TRITON_INTERPRET=1 pytest tests/test_triton_interpret.py     # direct (about 1-2 minutes on 2 cores)
    pytest tests/test_triton_interpret.py                        # re-runs itself in such a subprocess

In a plain pytest process, only `test_interpreter_suite` runs: it starts the subprocess and fails
with its output if any interpreted test fails; the other tests are skipped there.

Shapes are tiny; dtypes fp32 and fp16 (the interpreter cannot run bf16 tl.dot). Each kernel is checked
against an fp64 torch computation from the schedule, and the full path against megamoe.reference.experts
in fp64 + autograd within the error budget (docs/design.md). Launcher outputs are NaN-poisoned, so an element a
kernel forgets to write fails; rows past the rows in use are NaN-filled inputs, so a kernel that reads
them fails. The expert-parallel driver (ep.py) runs on a one-rank group with a CPU workspace and must
match experts.py bitwise, for every dispatch/combine direction and every overlap setting (communication
programs inside the fused kernels, rows per ready flag), and match its own unfused run.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import INTERPRET, INTERPRETER_WARNINGS, interpreted, interpreter_suite, poisoned_empty

pytestmark = INTERPRETER_WARNINGS
test_interpreter_suite = interpreter_suite(__file__)


if INTERPRET:
    from megamoe.backends.triton import block_m_for, ep, kernels
    from megamoe.backends.triton.comm.workspace import Workspace, _Buffer
    from megamoe.backends.triton.experts import empty_saved, experts_bwd, experts_fwd
    from megamoe.backends.triton.kernels._common import num_sms
    from megamoe.config import MoEConfig
    from megamoe.backends.triton.configs import TileConfig
    from megamoe.reference import experts as reference_experts
    from megamoe.schedule import build_schedule

DTYPES = [torch.float32, torch.float16]
# Small tiles so tiny shapes still span several row and column blocks and the grouped tile order.
SMALL = TileConfig(16, 16, 16, num_warps=4, num_stages=2, group_m=2) if INTERPRET else None
COMBINE = TileConfig(4, 16, 1, num_warps=4, num_stages=1) if INTERPRET else None


def assert_close(name, got, want, atol, rtol=0.0):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64 = got.double()
    assert not torch.isnan(got64).any(), f"{name}: NaN at {torch.isnan(got64).nonzero()[:5].tolist()}"
    err = (got64 - want.double()).abs()
    tol = atol + rtol * want.double().abs()
    bad = err > tol
    assert not bad.any(), f"{name}: max err {err.max().item():.3e} (tol {atol:.1e} + {rtol:.1e}*|want|) at {bad.nonzero()[:5].tolist()}"


def tol_for(dtype):
    return (2e-5, 2e-5) if dtype == torch.float32 else (5e-3, 5e-3)


def make_problem(T, H, I, E, k, dtype, routing="random", seed=0, shared=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    if routing == "random":
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    elif routing == "one":  # every slot of every token on expert E-1
        ids = torch.full((T, k), E - 1)
    elif routing == "sparse":  # only experts 1 and E-2 used: the others are empty
        ids = torch.where(torch.rand(T, k, generator=gen) < 0.5, 1, E - 2)
    else:
        raise ValueError(routing)
    weights = torch.rand(T, k, generator=gen)
    w_gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype)
    w_down = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    sgu = sd = None
    if shared:
        sgu = (torch.randn(2 * shared, H, generator=gen) / H**0.5).to(dtype)
        sd = (torch.randn(H, shared, generator=gen) / shared**0.5).to(dtype)
    return x, ids, weights, w_gate_up, w_down, sgu, sd


def row_info(schedule, k):
    """Per receive row (fp64 test side): used?, source pair, token, expert."""
    used = schedule.num_blocks.item() * schedule.block_m
    src = schedule.row_src.long()[:used]
    valid = src >= 0
    token = torch.where(valid, src // k, 0)
    expert = schedule.block_expert.long().repeat_interleave(schedule.block_m)[:used]
    return used, src, valid, token, expert


def swiglu64(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# ----------------------------------------------------------------------------------------------------
# Kernels one by one


def rows_of(tokens, s, k, fill_unused=float("nan")):
    """The expert-contiguous rows [R, H] of token rows: tokens[row_src // k], zero for padding, and
    `fill_unused` past the rows in use (kernels must not read those)."""
    used, src, valid, token, expert = row_info(s, k)
    out = torch.full((s.num_rows, tokens.shape[1]), fill_unused, dtype=tokens.dtype)
    out[:used] = torch.where(valid[:, None], tokens[token], torch.zeros((), dtype=tokens.dtype))
    return out


def random_rows(s, k, cols, dtype, seed=1):
    """Random [R, cols] rows, zero on padding rows and NaN past the rows in use."""
    used, src, valid, token, expert = row_info(s, k)
    out = torch.randn(s.num_rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out[:used][~valid] = 0.0
    out[used:] = float("nan")
    return out


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,E,k,block_m,capacity", [(23, 5, 3, 16, None), (23, 5, 3, 32, None), (48, 3, 2, 16, 0.1)],
                         ids=["b16", "b32", "capacity"])  # the capacity case: 64 rows for 96 pairs
def test_spread_rows_is_the_gather_token_major(dtype, T, E, k, block_m, capacity):
    """spread_rows writes every row in use exactly as the row-major gather (row r = x[row_src[r] // k]) does:
    padding rows zero, pairs without a row (a capacity cut them: dest_row -1) written nowhere, nothing past
    the rows in use."""
    H = 300  # > BLOCK_H and not a multiple of it; block_m 32: more padding rows
    x, ids, _, _, _, _, _ = make_problem(T, H, 8, E, k, dtype)
    s = build_schedule(ids, E, block_m=block_m, config=MoEConfig(capacity_factor=capacity))
    assert (s.dest_row < 0).any() == (capacity is not None), "the capacity case must cut pairs"
    used, src, valid, token, expert = row_info(s, k)
    with poisoned_empty():
        got = kernels.spread_rows(x, s.dest_row, s.row_src, s.expert_offsets[-1:])
    assert got.shape == (s.num_rows, H) and got.dtype == dtype
    assert torch.equal(got[:used], rows_of(x, s, k)[:used]), "spread_rows differs from the gather"
    assert (got[:used][~valid] == 0).all() and (~valid).any(), "padding rows must be zero (and exist here)"
    assert torch.isnan(got[used:]).all(), "spread_rows wrote rows past the rows in use"
    with poisoned_empty():
        pads = kernels.spread_rows(x, s.dest_row, s.row_src, s.expert_offsets[-1:], padding_only=True)
    assert (pads[:used][~valid] == 0).all(), "padding_only must zero the padding rows"
    assert torch.isnan(pads[:used][valid]).all() and torch.isnan(pads[used:]).all(), (
        "padding_only wrote rows other than the padding rows")


@interpreted
def test_row_passes_refuse_bad_maps():
    """spread_rows: a map of another dtype or shape is a ValueError naming it, before any launch."""
    x, ids, _, _, _, _, _ = make_problem(23, 64, 8, 5, 3, torch.float32)
    s = build_schedule(ids, 5, block_m=16)
    in_use = s.expert_offsets[-1:]
    with pytest.raises(ValueError, match=r"dest_row must be a contiguous int32 \[23, k\] tensor, got torch.int64"):
        kernels.spread_rows(x, s.dest_row.long(), s.row_src, in_use)
    with pytest.raises(ValueError, match=r"dest_row must be a contiguous int32 \[23, k\]"):
        kernels.spread_rows(x, s.dest_row[:5], s.row_src, in_use)
    with pytest.raises(ValueError, match=r"row_src must be a contiguous int32 \[R\] tensor, got torch.int64"):
        kernels.spread_rows(x, s.dest_row, s.row_src.long(), in_use)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("H", [48, 40], ids=["H48-evenK", "H40-oddK"])
@pytest.mark.parametrize("store", [True, False], ids=["save", "nosave"])
def test_gate_up_fwd(dtype, H, store):
    T, I, E, k = 23, 40, 4, 2
    x, ids, _, wgu, _, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=32)  # kernel BM=16: two kernel row blocks per schedule block
    with poisoned_empty():
        h, gate_up = kernels.gate_up_fwd(rows_of(x, s, k), wgu, s.block_expert, s.num_blocks,
                                         store_gate_up=store, config=SMALL)
    used, src, valid, token, expert = row_info(s, k)
    want_gu = torch.einsum("rh,rnh->rn", x.double()[token], wgu.double()[expert]) * valid[:, None]
    atol, rtol = tol_for(dtype)
    assert_close("h", h[:used], swiglu64(want_gu), atol, rtol)
    assert (h[:used][~valid] == 0).all(), "h: padding rows must be exactly zero"
    if store:
        assert_close("gate_up", gate_up[:used], want_gu, atol, rtol)
    else:
        assert gate_up is None


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("I", [48, 40], ids=["I48-evenK", "I40-oddK"])
def test_down_fwd(dtype, I):
    T, H, E, k = 21, 40, 5, 3
    _, ids, _, _, wd, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=16)
    used, src, valid, token, expert = row_info(s, k)
    h = random_rows(s, k, I, dtype)
    with poisoned_empty():
        y = kernels.down_fwd(h, wd, s.block_expert, s.num_blocks, config=SMALL)
    want = torch.einsum("ri,rhi->rh", h[:used].double(), wd.double()[expert])
    assert y.shape == (s.num_rows, H)
    assert_close("y_rows", y[:used], want, *tol_for(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("H", [48, 40], ids=["H48-evenK", "H40-oddK"])
def test_down_dgrad(dtype, H):
    T, I, E, k = 19, 24, 4, 2
    _, ids, _, _, wd, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=16)
    used, src, valid, token, expert = row_info(s, k)
    d_y = random_rows(s, k, H, dtype, seed=2)
    gate_up = random_rows(s, k, 2 * I, dtype, seed=3)
    with poisoned_empty():
        d_gu = kernels.down_dgrad(d_y, wd, gate_up, s.block_expert, s.num_blocks, config=SMALL)
    d_h = torch.einsum("rh,rhi->ri", d_y[:used].double(), wd.double()[expert])
    gu = gate_up[:used].double().clone().requires_grad_()
    (d_want,) = torch.autograd.grad(swiglu64(gu), gu, d_h)
    assert_close("d_gate_up", d_gu[:used], d_want, *tol_for(dtype))
    assert (d_gu[:used][~valid] == 0).all(), "d_gate_up: padding rows must be exactly zero"


@interpreted
def test_gemm_bench_torch_side_of_down_dgrad_router():
    """benchmarks/gemm_bench.py times down_dgrad as the path runs it (kernels.down_dgrad_router on unweighted d_out
    rows) against cuBLAS plus down_dgrad_router_torch, the torch ops its epilogue replaces: those compute the same
    d_gate_up, h_w and router-weight row sums as the kernel."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gemm_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_bench.py")
    gemm_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gemm_bench)
    T, H, I, E, k = 19, 40, 24, 4, 2
    _, ids, weights, _, wd, _, _ = make_problem(T, H, I, E, k, torch.float32)
    s = build_schedule(ids, E, block_m=16)
    used, src, valid, token, expert = row_info(s, k)
    d_out_rows = random_rows(s, k, H, torch.float32, seed=2)
    gate_up = random_rows(s, k, 2 * I, torch.float32, seed=3)
    row_w = torch.where(s.row_src >= 0, weights.reshape(-1)[s.row_src.clamp(min=0).long()], 0.0)
    d_gu, h_w, d_w_part = kernels.down_dgrad_router(d_out_rows, wd, gate_up, s.row_src, weights, s.block_expert,
                                                    s.num_blocks, store_h_w=True, config=SMALL)
    torch_side = gemm_bench.down_dgrad_router_torch(d_out_rows[:used], wd, gate_up[:used], row_w[:used],
                                                    s.expert_offsets[1:].contiguous())
    for name, got, want in zip(("d_gate_up", "h_w", "d_w rows"), (d_gu, h_w, d_w_part.sum(-1)), torch_side):
        assert_close(name, got[:used], want, *tol_for(torch.float32))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("I", [24, 20], ids=["I24-evenK", "I20-oddK"])
def test_gate_up_dgrad(dtype, I):
    T, H, E, k = 19, 40, 4, 2
    _, ids, _, wgu, _, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=16)
    used, src, valid, token, expert = row_info(s, k)
    d_gu = random_rows(s, k, 2 * I, dtype)
    with poisoned_empty():
        d_x = kernels.gate_up_dgrad(d_gu, wgu, s.block_expert, s.num_blocks, config=SMALL)
    want = torch.einsum("rn,rnh->rh", d_gu[:used].double(), wgu.double()[expert])
    assert d_x.shape == (s.num_rows, H)
    assert_close("d_x_rows", d_x[:used], want, *tol_for(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("routing", ["random", "sparse"], ids=["random", "empty-experts"])
def test_weight_grads(dtype, routing):
    T, H, I, E, k = 29, 40, 24, 5, 2
    x, ids, _, _, _, _, _ = make_problem(T, H, I, E, k, dtype, routing=routing)
    s = build_schedule(ids, E, block_m=32)
    used, src, valid, token, expert = row_info(s, k)
    d_y, h, d_gu = (random_rows(s, k, n, dtype, seed=i) for i, n in enumerate((H, I, 2 * I)))
    x_rows = rows_of(x, s, k)
    with poisoned_empty():
        dw_d = kernels.dw_down(d_y, h, s.expert_offsets, E, config=SMALL)
        dw_gu = kernels.dw_gate_up(d_gu, x_rows, s.expert_offsets, E, config=SMALL)
    want_d = torch.zeros(E, H, I, dtype=torch.float64)
    want_gu = torch.zeros(E, 2 * I, H, dtype=torch.float64)
    for e in range(E):
        rows = expert == e
        want_d[e] = d_y[:used][rows].double().t() @ h[:used][rows].double()
        want_gu[e] = d_gu[:used][rows].double().t() @ x_rows[:used][rows].double()
    assert_close("d_w_down", dw_d, want_d, *tol_for(dtype))
    assert_close("d_w_gate_up", dw_gu, want_gu, *tol_for(dtype))
    if routing == "sparse":
        assert (dw_d[0] == 0).all() and (dw_gu[0] == 0).all(), "empty expert 0 must get exact zero grads"


@interpreted
def test_dw_gate_up_refuses_a_d_gate_up_not_2d():
    """dw_gate_up: a d_gate_up that is not [R, 2I] is a ValueError naming it (before: a 1-D one, an IndexError)."""
    s = build_schedule(torch.zeros(4, 1, dtype=torch.int64), 1, block_m=16)
    for d_gate_up in (torch.zeros(16), torch.zeros(16, 3)):
        with pytest.raises(ValueError, match=r"d_gate_up must be a \[R, 2I\] tensor, got"):
            kernels.dw_gate_up(d_gate_up, torch.zeros(16, 8), s.expert_offsets, 1, config=SMALL)


@interpreted
def test_down_dgrad_refuses_a_gate_up_of_another_dtype():
    """down_dgrad / down_dgrad_router: a gate_up not in the rows' dtype is a ValueError naming both, on every core, as
    the Gluon kernel's own launcher (gluon_down_dgrad) refuses it (before: accepted by grouped_gemm, whose Gluon branch
    skips that launcher's check: the kernel stages gate_up in shared memory of the rows' dtype)."""
    _, ids, _, _, wd, _, _ = make_problem(10, 32, 16, 3, 2, torch.float32)
    s = build_schedule(ids, 3, block_m=16)
    rows, gate_up = torch.zeros(s.num_rows, 32), torch.zeros(s.num_rows, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"gate_up \(torch.float16\) must have the rows' dtype \(torch.float32\)"):
        kernels.down_dgrad(rows, wd, gate_up, s.block_expert, s.num_blocks, config=SMALL)
    with pytest.raises(ValueError, match=r"gate_up \(torch.float16\) must have the rows' dtype \(torch.float32\)"):
        kernels.down_dgrad_router(rows, wd, gate_up, s.row_src, torch.ones(10, 2), s.block_expert, s.num_blocks,
                                  store_h_w=True, config=SMALL)


@interpreted
def test_gate_up_dgrad_refuses_an_odd_d_gate_up():
    """gate_up_dgrad: a d_gate_up (and w_gate_up) with an odd column count is not [R, 2I]: a ValueError naming it, as
    dw_gate_up's (before: accepted, the pointer-load kernel reading rows of 2 * (2I // 2) columns: every row but the
    first shifted, a wrong d_x_rows, silently)."""
    _, ids, _, _, _, _, _ = make_problem(10, 32, 16, 3, 2, torch.float32)
    s = build_schedule(ids, 3, block_m=16)
    with pytest.raises(ValueError, match=r"d_gate_up must be a \[R, 2I\] tensor, got \(64, 5\)"):
        kernels.gate_up_dgrad(torch.zeros(s.num_rows, 5), torch.zeros(3, 5, 32), s.block_expert, s.num_blocks,
                              config=SMALL)


@interpreted
def test_weight_grads_refuse_strided_expert_offsets():
    """dw_down / dw_gate_up read expert_offsets as a contiguous int32 array: a strided view is a ValueError naming
    it, before any launch (before: accepted, expert e's rows read from elements e and e + 1 of the storage, not of
    the view: other experts' rows summed into its gradient, silently)."""
    _, ids, _, _, _, _, _ = make_problem(10, 32, 16, 3, 2, torch.float32)
    s = build_schedule(ids, 3, block_m=16)
    strided = torch.stack([s.expert_offsets, torch.zeros_like(s.expert_offsets)], 1)[:, 0]
    rows = torch.zeros(s.num_rows, 32)
    for launch in (kernels.dw_down, kernels.dw_gate_up):
        with pytest.raises(ValueError, match=r"expert_offsets must be a contiguous int32 \[4\] tensor, got torch.int32 "
                                             r"\(4,\) \(not contiguous\)"):
            launch(rows, rows, strided, 3, config=SMALL)
        launch(rows, rows, strided.contiguous(), 3, config=SMALL)  # the same values, contiguous: accepted


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "noshared"])
def test_combine(dtype, shared):
    T, H, k, N = 11, 40, 3, 50
    rows = torch.randn(N, H).to(dtype)
    weights = torch.rand(T, k)
    index = torch.randperm(N, generator=torch.Generator().manual_seed(3))[: T * k].to(torch.int32).view(T, k).contiguous()
    index[2, 1] = -1  # a pair cut by a capacity: no row, counts as zero
    sh = torch.randn(T, H).to(dtype) if shared else None
    with poisoned_empty():
        out = kernels.combine(rows, weights, index, sh, config=COMBINE)
        summed = kernels.combine(rows, None, index, None, config=COMBINE)
    y64 = torch.where((index >= 0)[..., None], rows.double()[index.long().clamp(min=0)], 0.0)  # [T, k, H]
    want = torch.zeros(T, H, dtype=torch.float64)
    for j in range(k):
        want = want + weights[:, j : j + 1].double() * y64[:, j]
    if shared:
        want = want + sh.double()
    atol, rtol = tol_for(dtype)
    assert_close("out", out, want, atol, rtol)
    assert_close("sum_rows", summed, y64.sum(1), atol, rtol)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parts", [6, 40], ids=["one-step", "three-steps"])
def test_row_sums(dtype, parts):
    """The router weights' gradient from down_dgrad's partials: row index[t, j]'s partials summed, 0 where -1."""
    T, k, R = 300, 3, 1000  # two programs of pairs, the second partly masked
    parts_RP = torch.randn(R, parts)
    index = torch.randperm(R, generator=torch.Generator().manual_seed(5))[: T * k].to(torch.int32).view(T, k).contiguous()
    index[7, 2] = -1  # a pair cut by a capacity
    with poisoned_empty():
        got = kernels.row_sums(parts_RP, index, dtype)
    want = torch.where(index >= 0, parts_RP.double().sum(1)[index.long().clamp(min=0)], 0.0)
    assert got.dtype == dtype and got.shape == (T, k)
    # fp32 sums in both; bf16 results within one bf16 ulp (2^-7 relative) of the exact sum
    assert_close("d_topk_weights", got, want, *(tol_for(dtype) if dtype == torch.float32 else (1e-6, 2.0**-7)))
    assert got[7, 2] == 0, "a pair without a row must get a zero router-weight gradient"
    again = kernels.row_sums(parts_RP, index, dtype)
    assert torch.equal(got, again), "row_sums must repeat its bits"


# ----------------------------------------------------------------------------------------------------
# Full forward + backward against the reference


def budget_check(name, got, want64, ref_lowp):
    """The error budget (docs/design.md): |ours - fp64| <= 2 |reference in the same dtype - fp64| + 1e-5 (max norms)."""
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = (got.double() - want64).abs().max().item()
    ref_err = (ref_lowp.double() - want64).abs().max().item()
    scale = want64.abs().max().item()
    budget = 2 * ref_err + 1e-5 * max(1.0, scale)
    assert err <= budget, f"{name}: error {err:.3e} > budget {budget:.3e} (reference's own error {ref_err:.3e})"


def run_reference(x, ids, weights, wgu, wd, sgu, sd, d_out, dtype):
    leaves = [t.to(dtype).clone().requires_grad_() if t is not None else None for t in (x, weights, wgu, wd, sgu, sd)]
    if dtype != torch.float64:
        leaves[1] = weights.clone().requires_grad_()  # router weights stay fp32
    out = reference_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], shared_gate_up=leaves[4], shared_down=leaves[5])
    out.backward(d_out.to(dtype))
    return out.detach(), [t.grad if t is not None else None for t in leaves]


CASES = {
    # id: (T, H, I, E, k, routing, shared I, block_m)
    "T37-H48-I40-E5-k3-shared": (37, 48, 40, 5, 3, "random", 24, 16),
    "T37-H40-I20-E6-k2-oddK": (37, 40, 20, 6, 2, "random", 0, 16),
    "T40-H32-I32-E8-k2-empty-experts": (40, 32, 32, 8, 2, "sparse", 0, 16),
    "T33-H32-I16-E4-k1-one-expert": (33, 32, 16, 4, 1, "one", 0, 16),
    "T17-H32-I16-E3-k2-one-expert-both-slots": (17, 32, 16, 3, 2, "one", 16, 32),
    "T1-H32-I16-E4-k1": (1, 32, 16, 4, 1, "random", 0, 16),
    "T1-H32-I16-E1-k1-El1": (1, 32, 16, 1, 1, "random", 16, 16),
    # every expert in every token's slots (k = E), segments of one 64-row block mostly padding
    "T7-H72-I8-E3-k3-k-is-E-bm64": (7, 72, 8, 3, 3, "random", 8, 64),
    # a schedule block of two kernel row tiles (128) in every GEMM, the weight grads' row loop over 256-row segments
    "T20-H24-I12-E4-k2-bm256": (20, 24, 12, 4, 2, "random", 0, 256),
}


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_experts_fwd_bwd(case, dtype):
    T, H, I, E, k, routing, shared, block_m = CASES[case]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, dtype, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    s = build_schedule(ids, E, block_m=block_m)
    with poisoned_empty():
        out, saved = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None)
        grads = experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved)
    out64, grads64 = run_reference(x, ids, weights, wgu, wd, sgu, sd, d_out, torch.float64)
    out_lp, grads_lp = run_reference(x, ids, weights, wgu, wd, sgu, sd, d_out, dtype)
    assert out.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == torch.float32
    budget_check("out", out, out64, out_lp)
    names = ["d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_shared_gate_up", "d_shared_down"]
    for name, got, want, lp in zip(names, grads, grads64, grads_lp):
        if want is None:
            assert got is None, f"{name}: expected None without a shared expert"
            continue
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        budget_check(name, got, want, lp)


@interpreted
def test_recompute_matches_save_bitwise():
    x, ids, weights, wgu, wd, sgu, sd = make_problem(37, 48, 40, 5, 3, torch.float16, shared=16)
    d_out = torch.randn(37, 48).half()
    s = build_schedule(ids, 5, block_m=16)
    results = []
    for recompute in (False, True):
        config = MoEConfig(recompute=recompute)
        out, saved = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None, config)
        per_row = saved[0].numel()
        assert per_row == (0 if recompute else s.num_rows * 2 * 40), f"recompute={recompute}: saved gate_up {tuple(saved[0].shape)}"
        results.append((out, *experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, config, saved)))
    for name, a, b in zip(["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_sgu", "d_sd"], *results):
        assert torch.equal(a, b), f"{name}: recompute differs from save"


@interpreted
def test_backward_releases_gate_up_and_a_second_backward_recomputes_it():
    """The backward frees the saved gate_up's memory once it has read it (autograd would hold it to the end);
    a second backward through the same forward (retain_graph=True) recomputes it and gives the same bits."""
    x, ids, weights, wgu, wd, sgu, sd = make_problem(37, 48, 40, 5, 3, torch.float16, shared=16)
    d_out = torch.randn(37, 48).half()
    s = build_schedule(ids, 5, block_m=16)
    _, saved = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None, None)
    assert saved[0].untyped_storage().nbytes() == s.num_rows * 2 * 40 * 2
    first = experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved)
    assert saved[0].untyped_storage().nbytes() == 0, "gate_up's memory still held after the backward"
    second = experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved)
    for name, a, b in zip(["d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_sgu", "d_sd"], first, second):
        assert torch.equal(a, b), f"{name}: the second backward differs from the first"


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_shared_expert_gradients_are_the_torch_paths(dtype):
    """The shared expert is one implementation for every backend (backends/swiglu.py): its gradients from the
    one-GPU Triton driver are the torch path's, bit for bit (ep.py's are experts.py's: test_ep_matches_one_gpu)."""
    from megamoe.backends import torch_native
    from megamoe.backends.triton import experts as triton_experts

    x, ids, weights, wgu, wd, sgu, sd = make_problem(37, 48, 40, 5, 3, dtype, shared=24)
    d_out = torch.randn(37, 48, generator=torch.Generator().manual_seed(7)).to(dtype)
    s = build_schedule(ids, 5, block_m=16)
    shared_grads = {}
    for backend in (triton_experts, torch_native):
        _, saved = backend.experts_fwd(x, weights, wgu, wd, sgu, sd, s, None, None)
        shared_grads[backend] = backend.experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved)[4:]
    for name, a, b in zip(["d_shared_gate_up", "d_shared_down"], shared_grads[triton_experts], shared_grads[torch_native]):
        assert torch.equal(a, b), f"{name}: the Triton path differs from the torch path (max {(a - b).abs().max():.3e})"


# ----------------------------------------------------------------------------------------------------
# The TMA core (kernels/tma_gemm.py): the same GEMMs with descriptor copies. On a GPU it runs where
# tma_kernel_configs allows; here it is forced, and must give the pointer core's bits (same tiles, same K
# order), with K and N tails that are not multiples of the tile (H40: 16 + 16 + 8, I24: 16 + 8).

TMA_CASES = {
    # id: (T, H, I, E, k, routing, shared I)
    "T37-H48-I40-E5-k3-shared": (37, 48, 40, 5, 3, "random", 24),
    "T29-H40-I24-E6-k2-tails": (29, 40, 24, 6, 2, "random", 0),
    "T40-H32-I32-E8-k2-empty-experts": (40, 32, 32, 8, 2, "sparse", 0),
}


def _as_tma(table):
    """A tile table with every GEMM entry switched to the TMA core (same tiles, same K order)."""
    gemms = [f.name for f in dataclasses.fields(table) if f.name != "combine"]
    return dataclasses.replace(table, **{n: dataclasses.replace(getattr(table, n), tma=True) for n in gemms})


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(TMA_CASES), ids=list(TMA_CASES))
def test_tma_core_matches_pointer_core_bitwise(case, dtype, monkeypatch):
    from megamoe.backends.triton import experts as triton_experts
    from megamoe.backends.triton.configs import kernel_configs

    T, H, I, E, k, routing, shared = TMA_CASES[case]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, dtype, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    s = build_schedule(ids, E, block_m=32)

    def run(tma):
        assert triton_experts.one_gpu_configs(x, wgu, wd, s).gate_up_fwd.tma == tma, f"tma={tma} core not selected"
        with poisoned_empty():
            out, saved = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None)
            return (out, *experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved))

    pointer = run(False)
    # The pointer core's own tiles, so that both cores sum every output in the same order.
    monkeypatch.setattr(triton_experts, "tma_kernel_configs", lambda *args: _as_tma(kernel_configs(*args)))
    tma = run(True)

    def gathering(table):  # gate_up_fwd gathering x in its loads (no gather pass)
        return dataclasses.replace(table, gate_up_fwd=dataclasses.replace(table.gate_up_fwd, gather=True))

    monkeypatch.setattr(triton_experts, "tma_kernel_configs", lambda *args: gathering(_as_tma(kernel_configs(*args))))
    tma_gathering = run(True)
    names = ["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_shared_gate_up", "d_shared_down"]
    for core, results in (("TMA core", tma), ("TMA core gathering x in gate_up_fwd", tma_gathering)):
        for name, a, b in zip(names, pointer, results):
            if a is None:
                assert b is None, f"{name}: expected None"
                continue
            assert not torch.isnan(b).any(), f"{name}: NaN from the {core}"
            assert torch.equal(a, b), f"{name}: {core} differs from the pointer core (max {(a - b).abs().max():.3e})"


@interpreted
def test_tma_core_refuses_unaligned_rows(monkeypatch):
    """TMA needs 16-byte row strides: I = 20 fp16 (40 bytes) is refused by the launcher, and the one-GPU
    path keeps the pointer core for such weights even where the TMA tiles would apply."""
    from megamoe.backends.triton import experts as triton_experts
    from megamoe.backends.triton.configs import kernel_configs

    x, ids, _, wgu, wd, _, _ = make_problem(19, 40, 20, 4, 2, torch.float16)
    s = build_schedule(ids, 4, block_m=16)
    h = random_rows(s, 2, 20, torch.float16)
    with pytest.raises(ValueError, match="16-byte"):
        kernels.down_fwd(h, wd, s.block_expert, s.num_blocks, config=dataclasses.replace(SMALL, tma=True))
    monkeypatch.setattr(triton_experts, "tma_kernel_configs", lambda *args: _as_tma(kernel_configs(*args)))
    assert not triton_experts.one_gpu_configs(x, wgu, wd, s).gate_up_fwd.tma


@interpreted
def test_gate_up_fwd_refuses_a_bad_gather():
    """gate_up_fwd gathering x in its loads (TMA core): a row_src not a contiguous int32 [R] or a top_k below 1 is a
    ValueError naming it, before any launch (before: accepted, the kernel reading wrong rows or dividing by 0)."""
    x, ids, _, wgu, _, _, _ = make_problem(10, 32, 16, 3, 2, torch.float16)
    s = build_schedule(ids, 3, block_m=16)

    def run(row_src, top_k):
        kernels.gate_up_fwd(x, wgu, s.block_expert, s.num_blocks, store_gate_up=False,
                            config=dataclasses.replace(SMALL, tma=True), gather=(row_src, top_k))

    with pytest.raises(ValueError, match=r"row_src must be a contiguous int32"):
        run(torch.stack([s.row_src, s.row_src], 1)[:, 0], 2)
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        run(s.row_src, 0)


@interpreted
def test_row_block_gemms_refuse_a_strided_block_expert():
    """The row-block GEMMs read block_expert as a contiguous int32 array: a strided view (a column of a larger
    tensor) is a ValueError naming it, before any launch (before: accepted, block b run with the expert at element b
    of the storage, not the view's entry b)."""
    x, ids, _, wgu, wd, _, _ = make_problem(10, 32, 16, 3, 2, torch.float32)
    s = build_schedule(ids, 3, block_m=16)
    strided = torch.stack([s.block_expert, torch.zeros_like(s.block_expert)], 1)[:, 0]
    rows = torch.zeros(s.num_rows, 32)
    gate_up = torch.zeros(s.num_rows, 32)
    launches = {
        "gate_up_fwd": lambda be: kernels.gate_up_fwd(rows, wgu, be, s.num_blocks, store_gate_up=False, config=SMALL),
        "down_fwd": lambda be: kernels.down_fwd(torch.zeros(s.num_rows, 16), wd, be, s.num_blocks, config=SMALL),
        "down_dgrad": lambda be: kernels.down_dgrad(rows, wd, gate_up, be, s.num_blocks, config=SMALL),
        "gate_up_dgrad": lambda be: kernels.gate_up_dgrad(gate_up, wgu, be, s.num_blocks, config=SMALL),
    }
    for name, launch in launches.items():
        with pytest.raises(ValueError, match=r"block_expert must be a contiguous int32 \[R // block_m\] tensor, got "
                                             r"torch.int32 \(4,\) \(not contiguous\)"):
            launch(strided)
        launch(strided.contiguous())  # the same values, contiguous: accepted


def _gather_x_on_the_tma_core(monkeypatch):
    """experts.py takes the TMA core's tiles (as on Hopper; Triton's kernels, which the interpreter runs), gate_up_fwd
    gathering x in its loads."""
    from megamoe.backends.triton import experts as triton_experts
    from megamoe.backends.triton.configs import kernel_configs

    def gathering(*args):
        table = _as_tma(kernel_configs(*args))
        return dataclasses.replace(table, gate_up_fwd=dataclasses.replace(table.gate_up_fwd, gather=True))

    monkeypatch.setattr(triton_experts, "tma_kernel_configs", gathering)


def _assert_same_bits(x, x_other, d_out, weights, wgu, wd, s):
    """The one-GPU forward and backward on x and on x_other (the same values in another layout) agree bit for bit."""

    def run(x_in):
        out, saved = experts_fwd(x_in, weights, wgu, wd, None, None, s, None)
        return (out, *experts_bwd(d_out, x_in, weights, wgu, wd, None, None, s, None, None, saved)[:4])

    for name, a, b in zip(["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down"], run(x), run(x_other)):
        assert torch.equal(a, b), name


@interpreted
def test_tma_core_takes_x_at_an_unaligned_base(monkeypatch):
    """A contiguous x whose base is not 16-byte aligned (a view at an odd offset of a larger buffer; H a multiple
    of 8, so the TMA tiles apply) runs on the TMA core gathering x in gate_up_fwd, with the bits of an aligned x
    (before: the launcher's TMA check refused it, a ValueError from megamoe.experts on Hopper for H <= 2048)."""
    _gather_x_on_the_tma_core(monkeypatch)
    T, H, I, E, k = 19, 32, 16, 4, 2
    x, ids, weights, wgu, wd, _, _ = make_problem(T, H, I, E, k, torch.float16)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).half()
    unaligned = torch.empty(T * H + 1, dtype=torch.float16)[1:].view(T, H)
    unaligned.copy_(x)
    assert unaligned.is_contiguous() and unaligned.data_ptr() % 16
    s = build_schedule(ids, E, block_m=16)
    _assert_same_bits(x, unaligned, d_out, weights, wgu, wd, s)


@interpreted
def test_tma_core_takes_a_one_token_x_with_an_odd_stride(monkeypatch):
    """x [1, H] as a column's transpose (strides (1, 1): contiguous to torch, not to a TMA descriptor, whose strides
    but the last must be multiples of 16 bytes) runs on the TMA core gathering x in gate_up_fwd, with the bits of x
    [1, H] in the contiguous format (before: tma_addressable let it through and the descriptor's assert failed); so
    does a weight whose size-1 expert dimension has such a stride, on the pointer-load core instead."""
    from megamoe.backends.triton import experts as triton_experts

    _gather_x_on_the_tma_core(monkeypatch)
    H, I, E, k = 32, 16, 4, 2
    x, ids, weights, wgu, wd, _, _ = make_problem(1, H, I, E, k, torch.float16)
    d_out = torch.randn(1, H, generator=torch.Generator().manual_seed(7)).half()
    column = x.view(H, 1).T  # x's memory seen as a column's transpose: strides (1, 1)
    assert column.is_contiguous() and column.stride() == (1, 1)
    s = build_schedule(ids, E, block_m=16)
    _assert_same_bits(x, column, d_out, weights, wgu, wd, s)
    one_expert = wgu[0].view(2 * I, H, 1).permute(2, 0, 1)  # [1, 2I, H], strides (1, H, 1)
    assert one_expert.is_contiguous() and one_expert.stride()[0] == 1
    one_s = build_schedule(torch.zeros_like(ids), 1, block_m=16)
    assert not triton_experts.one_gpu_configs(x, one_expert, wd[:1], one_s).gate_up_fwd.tma


@interpreted
def test_capacity_cut_pairs_count_as_zero():
    """Pairs a declared capacity cut (dest_row -1) contribute nothing and get zero router grads, never NaN."""
    T, H, I, E, k = 48, 32, 16, 3, 2
    x, ids, weights, wgu, wd, _, _ = make_problem(T, H, I, E, k, torch.float32)
    s = build_schedule(ids, E, block_m=16, config=MoEConfig(capacity_factor=0.1))  # 64 rows for 96 pairs
    assert s.overflow.item() > 0, "test setup: the capacity must cut some pairs"
    kept = (s.dest_row >= 0).float()
    d_out = torch.randn(T, H)
    with poisoned_empty():
        out, saved = experts_fwd(x, weights, wgu, wd, None, None, s, None)
        grads = experts_bwd(d_out, x, weights, wgu, wd, None, None, s, None, None, saved)
    out64, grads64 = run_reference(x, ids, weights * kept, wgu, wd, None, None, d_out, torch.float64)
    tol = tol_for(torch.float32)
    assert_close("out", out, out64, *tol)
    assert_close("d_x", grads[0], grads64[0], *tol)
    assert_close("d_topk_weights", grads[1], grads64[1] * kept, *tol)
    assert_close("d_w_gate_up", grads[2], grads64[2], *tol)
    assert_close("d_w_down", grads[3], grads64[3], *tol)


@interpreted
def test_block_m_check_and_table():
    x, ids, weights, wgu, wd, _, _ = make_problem(4, 32, 16, 2, 1, torch.float32)
    bad = build_schedule(ids, 2, block_m=8)
    with pytest.raises(ValueError, match="block_m"):
        experts_fwd(x, weights, wgu, wd, None, None, bad, None)
    for H, I in [(2048, 768), (4096, 1536), (7168, 2048), (2880, 2880), (4096, 14336)]:
        assert block_m_for(H, I, torch.bfloat16) == 128


# ----------------------------------------------------------------------------------------------------
# The expert-parallel driver (ep.py) on one rank, with a CPU workspace


class RecordingBarrier:
    """A symmetric-memory handle whose barrier does nothing but note the channel it was called on."""

    channels: list = []

    def barrier(self, channel=0, timeout_ms=None):
        del timeout_ms
        self.channels.append(channel)


def fake_workspace(group, *, device, num_tokens, hidden_size, top_k, num_rows, dtype, comm_timeout_ms):
    """comm/workspace.py's Workspace for a group of one, on plain CPU tensors: each buffer's peer table
    holds its own address (the interpreter dereferences it as host memory), barriers do nothing (but note
    their channels in RecordingBarrier.channels)."""
    del group, device

    def buf(shape, dt):
        local = torch.full(shape, float("nan") if dt.is_floating_point else -7, dtype=dt)
        return _Buffer(local, RecordingBarrier(), torch.tensor([local.data_ptr()], dtype=torch.int64))

    return Workspace(
        group_name="fake", rank=0, world_size=1, comm_timeout_ms=comm_timeout_ms,
        tokens=buf((num_tokens, hidden_size), dtype), weights=buf((num_tokens, top_k), torch.float32),
        ids=buf((num_tokens, top_k), torch.int32), pairs=buf((num_tokens * top_k, hidden_size), dtype),
        rows_in=buf((num_rows, hidden_size), dtype), rows_out=buf((num_rows, hidden_size), dtype),
    )


EP_CASES = ["T37-H48-I40-E5-k3-shared", "T40-H32-I32-E8-k2-empty-experts", "T1-H32-I16-E1-k1-El1"]
DIRECTIONS = {"pull-push": ("pull", "push"), "push-pull": ("push", "pull")}
# (num_comm_sms, minibatch_tokens): the default (DEFAULT_COMM_SMS communication programs: all 3 programs
# of a CPU grid pull, then compute; a flag per block), one communication program and two GEMM programs
# (a flag per block), and two communication programs with flags over ~16 tokens' rows. The unfused run
# (overlap=False: whole exchanges around plain GEMMs) is the reference. All must give the same bits.
OVERLAPS = {"default": (None, None), "comm1-mb1": (1, 1), "comm2-mb16": (2, 16)}


def run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config, overlap=True):
    out, saved = ep.experts_fwd(x, weights, wgu, wd, sgu, sd, s, None, config, overlap=overlap)
    grads = ep.experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, config, saved, overlap=overlap)
    return (out, *grads), saved


# Every case x direction x overlap setting dropless; with a capacity, the default only (interpreter time).
EP_PARAMS = [
    pytest.param(case, capacity, directions, overlap, id=f"{case}-{'dropless' if capacity is None else 'capacity'}-{directions}-{overlap}")
    for case in EP_CASES
    for capacity in (None, 0.3)
    for directions in DIRECTIONS
    for overlap in (OVERLAPS if capacity is None else ["default"])
]


@interpreted
@pytest.mark.parametrize("directions", list(DIRECTIONS))
@pytest.mark.parametrize("overlap", [True, False], ids=["fused", "whole-exchanges"])
def test_ep_barriers_name_their_exchange(directions, overlap, monkeypatch):
    """Every barrier of an exchange waits on that exchange's channel (workspace.BARRIER_CHANNELS), so that
    torch's timeout report ("... failed to receive signal from rank P on channel C ...") names it: the
    forward's and the backward's barriers each run the dispatch's channel, then the combine's."""
    import re

    from megamoe.backends.triton.comm.workspace import BARRIER_CHANNELS

    T, H, I, E, k, routing, shared, block_m = CASES["T37-H48-I40-E5-k3-shared"]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, torch.float16, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).half()
    dispatch, combine = DIRECTIONS[directions]
    config = MoEConfig(dispatch=dispatch, combine=combine)
    s = build_schedule(ids, E, block_m=block_m, config=config)
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    monkeypatch.setattr(RecordingBarrier, "channels", [])
    run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config, overlap=overlap)
    letter = {BARRIER_CHANNELS["dispatch"]: "d", BARRIER_CHANNELS["combine"]: "c"}
    seen = "".join(letter.get(c, "?") for c in RecordingBarrier.channels)
    assert re.fullmatch(r"(d+c+){2}", seen), f"barrier channels {RecordingBarrier.channels} (d: dispatch, c: combine)"
    assert len(set(BARRIER_CHANNELS.values())) == len(BARRIER_CHANNELS) and 0 not in BARRIER_CHANNELS.values()


@interpreted
@pytest.mark.parametrize("case,capacity,directions,overlap", EP_PARAMS)
def test_ep_matches_one_gpu(case, capacity, directions, overlap, monkeypatch):
    """ep.py on a one-rank group, for both directions of dispatch and combine and every overlap setting
    (communication programs, rows per ready flag): every output bitwise equal to the unfused run
    (overlap=False: whole exchanges around plain GEMMs); out and the shared expert's gradients bitwise equal to
    experts.py's (the same forward kernels). The routed gradients are not: experts.py applies the router
    weight in down_dgrad's epilogue (so that it keeps neither h nor y_rows), ep.py to the d_y rows it pulls;
    both are held to the error budget against the fp64 reference (with the pairs a capacity cut given
    weight 0 there, and a zero router-weight gradient checked exactly)."""
    T, H, I, E, k, routing, shared, block_m = CASES[case]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, torch.float16, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).half()
    dispatch, combine = DIRECTIONS[directions]
    num_comm_sms, minibatch_tokens = OVERLAPS[overlap]
    config = MoEConfig(dispatch=dispatch, combine=combine, capacity_factor=capacity,
                       num_comm_sms=num_comm_sms, minibatch_tokens=minibatch_tokens)
    s = build_schedule(ids, E, block_m=block_m, config=config)
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    with poisoned_empty():
        got, saved = run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config)
        serial, _ = run_ep(x, weights, wgu, wd, sgu, sd, s, d_out, config, overlap=False)
        out1, saved1 = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None)
        grads1 = experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved1)
    routed = s.dest_row >= 0
    kept = torch.where(routed, weights, 0.0)
    ref64 = run_reference(x, ids, kept, wgu, wd, sgu, sd, d_out, torch.float64)
    ref_lp = run_reference(x, ids, kept, wgu, wd, sgu, sd, d_out, torch.float16)
    names = ["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_sgu", "d_sd"]
    for i, (name, a, b, c) in enumerate(zip(names, got, (out1, *grads1), serial)):
        if b is None:
            assert a is None and c is None, f"{name}: expected None"
            continue
        assert not torch.isnan(a).any(), f"{name}: NaN"
        assert torch.equal(a, c), f"{name}: fused ep.py differs from the serial run"
        if name in ("out", "d_sgu", "d_sd"):
            assert torch.equal(a, b), f"{name}: ep.py differs from experts.py (max diff {(a.double() - b.double()).abs().max():.3e})"
            continue
        want64, want_lp = (ref64[0], ref_lp[0]) if i == 0 else (ref64[1][i - 1], ref_lp[1][i - 1])
        for path, result in (("ep.py", a), ("experts.py", b)):
            if name == "d_topk_weights":
                assert (result[~routed] == 0).all(), f"{path}: a pair cut by the capacity got a router-weight gradient"
                budget_check(f"{path} {name}", result[routed], want64[routed], want_lp[routed])
            else:
                budget_check(f"{path} {name}", result, want64, want_lp)
    for name, module, saved_ in [("experts.py", None, saved1), ("ep.py", ep, saved)]:
        want = (module.empty_saved if module else empty_saved)(x, wgu, wd, sgu, s, config)
        shapes = [tuple(t.shape) for t in saved_], [tuple(t.shape) for t in want]
        assert shapes[0] == shapes[1], f"{name}: empty_saved shapes {shapes[1]} != saved {shapes[0]}"
        assert [t.dtype for t in saved_] == [t.dtype for t in want], f"{name}: empty_saved dtypes differ from saved"


@interpreted
def test_overlap_knobs():
    """num_comm_sms -> communication programs of each pulling kernel (default ep.DEFAULT_COMM_SMS on the
    pointer-load core, one per SM, i.e. every CTA, on the Gluon core);
    minibatch_tokens -> schedule blocks per ready flag = ceil(minibatch_tokens * k / block_m), at least 1
    and at most the schedule's blocks (None: 1)."""
    T, E, k = 64, 8, 2
    _, ids, *_ = make_problem(T, 32, 16, E, k, torch.float32, routing="sparse")
    s = build_schedule(ids, E, block_m=16)
    cpu = torch.device("cpu")
    assert ep.comm_programs(MoEConfig(), cpu) == ep.DEFAULT_COMM_SMS
    assert ep.comm_programs(MoEConfig(num_comm_sms=5), cpu) == 5
    assert ep.comm_programs(MoEConfig(), cpu, gluon=True) == num_sms(cpu)
    assert ep.comm_programs(MoEConfig(num_comm_sms=5), cpu, gluon=True) == 5
    assert s.num_rows // 16 == 15
    for minibatch, blocks in [(None, 1), (1, 1), (8, 1), (9, 2), (64, 8), (10_000, 15)]:
        got = ep.group_blocks(s, MoEConfig(minibatch_tokens=minibatch))
        assert got == blocks, f"minibatch_tokens={minibatch}: {got} blocks per flag, want {blocks}"


@interpreted
def test_ep_largest_minibatch_tokens(monkeypatch):
    """minibatch_tokens = MAX_MINIBATCH_TOKENS (one ready flag for the whole batch) at k = block_m = 16: its
    2**31 - 1 blocks per flag, passed as such, overflowed the fused kernels' int32 count of flags (no flag was
    ever raised, and every tile waited for its rows until the timeout); the same bits as the unfused run."""
    from megamoe.config import MAX_MINIBATCH_TOKENS

    T, H, I, E, k = 4, 32, 16, 16, 16
    x, ids, weights, wgu, wd, _, _ = make_problem(T, H, I, E, k, torch.float32)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    config = MoEConfig(minibatch_tokens=MAX_MINIBATCH_TOKENS)
    s = build_schedule(ids, E, block_m=16, config=config)
    assert s.num_blocks.item() > 1
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    got, _ = run_ep(x, weights, wgu, wd, None, None, s, d_out, config)
    serial, _ = run_ep(x, weights, wgu, wd, None, None, s, d_out, config, overlap=False)
    for name, a, b in zip(["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down"], got, serial):
        assert torch.equal(a, b), f"{name}: fused ep.py differs from the serial run"


if INTERPRET:
    import triton
    import triton.language as tl

    from megamoe.backends.triton.kernels._common import expert_segments, expert_tile_coords

    @triton.jit
    def tile_order_kernel(block_expert_ptr, offsets_ptr, out_ptr, first_m, num_m, num_n, SPLIT: tl.constexpr,
                          BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
        """out[t] = expert_tile_coords(t) (row block, column block, expert) for every tile t of the range."""
        for tile in range(0, num_m * num_n):
            m, n, e = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, offsets_ptr, SPLIT, BLOCK_M,
                                         GROUP_M)
            tl.store(out_ptr + 3 * tile, m)
            tl.store(out_ptr + 3 * tile + 1, n)
            tl.store(out_ptr + 3 * tile + 2, e)


def _expert_tile_order(block_expert, offsets, first_m, end_m, num_n, split, block_m, group_m):
    """The documented order of _common.expert_tile_coords, built from its definition: the row blocks [first_m,
    end_m) cut into runs of one expert, each run into groups of group_m blocks from its start, a group's tiles
    column by column, each column down the group's blocks."""
    order = []
    m = first_m
    while m < end_m:
        expert = block_expert[m // split]
        run_end = min(offsets[expert + 1] // block_m, end_m)
        for start in range(m, run_end, group_m):
            size = min(group_m, run_end - start)
            order += [(start + i, n, expert) for n in range(num_n) for i in range(size)]
        m = run_end
    return order


@interpreted
@pytest.mark.parametrize("split,first,end", [(1, 0, 9), (1, 2, 7), (2, 1, 8)], ids=["whole", "range", "split"])
def test_expert_tile_coords_groups_inside_one_expert(split, first, end):
    """expert_tile_coords (the one-GPU row GEMMs' tile order): tile t of the range's num_m x num_n tiles is the t-th
    of the documented order (groups of GROUP_M row blocks inside one expert's run, clipped to the range), so every
    tile is visited once, with its block's expert."""
    # Schedule blocks of 16 rows: expert 0 has 7, expert 1 none, expert 2 one, expert 3 four, then 2 unused blocks.
    block_expert = torch.tensor([0] * 7 + [2] + [3] * 4 + [-1, -1], dtype=torch.int32)
    offsets = expert_segments(None, block_expert, 4, 16 * block_expert.numel())
    assert offsets.tolist() == [0, 112, 112, 128, 192]
    block_m, group_m, num_n = 16 // split, 3, 2
    first_m, end_m = first * split, end * split
    out = torch.full(((end_m - first_m) * num_n, 3), -7, dtype=torch.int32)
    tile_order_kernel[(1,)](block_expert, offsets, out, first_m, end_m - first_m, num_n, SPLIT=split,
                            BLOCK_M=block_m, GROUP_M=group_m)
    want = _expert_tile_order(block_expert.tolist(), offsets.tolist(), first_m, end_m, num_n, split, block_m, group_m)
    assert [tuple(t) for t in out.tolist()] == want
    assert sorted((m, n) for m, n, _ in want) == [(m, n) for m in range(first_m, end_m) for n in range(num_n)]


@interpreted
@pytest.mark.parametrize("split,group_m", [(1, 3), (2, 2), (4, 8)])
@pytest.mark.parametrize("routing,world_size,rank,capacity", [("random", 1, 0, None), ("sparse", 1, 0, None),
                                                             ("sparse", 1, 0, 192), ("sparse", 2, 0, None)],
                         ids=["random", "empty-experts", "capacity", "ep-rank0"])
def test_expert_tile_coords_covers_schedule_layouts(routing, world_size, rank, capacity, split, group_m):
    """expert_tile_coords over the layouts a schedule gives (empty experts, a capacity cutting an expert's run, an
    expert-parallel rank's local experts), with the schedule's expert_offsets and block_m 32: over the blocks in
    use and over a range that clips the first and last runs, every tile is visited once, in the documented order,
    with its block's expert."""
    from megamoe.schedule import place_routing_torch

    E, k, block_m, num_n = 6, 2, 32, 3
    _, ids, _, _, _, _, _ = make_problem(100, 8, 8, E, k, torch.float32, routing=routing, seed=3)
    rows = capacity or (2 * 100 * k // block_m + E) * block_m
    flat = torch.cat([ids.flatten()] * world_size)
    p = place_routing_torch(flat, num_experts=E, world_size=world_size, rank=rank, block_m=block_m, num_rows=rows)
    block_expert, offsets, used = p.block_expert, p.expert_offsets, int(p.num_blocks)
    assert used >= 3
    for first, end in [(0, used), (1, used - 1)]:
        first_m, end_m = first * split, end * split
        out = torch.full(((end_m - first_m) * num_n, 3), -7, dtype=torch.int32)
        tile_order_kernel[(1,)](block_expert, offsets, out, first_m, end_m - first_m, num_n, SPLIT=split,
                                BLOCK_M=block_m // split, GROUP_M=group_m)
        got = [tuple(t) for t in out.tolist()]
        assert got == _expert_tile_order(block_expert.tolist(), offsets.tolist(), first_m, end_m, num_n, split,
                                         block_m // split, group_m)
        assert sorted((m, n) for m, n, _ in got) == [(m, n) for m in range(first_m, end_m) for n in range(num_n)]
        assert all(e == block_expert[m // split] for m, _, e in got)


@interpreted
@pytest.mark.parametrize("routing", ["random", "one", "sparse"])
@pytest.mark.parametrize("world_size,rank,capacity", [(1, 0, None), (2, 1, None), (1, 0, 48)],
                         ids=["one-gpu", "ep-rank1", "capacity"])
def test_expert_segments_derives_the_schedule_offsets(routing, world_size, rank, capacity):
    """Without the schedule's expert_offsets the row GEMMs derive them from block_expert: the same tensor, for
    empty experts, an expert-parallel rank's local experts and a capacity cut alike."""
    from megamoe.schedule import place_routing_torch

    E, k, block_m = 6, 2, 16
    _, ids, _, _, _, _, _ = make_problem(40, 8, 8, E, k, torch.float32, routing=routing)
    rows = capacity or 2 * 40 * k + E * block_m
    flat = torch.cat([ids.flatten()] * world_size)
    p = place_routing_torch(flat, num_experts=E, world_size=world_size, rank=rank, block_m=block_m, num_rows=rows)
    derived = expert_segments(None, p.block_expert, E // world_size, rows)
    assert torch.equal(derived, p.expert_offsets), (derived, p.expert_offsets)


@interpreted
def test_row_block_gemms_refuse_bad_expert_offsets():
    """The schedule's expert_offsets, when given, must be the contiguous int32 [E_l + 1] tensor the tile order
    reads: anything else is a ValueError naming it and what was given (a strided view: "not contiguous"; before: no
    such argument)."""
    x, ids, _, wgu, _, _, _ = make_problem(10, 32, 16, 3, 2, torch.float32)
    s = build_schedule(ids, 3, block_m=16)
    rows = rows_of(x, s, 2)
    strided = torch.stack([s.expert_offsets, s.expert_offsets], 1)[:, 0]  # the right values, every other element
    for bad, shown in [(s.expert_offsets.long(), "torch.int64 (4,)"), (s.expert_offsets[:3], "torch.int32 (3,)"),
                       (strided, "torch.int32 (4,) (not contiguous)"), ([0, 16, 32, 48], "list")]:
        with pytest.raises(ValueError, match=re.escape(f"expert_offsets must be a contiguous int32 [4] tensor, got "
                                                       f"{shown}")):
            kernels.gate_up_fwd(rows, wgu, s.block_expert, s.num_blocks, store_gate_up=False, config=SMALL,
                                expert_offsets=bad)
    with pytest.raises(ValueError, match=re.escape("expert_offsets must be on block_expert's device (cpu), got meta")):
        kernels.gate_up_fwd(rows, wgu, s.block_expert, s.num_blocks, store_gate_up=False, config=SMALL,
                            expert_offsets=s.expert_offsets.to("meta"))
    given, _ = kernels.gate_up_fwd(rows, wgu, s.block_expert, s.num_blocks, store_gate_up=False, config=SMALL,
                                   expert_offsets=s.expert_offsets)
    derived, _ = kernels.gate_up_fwd(rows, wgu, s.block_expert, s.num_blocks, store_gate_up=False, config=SMALL)
    used = s.num_blocks.item() * s.block_m
    assert torch.equal(given[:used], derived[:used])


@interpreted
def test_ranges_write_only_their_rows():
    """A device range (first, end) of schedule blocks for the GEMM launchers: the launch writes exactly those
    rows, bitwise as a whole launch does, and leaves the rest poisoned."""
    T, H, I, E, k = 40, 32, 16, 4, 2
    x, ids, _, wgu, _, _, _ = make_problem(T, H, I, E, k, torch.float16)
    s = build_schedule(ids, E, block_m=16)
    x_rows = rows_of(x, s, k)
    offsets = s.expert_offsets.tolist()
    first, end = offsets[1], offsets[3]  # the rows of experts 1 and 2
    assert 0 < first < end < offsets[-1]
    whole_h, _ = kernels.gate_up_fwd(x_rows, wgu, s.block_expert, s.num_blocks, store_gate_up=False, config=SMALL)
    blocks = torch.tensor([first // 16, end // 16], dtype=torch.int32)
    with poisoned_empty():
        h, _ = kernels.gate_up_fwd(x_rows, wgu, s.block_expert, blocks, store_gate_up=False, config=SMALL)
    assert torch.equal(h[first:end], whole_h[first:end]), "gate_up_fwd over a block range differs from one launch"
    assert torch.isnan(h[:first]).all() and torch.isnan(h[end:]).all(), "gate_up_fwd wrote outside its blocks"


@interpreted
def test_copy_rows_refuses_maps_and_tensors_it_would_misread():
    """copy_rows (the exchanges' row copy): a map that is not a contiguous int32 [N], a table that is not int64 [W],
    or a local tensor not contiguous or of other than element_size-byte elements is a ValueError naming it, before
    any launch, as comm_tiles' RowPull / RowPush checks do (before: accepted, the kernel reading map i at element i
    of the storage, or rows of element_size-byte elements past the end of a 2-byte tensor)."""
    from megamoe.backends.triton.kernels.row_copy import copy_rows

    src, dst = torch.arange(12.0).reshape(4, 3), torch.zeros(4, 3)
    peers, reversed_rows = torch.zeros(4, dtype=torch.int32), torch.tensor([3, 2, 1, 0], dtype=torch.int32)

    def run(src=src, dst=dst, src_row=reversed_rows, src_is_table=False):
        copy_rows(src, peers, src_row, dst, peers, torch.arange(4, dtype=torch.int32), row_elems=3, element_size=4,
                  src_is_table=src_is_table, dst_is_table=False)

    with pytest.raises(ValueError, match=r"src_row must be a contiguous int32 \[N\] tensor, got torch.int32 \(4,\) "
                                         r"\(not contiguous\)"):
        run(src_row=torch.stack([reversed_rows, peers], 1)[:, 0])
    with pytest.raises(ValueError, match=r"src_row must be a contiguous int32 \[N\] tensor, got torch.int64"):
        run(src_row=reversed_rows.long())
    with pytest.raises(ValueError, match=r"src \(a table\) must be an int64 \[W\] tensor of base addresses, got "
                                         r"torch.float32"):
        run(src_is_table=True)
    with pytest.raises(ValueError, match=r"src \(a local tensor\) must be contiguous, of 4-byte elements "
                                         r"\(element_size\), got torch.float16"):
        run(src=src.half())
    with pytest.raises(ValueError, match=r"dst \(a local tensor\) must be contiguous, of 4-byte elements "
                                         r"\(element_size\), got torch.float32 \(not contiguous\)"):
        run(dst=torch.zeros(3, 4).t())
    run()
    assert torch.equal(dst, src.flip(0)), "copy_rows: dst[i] = src[src_row[i]]"
