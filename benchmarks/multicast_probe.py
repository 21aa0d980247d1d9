"""Does sharing the weight tile between two CTAs by TMA multicast make a Hopper GEMM faster at megamoe's shapes,
in particular the gathering gate_up_fwd's (A rows gathered by cp.async, the weight tile by TMA)?

A dense probe, not a megamoe kernel: C [M, N] = A [M, K] @ B [N, K]^T in bf16 (fp32 accumulation), in Gluon with
multi-CTA layouts and multicast TMA loads (Triton >= 3.8: 3.6's Gluon has neither; 3.7.1's compiles this kernel but
lowers the arrivals on the lead CTA's barrier as local ones and leaves out the cluster barrier after the barriers'
initialisation, so there the lead would refill a slot the other CTA still reads), warp-specialized as megamoe's
Gluon kernels are: a producer feeding a ring of STAGES shared-memory slots, two consumer warpgroups issuing wgmma.
Each CTA computes a 128 x 256 tile (the row kernels' tile, and gate_up_fwd's 128 gate + 128 up columns; v12 measured
down_dgrad's 128 x 128 tile slower in clusters), its two warpgroups one half of the columns each. A's rows come
either by TMA from A (GATHER=False, one producer warp) or gathered from a token matrix X [T, K] by an index,
A[r] = X[idx[r]], with cp.async by a producer warpgroup (GATHER=True, 8 16-byte copies per thread per K step, each
thread arriving on the slot's "ready" barrier when its copies landed, as gate_up_fwd's gathering producer does).

With CLUSTER = 2 the kernel launches 2-CTA clusters (num_ctas=2): a cluster takes two row blocks of one column block,
each CTA loads its own A rows, and the B tile of a K step (two [128, 64] halves, one per consumer warpgroup, as
gate_up_fwd's gate and up tiles) is copied once from L2 and multicast into both CTAs' shared memory by the lead CTA
(Gluon issues a multicast load of a broadcast buffer from CTA 0 only). With
CLUSTER = 1 the same code runs one CTA per program.

Slot release: a slot's A rows are read by the CTA's own consumers only, but its B tile lives in both CTAs and is
refilled by the lead's multicast, so the lead may refill a slot only once the consumers of both CTAs released it.
Every slot has two "empty" barriers: a per-CTA one (its own two warpgroups arrive; each CTA's producer waits on it
before its A copies) and a cluster one living on the lead CTA (MBarrierLayout with a broadcast basis: the four
warpgroups of the cluster arrive on it; only the lead waits, before its multicast). "ready" is per CTA: armed by the
CTA's producer with the bytes its TMA copies bring (A's too with GATHER=False, and the B tile's), plus one arrival per
gathering thread with GATHER=True; the multicast completes the B bytes on the same-offset barrier of both CTAs.
Barriers are initialised before gl.warp_specialize (cross-CTA barriers must be; the compiler then fences and
synchronises the cluster).

Usage (an H100/H200 with Triton >= 3.8 importable):  python3 benchmarks/multicast_probe.py OUT.json
Times the variants (triton.testing.do_bench medians in megamoe.bench.measure.alternating_rounds) on M = 131072 rows
against (N, K) shapes of megamoe's GEMMs, with torch.matmul (cuBLAS) beside them on the same A (for GATHER, on rows
gathered by a torch index first, and that gather timed alone). Each result is checked against torch.matmul first
(relative Frobenius error).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.backends.triton.kernels.gluon_common import cp_async_load, tma_load, tma_store
from megamoe.bench.measure import alternating_rounds, run_facts

# Per CTA: BLOCK_M x BLOCK_N; a consumer warpgroup owns half the columns. 3 ring stages of 48 KB + two 32 KB output
# buffers (208 KB).
BLOCK_M, BLOCK_N, BLOCK_K = gl.constexpr(128), gl.constexpr(256), gl.constexpr(64)
GATHER_WARPS = gl.constexpr(4)
STAGES = 3
# (name, N, K, gather): qwen3-30b-a3b's gate_up_fwd (gate + up columns; gathered in the product) both ways, and two
# of v12's dense shapes for reference.
SHAPES = (
    ("30b-gate_up gather", 1536, 2048, True),
    ("30b-gate_up rows", 1536, 2048, False),
    ("30b-down_fwd", 2048, 768, False),
    ("235b-gate_up rows", 3072, 4096, False),
)
M_ROWS = 131072
TOKENS = 16384  # the index reads X's rows the way qwen3-30b-a3b's schedule does: 8 rows a token, grouped by expert
TOP_K = 8
EXPERTS = 128
MAX_REL_ERR = 1e-2


@gluon.jit
def _producer_tma(a_desc, b_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, num_tiles, num_n, k_steps):
    """One warp: A's and B's tiles by TMA (B multicast from the lead CTA in a cluster)."""
    NBYTES: gl.constexpr = a_desc.nbytes_per_cta + 2 * b_desc.nbytes_per_cta
    CLUSTER_M: gl.constexpr = a_desc.block_shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = 2 * b_bufs.shape[1]
    p = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row = (tile // num_n) * CLUSTER_M
        col = (tile % num_n) * BLOCK_N
        for ki in range(k_steps):
            s = p % STAGES
            phase = ((p // STAGES) & 1) ^ 1  # a fresh barrier passes parity 1: the first pass does not wait
            mbarrier.wait(empty_cta.index(s), phase)  # this CTA's consumers released the slot (its A rows)
            if gl.num_ctas() > 1:
                mbarrier.wait(empty_cluster.index(s), phase)  # the lead only: both CTAs released the B tile
            mbarrier.expect(ready.index(s), NBYTES)
            tma_load(a_desc, [row, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            load_b(b_desc, b_bufs, s, col, ki * BLOCK_K, ready.index(s))
            p += 1


@gluon.jit
def load_b(b_desc, b_bufs, s, col, k, bar):
    """The B tile of slot s, rows [col, col + BLOCK_N) (the consumers' two halves, as gate_up_fwd's gate and up
    tiles), multicast from the lead CTA in a cluster."""
    HALF_N: gl.constexpr = b_bufs.shape[1]
    for half in gl.static_range(2):
        tma_load(b_desc, [col + half * HALF_N, k], bar, b_bufs.index(2 * s + half), multicast=gl.num_ctas() > 1)


@gluon.jit
def _producer_gather(x_ptr, idx_ptr, b_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, num_tiles, num_n,
                     k_steps, K):
    """One warpgroup: A[r] = X[idx[r]] by cp.async (every thread), B by TMA (one thread; multicast in a cluster)."""
    NBYTES: gl.constexpr = 2 * b_desc.nbytes_per_cta
    CLUSTER_M: gl.constexpr = a_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = 2 * b_bufs.shape[1]
    VEC: gl.constexpr = 8  # bf16 elements per 16-byte copy
    COL_THREADS: gl.constexpr = BLOCK_K // VEC
    cga: gl.constexpr = a_bufs.type.layout.cga_layout  # rows split over the cluster's CTAs like the A buffers
    copy_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC],
                                                 threads_per_warp=[32 // COL_THREADS, COL_THREADS],
                                                 warps_per_cta=[GATHER_WARPS, 1], order=[1, 0], cga_layout=cga)
    tile_rows = gl.arange(0, CLUSTER_M, layout=gl.SliceLayout(1, copy_layout))
    step_cols = gl.expand_dims(gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout)), 0)
    K = K // VEC * VEC  # a multiple of VEC (the launcher checks): the compiler then sees 16-byte aligned rows
    p = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row = (tile // num_n) * CLUSTER_M
        col = (tile % num_n) * BLOCK_N
        src = gl.load(idx_ptr + row + tile_rows)
        row_ptrs = gl.expand_dims(x_ptr + src.to(gl.int64) * K, 1)
        for ki in range(k_steps):
            s = p % STAGES
            phase = ((p // STAGES) & 1) ^ 1
            mbarrier.wait(empty_cta.index(s), phase)
            if gl.num_ctas() > 1:
                mbarrier.wait(empty_cluster.index(s), phase)
            bar = ready.index(s)
            mbarrier.expect(bar, NBYTES)
            load_b(b_desc, b_bufs, s, col, ki * BLOCK_K, bar)
            cp_async_load(a_bufs.index(s), row_ptrs + ki * BLOCK_K + step_cols)
            async_copy.mbarrier_arrive(bar, increment_count=False)  # this thread's copies landed: one arrival
            p += 1


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_smem, num_tiles, num_n, k_steps,
              WG: gl.constexpr, GATHER: gl.constexpr):
    CLUSTER_M: gl.constexpr = a_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    HALF_N: gl.constexpr = b_bufs.shape[1]
    BLOCK_N: gl.constexpr = 2 * HALF_N
    cga: gl.constexpr = c_smem.type.layout.cga_layout
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF_N, 16], cga_layout=cga)
    c = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        row = (tile // num_n) * CLUSTER_M
        col = (tile % num_n) * BLOCK_N + WG * HALF_N
        acc = gl.zeros([CLUSTER_M, HALF_N], gl.float32, acc_layout)
        for ki in range(k_steps):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            if GATHER:
                fence_async_shared()  # A came through the generic proxy (cp.async); wgmma reads through the async one
            b = b_bufs.index(2 * s + WG).permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            prev = (c + STAGES - 1) % STAGES  # step c - 1's group has retired: release its slot
            mbarrier.arrive(empty_cta.index(prev), pred=ki > 0)
            if gl.num_ctas() > 1:
                mbarrier.arrive(empty_cluster.index(prev), pred=ki > 0)
            c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        last = (c + STAGES - 1) % STAGES
        mbarrier.arrive(empty_cta.index(last))
        if gl.num_ctas() > 1:
            mbarrier.arrive(empty_cluster.index(last))
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [row, col], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def multicast_gemm_kernel(a_desc, b_desc, c_desc, x_ptr, idx_ptr, M, N, K, STAGES: gl.constexpr, GATHER: gl.constexpr):
    """C = A @ B^T; a_desc block [CLUSTER_M, BLOCK_K] sharded over the CTAs by rows (with GATHER its layout only:
    A[r] = X[idx[r]] from x_ptr [T, K]), b_desc block [BLOCK_N / 2, BLOCK_K] broadcast to every CTA, c_desc block
    [CLUSTER_M, HALF_N] sharded by rows. Launch with num_warps=4, num_ctas=1 or 2."""
    CLUSTER_M: gl.constexpr = a_desc.block_shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES] + b_desc.block_shape, b_desc.layout)  # halves
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_cta = mbarrier.allocate_mbarrier(batch=STAGES)
    # One barrier per slot for the whole cluster, on the lead CTA (a broadcast basis per CTA bit).
    cluster_bar: gl.constexpr = mbarrier.MBarrierLayout(cga_layout=[[0]] * (gl.num_ctas().bit_length() - 1))
    empty_cluster = gl.allocate_shared_memory(gl.int64, [STAGES, 1], cluster_bar)
    for i in gl.static_range(STAGES):
        # TMA: the producer's expect; gathering: that and one arrival per cp.async thread.
        mbarrier.init(ready.index(i), count=1 + GATHER * GATHER_WARPS * 32)
        mbarrier.init(empty_cta.index(i), count=2)  # the CTA's two consumer warpgroups
        mbarrier.init(empty_cluster.index(i), count=2)  # times the CTAs of the cluster
    fence_async_shared()
    num_n = N // (2 * b_desc.block_shape[0])
    num_tiles = (M // CLUSTER_M) * num_n
    k_steps = gl.cdiv(K, BLOCK_K)
    if GATHER:
        gl.warp_specialize([
            (_consumer, (c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_bufs.index(0), num_tiles, num_n,
                         k_steps, 0, GATHER)),
            (_consumer, (c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_bufs.index(1), num_tiles, num_n,
                         k_steps, 1, GATHER)),
            (_producer_gather, (x_ptr, idx_ptr, b_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, num_tiles,
                                num_n, k_steps, K)),
        ], [4, GATHER_WARPS], [232, 40])
    else:
        gl.warp_specialize([
            (_consumer, (c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_bufs.index(0), num_tiles, num_n,
                         k_steps, 0, GATHER)),
            (_consumer, (c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_bufs.index(1), num_tiles, num_n,
                         k_steps, 1, GATHER)),
            (_producer_tma, (a_desc, b_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, num_tiles, num_n,
                             k_steps)),
        ], [4, 1], [232, 40])


def layouts(cluster: int) -> tuple:
    sharded = [[1, 0]] if cluster == 2 else []
    broadcast = [[0, 0]] if cluster == 2 else []
    a = gl.NVMMASharedLayout.get_default_for([BLOCK_M.value * cluster, BLOCK_K.value], gl.bfloat16, cga_layout=sharded)
    b = gl.NVMMASharedLayout.get_default_for([BLOCK_N.value // 2, BLOCK_K.value], gl.bfloat16, cga_layout=broadcast)
    c = gl.NVMMASharedLayout.get_default_for([BLOCK_M.value * cluster, BLOCK_N.value // 2], gl.bfloat16,
                                             cga_layout=sharded)
    return a, b, c


def descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cluster: int) -> tuple:
    la, lb, lc = layouts(cluster)
    return (TensorDescriptor.from_tensor(a, [BLOCK_M.value * cluster, BLOCK_K.value], la),
            TensorDescriptor.from_tensor(b, [BLOCK_N.value // 2, BLOCK_K.value], lb),
            TensorDescriptor.from_tensor(c, [BLOCK_M.value * cluster, BLOCK_N.value // 2], lc))


def gemm(a: torch.Tensor, b: torch.Tensor, cluster: int, c: torch.Tensor | None = None,
         idx: torch.Tensor | None = None) -> torch.Tensor:
    """C = A @ B^T, or with idx (int32 [M]) C = A[idx] @ B^T gathered in the loads (A then the token matrix)."""
    K, (N, _) = a.shape[1], b.shape
    M = a.shape[0] if idx is None else idx.shape[0]
    if M % (BLOCK_M.value * cluster) or N % BLOCK_N.value or K % BLOCK_K.value:  # (K % 64: 16-byte rows for cp.async)
        raise ValueError(f"M must be a multiple of {BLOCK_M.value * cluster}, N of {BLOCK_N.value}, "
                         f"K of {BLOCK_K.value}; "
                         f"got {M}, {N}, {K}")
    c = torch.empty(M, N, dtype=a.dtype, device=a.device) if c is None else c
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = (M // (BLOCK_M.value * cluster)) * (N // BLOCK_N.value)
    grid = (min(sms // cluster, tiles), )
    multicast_gemm_kernel[grid](*descriptors(a, b, c, cluster), a, a if idx is None else idx, M, N, K, STAGES,
                                idx is not None, num_warps=4, num_ctas=cluster)
    return c


def routed_index(device: str) -> torch.Tensor:
    """Token of each row as a balanced top-8-of-128 schedule lays them out: rows grouped by expert, tokens in order."""
    scores = torch.rand(TOKENS, EXPERTS, device=device)
    experts = scores.topk(TOP_K, dim=1).indices.flatten()
    tokens = torch.arange(TOKENS, device=device).repeat_interleave(TOP_K)
    order = torch.argsort(experts * TOKENS + tokens)
    return tokens[order].to(torch.int32)


def probe_shape(name: str, N: int, K: int, gather: bool, rounds: int) -> list[dict]:
    """Both variants and cuBLAS on one (N, K): checked against torch.matmul, then timed alternating."""
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    if gather:
        x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16)
        idx = routed_index("cuda")
        want = x[idx] @ b.T
        calls = {"cublas": lambda: x[idx] @ b.T, "torch gather": lambda: x[idx]}
    else:
        x, idx = torch.randn(M_ROWS, K, device="cuda", dtype=torch.bfloat16), None
        want = x @ b.T
        calls = {"cublas": lambda: x @ b.T}
    records = []
    for cluster in (1, 2):
        got = gemm(x, b, cluster, idx=idx)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        records.append(dict(kind="check", shape=name, gather=gather, cluster=cluster, rel_err=err,
                            ok=err < MAX_REL_ERR))
        print(f"{name} cluster {cluster}: relative error {err:.2e}", flush=True)
        calls[f"cluster{cluster}"] = lambda cluster=cluster, out=torch.empty_like(want): gemm(x, b, cluster, out, idx)
    times = alternating_rounds(calls, rounds, lambda call: triton.testing.do_bench(call, warmup=10, rep=50))
    for v, ms in times.items():
        med = statistics.median(ms)
        records.append(dict(kind="time", shape=name, gather=gather, N=N, K=K, M=M_ROWS, variant=v,
                            ms=med, round_ms=ms, tflops=2 * M_ROWS * N * K / med / 1e9))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    records = []
    for name, N, K, gather in SHAPES:
        records += probe_shape(name, N, K, gather, args.rounds)
        torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(dict(run_facts(torch.device("cuda")), records=records), f, indent=1)
    for r in records:
        if r["kind"] == "time":
            print(f"{r['shape']:20} {r['variant']:13} {r['ms']:8.3f} ms {r['tflops']:6.0f} TF/s")
    print("all checks ok:", all(r["ok"] for r in records if r["kind"] == "check"))


if __name__ == "__main__":
    main()
