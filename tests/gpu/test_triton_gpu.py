"""The fused Triton backend on a real GPU: bf16 accuracy within the error budget, determinism,
CUDA-graph replay with new routing, and no host synchronisation.

Run on a CUDA machine: pytest -m gpu tests/gpu/test_triton_gpu.py  (skipped without CUDA).

Accuracy (docs/design.md): for every output, the relative error (Frobenius) to the fp64 reference <= 2x the bf16
reference's (plus one bf16 ulp / sqrt(n), conftest.assert_close_budget) + 1e-5, where the reference is
megamoe.reference.experts (+ autograd). Workloads are small
versions (fewer tokens and experts, real H and I, so the real tile-table entries run) of the benchmarked workloads (megamoe.bench.workloads).
"""

from __future__ import annotations

import pytest
import torch
from conftest import BF16_ULP, assert_close_budget, assert_close_tight, poisoned_empty

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    from megamoe.backends.triton import block_m_for
    from megamoe.backends.triton.configs import triton_tile
    from megamoe.backends.triton.experts import experts_bwd, experts_fwd, one_gpu_configs
    from megamoe.reference import experts as reference_experts
    from megamoe.schedule import build_schedule

DTYPE = torch.bfloat16
GRAD_NAMES = ["d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_shared_gate_up", "d_shared_down"]

# id: (T, H, I, E, k, shared I, routing)
WORKLOADS = {
    "qwen3-30b-a3b-T512-E16": (512, 2048, 768, 16, 8, 0, "balanced"),
    "qwen3-235b-a22b-T256-E16": (256, 4096, 1536, 16, 8, 0, "balanced"),
    "deepseek-v3-T128-E8-shared": (128, 7168, 2048, 8, 8, 2048, "balanced"),
    "gpt-oss-120b-T256-E8": (256, 2880, 2880, 8, 4, 0, "balanced"),
    "mixtral-8x7b-T128-E4": (128, 4096, 14336, 4, 2, 0, "balanced"),
    "kimi-k2-T64-E12-shared": (64, 7168, 2048, 12, 8, 2048, "balanced"),
    "qwen3-30b-skewed-T512-E16": (512, 2048, 768, 16, 8, 0, "skewed"),
}
EDGES = {
    "empty-experts-T300-E16": (300, 2048, 768, 16, 2, 0, "two-experts"),
    "one-expert-T300-E16-k1": (300, 2048, 768, 16, 1, 0, "one-expert"),
    "T1-k1-E16": (1, 2048, 768, 16, 1, 0, "balanced"),
    "T1-k1-E1-shared": (1, 2048, 768, 1, 1, 512, "balanced"),
    "T129-not-multiple-of-block-k3": (129, 2048, 768, 8, 3, 0, "balanced"),
    "odd-H2880-T77-k4": (77, 2880, 2880, 4, 4, 0, "skewed"),
    # H not a multiple of 8: rows TMA cannot address, so the pointer-load core runs (one_gpu_configs).
    "pointer-core-H2052-T100-k2": (100, 2052, 768, 8, 2, 0, "balanced"),
}


def routing(T, E, k, kind, gen):
    if kind == "balanced":  # top-k of uniform scores
        return torch.rand(T, E, generator=gen, device="cuda").topk(k, dim=1).indices
    if kind == "skewed":  # Zipf-like preference: expert e drawn with probability ~ 1 / (e + 1)
        probs = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32)
        return torch.multinomial(probs.repeat(T, 1), k, replacement=False, generator=gen)
    if kind == "two-experts":  # every expert but 1 and E-2 is empty
        return torch.tensor([1, E - 2], device="cuda")[torch.rand(T, k, generator=gen, device="cuda").argsort(1) % 2]
    if kind == "one-expert":
        return torch.full((T, k), E - 1, device="cuda")
    raise ValueError(kind)


def make_inputs(T, H, I, E, k, shared, kind, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(DTYPE)

    ids = routing(T, E, k, kind, gen)
    weights = torch.rand(T, k, generator=gen, device="cuda").softmax(-1)
    x = randn(T, H)
    wgu, wd = randn(E, 2 * I, H, scale=H**-0.5), randn(E, H, I, scale=I**-0.5)
    sgu = randn(2 * shared, H, scale=H**-0.5) if shared else None
    sd = randn(H, shared, scale=shared**-0.5) if shared else None
    d_out = randn(T, H)
    return x, ids, weights, wgu, wd, sgu, sd, d_out


def run_triton(x, ids, weights, wgu, wd, sgu, sd, d_out, num_experts, config=None):
    s = build_schedule(ids, num_experts, block_m=block_m_for(x.shape[1], wd.shape[2], x.dtype))
    out, saved = experts_fwd(x, weights, wgu, wd, sgu, sd, s, None, config)
    return (out, *experts_bwd(d_out, x, weights, wgu, wd, sgu, sd, s, None, config, saved))


def run_reference(x, ids, weights, wgu, wd, sgu, sd, d_out, dtype):
    leaves = [t.to(dtype).clone().requires_grad_() if t is not None else None for t in (x, weights, wgu, wd, sgu, sd)]
    leaves[1] = weights.to(torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_()
    out = reference_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], shared_gate_up=leaves[4], shared_down=leaves[5])
    out.backward(d_out.to(dtype))
    return (out.detach(), *[t.grad if t is not None else None for t in leaves])


def check_budget(inputs, num_experts):
    with poisoned_empty():
        ours = run_triton(*inputs, num_experts)
    want = run_reference(*inputs, torch.float64)
    ref = run_reference(*inputs, DTYPE)
    for name, got, w, r in zip(["out", *GRAD_NAMES], ours, want, ref):
        if w is None:
            assert got is None, f"{name}: expected None without a shared expert"
            continue
        assert_close_budget(name, got, w, r, ulp=BF16_ULP)  # non-finite fails: an element not written


@pytest.mark.parametrize("case", list(WORKLOADS), ids=list(WORKLOADS))
def test_workload_accuracy(case):
    T, H, I, E, k, shared, kind = WORKLOADS[case]
    check_budget(make_inputs(T, H, I, E, k, shared, kind), E)


@pytest.mark.parametrize("case", list(EDGES), ids=list(EDGES))
def test_edge_accuracy(case):
    T, H, I, E, k, shared, kind = EDGES[case]
    check_budget(make_inputs(T, H, I, E, k, shared, kind), E)


@pytest.mark.parametrize("case", ["qwen3-30b-a3b-T512-E16", "odd-H2880-T77-k4"])
def test_fp32_is_full_precision(case):
    """fp32 inputs (backend="triton" runs them on the pointer-load core) multiply in fp32, not TF32 (Triton's
    default for tl.dot on NVIDIA GPUs: 4.2e-4 relative error on an H200): every output within 2e-5 of the fp64 reference,
    the fp32 tolerance of the CPU interpreter tests."""
    T, H, I, E, k, shared, kind = {**WORKLOADS, **EDGES}[case]
    inputs = [t.float() if t is not None and t.is_floating_point() else t
              for t in make_inputs(T, H, I, E, k, shared, kind)]
    ours = run_triton(*inputs, E)
    want = run_reference(*inputs, torch.float64)
    for name, got, w in zip(["out", *GRAD_NAMES], ours, want):
        if w is None:
            continue
        assert got.dtype == torch.float32, f"{name}: {got.dtype}"
        assert_close_tight(name, got, w, 2e-5)


def test_bitwise_deterministic_over_10_runs():
    T, H, I, E, k, shared, kind = 512, 2048, 768, 16, 8, 512, "skewed"
    inputs = make_inputs(T, H, I, E, k, shared, kind)
    first = run_triton(*inputs, E)
    for run in range(9):
        again = run_triton(*inputs, E)
        for name, a, b in zip(["out", *GRAD_NAMES], first, again):
            assert torch.equal(a, b), f"{name}: run {run + 2} differs bitwise from run 1"


def test_cuda_graph_replay_with_new_routing_matches_eager():
    T, H, I, E, k, shared = 256, 2048, 768, 16, 8, 512
    static = list(make_inputs(T, H, I, E, k, shared, "balanced", seed=1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (Triton compiles here, outside the capture)
        for _ in range(2):
            run_triton(*static, E)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_triton(*static, E)
    for seed, kind in [(2, "balanced"), (3, "skewed"), (4, "two-experts")]:
        new = make_inputs(T, H, I, E, k, shared, kind, seed=seed)
        for dst, src in zip(static, new):
            if dst is not None:
                dst.copy_(src)
        graph.replay()
        eager = run_triton(*new, E)
        for name, a, b in zip(["out", *GRAD_NAMES], captured, eager):
            assert torch.equal(a, b), f"{name}: graph replay with {kind} routing differs from eager"


def test_no_host_synchronisation():
    T, H, I, E, k, shared = 256, 2048, 768, 16, 8, 512
    inputs = make_inputs(T, H, I, E, k, shared, "skewed")
    run_triton(*inputs, E)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_triton(*inputs, E)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_tma_core_runs_where_rows_are_16_byte_aligned():
    """On Hopper the benchmarked shapes run the TMA core (so the accuracy tests above test it), and an H
    that is not a multiple of 8 runs the pointer core (the pointer-core edge case above)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA tile table is for Hopper (sm_90)")
    for T, H, I, E, k, shared, kind in [*WORKLOADS.values(), EDGES["pointer-core-H2052-T100-k2"]]:
        x, ids, _, wgu, wd, *_ = make_inputs(min(T, 8), H, I, E, k, shared, kind)
        s = build_schedule(ids, E, block_m=block_m_for(H, I, DTYPE))
        cfg = one_gpu_configs(x, wgu, wd, s)
        assert all(getattr(cfg, n).tma == (H % 8 == 0) for n in ("gate_up_fwd", "down_fwd", "down_dgrad",
                   "gate_up_dgrad", "dw_down", "dw_gate_up")), f"H={H}, I={I}: {cfg}"


@pytest.mark.parametrize("case", [*WORKLOADS, "empty-experts-T300-E16", "odd-H2880-T77-k4"])
def test_gluon_kernels_match_the_triton_tma_kernels_bitwise(case, monkeypatch):
    """The table's Gluon kernels (TileConfig.gluon: warp-specialized, kernels/gluon_*.py) give the bits of the
    Triton TMA kernels of the same tiles, on every output and gradient of the fused path."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are in the Hopper (sm_90) table")
    import dataclasses

    from megamoe.backends.triton import experts as triton_experts
    from megamoe.backends.triton.configs import tma_kernel_configs

    T, H, I, E, k, shared, kind = {**WORKLOADS, **EDGES}[case]
    inputs = make_inputs(T, H, I, E, k, shared, kind)
    x, ids, _, wgu, wd, *_ = inputs
    table = one_gpu_configs(x, wgu, wd, build_schedule(ids, E, block_m=block_m_for(H, I, DTYPE)))
    gluon = [f.name for f in dataclasses.fields(table) if getattr(getattr(table, f.name), "gluon", False)]
    assert gluon, f"no Gluon kernel in the table for H={H}, I={I}"
    with poisoned_empty():
        ours = run_triton(*inputs, E)

    def triton_only(*args):
        t = tma_kernel_configs(*args)
        return dataclasses.replace(t, **{n: triton_tile(getattr(t, n)) for n in gluon})

    monkeypatch.setattr(triton_experts, "tma_kernel_configs", triton_only)
    with poisoned_empty():
        want = run_triton(*inputs, E)
    for name, a, b in zip(["out", *GRAD_NAMES], ours, want):
        if b is None:
            continue
        assert torch.equal(a, b), f"{name}: the Gluon kernels ({', '.join(gluon)}) differ from the Triton TMA kernels"


@pytest.mark.parametrize("case", ["qwen3-30b-a3b-T512-E16", "gpt-oss-120b-T256-E8", "deepseek-v3-T128-E8-shared",
                                  "empty-experts-T300-E16", "odd-H2880-T77-k4"])
def test_recompute_gives_the_bits_of_the_default(case):
    """MoEConfig(recompute=True) (gate_up rerun in the backward, x gathered inside dw_gate_up's loads on Hopper)
    gives every output and gradient bit for bit as the default (gate_up kept, x_rows gathered by a pass)."""
    from megamoe.config import MoEConfig

    T, H, I, E, k, shared, kind = {**WORKLOADS, **EDGES}[case]
    inputs = make_inputs(T, H, I, E, k, shared, kind)
    with poisoned_empty():
        want = run_triton(*inputs, E)
        got = run_triton(*inputs, E, MoEConfig(recompute=True))
    for name, a, b in zip(["out", *GRAD_NAMES], got, want):
        if b is None:
            continue
        assert torch.equal(a.view(torch.int16) if a.dtype == DTYPE else a, b.view(torch.int16) if b.dtype == DTYPE else b), (
            f"{name}: recompute differs from the default")


@pytest.mark.parametrize("case", ["qwen3-30b-a3b-T512-E16", "qwen3-235b-a22b-T256-E16", "empty-experts-T300-E16",
                                  "T129-not-multiple-of-block-k3", "odd-H2880-T77-k4"])
def test_gluon_dw_gate_up_gathering_x_equals_it_on_gathered_rows(case):
    """The Gluon weight-grad kernel gathering x in its loads (cp.async producer, kernels/gluon_dw.py) gives the
    bits of the same kernel on the x rows of a gather pass: padding rows zero, empty experts zero, every
    element written (the output starts as NaN)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are in the Hopper (sm_90) table")
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import tma_kernel_configs
    from megamoe.backends.triton.kernels import gluon_dw

    T, H, I, E, k, _, kind = {**WORKLOADS, **EDGES}[case]
    x, ids, *_ = make_inputs(T, H, I, E, k, 0, kind)
    schedule = build_schedule(ids, E, block_m=block_m_for(H, I, DTYPE))
    cfg = tma_kernel_configs(H, I, DTYPE, x.device, schedule.block_m).dw_gate_up
    gen = torch.Generator(device="cuda").manual_seed(1)
    d_gate_up = torch.randn(schedule.num_rows, 2 * I, generator=gen, device="cuda").to(DTYPE)
    d_gate_up[schedule.row_src < 0] = 0  # padding rows are zero, as down_dgrad writes them
    in_use = schedule.expert_offsets[-1:]
    x_rows = kernels.spread_rows(x, schedule.dest_row, schedule.row_src, in_use)
    want = torch.full((E, 2 * I, H), float("nan"), dtype=DTYPE, device="cuda")
    got = torch.full_like(want, float("nan"))
    gluon_dw.launch_dw(d_gate_up, x_rows, want, schedule.expert_offsets, cfg)
    gluon_dw.launch_dw(d_gate_up, x, got, schedule.expert_offsets, cfg, gather_b=(schedule.row_src, k))
    assert not want.isnan().any() and not got.isnan().any()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "gathering in the loads changed the bits"


@pytest.mark.parametrize("case,capacity", [
    ("qwen3-30b-a3b-T512-E16", None), ("qwen3-235b-a22b-T256-E16", None), ("mixtral-8x7b-T128-E4", None),
    ("deepseek-v3-T128-E8-shared", None), ("kimi-k2-T64-E12-shared", None),
    ("empty-experts-T300-E16", None), ("T129-not-multiple-of-block-k3", None), ("odd-H2880-T77-k4", None),
    ("T1-k1-E16", None), ("qwen3-30b-a3b-T512-E16", 0.5)])
def test_gate_up_dgrad_spreading_x_gives_the_pass_bits(case, capacity):
    """gate_up_dgrad's Gluon kernel spreading x beside its GEMM (spread_x, a warp of TMA row copies) writes every
    token row of x_rows as the spread pass does (its padding rows zeroed by the pass's padding_only mode; rows
    start as NaN, those past the rows in use stay so; pairs a capacity cut have no row and are skipped), and its
    GEMM output keeps its bits. (The whole layer with it, against the Triton kernels without it: the Gluon
    bitwise test above.)"""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are in the Hopper (sm_90) table")
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import tma_kernel_configs
    from megamoe.backends.triton.experts import all_blocks
    from megamoe.config import MoEConfig

    T, H, I, E, k, _, kind = {**WORKLOADS, **EDGES}[case]
    x, ids, *_ = make_inputs(T, H, I, E, k, 0, kind)
    s = build_schedule(ids, E, block_m=block_m_for(H, I, DTYPE), config=MoEConfig(capacity_factor=capacity))
    assert (s.dest_row < 0).any() == (capacity is not None), "the capacity case must cut pairs"
    cfg = tma_kernel_configs(H, I, DTYPE, x.device, s.block_m).gate_up_dgrad
    assert kernels.gate_up_dgrad_spreads_x(cfg, x), f"H={H}: the table's gate_up_dgrad cannot spread x"
    gen = torch.Generator(device="cuda").manual_seed(2)
    wgu = torch.randn(E, 2 * I, H, generator=gen, device="cuda").to(DTYPE)
    d_gate_up = torch.randn(s.num_rows, 2 * I, generator=gen, device="cuda").to(DTYPE)
    blocks, in_use = all_blocks(s), s.expert_offsets[-1:]
    used = int(in_use.item())
    with poisoned_empty():
        want_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
        x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use, padding_only=True)
        want = kernels.gate_up_dgrad(d_gate_up, wgu, s.block_expert, blocks, config=cfg)
        got = kernels.gate_up_dgrad(d_gate_up, wgu, s.block_expert, blocks, config=cfg,
                                    spread_x=(x, s.dest_row, x_rows))
    assert torch.equal(x_rows[:used].view(torch.int16), want_rows[:used].view(torch.int16)), "x_rows differ from the pass"
    assert x_rows[used:].isnan().all(), "rows past the rows in use were written"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "spreading x changed the GEMM's bits"


@pytest.mark.parametrize("case", ["qwen3-30b-a3b-T512-E16", "gpt-oss-120b-T256-E8", "qwen3-30b-skewed-T512-E16",
                                  "empty-experts-T300-E16", "T129-not-multiple-of-block-k3"])
def test_gluon_weight_grads_skipping_padding_give_the_same_bits(case):
    """Given the schedule's row_src, the Gluon weight-grad kernel skips an expert's last row step where it holds
    padding rows only; every element is bitwise what the kernel gives summing every row (outputs start as NaN:
    each is written either way), on gathered rows and gathering x in the loads."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are in the Hopper (sm_90) table")
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import tma_kernel_configs
    from megamoe.backends.triton.kernels._common import range_of

    T, H, I, E, k, _, kind = {**WORKLOADS, **EDGES}[case]
    x, ids, weights, wgu, wd, *_, d_out = make_inputs(T, H, I, E, k, 0, kind)
    s = build_schedule(ids, E, block_m=block_m_for(H, I, DTYPE))
    # The case must hold what is skipped: an expert whose last block's second half is padding.
    tails = s.expert_counts[s.expert_counts > 0] % s.block_m
    assert ((tails > 0) & (tails <= s.block_m // 2)).any(), f"{case}: no row step of padding only"
    table = tma_kernel_configs(H, I, DTYPE, x.device, s.block_m)
    assert table.dw_down.gluon and table.dw_gate_up.gluon
    blocks = (s.block_expert, range_of(s.num_blocks, "num_blocks"))
    in_use = s.expert_offsets[-1:]
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
    d_out_rows = kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use)
    _, gate_up = kernels.gate_up_fwd(x_rows, wgu, *blocks, store_gate_up=True, config=table.gate_up_fwd)
    d_gate_up, h_w, _ = kernels.down_dgrad_router(d_out_rows, wd, gate_up, s.row_src, weights, *blocks,
                                                  store_h_w=True, config=table.down_dgrad)
    runs = {
        "dw_down": lambda rs: kernels.dw_down(d_out_rows, h_w, s.expert_offsets, E, config=table.dw_down, row_src=rs),
        "dw_gate_up": lambda rs: kernels.dw_gate_up(d_gate_up, x_rows, s.expert_offsets, E, config=table.dw_gate_up,
                                                    row_src=rs),
        "dw_gate_up gathering x": lambda rs: kernels.dw_gate_up(d_gate_up, x, s.expert_offsets, E,
                                                                config=table.dw_gate_up, gather=(s.row_src, k),
                                                                row_src=rs),
    }
    for name, run in runs.items():
        with poisoned_empty():
            want = run(None)
            got = run(s.row_src)
        assert not want.isnan().any() and not got.isnan().any(), f"{name}: an element left unwritten"
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{name}: skipping padding changed the bits"


_NEVER_RAISED = """
import time, torch, triton, triton.language as tl
from megamoe.backends.triton.kernels.comm_tiles import wait_ready

@triton.jit
def waits_for_a_flag_nobody_raises(ready_ptr, out_ptr, timeout_ns):
    wait_ready(ready_ptr, 0, timeout_ns)
    tl.store(out_ptr, 1)

ready = torch.zeros(3, dtype=torch.int32, device="cuda")  # [next group, next task, the flag]
out = torch.zeros(1, dtype=torch.int32, device="cuda")
start = time.monotonic()
try:
    waits_for_a_flag_nobody_raises[(1,)](ready, out, 300_000_000)  # 300 ms
    torch.cuda.synchronize()
except Exception as exc:
    print(f"raised after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(7)
print("NO ERROR", flush=True)
"""


def test_ready_flag_wait_is_bounded(tmp_path):
    """The fused EP kernels' wait for a ready flag (comm_tiles.wait_ready, on wait_at_least): a flag
    nobody raises becomes a CUDA error after the timeout, not a hang (in a subprocess: the trap ends
    the CUDA context)."""
    import subprocess
    import sys

    script = tmp_path / "never_raised.py"  # Triton reads a jit function's source from its file
    script.write_text(_NEVER_RAISED)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 7, f"expected a CUDA error, got rc={proc.returncode}:\n{log[-3000:]}"
    seconds = float(log.split("raised after ")[1].split(" s")[0])
    assert 0.25 <= seconds < 30, f"the wait ended after {seconds} s, expected about 0.3 s"


_HANDOFF_CHECK = """
import torch
from megamoe.backends.triton.kernels import gluon_gate_up as G
from megamoe.schedule import build_schedule
from megamoe.backends.triton import kernels

torch.manual_seed(0)
for T, E, k, H, I in ((504, 6, 2, 1040, 208), (4096, 32, 8, 4096, 1536)):  # K and column tails; a 235b-like shape
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).cuda()
    s = build_schedule(ids, E, block_m=128)
    x = torch.randn(T, H, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * I, H, device="cuda") * H ** -0.5).bfloat16()
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, torch.cat([s.expert_offsets[:1], s.expert_offsets[-1:]]))
    used = int(s.num_blocks.item())
    for blocks in (s.num_blocks, torch.tensor([1, max(1, used - 1)], dtype=torch.int32, device="cuda")):
        for store in (True, False):
            want = G.gate_up_fwd_gluon(x_rows, w, s.block_expert, blocks, store_gate_up=store, tile=G.TILES["s3b2"])
            rows = x_rows.shape[0]
            out = (torch.full((rows, I), float("nan"), device="cuda").bfloat16(),
                   torch.full((rows, 2 * I), float("nan"), device="cuda").bfloat16() if store else None)
            got = G.gate_up_fwd_gluon(x_rows, w, s.block_expert, blocks, store_gate_up=store, tile=G.TILES["s3-handoff"],
                                      out=out)
            first, end = (0, used) if blocks.numel() == 1 else (int(blocks[0]), int(blocks[1]))
            r = slice(first * 128, end * 128)
            for a, b in zip(got, want):
                if b is None:
                    continue
                assert torch.equal(a[r].view(torch.int16), b[r].view(torch.int16)), (T, H, I, store, "bits differ")
                assert a[:first * 128].isnan().all() and a[end * 128:].isnan().all(), (T, H, I, store, "rows out of range")
print("HANDOFF OK", flush=True)
"""


def test_gate_up_handoff_gives_the_production_bits(tmp_path):
    """gate_up_fwd with its epilogue on warps of its own (gluon_gate_up.gate_up_fwd_handoff_kernel, tile
    "s3-handoff") gives the production Gluon kernel's h and gate_up bit for bit, on the whole block range and a
    sub-range (rows outside it untouched), with and without gate_up; in a subprocess with a timeout, so that a
    barrier bug fails the test instead of hanging the suite."""
    import subprocess
    import sys

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are sm_90a code")
    script = tmp_path / "handoff.py"
    script.write_text(_HANDOFF_CHECK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0 and "HANDOFF OK" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
