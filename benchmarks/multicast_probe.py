"""Does sharing the weight tile between two CTAs by TMA multicast make a Hopper GEMM faster at megamoe's shapes?

A dense probe, not a megamoe kernel: C [M, N] = A [M, K] @ B [N, K]^T in bf16 (fp32 accumulation), written in
Triton >= 3.9's Gluon (multi-CTA layouts and multicast TMA loads; Triton 3.6's Gluon has neither), warp-specialized
as megamoe's Gluon kernels are: one producer warp feeding a ring of STAGES shared-memory slots by TMA, two consumer
warpgroups issuing wgmma. Each CTA computes a 128 x block_n tile (256: the row kernels' tile; 128: down_dgrad's, the one
measured bound by L2 throughput), its two warpgroups one half of the columns each. With CLUSTER = 2 the kernel
launches 2-CTA clusters (num_ctas=2): a cluster takes two row blocks of one column block, each CTA loads its own A
rows, and the B tile [block_n, 64] of a K step is copied once from L2 and multicast into both
CTAs' shared memory by the lead CTA (Gluon issues a multicast load of a broadcast buffer from CTA 0 only). With
CLUSTER = 1 the same code runs one CTA per program.

Slot release (the protocol this probe exists to try): a slot's A rows are read by the CTA's own consumers only,
but its B tile lives in both CTAs and is refilled by the lead's multicast, so the lead may refill a slot only
once the consumers of both CTAs released it. Every slot has two "empty" barriers: a per-CTA one (its own two
warpgroups arrive; each CTA's producer waits on it before its A copy) and a cluster one living on the lead CTA
(MBarrierLayout with a broadcast basis: the four warpgroups of the cluster arrive on it; only the lead waits, before
its multicast). "ready" is per CTA: armed by the CTA's producer with its A bytes plus the B tile's bytes; the
multicast completes the B bytes on the same-offset barrier of both CTAs. Barriers are initialised before
gl.warp_specialize (cross-CTA barriers must be, the compiler then fences and synchronises the cluster).

Usage (an H100/H200 with Triton >= 3.9 importable):  python3 benchmarks/multicast_probe.py OUT.json [--block-n 256,128]
Times both variants (triton.testing.do_bench, alternating rounds) on M = 131072 rows against megamoe's (N, K):
with 128 x 256 tiles qwen3-30b-a3b's down_fwd (2048, 768) and gate_up_dgrad (2048, 1536), qwen3-235b-a22b's
down_fwd (4096, 1536) and a gate/up-shaped (3072, 4096); with 128 x 128 tiles the down_dgrad shapes of
qwen3-30b-a3b (768, 2048) and qwen3-235b-a22b (1536, 4096); torch.matmul (cuBLAS) beside them. Each result is
checked against torch.matmul first (relative Frobenius error).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Per CTA: BLOCK_M x block_n (256, the row kernels' tile, or 128, down_dgrad's); a consumer warpgroup owns half
# the columns. Ring stages per tile width: 3 x 48 KB + two 32 KB output buffers (208 KB), or 4 x 32 KB + two 16 KB.
BLOCK_M, BLOCK_K = gl.constexpr(128), gl.constexpr(64)
STAGES = {256: 3, 128: 4}
SHAPES = {  # block_n: {name: (N, K)}
    256: {"30b-down_fwd": (2048, 768), "30b-gate_up_dgrad": (2048, 1536), "235b-down_fwd": (4096, 1536),
          "gate_up-like": (3072, 4096)},
    128: {"30b-down_dgrad": (768, 2048), "235b-down_dgrad": (1536, 4096)},
}
M_ROWS = 131072
MAX_REL_ERR = 1e-2


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, num_tiles, num_n, k_steps):
    NBYTES: gl.constexpr = a_desc.nbytes_per_cta + b_desc.nbytes_per_cta
    CLUSTER_M: gl.constexpr = a_desc.block_shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
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
            tma.async_load(a_desc, [row, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            tma.async_load(b_desc, [col, ki * BLOCK_K], ready.index(s), b_bufs.index(s),
                           multicast=gl.num_ctas() > 1)
            p += 1


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_smem, num_tiles, num_n, k_steps,
              WG: gl.constexpr):
    CLUSTER_M: gl.constexpr = a_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    HALF_N: gl.constexpr = c_smem.shape[1]
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
            b = b_bufs.index(s).slice(WG * HALF_N, HALF_N).permute((1, 0))
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
        tma.async_store(c_desc, [row, col], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def multicast_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr):
    """C = A @ B^T; a_desc block [CLUSTER_M, BLOCK_K] sharded over the CTAs by rows, b_desc block [BLOCK_N,
    BLOCK_K] broadcast to every CTA, c_desc block [CLUSTER_M, HALF_N] sharded by rows. Launch with num_warps=4,
    num_ctas=1 or 2."""
    CLUSTER_M: gl.constexpr = a_desc.block_shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_cta = mbarrier.allocate_mbarrier(batch=STAGES)
    # One barrier per slot for the whole cluster, on the lead CTA (a broadcast basis per CTA bit).
    cluster_bar: gl.constexpr = mbarrier.MBarrierLayout(cga_layout=[[0]] * (gl.num_ctas().bit_length() - 1))
    empty_cluster = gl.allocate_shared_memory(gl.int64, [STAGES, 1], cluster_bar)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty_cta.index(i), count=2)  # the CTA's two consumer warpgroups
        mbarrier.init(empty_cluster.index(i), count=2)  # times the CTAs of the cluster
    fence_async_shared()
    num_n = N // b_desc.block_shape[0]
    num_tiles = (M // CLUSTER_M) * num_n
    k_steps = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_bufs.index(0), num_tiles, num_n,
                     k_steps, 0)),
        (_consumer, (c_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, c_bufs.index(1), num_tiles, num_n,
                     k_steps, 1)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty_cta, empty_cluster, num_tiles, num_n, k_steps)),
    ], [4, 1], [232, 40])


def layouts(cluster: int, block_n: int) -> tuple:
    sharded = [[1, 0]] if cluster == 2 else []
    broadcast = [[0, 0]] if cluster == 2 else []
    a = gl.NVMMASharedLayout.get_default_for([BLOCK_M.value * cluster, BLOCK_K.value], gl.bfloat16, cga_layout=sharded)
    b = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K.value], gl.bfloat16, cga_layout=broadcast)
    c = gl.NVMMASharedLayout.get_default_for([BLOCK_M.value * cluster, block_n // 2], gl.bfloat16, cga_layout=sharded)
    return a, b, c


def descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cluster: int, block_n: int) -> tuple:
    la, lb, lc = layouts(cluster, block_n)
    return (TensorDescriptor.from_tensor(a, [BLOCK_M.value * cluster, BLOCK_K.value], la),
            TensorDescriptor.from_tensor(b, [block_n, BLOCK_K.value], lb),
            TensorDescriptor.from_tensor(c, [BLOCK_M.value * cluster, block_n // 2], lc))


def gemm(a: torch.Tensor, b: torch.Tensor, cluster: int, block_n: int = 256, c: torch.Tensor | None = None) -> torch.Tensor:
    (M, K), (N, _) = a.shape, b.shape
    if block_n not in STAGES:
        raise ValueError(f"block_n must be one of {sorted(STAGES)}, got {block_n}")
    if M % (BLOCK_M.value * cluster) or N % block_n or K % BLOCK_K.value:
        raise ValueError(f"M must be a multiple of {BLOCK_M.value * cluster}, N of {block_n}, K of {BLOCK_K.value}; "
                         f"got {M}, {N}, {K}")
    c = torch.empty(M, N, dtype=a.dtype, device=a.device) if c is None else c
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = (M // (BLOCK_M.value * cluster)) * (N // block_n)
    grid = (min(sms // cluster, tiles), )
    multicast_gemm_kernel[grid](*descriptors(a, b, c, cluster, block_n), M, N, K, STAGES[block_n], num_warps=4,
                                num_ctas=cluster)
    return c


def probe_shape(name: str, N: int, K: int, block_n: int, rounds: int) -> list[dict]:
    """Both variants and cuBLAS on one (N, K): checked against torch.matmul, then timed alternating."""
    a = torch.randn(M_ROWS, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    want = a @ b.T
    records = []
    calls = {"cublas": lambda: a @ b.T}
    for cluster in (1, 2):
        got = gemm(a, b, cluster, block_n)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        records.append(dict(kind="check", shape=name, block_n=block_n, cluster=cluster, rel_err=err, ok=err < MAX_REL_ERR))
        print(f"{name} cluster {cluster}: relative error {err:.2e}", flush=True)
        calls[f"cluster{cluster}"] = lambda cluster=cluster, out=torch.empty_like(want): gemm(a, b, cluster, block_n, out)
    times = {v: [] for v in calls}
    order = list(calls)
    for r in range(rounds):
        for v in order[r % len(order):] + order[:r % len(order)]:
            times[v].append(triton.testing.do_bench(calls[v], warmup=10, rep=50))
    for v, ms in times.items():
        med = statistics.median(ms)
        records.append(dict(kind="time", shape=name, block_n=block_n, N=N, K=K, M=M_ROWS, variant=v, ms=med, round_ms=ms,
                            tflops=2 * M_ROWS * N * K / med / 1e9))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-n", default="256,128", help="tile widths to probe, of 256 and 128")
    args = parser.parse_args()
    torch.manual_seed(0)
    records = []
    for block_n in map(int, args.block_n.split(",")):
        for name, (N, K) in SHAPES[block_n].items():
            records += probe_shape(name, N, K, block_n, args.rounds)
            torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       records=records), f, indent=1)
    for r in records:
        if r["kind"] == "time":
            print(f"{r['shape']:20} {r['block_n']:4} {r['variant']:9} {r['ms']:8.3f} ms {r['tflops']:6.0f} TF/s")
    print("all checks ok:", all(r["ok"] for r in records if r["kind"] == "check"))


if __name__ == "__main__":
    main()
