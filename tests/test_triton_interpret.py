"""Every Triton kernel, and the whole forward/backward, run by Triton's interpreter on CPU.

Triton reads TRITON_INTERPRET when a kernel is *defined*, so these tests must run in a process where it
was set before megamoe's kernels were imported. Two ways:

    TRITON_INTERPRET=1 pytest tests/test_triton_interpret.py     # direct (about 1-2 minutes on 2 cores)
    pytest tests/test_triton_interpret.py                        # re-runs itself in such a subprocess

In a plain pytest process, only `test_interpreter_suite` runs: it starts the subprocess and fails
with its output if any interpreted test fails; the other tests are skipped there.

Shapes are tiny; dtypes fp32 and fp16 (the interpreter cannot run bf16 tl.dot). Each kernel is checked
against an fp64 torch computation from the schedule, and the full path against megamoe.reference.experts
in fp64 + autograd within the STYLE.md error budget. Launcher outputs are NaN-poisoned, so an element a
kernel forgets to write fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter itself trips a NumPy deprecation on every scalar index; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in test_interpreter_suite's TRITON_INTERPRET=1 subprocess")


@pytest.mark.skipif(INTERPRET, reason="already interpreted")
def test_interpreter_suite():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreted tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"


if INTERPRET:
    from megamoe.backends.triton import block_m_for, kernels
    from megamoe.backends.triton.experts import experts_bwd, experts_fwd
    from megamoe.backends.triton.configs import TileConfig
    from megamoe.reference import experts as reference_experts
    from megamoe.schedule import build_schedule

DTYPES = [torch.float32, torch.float16]
# Small tiles so tiny shapes still span several row and column blocks and the grouped tile order.
SMALL = TileConfig(16, 16, 16, num_warps=4, num_stages=2, group_m=2) if INTERPRET else None
COMBINE = TileConfig(4, 16, 1, num_warps=4, num_stages=1) if INTERPRET else None


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returns NaN-filled floating tensors inside the block: unwritten outputs show as NaN."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


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


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("H", [48, 40], ids=["H48-evenK", "H40-oddK"])
@pytest.mark.parametrize("store", [True, False], ids=["save", "nosave"])
def test_gate_up_fwd(dtype, H, store):
    T, I, E, k = 23, 40, 4, 2
    x, ids, _, wgu, _, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=32)  # kernel BM=16: two kernel row blocks per schedule block
    with poisoned_empty():
        h, gate_up = kernels.gate_up_fwd(x, wgu, s.row_src, s.block_expert, s.num_blocks, k, store_gate_up=store, config=SMALL)
    used, src, valid, token, expert = row_info(s, k)
    want_gu = torch.einsum("rh,rnh->rn", x.double()[token], wgu.double()[expert]) * valid[:, None]
    atol, rtol = tol_for(dtype)
    assert_close("h", h[:used], swiglu64(want_gu), atol, rtol)
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
    h = torch.randn(s.num_rows, I).to(dtype)
    used, src, valid, token, expert = row_info(s, k)
    h[used:] = float("nan")  # rows past the used blocks are never read
    with poisoned_empty():
        y = kernels.down_fwd(h, wd, s.row_src, s.block_expert, s.num_blocks, T * k, config=SMALL)
    want = torch.zeros(T * k, H, dtype=torch.float64)
    want[src[valid]] = torch.einsum("ri,rhi->rh", h[:used].double(), wd.double()[expert])[valid]
    assert_close("y_pairs", y, want, *tol_for(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("H", [48, 40], ids=["H48-evenK", "H40-oddK"])
def test_down_dgrad(dtype, H):
    T, I, E, k = 19, 24, 4, 2
    _, ids, weights, _, wd, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=16)
    used, src, valid, token, expert = row_info(s, k)
    d_out = torch.randn(T, H).to(dtype)
    gate_up = torch.randn(s.num_rows, 2 * I).to(dtype)
    gate_up[:used][~valid] = float("nan")  # padding rows must come out zero whatever they hold
    with poisoned_empty():
        d_gu = kernels.down_dgrad(d_out, weights, wd, gate_up, s.row_src, s.block_expert, s.num_blocks, config=SMALL)
    w_row = torch.where(valid, weights.reshape(-1).double()[src.clamp(min=0)], 0.0)
    d_h = torch.einsum("rh,rhi->ri", d_out.double()[token], wd.double()[expert]) * w_row[:, None]
    gu = gate_up[:used].double().clone().requires_grad_()
    (d_want,) = torch.autograd.grad(swiglu64(gu), gu, d_h)
    d_want[~valid] = 0.0
    assert_close("d_gate_up", d_gu[:used], d_want, *tol_for(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("I", [24, 20], ids=["I24-evenK", "I20-oddK"])
def test_gate_up_dgrad(dtype, I):
    T, H, E, k = 19, 40, 4, 2
    _, ids, _, wgu, _, _, _ = make_problem(T, H, I, E, k, dtype)
    s = build_schedule(ids, E, block_m=16)
    used, src, valid, token, expert = row_info(s, k)
    d_gu = torch.randn(s.num_rows, 2 * I).to(dtype)
    with poisoned_empty():
        d_xp = kernels.gate_up_dgrad(d_gu, wgu, s.row_src, s.block_expert, s.num_blocks, T * k, config=SMALL)
    want = torch.zeros(T * k, H, dtype=torch.float64)
    want[src[valid]] = torch.einsum("rn,rnh->rh", d_gu[:used].double(), wgu.double()[expert])[valid]
    assert_close("d_xpairs", d_xp, want, *tol_for(dtype))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("routing", ["random", "sparse"], ids=["random", "empty-experts"])
def test_weight_grads(dtype, routing):
    T, H, I, E, k = 29, 40, 24, 5, 2
    x, ids, weights, _, _, _, _ = make_problem(T, H, I, E, k, dtype, routing=routing)
    s = build_schedule(ids, E, block_m=32)
    used, src, valid, token, expert = row_info(s, k)
    d_out = torch.randn(T, H).to(dtype)
    h = torch.randn(s.num_rows, I).to(dtype)
    d_gu = torch.randn(s.num_rows, 2 * I).to(dtype)
    h[:used][~valid] = float("nan")  # padding contents never matter
    d_gu[:used][~valid] = float("nan")
    with poisoned_empty():
        dw_d = kernels.dw_down(d_out, weights, h, s.row_src, s.expert_offsets, E, config=SMALL)
        dw_gu = kernels.dw_gate_up(d_gu, x, s.row_src, s.expert_offsets, E, k, config=SMALL)
    w_row = torch.where(valid, weights.reshape(-1).double()[src.clamp(min=0)], 0.0)
    a = (d_out.double()[token] * w_row[:, None]).to(dtype).double()  # weighted d_out, rounded as autograd does
    want_d = torch.zeros(E, H, I, dtype=torch.float64)
    want_gu = torch.zeros(E, 2 * I, H, dtype=torch.float64)
    for e in range(E):
        rows = (expert == e) & valid
        want_d[e] = a[rows].t() @ h[:used][rows].double()
        want_gu[e] = d_gu[:used][rows].double().t() @ x.double()[token[rows]]
    atol, rtol = tol_for(dtype)
    assert_close("d_w_down", dw_d, want_d, atol * 10, rtol)
    assert_close("d_w_gate_up", dw_gu, want_gu, atol * 10, rtol)
    if routing == "sparse":
        assert (dw_d[0] == 0).all() and (dw_gu[0] == 0).all(), "empty expert 0 must get exact zero grads"


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "noshared"])
def test_combine_and_bwd(dtype, shared):
    T, H, k = 11, 40, 3
    y = torch.randn(T * k, H).to(dtype)
    weights = torch.rand(T, k)
    dest_row = torch.arange(T * k, dtype=torch.int32).view(T, k).contiguous()
    dest_row[2, 1] = -1  # a pair cut by a capacity: no row, counts as zero
    y[2 * k + 1] = float("nan")
    sh = torch.randn(T, H).to(dtype) if shared else None
    d_out = torch.randn(T, H).to(dtype)
    with poisoned_empty():
        out = kernels.combine(y, weights, dest_row, sh, config=COMBINE)
        summed = kernels.combine(y, None, dest_row, None, config=COMBINE)
        d_w = kernels.combine_bwd(d_out, y, dest_row, config=COMBINE)
    keep = (dest_row >= 0).reshape(-1)
    y64 = torch.where(keep[:, None], y.double(), 0.0).view(T, k, H)
    want = torch.zeros(T, H, dtype=torch.float64)
    for j in range(k):
        want = want + weights[:, j : j + 1].double() * y64[:, j]
    if shared:
        want = want + sh.double()
    atol, rtol = tol_for(dtype)
    assert_close("out", out, want, atol, rtol)
    assert_close("sum_pairs", summed, y64.sum(1), atol, rtol)
    assert_close("d_topk_weights", d_w, torch.einsum("th,tjh->tj", d_out.double(), y64), atol * 10, rtol)
    assert d_w[2, 1] == 0, "a pair without a row must get a zero router-weight gradient"


# ----------------------------------------------------------------------------------------------------
# Full forward + backward against the reference


def budget_check(name, got, want64, ref_lowp):
    """STYLE.md error budget: |ours - fp64| <= 2 |reference in the same dtype - fp64| + 1e-5 (max norms)."""
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
    for save in (True, False):
        out, saved = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None, save_gate_up=save)
        if not save:
            assert saved[0].numel() == 0 and saved[1].numel() == 0, "recompute mode must not keep h / gate_up"
        results.append((out, *experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, None, saved)))
    for name, a, b in zip(["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_sgu", "d_sd"], *results):
        assert torch.equal(a, b), f"{name}: recompute differs from save"


@interpreted
def test_capacity_cut_pairs_count_as_zero():
    """Pairs a declared capacity cut (dest_row -1) contribute nothing and get zero router grads, never NaN."""
    from megamoe.config import MoEConfig

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
    assert_close("out", out, out64, 1e-4, 1e-4)
    assert_close("d_x", grads[0], grads64[0], 1e-4, 1e-4)
    assert_close("d_topk_weights", grads[1], grads64[1] * kept, 1e-4, 1e-4)
    assert_close("d_w_gate_up", grads[2], grads64[2], 1e-4, 1e-4)
    assert_close("d_w_down", grads[3], grads64[3], 1e-4, 1e-4)


@interpreted
def test_block_m_check_and_table():
    x, ids, weights, wgu, wd, _, _ = make_problem(4, 32, 16, 2, 1, torch.float32)
    bad = build_schedule(ids, 2, block_m=8)
    with pytest.raises(ValueError, match="block_m"):
        experts_fwd(x, weights, wgu, wd, None, None, bad, None)
    for H, I in [(2048, 768), (4096, 1536), (7168, 2048), (2880, 2880), (4096, 14336)]:
        assert block_m_for(H, I, torch.bfloat16) == 128
