"""gate_up_fwd as a warp-specialized Hopper kernel in Gluon: the production TMA kernel's GEMM and SwiGLU epilogue
(tma_gemm.gate_up_fwd_tma_kernel), bit for bit, with a producer/consumer pipeline of its own.

The computation (grouped_gemm.gate_up_fwd with the TMA tile config):

    g = x_rows[r] . w_gate_up[e, n],  u = x_rows[r] . w_gate_up[e, I + n]     (fp32, K = H in order)
    g, u rounded to the dtype;  h[r, n] = swiglu(g, u) (kernels/_common.py, from the rounded values)
    gate_up[r] = [g, u] too with STORE_GATE_UP

for the rows of the schedule blocks in the device range `blocks` (e = block_expert[r // 128]); x_rows [R, H]
by TMA, or with GATHER the token rows x [T, H] gathered in the loads: row r reads x[row_src[r] // top_k], zeros
where row_src[r] is -1 (padding). Tiles of 128 rows x BLOCK_N gate columns (and the BLOCK_N matching up
columns), in the order of _common.expert_tile_coords (groups inside one expert), over a persistent grid; tiles
past the range exit, so the block count never leaves the device.

Structure of a CTA (gl.warp_specialize, 12 warps):
  * producer (worker partition): walks the CTA's tiles and K steps in order; per step it waits for a free
    slot of the STAGES-deep shared-memory ring ("empty" mbarrier), arms the slot's "ready" mbarrier with
    the TMA byte count and copies the weights' gate tile [1, BLOCK_N, 64] (rows col..) and up tile (rows
    I + col..) of the expert by TMA (3-D descriptor over [E, 2I, H]: an H tail reads zeros; gate columns
    past I read up rows that the stores clip away, as in the Triton kernel), and the A tile [128, 64]:
      - GATHER=False: 1 warp; A by TMA from x_rows [R, H] (the same barrier, count 1);
      - GATHER=True: 4 warps (Hopper's TMA has no row gather); the warp-group loads the tile's row_src
        once per tile and copies A with cp.async (16 bytes per copy, zero-fill for padding rows and the H
        tail), each thread then arrives on the slot's "ready" barrier when its copies have landed
        (cp.async.mbarrier.arrive.noinc): count 1 (the TMA expect) + 128 (the threads).
  * consumers (the default partition and one worker): 2 warpgroups in the CUTLASS "cooperative" split, each
    rows [64 WG, 64 WG + 64) of every tile, holding two fp32 accumulators of 64 x BLOCK_N (gate and up
    columns of one output block). Per K step: wait "ready", two async wgmma m64nBLOCK_Nk16 x 4 from the
    slot (B: the K-major weight tile viewed transposed), keep that step's two wgmma groups in flight, and
    release the previous step's slot ("empty", count 2: one arrive per consumer) once its groups retired.
  * epilogue, per consumer: g, u -> dtype; with STORE_GATE_UP TMA stores of g and u (the [R, 2, I] view of
    gate_up, box [64, 1, BLOCK_N]: the gate and up halves clip at I separately), then h = swiglu(g, u)
    and its TMA store (h viewed [R, 1, I], the same box). Each store goes through a rotating set of
    OUT_BUFS shared-memory staging buffers of the consumer: before writing a buffer it waits only for the
    store issued OUT_BUFS stores earlier (cp.async.bulk.wait_group.read OUT_BUFS - 1), and it never waits
    for its stores' global writes, so the next tile's main loop starts as soon as the last store is issued.

The epilogue handed off (gate_up_fwd_handoff_kernel, tile "s3-handoff", TileConfig.handoff; x rows by TMA only,
the tile table's kernel where x is not gathered): the consumers' epilogue above runs while the tensor cores wait
(both consumers finish a tile's main loop together), the SwiGLU's ~20 instructions an element and the three
stores a few percent of a tile's time. In this variant the consumers only round g and u into two [128, BLOCK_N]
shared-memory buffers (fence, arrive on "gu_ready", count 2) and go on to the next tile; EPILOGUE_WARPS warps
beside the producer's warp (its warpgroup's otherwise idle warps, at its register count) wait for "gu_ready",
TMA-store g and u, compute h 8 rows at a time from the buffers into g's (whose store has read it), TMA-store h,
and once that store has read the buffer arrive on "gu_free", which the consumers wait for before writing the
next tile (one buffer set: a tile's main loop is long beside its epilogue). Shared memory: 3 stages + the
buffers, 208 KB. The same bits (the same rounding, the same swiglu on the same values). On qwen3-235b-a22b h and
gate_up at 662 TF/s against 609 / 632 for the consumers' epilogue (3 stages two staging buffers / 4 stages one),
h alone 651 against 628 / 608 (docs/perf-notes.md, "GEMM core v10").

Tile: BLOCK_N 128 (what the Triton kernel runs: 128 rows x 128 gate + 128 up columns). A consumer's two 64 x 128
fp32 accumulators take 128 of the 232 registers a thread gets with setmaxnreg (232 + 232 for the consumers, 40
for the producer warpgroup), which leaves room for addresses, the epilogue's 16-bit g, u and the fp32 SwiGLU
without spills (tests/test_gluon_gate_up_compile.py). BLOCK_N 256 would need 256 accumulator registers alone,
more than a thread can hold. BLOCK_N 64 fits in half the registers but moves more bytes per flop: a ring
stage brings 32 KB per 2.1 MFLOP instead of 48 KB per 4.2 (a third more from L2), and each m64n64k16 wgmma
re-reads its A tile from shared memory for half as many columns. Shared memory (227 KB): a ring stage is 16 KB
of A + 2 x 16 KB of weights; a staging buffer 16 KB. With STORE_GATE_UP (three stores per tile) 3 stages + 2
buffers per consumer (208 KB); h alone 4 stages + 1 buffer per consumer (224 KB): its one store per tile is
waited for only at the next tile's epilogue. The benchmark (benchmarks/gluon_gate_up_bench.py) times the
alternatives (TILES).

The gather: TMA on Hopper copies boxes, not lists of rows. One 1-row TMA copy per row would be 128 copies
per K step issued by one thread; cp.async by a warpgroup is 8 copies per thread, with the same zero-fill
semantics as the Triton kernel's masked pointer loads. cp.async writes shared memory through the generic
proxy and wgmma reads it through the async proxy, so the consumers fence (fence.proxy.async) after the
"ready" wait in this mode.

Numerics, against the Triton kernel: the same fp32 accumulation (zero-initialised accumulators, wgmma k16
steps over K in order, gate then up per step, each element summed by the same instruction sequence),
the same rounding (cvt.rn to the dtype), the same SwiGLU (the production swiglu function itself, called
from Gluon, as are expert_tile_coords and load_range: 0 - g, exp as ex2.approx of x * log2(e), 1 + e, div.full, two
multiplies), and the same zero-filled operands (TMA or cp.async zero-fill): h and gate_up are bitwise equal.

Compile-only checks (CPU): tests/test_gluon_gate_up_compile.py. GPU check and timing against the Triton
kernel: benchmarks/gluon_gate_up_bench.py.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import (
    check, check_matrix, check_row_src, check_rows, check_weight, expert_segments, load_range, persistent_grid, swiglu,
)
from megamoe.backends.triton.kernels.gluon_common import (
    cp_async_load, expert_tile_origin, nvmma_layout, tma_load, tma_store,
)
from megamoe.backends.triton.kernels.tma_gemm import check_tma

BLOCK_M = 128  # rows per tile: two consumer warpgroups of 64 (wgmma's M); the kernels read it from x_desc
BLOCK_K = 64  # 128-byte rows of 16-bit operands: the widest shared-memory swizzle
CONSUMER_ROWS = BLOCK_M // 2  # rows of one consumer warpgroup, the TMA store box (h_desc's)
GATHER_WARPS = 4  # the gathering producer: one warpgroup of cp.async threads
_GATHER_WARPS = gl.constexpr(GATHER_WARPS)  # the same, as the kernels see it
_BLOCK_M = gl.constexpr(BLOCK_M)
EPILOGUE_WARPS = 2  # the hand-off kernel's epilogue warps (beside the producer's in its warpgroup)
_EPILOGUE_WARPS = gl.constexpr(EPILOGUE_WARPS)


# ----------------------------------------------------------------------------------------------------
# Kernel partitions


@gluon.jit
def _producer_tma(x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, block_expert_ptr,
                  expert_offsets_ptr, block_range_ptr, H, I, SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    """One warp: TMA copies of the A, gate and up tiles of every (tile, K step) of this CTA, in order."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    p = 0  # slot counter: slot p % STAGES, its use number p // STAGES
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row, col, expert = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                              BLOCK_M, BLOCK_N, GROUP_M)
        p = produce_tile(x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, row, col, expert, p, H, I)


@gluon.jit
def produce_tile(x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, row, col, expert, p, H, I):
    """The TMA copies of one tile's K steps (x rows from `row`, gate and up weight rows of `expert` from `col`) into
    the ring's slots from fill counter p on. Returns the next fill counter."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    NBYTES: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    for ki in range(gl.cdiv(H, BLOCK_K)):
        s = p % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first pass over the ring
        # (parity 1) does not wait.
        mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
        bar = ready_bars.index(s)
        mbarrier.expect(bar, NBYTES)
        k = ki * BLOCK_K
        tma_load(x_desc, [row, k], bar, a_bufs.index(s))
        tma_load(w_desc, [expert, col, k], bar, gate_bufs.index(s))
        tma_load(w_desc, [expert, I + col, k], bar, up_bufs.index(s))
        p += 1
    return p


@gluon.jit
def _producer_gather(x_ptr, row_src_ptr, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars,
                     block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, top_k, SPLIT: gl.constexpr,
                     GROUP_M: gl.constexpr):
    """One warpgroup: the weight tiles by TMA (one thread) and the gathered A tile by cp.async (every thread,
    8 16-byte copies per K step), x_rows[r] = x[row_src[r] // top_k] or zeros where row_src[r] = -1."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    NBYTES: gl.constexpr = 2 * w_desc.block_type.nbytes
    VEC: gl.constexpr = 128 // w_desc.dtype.primitive_bitwidth  # elements per 16-byte copy
    COL_THREADS: gl.constexpr = BLOCK_K // VEC
    copy_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // COL_THREADS, COL_THREADS],
                                                 warps_per_cta=[_GATHER_WARPS, 1], order=[1, 0])
    tile_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    step_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
    # H is a multiple of VEC (the launcher's TMA check: 16-byte row strides); written as one, the compiler sees
    # that a row's copies are 16-byte aligned and the H tail masks whole copies, also where the launch did not
    # specialise H as a multiple of 16.
    H = H // VEC * VEC
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    p = 0  # slot counter, as in _producer_tma
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row, col, expert = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                              BLOCK_M, BLOCK_N, GROUP_M)
        src = gl.load(row_src_ptr + row + tile_rows)
        has_src = gl.expand_dims(src >= 0, 1)
        row_ptrs = gl.expand_dims(x_ptr + (gl.where(src >= 0, src, 0) // top_k).to(gl.int64) * H, 1)
        for ki in range(k_steps):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, NBYTES)
            k = ki * BLOCK_K
            tma_load(w_desc, [expert, col, k], bar, gate_bufs.index(s))
            tma_load(w_desc, [expert, I + col, k], bar, up_bufs.index(s))
            cols = gl.expand_dims(k + step_cols, 0)
            cp_async_load(a_bufs.index(s), row_ptrs + cols, mask=has_src & (cols < H))
            # This thread's copies (all it issued so far) complete -> one arrive; .noinc: the barrier's count
            # includes these _GATHER_WARPS * 32 arrivals.
            async_copy.mbarrier_arrive(bar, increment_count=False)
            p += 1


@gluon.jit
def consumer_main_loop(a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, c, k_steps, WG: gl.constexpr, GATHER: gl.constexpr):
    """One consumer warpgroup's K loop over a tile: rows [64 WG, 64 WG + 64) of the slots c, c + 1, ... (the
    producer's fill counter), two wgmma groups (gate, up) a step kept in flight, each slot released once its
    groups retired. Returns the fp32 accumulators (gate, up) and the next slot counter."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    CONSUMER_ROWS: gl.constexpr = BLOCK_M // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc_g = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, acc_layout)
    acc_u = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, acc_layout)
    for ki in range(k_steps):
        s = c % STAGES
        mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
        if GATHER:
            # A was written by cp.async (generic proxy); wgmma reads shared memory through the async proxy.
            fence_async_shared()
        a = a_bufs.index(s).slice(WG * CONSUMER_ROWS, CONSUMER_ROWS)
        b_gate = gate_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
        b_up = up_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
        acc_g = warpgroup_mma(a, b_gate, acc_g, is_async=True)
        acc_u = warpgroup_mma(a, b_up, acc_u, is_async=True)
        # Step c's two wgmma groups stay in flight; step c - 1's have retired: its slot goes back.
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
        c += 1
    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
    mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
    return acc_g, acc_u, c


@gluon.jit
def _stage_store(desc, row, plane, col, value, out_bufs, n_stored):
    """TMA store of value [64, BLOCK_N] at [row, plane, col] through staging buffer n_stored % OUT_BUFS; waits
    only for the store that last used that buffer. Returns the consumer's store count."""
    OUT_BUFS: gl.constexpr = out_bufs.shape[0]
    buf = out_bufs.index(n_stored % OUT_BUFS)
    tma.store_wait(pendings=OUT_BUFS - 1)  # the store OUT_BUFS stores back has read this buffer
    buf.reshape(value.shape).store(value)
    fence_async_shared()  # the generic-proxy writes are visible to the TMA engine
    tma_store(desc, [row, plane, col], buf)
    return n_stored + 1


@gluon.jit
def _consumer(h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs, ready_bars, empty_bars, block_expert_ptr,
              expert_offsets_ptr, block_range_ptr, H, I, WG: gl.constexpr, STORE_GATE_UP: gl.constexpr,
              GATHER: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    """One warpgroup: rows [64 WG, 64 WG + 64) of every tile of this CTA: the gate and up wgmma over the ring's
    slots, then the epilogue (g, u rounded, h = swiglu(g, u), TMA stores)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = 0  # slot counter: the producer's p for the same (tile, K step)
    n_stored = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row, col, _ = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                         BLOCK_M, BLOCK_N, GROUP_M)
        acc_g, acc_u, c = consumer_main_loop(a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, c, k_steps, WG, GATHER)
        n_stored = consumer_epilogue(h_desc, gu_desc, acc_g, acc_u, row, col, out_bufs, n_stored, WG, STORE_GATE_UP)
    tma.store_wait(pendings=0)


@gluon.jit
def consumer_epilogue(h_desc, gu_desc, acc_g, acc_u, row, col, out_bufs, n_stored, WG: gl.constexpr,
                      STORE_GATE_UP: gl.constexpr):
    """A consumer's epilogue of one tile (rows [64 WG, 64 WG + 64) from `row`): g, u rounded, with STORE_GATE_UP
    TMA-stored, h = swiglu(g, u) TMA-stored, all through the staging buffers (_stage_store). Returns the store
    count."""
    CONSUMER_ROWS: gl.constexpr = h_desc.block_type.shape[0]
    dtype: gl.constexpr = h_desc.dtype
    g = acc_g.to(dtype)
    u = acc_u.to(dtype)
    out_row = row + WG * CONSUMER_ROWS
    if STORE_GATE_UP:
        n_stored = _stage_store(gu_desc, out_row, 0, col, g, out_bufs, n_stored)
        n_stored = _stage_store(gu_desc, out_row, 1, col, u, out_bufs, n_stored)
    return _stage_store(h_desc, out_row, 0, col, swiglu(g, u).to(dtype), out_bufs, n_stored)


@gluon.jit
def _consumer_handoff(a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free,
                      block_range_ptr, H, I, WG: gl.constexpr, SPLIT: gl.constexpr):
    """_consumer's main loop (x rows by TMA); its epilogue only rounds g and u into the hand-off buffers (rows
    [64 WG, 64 WG + 64) of the tile) and hands them to the epilogue warps, which do the SwiGLU and the stores
    (hand_off)."""
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = 0  # slot counter: the producer's p for the same (tile, K step)
    t = 0  # tiles of this CTA so far: use t of the hand-off buffers
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        acc_g, acc_u, c = consumer_main_loop(a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, c, k_steps, WG, False)
        hand_off(acc_g, acc_u, g_buf, u_buf, gu_ready, gu_free, t, WG)
        t += 1


@gluon.jit
def hand_off(acc_g, acc_u, g_buf, u_buf, gu_ready, gu_free, t, WG: gl.constexpr):
    """A consumer's hand-off of its tile t (the CTA's t-th): wait for gu_free's phase t - 1 (the epilogue warps
    stored tile t - 1 out of the buffers; a fresh barrier passes t = 0), round g and u into rows [64 WG, 64 WG + 64)
    of the buffers, fence for the TMA engine, arrive on gu_ready (count 2)."""
    CONSUMER_ROWS: gl.constexpr = acc_g.shape[0]
    mbarrier.wait(gu_free, (t & 1) ^ 1)
    g_buf.slice(WG * CONSUMER_ROWS, CONSUMER_ROWS).store(acc_g.to(g_buf.dtype))
    u_buf.slice(WG * CONSUMER_ROWS, CONSUMER_ROWS).store(acc_u.to(u_buf.dtype))
    fence_async_shared()  # the epilogue's TMA stores read these writes through the async proxy
    mbarrier.arrive(gu_ready)


@gluon.jit
def _epilogue(h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, block_expert_ptr, expert_offsets_ptr, block_range_ptr,
              I, STORE_GATE_UP: gl.constexpr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr, ROWS: gl.constexpr):
    """EPILOGUE_WARPS warps: epilogue_tile for every tile of this CTA, in order."""
    BLOCK_M: gl.constexpr = g_buf.shape[0]
    BLOCK_N: gl.constexpr = g_buf.shape[1]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    t = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row, col, _ = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                         BLOCK_M, BLOCK_N, GROUP_M)
        epilogue_tile(h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, row, col, t, STORE_GATE_UP, ROWS)
        t += 1


@gluon.jit
def epilogue_tile(h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, row, col, t, STORE_GATE_UP: gl.constexpr,
                  ROWS: gl.constexpr):
    """The epilogue warps' tile t (at row, col): once gu_ready's phase t completed (both consumers handed g and u
    over), TMA-store them (STORE_GATE_UP), compute h = swiglu(g, u) ROWS rows at a time from the buffers, writing h
    over g (whose store has read it), TMA-store h, and once that store has read the buffer, arrive on gu_free."""
    BLOCK_M: gl.constexpr = g_buf.shape[0]
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                            warps_per_cta=[_EPILOGUE_WARPS, 1], order=[1, 0])
    mbarrier.wait(gu_ready, t & 1)
    if STORE_GATE_UP:
        tma_store(gu_desc, [row, 0, col], g_buf.reshape(gu_desc.block_type.shape))
        tma_store(gu_desc, [row, 1, col], u_buf.reshape(gu_desc.block_type.shape))
        tma.store_wait(pendings=0)  # g's store has read g_buf: h may overwrite it
    for r in gl.static_range(0, BLOCK_M, ROWS):
        g = g_buf.slice(r, ROWS).load(layout)
        u = u_buf.slice(r, ROWS).load(layout)
        g_buf.slice(r, ROWS).store(swiglu(g, u).to(g_buf.dtype))
    fence_async_shared()  # the generic-proxy writes are visible to the TMA engine
    tma_store(h_desc, [row, 0, col], g_buf.reshape(h_desc.block_type.shape))
    tma.store_wait(pendings=0)  # h's store has read the buffer
    mbarrier.arrive(gu_free)


@gluon.jit
def handoff_smem(x_desc, w_desc, h_desc, STAGES: gl.constexpr):
    """The hand-off kernels' shared memory, barriers initialised (the caller fences them): the A and weight rings
    (STAGES slots each), the [128, BLOCK_N] g and u hand-off buffers in the 128-byte swizzle of h_desc's
    [128, 1, BLOCK_N] boxes (the TMA stores' view), "ready" (the producer's expect) and "empty" (one arrive per
    consumer warpgroup) per slot, gu_ready (one arrive per consumer warpgroup) and gu_free (the epilogue warps')."""
    dtype: gl.constexpr = x_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    gate_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    up_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    gu_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    g_buf = gl.allocate_shared_memory(dtype, [_BLOCK_M, h_desc.block_type.shape[2]], gu_layout)
    u_buf = gl.allocate_shared_memory(dtype, [_BLOCK_M, h_desc.block_type.shape[2]], gu_layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    gu_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)
    mbarrier.init(gu_ready, count=2)
    mbarrier.init(gu_free, count=1)
    return a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free


@gluon.jit
def gate_up_fwd_handoff_kernel(x_desc, w_desc, h_desc, gu_desc, block_expert_ptr, expert_offsets_ptr, block_range_ptr,
                               H, I,
                               STORE_GATE_UP: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr,
                               STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               EPILOGUE_ROWS: gl.constexpr):
    """gate_up_fwd_ws_kernel's results (x rows by TMA) with the epilogue off the consumers' path: the consumers
    round g and u into two [128, BLOCK_N] hand-off buffers and go on to the next tile's main loop;
    EPILOGUE_WARPS warps of their own (in the producer's warpgroup, with its registers) store g and u, compute
    h and store it. h_desc / gu_desc boxes cover a whole tile ([128, 1, BLOCK_N]). Launch with num_warps=4."""
    a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free = handoff_smem(
        x_desc, w_desc, h_desc, STAGES)
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    gl.warp_specialize([
        (_consumer_handoff, (a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free,
                             block_range_ptr, H, I, 0, SPLIT)),
        (_consumer_handoff, (a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free,
                             block_range_ptr, H, I, 1, SPLIT)),
        (_producer_tma, (x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, block_expert_ptr,
                         expert_offsets_ptr, block_range_ptr, H, I, SPLIT, GROUP_M)),
        (_epilogue, (h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, block_expert_ptr, expert_offsets_ptr,
                     block_range_ptr, I, STORE_GATE_UP, SPLIT, GROUP_M, EPILOGUE_ROWS)),
    ], [4, 1, _EPILOGUE_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


@gluon.jit
def gate_up_fwd_ws_kernel(x_desc, w_desc, h_desc, gu_desc, x_ptr, row_src_ptr, block_expert_ptr, expert_offsets_ptr,
                          block_range_ptr, H, I, top_k,
                          STORE_GATE_UP: gl.constexpr, GATHER: gl.constexpr, SPLIT: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, OUT_BUFS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """h (and gate_up) of the row blocks in block_range (int32 [first, end] schedule blocks), tma_gemm's
    gate_up_fwd_tma_kernel semantics. x_desc: x_rows [R, H] (GATHER: x [T, H], its layout only; x_ptr, row_src_ptr
    and top_k gather), block [128, 64]; w_desc: [E, 2I, H] block [1, BLOCK_N, 64]; h_desc: h as [R, 1, I],
    gu_desc: gate_up as [R, 2, I] (without STORE_GATE_UP: any descriptor of h_desc's type), block [64, 1,
    BLOCK_N]. Launch with num_warps=4 (the default partition is consumer 0)."""
    dtype: gl.constexpr = x_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    gate_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    up_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    out_bufs0 = gl.allocate_shared_memory(dtype, [OUT_BUFS] + h_desc.block_type.shape, h_desc.layout)
    out_bufs1 = gl.allocate_shared_memory(dtype, [OUT_BUFS] + h_desc.block_type.shape, h_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # ready: the producer's expect (the TMA bytes complete it), plus every gathering thread's cp.async arrive
        mbarrier.init(ready_bars.index(i), count=1 + GATHER * _GATHER_WARPS * 32)
        mbarrier.init(empty_bars.index(i), count=2)  # one arrive per consumer warpgroup
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    if GATHER:
        gl.warp_specialize([
            (_consumer, (h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs0, ready_bars, empty_bars,
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, 0, STORE_GATE_UP, GATHER, SPLIT,
                         GROUP_M)),
            (_consumer, (h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs1, ready_bars, empty_bars,
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, 1, STORE_GATE_UP, GATHER, SPLIT,
                         GROUP_M)),
            (_producer_gather, (x_ptr, row_src_ptr, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars,
                                block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, top_k, SPLIT, GROUP_M)),
        ], [4, _GATHER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs0, ready_bars, empty_bars,
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, 0, STORE_GATE_UP, GATHER, SPLIT,
                         GROUP_M)),
            (_consumer, (h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs1, ready_bars, empty_bars,
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, 1, STORE_GATE_UP, GATHER, SPLIT,
                         GROUP_M)),
            (_producer_tma, (x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, block_expert_ptr,
                             expert_offsets_ptr, block_range_ptr, H, I, SPLIT, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Tiles and the host launcher


@dataclasses.dataclass(frozen=True)
class GateUpTile:
    """The Gluon kernel's shape: BLOCK_N gate (and as many up) columns per 128-row tile, a STAGES-deep ring,
    OUT_BUFS staging buffers per consumer warpgroup, the registers setmaxnreg gives each partition."""

    block_n: int = 128
    stages: int = 3
    out_bufs: int = 2
    group_m: int = 8
    producer_regs: int = 40
    consumer_regs: int = 232
    handoff: bool = False  # gate_up_fwd_handoff_kernel: the epilogue on warps of its own (out_bufs unused)
    epilogue_rows: int = 8  # its rows per SwiGLU step

    def smem_bytes(self, elem: int = 2) -> int:
        """Operand ring + both consumers' staging buffers, or the hand-off buffers (without the barriers)."""
        ring = self.stages * (BLOCK_M + 2 * self.block_n) * BLOCK_K * elem
        if self.handoff:
            return ring + 2 * BLOCK_M * self.block_n * elem
        return ring + 2 * self.out_bufs * CONSUMER_ROWS * self.block_n * elem


# The tiles the benchmark compares (name: tile); each fits 227 KB of shared memory. Registers: Triton starts
# the 12 warps at 168 a thread (64K / 384, rounded down to 8); the default partition (consumer 0) gets what the
# others free: 168 x 4 warps + (168 - 232) x 4 + (168 - 40) x 4 = 232 x 4, so both consumers run with 232
# only while the producer warpgroup (1 padded or 4 gathering warps) keeps 40.
TILES = {
    "s3b2": GateUpTile(stages=3, out_bufs=2),  # gate_up stores: 3 stages, g and u and h through 2 buffers
    "s4b1": GateUpTile(stages=4, out_bufs=1),  # h alone: 4 stages, 1 buffer (its store has a main loop to drain)
    "n64-s5b3": GateUpTile(block_n=64, stages=5, out_bufs=3),  # the narrow tile, for the register argument
    # The epilogue handed off (x rows only; the table's tile where x is not gathered): 3 stages + the [128, 128]
    # g and u buffers (208 KB).
    "s3-handoff": GateUpTile(stages=3, handoff=True),
}


def default_tile(store_gate_up: bool) -> GateUpTile:
    """The launcher's tile: three stores per tile need two staging buffers (3 stages fit beside them); h alone
    needs one, and a 4th stage fits."""
    return TILES["s3b2"] if store_gate_up else TILES["s4b1"]


def constexprs(tile: GateUpTile, split: int, store_gate_up: bool, gather: bool) -> dict:
    """The kernel's constexpr arguments (the launcher and tests/test_gluon_gate_up_compile.py share them)."""
    if tile.handoff:
        return dict(STORE_GATE_UP=store_gate_up, SPLIT=split, GROUP_M=tile.group_m, STAGES=tile.stages,
                    PRODUCER_REGS=tile.producer_regs, CONSUMER_REGS=tile.consumer_regs, EPILOGUE_ROWS=tile.epilogue_rows)
    return dict(STORE_GATE_UP=store_gate_up, GATHER=gather, SPLIT=split, GROUP_M=tile.group_m, STAGES=tile.stages,
                OUT_BUFS=tile.out_bufs, PRODUCER_REGS=tile.producer_regs, CONSUMER_REGS=tile.consumer_regs)


def descriptors(x_RH: torch.Tensor, w_gate_up_E2IH: torch.Tensor, h_RI: torch.Tensor, gate_up_R2I: torch.Tensor | None,
                tile: GateUpTile) -> tuple:
    """Host-side TMA descriptors (x_desc, w_desc, h_desc, gu_desc); without gate_up, gu_desc is h's."""
    rows, inter = h_RI.shape
    a_block = [BLOCK_M, BLOCK_K]
    w_block = [1, tile.block_n, BLOCK_K]
    out_block = [BLOCK_M if tile.handoff else CONSUMER_ROWS, 1, tile.block_n]
    out_layout = nvmma_layout(out_block, h_RI.dtype)
    h_desc = TensorDescriptor(h_RI, [rows, 1, inter], [inter, inter, 1], out_block, out_layout)
    gu_desc = h_desc
    if gate_up_R2I is not None:
        gu_desc = TensorDescriptor(gate_up_R2I, [rows, 2, inter], [2 * inter, inter, 1], out_block, out_layout)
    return (TensorDescriptor.from_tensor(x_RH, a_block, nvmma_layout(a_block, x_RH.dtype)),
            TensorDescriptor.from_tensor(w_gate_up_E2IH, w_block, nvmma_layout(w_block, x_RH.dtype)), h_desc, gu_desc)


def tile_of(config: TileConfig) -> GateUpTile:
    """The tile a tile-table entry launches: 4 stages beside one staging buffer per consumer, or 3 beside two
    (the shared memory holds one or the other), or the hand-off kernel's."""
    return GateUpTile(block_n=config.block_n, stages=config.num_stages, out_bufs=1 if config.num_stages >= 4 else 2,
                      group_m=config.group_m, handoff=config.handoff)


def launch_gate_up_fwd(x_RH, w_gate_up_E2IH, h_RI, gate_up_R2I, block_expert, expert_offsets, block_range, split,
                       config: TileConfig, store_gate_up: bool, gather: tuple[torch.Tensor, int] | None) -> None:
    """grouped_gemm.gate_up_fwd's Gluon branch (config.gluon): operands validated and outputs allocated there
    (gate_up_R2I unread without store_gate_up; expert_offsets: _common.expert_segments'); the tile table's entry
    as this kernel's tile (tile_of)."""
    check(config.block_m == BLOCK_M and config.block_k == BLOCK_K,
          f"the Gluon gate_up_fwd runs {BLOCK_M} x n x {BLOCK_K} tiles, got {config}")
    check(not config.handoff or (gather is None and config.num_stages == 3),
          f"the hand-off kernel reads x rows by TMA through 3 stages, got {config} with gather={gather is not None}")
    tile = tile_of(config)
    check_tma(x_RH, w_gate_up_E2IH, h_RI, *([gate_up_R2I] if store_gate_up else []))
    row_src, top_k = gather if gather is not None else (block_expert, 1)  # unread without gather
    descs = descriptors(x_RH, w_gate_up_E2IH, h_RI, gate_up_R2I if store_gate_up else None, tile)
    grid = persistent_grid(x_RH.device, h_RI.shape[0] // BLOCK_M * triton.cdiv(h_RI.shape[1], tile.block_n))
    if tile.handoff:
        gate_up_fwd_handoff_kernel[grid](*descs, block_expert, expert_offsets, block_range, x_RH.shape[1],
                                         h_RI.shape[1], **constexprs(tile, split, store_gate_up, False), num_warps=4)
    else:
        gate_up_fwd_ws_kernel[grid](*descs, x_RH, row_src, block_expert, expert_offsets, block_range, x_RH.shape[1],
                                    h_RI.shape[1], top_k, **constexprs(tile, split, store_gate_up, gather is not None),
                                    num_warps=4)


def gate_up_fwd_gluon(x_RH: torch.Tensor, w_gate_up_E2IH: torch.Tensor, block_expert: torch.Tensor,
                      blocks: torch.Tensor, *, store_gate_up: bool, gather: tuple[torch.Tensor, int] | None = None,
                      tile: GateUpTile | None = None, out: tuple[torch.Tensor, torch.Tensor | None] | None = None):
    """(h [R, I], gate_up [R, 2I] or None): grouped_gemm.gate_up_fwd's results (bit for bit, its TMA config) for
    the rows of the schedule blocks in `blocks` (int32 [1] count or [2] range, on the device: no host sync).
    x_RH: the rows [R, H] (padding rows zero), or with gather = (row_src int32 [R], top_k) the tokens x [T, H],
    row r reading x[row_src[r] // top_k]. out: (h, gate_up) to write into (rows outside the range keep their
    values); else both are allocated."""
    check(x_RH.dtype in (torch.bfloat16, torch.float16), f"16-bit activations, got {x_RH.dtype}")
    check_matrix(x_RH, None, None, "x_rows")
    rows, hidden = x_RH.shape
    if gather is not None:
        row_src, top_k = gather
        rows = row_src.numel()
        check_row_src(row_src, rows)
        check(top_k >= 1, f"top_k must be >= 1, got {top_k}")
    else:
        row_src, top_k = block_expert, 1  # unread without gather
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] % 2 == 0, "w_gate_up must be [E_l, 2I, H]")
    inter = w_gate_up_E2IH.shape[1] // 2
    check_weight(w_gate_up_E2IH, x_RH, (w_gate_up_E2IH.shape[0], 2 * inter, hidden), "w_gate_up")
    split, block_range = check_rows(rows, block_expert, blocks, BLOCK_M)
    tile = tile or default_tile(store_gate_up)
    if out is None:
        h = torch.empty(rows, inter, dtype=x_RH.dtype, device=x_RH.device)
        gate_up = torch.empty(rows, 2 * inter, dtype=x_RH.dtype, device=x_RH.device) if store_gate_up else None
    else:
        h, gate_up = out
        check(all(t.dtype == x_RH.dtype for t in out if t is not None), "outputs in the activations' dtype")
        check_matrix(h, rows, inter, "h")
        check(not store_gate_up or gate_up is not None, "store_gate_up needs a gate_up output")
        if store_gate_up:
            check_matrix(gate_up, rows, 2 * inter, "gate_up")
    check_tma(x_RH, w_gate_up_E2IH, h, *([gate_up] if store_gate_up else []))
    descs = descriptors(x_RH, w_gate_up_E2IH, h, gate_up if store_gate_up else None, tile)
    grid = persistent_grid(x_RH.device, rows // BLOCK_M * triton.cdiv(inter, tile.block_n))
    offsets = expert_segments(None, block_expert, w_gate_up_E2IH.shape[0], rows)
    if tile.handoff:
        check(gather is None, "the hand-off tile reads x rows by TMA (it has no gathering producer)")
        gate_up_fwd_handoff_kernel[grid](*descs, block_expert, offsets, block_range, hidden, inter,
                                         **constexprs(tile, split, store_gate_up, False), num_warps=4)
    else:
        gate_up_fwd_ws_kernel[grid](*descs, x_RH, row_src, block_expert, offsets, block_range, hidden, inter, top_k,
                                    **constexprs(tile, split, store_gate_up, gather is not None), num_warps=4)
    return h, (gate_up if store_gate_up else None)
