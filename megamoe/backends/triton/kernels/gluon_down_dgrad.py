"""down_dgrad on Hopper in Gluon: a warp-specialized version of tma_gemm.down_dgrad_tma_kernel whose epilogue
never waits on HBM.

What it computes (bit for bit what down_dgrad_tma_kernel computes with the TMA tile table's 128 x 128 x 64
tile, kernels.down_dgrad / down_dgrad_router):

    acc [128, 128] = d_y_rows[rows] @ w_down[e][:, cols]        K = H in steps of 64, in order, fp32
    then per column half (64 columns), as tma_gemm._down_dgrad_half:
      ROUTER:  d_h, h_w, part = router_epilogue(acc, g, u, w[row]);  h_w stored if STORE_H_W
      else:    d_h = acc
      d_gate_up[rows, cols] = swiglu_bwd(d_h, g, u)                  (gate half, up half)
    ROUTER: d_w_part[row, tile column] = part(half 0) + part(half 1)

with g, u the tile's saved gate_up columns ([R, 2I] read as [R, 2, I]: the gate and up halves clip at I
separately). The epilogue math is _common's own jit functions (column_halves, router_epilogue, swiglu_bwd,
pair_weights), called from Gluon, on the layout the Triton kernel's epilogue has (HALF_LAYOUT: each row's
64 columns in the same registers and lanes), so the row sums of d_w_part are reduced in the same order
(tests/test_gluon_down_dgrad_compile.py compares the layouts and the fused multiply-adds).

Structure of a CTA (persistent: one per SM, tiles in the order of _common.tile_coords; tiles past the
device block range are never visited, so no host sync):

  * producer (1 warp): per (tile, K step) waits for a free slot of the STAGES-deep operand ring ("empty"
    mbarrier), arms the slot's "ready" mbarrier with the byte count and issues two TMA copies: the d_y
    rows [128, 64] and the weight tile [1, 64, 128] of w_down [E, H, I] (N-contiguous; a K or N tail reads
    zeros, never the next expert). After the K step GU_PREFETCH_STEP of a tile (or its last, if fewer) it
    also prefetches the tile's gate_up inputs: it waits for the gate_up buffers to be free ("gu_empty") and
    issues four TMA copies ([128, 1, 64] each: gate and up of both column halves) onto "gu_ready". They have
    the rest of the main loop (tens of K steps at the model shapes) to arrive.
  * router-weight loader (1 warp, ROUTER only): per tile, the rows' router weights (pair_weights: two
    dependent pointer loads, row_src then weights) into a double-buffered [2, 128] fp32 shared buffer
    ("wt_ready" / "wt_empty"), up to two tiles ahead, so that latency is off the consumers' path too.
  * consumers (2 warpgroups, "cooperative"): both work on every tile, 64 rows each. K loop: wait "ready",
    async wgmma m64n128k16 from the slot, keep one wgmma group in flight, release the previous slot. Then
    the epilogue, all from shared memory: wait "gu_ready" (and "wt_ready"), and per column half load g, u
    (local_load into the accumulator half's layout), compute in registers, write d_g and d_u back over the
    g and u they were computed from (the same shared memory, then TMA-stored from there) and h_w into its
    own buffer, and issue the three TMA stores (clipped at I and at the rows' end). The epilogue does not
    wait for its stores: the next tile's K step GU_RELEASE_STEP (<= GU_PREFETCH_STEP) waits for them to
    have read shared memory (cp.async.bulk.wait_group.read) and then releases the gate_up buffers
    ("gu_empty") -- by then they are long done, while the next tile's wgmmas run.

Shared memory (bf16, the default 4 stages): ring 4 x (128 x 64 + 64 x 128) x 2 B = 128 KB, gate_up buffers
4 x 128 x 64 x 2 B = 64 KB (reused for d_gate_up), h_w buffers 2 warpgroups x 2 halves x 64 x 64 x 2 B =
32 KB, router weights 1 KB, barriers: 225 KB of the 227 KB an SM allows. There is no room for separate
d_gate_up staging buffers beside a 4-stage ring, hence the in-place reuse. Without h_w (no ROUTER, or no
STORE_H_W) the ring takes a 5th stage in the h_w buffers' place.

Registers: kernel-wide 168 per thread for 12 warps (two consumer warpgroups, the producer's and the loader's
warps in a third); setmaxnreg moves them to 232 (consumers) / 40 (producer, loader). The epilogue runs on
column halves, as the Triton kernel's: a half's acc, g, u and temporaries fit beside the other half's acc.

Barrier protocol (phase parities; a fresh mbarrier counts as having completed the phase before phase 0):
  ready[s] (count 1: expect + TMA bytes)      consumers wait parity (c // STAGES) & 1 for slot counter c
  empty[s] (count 2: one arrive per consumer)  producer waits ((p // STAGES) & 1) ^ 1
  gu_ready (count 1: expect + TMA bytes)      consumers wait parity j & 1 for their j-th tile
  gu_empty (count 2)                          producer waits (j & 1) ^ 1 before tile j's prefetch; consumers
                                              arrive in tile j + 1's K loop (not in their first tile)
  wt_ready[b], wt_empty[b] (counts 1, 2)      tile j uses buffer j % 2, parities (j // 2) & 1 (^ 1 to refill)
Every partition walks the same tiles in the same order, so the counters agree.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import (
    check, check_matrix, check_rows, check_weight, column_halves, load_range, num_sms, pair_weights, router_epilogue,
    swiglu_bwd, tile_coords,
)
from megamoe.backends.triton.kernels.gluon_common import nvmma_layout
from megamoe.backends.triton.kernels.tma_gemm import tma_addressable

NUM_CONSUMERS = gl.constexpr(2)  # consumer warpgroups, 64 rows of every 128-row tile each
GU_BUFFERS = gl.constexpr(4)  # gate_up buffers of a tile: index 2 * column half + (0: gate, 1: up)
# A warpgroup's accumulator [64, 128] (wgmma m64n128) split into column halves [64, 64]: the wgmma
# accumulator's registers without the column-64 bit. This is the layout Triton gives the epilogue of
# down_dgrad_tma_kernel (its 128-row tile over 8 warps: the same bases plus a third warp bit for rows
# 64..127), so the row sums of d_w_part run over the same registers and lanes in the same order.
HALF_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))


# ----------------------------------------------------------------------------------------------------
# Kernel partitions


@gluon.jit
def _producer(d_y_desc, w_desc, gu_desc, a_bufs, b_bufs, gu_bufs, ready_bars, empty_bars, gu_ready, gu_empty,
              block_expert_ptr, block_range_ptr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr,
              GU_PREFETCH_STEP: gl.constexpr):
    """One warp: TMA copies of every (tile, K step) of this CTA into the slot ring, in order, and of each
    tile's gate_up inputs after its K step GU_PREFETCH_STEP."""
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    HALF_N: gl.constexpr = gu_desc.block_type.shape[2]
    STAGES: gl.constexpr = a_bufs.shape[0]
    STEP_BYTES: gl.constexpr = d_y_desc.block_type.nbytes + w_desc.block_type.nbytes
    GU_BYTES: gl.constexpr = GU_BUFFERS * gu_desc.block_type.nbytes
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(w_desc.shape[2], BLOCK_N)
    k_steps = gl.cdiv(d_y_desc.shape[1], BLOCK_K)
    prefetch_step = gl.minimum(k_steps - 1, GU_PREFETCH_STEP)
    p = 0  # slot counter: slot p % STAGES, its use number p // STAGES
    j = 0  # this CTA's tile counter
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        m = first_m + pid_m
        expert = gl.load(block_expert_ptr + m // SPLIT)
        row = m * BLOCK_M
        col = pid_n * BLOCK_N
        for ki in range(k_steps):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, STEP_BYTES)
            tma.async_copy_global_to_shared(d_y_desc, [row, ki * BLOCK_K], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [expert, ki * BLOCK_K, col], bar, b_bufs.index(s))
            p += 1
            if ki == prefetch_step:
                # The consumers free the gate_up buffers of tile j - 1 in this tile's K step <= this one.
                mbarrier.wait(gu_empty, (j & 1) ^ 1)
                mbarrier.expect(gu_ready, GU_BYTES)
                for i in gl.static_range(GU_BUFFERS):
                    tma.async_copy_global_to_shared(gu_desc, [row, i % 2, col + (i // 2) * HALF_N], gu_ready,
                                                    gu_bufs.index(i))
        j += 1


@gluon.jit
def _router_weight_loader(row_src_ptr, weights_ptr, wt_bufs, wt_ready, wt_empty, block_range_ptr, I,
                          SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp (ROUTER): each tile's router weights (pair_weights of its rows) into wt_bufs[j % 2]."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    j = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        rows = (first_m + pid_m) * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
        weight = pair_weights(row_src_ptr, weights_ptr, rows)
        b = j % 2
        mbarrier.wait(wt_empty.index(b), ((j // 2) & 1) ^ 1)
        wt_bufs.index(b).store(weight)
        mbarrier.arrive(wt_ready.index(b))
        j += 1


@gluon.jit
def _epilogue_half(acc, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, row, col, HALF: gl.constexpr,
                   WG: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    """tma_gemm._down_dgrad_half on this warpgroup's rows of column half HALF, from shared memory: g and u
    from the gate_up buffers, d_g and d_u written back over them and TMA-stored from there, h_w through its
    own buffer. Returns the router-weight gradient's partial sum over the half's columns (ROUTER), else 0."""
    WG_M: gl.constexpr = acc.shape[0]
    HALF_N: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    # Two views of this warpgroup's rows of a gate_up buffer: [WG_M, 1, HALF_N] (the d_gate_up store's box)
    # and [WG_M, HALF_N] (registers).
    g_box = gu_bufs.index(2 * HALF).slice(WG * WG_M, WG_M)
    u_box = gu_bufs.index(2 * HALF + 1).slice(WG * WG_M, WG_M)
    g_tile = gu_bufs.index(2 * HALF).reshape([2 * WG_M, HALF_N]).slice(WG * WG_M, WG_M)
    u_tile = gu_bufs.index(2 * HALF + 1).reshape([2 * WG_M, HALF_N]).slice(WG * WG_M, WG_M)
    g = g_tile.load(layout)
    u = u_tile.load(layout)
    d_w_part = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, layout))
    if ROUTER:
        acc, h_w, d_w_part = router_epilogue(acc, g, u, weight)
        if STORE_H_W:
            hw_buf = hw_bufs.index(2 * WG + HALF)
            hw_buf.store(h_w.to(h_w_desc.dtype))
    d_g, d_u = swiglu_bwd(acc, g, u)
    g_tile.store(d_g.to(d_gu_desc.dtype))
    u_tile.store(d_u.to(d_gu_desc.dtype))
    # Every thread's generic-proxy writes above, then its proxy fence, then a barrier of the warpgroup, then
    # the TMA stores (issued by one thread). Without the explicit barrier Triton's barrier analysis would put
    # one after the writes but could leave it before the fence (h_w's writes are already ordered by the
    # barrier before d_g's writes over g), which does not order another thread's writes before the copy.
    fence_async_shared()
    gl.thread_barrier()
    if ROUTER and STORE_H_W:
        tma.async_copy_shared_to_global(h_w_desc, [row, col], hw_buf)
    tma.async_copy_shared_to_global(d_gu_desc, [row, 0, col], g_box)
    tma.async_copy_shared_to_global(d_gu_desc, [row, 1, col], u_box)
    return d_w_part


@gluon.jit
def _consumer(d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars, gu_ready,
              gu_empty, wt_ready, wt_empty, d_w_part_ptr, block_range_ptr, H, I, WG: gl.constexpr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr,
              GU_RELEASE_STEP: gl.constexpr):
    """One warpgroup (4 warps): rows [WG * 64, WG * 64 + 64) of every tile: async wgmma over the ring, then
    the epilogue on the two column halves (_epilogue_half) and the d_w_part store."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    WG_M: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    release_step = gl.minimum(k_steps - 1, GU_RELEASE_STEP)
    c = 0  # slot counter, as the producer's
    j = 0  # this CTA's tile counter
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        row = (first_m + pid_m) * BLOCK_M + WG * WG_M
        col = pid_n * BLOCK_N
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, acc_layout)
        for ki in range(k_steps):
            s = c % STAGES
            mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
            a = a_bufs.index(s).slice(WG * WG_M, WG_M)
            b = b_bufs.index(s).reshape([BLOCK_K, BLOCK_N])
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # The wgmma of step c - 1 has retired: its slot goes back to the producer.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
            if ki == release_step:
                # The previous tile's TMA stores have read the gate_up and h_w buffers: free them.
                tma.store_wait(pendings=0)
                mbarrier.arrive(gu_empty, pred=j > 0)
            c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
        acc0, acc1 = column_halves(acc)
        # Register renaming only (assert_trivial): the halves already are in HALF_LAYOUT.
        acc0 = gl.convert_layout(acc0, HALF_LAYOUT, assert_trivial=True)
        acc1 = gl.convert_layout(acc1, HALF_LAYOUT, assert_trivial=True)
        weight = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, HALF_LAYOUT))  # read only with ROUTER
        if ROUTER:
            wb = j % 2
            mbarrier.wait(wt_ready.index(wb), (j // 2) & 1)
            weight = wt_bufs.index(wb).slice(WG * WG_M, WG_M).load(gl.SliceLayout(1, HALF_LAYOUT))
            mbarrier.arrive(wt_empty.index(wb))
        mbarrier.wait(gu_ready, j & 1)
        d_w_part = _epilogue_half(acc0, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, row, col, 0, WG, ROUTER,
                                  STORE_H_W)
        d_w_part += _epilogue_half(acc1, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, row, col + BLOCK_N // 2, 1,
                                   WG, ROUTER, STORE_H_W)
        if ROUTER:
            rows = row + gl.arange(0, WG_M, layout=gl.SliceLayout(1, HALF_LAYOUT))
            gl.store(d_w_part_ptr + rows * num_n + pid_n, d_w_part)
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def down_dgrad_ws_kernel(d_y_desc, w_desc, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, d_w_part_ptr,
                         block_expert_ptr, block_range_ptr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr,
                         SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         GU_PREFETCH_STEP: gl.constexpr, GU_RELEASE_STEP: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """down_dgrad_tma_kernel's tiles (module docstring). Descriptors: d_y_desc d_y_rows [R, H] block
    [128, BLOCK_K]; w_desc w_down [E, H, I] block [1, BLOCK_K, BLOCK_N]; gu_desc gate_up as [R, 2, I] block
    [128, 1, BLOCK_N / 2]; d_gu_desc d_gate_up as [R, 2, I] block [64, 1, BLOCK_N / 2]; h_w_desc h_w [*, I]
    block [64, BLOCK_N / 2] (unused without ROUTER and STORE_H_W). row_src, weights, d_w_part: unused
    without ROUTER. Launch with num_warps=4 (the default partition is consumer 0)."""
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    gl.static_assert(BLOCK_M == NUM_CONSUMERS * 64, "two consumer warpgroups of 64 rows")
    gl.static_assert(BLOCK_N == 128, "HALF_LAYOUT: column halves of a 128-column accumulator")
    gl.static_assert(gu_desc.block_type.shape[2] * 2 == BLOCK_N, "gate_up boxes: column halves")
    gl.static_assert(d_gu_desc.block_type.shape[0] * NUM_CONSUMERS == BLOCK_M, "d_gate_up boxes: a warpgroup's rows")
    gl.static_assert(GU_RELEASE_STEP <= GU_PREFETCH_STEP, "the producer waits for a release at or before its step")
    dtype: gl.constexpr = d_y_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + d_y_desc.block_type.shape, d_y_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    gu_bufs = gl.allocate_shared_memory(dtype, [GU_BUFFERS] + gu_desc.block_type.shape, gu_desc.layout)
    if ROUTER and STORE_H_W:
        hw_bufs = gl.allocate_shared_memory(dtype, [2 * NUM_CONSUMERS] + h_w_desc.block_type.shape, h_w_desc.layout)
    else:
        hw_bufs = gu_bufs  # never written: _epilogue_half touches hw_bufs only with ROUTER and STORE_H_W
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    gu_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; the bytes complete it
        mbarrier.init(empty_bars.index(i), count=NUM_CONSUMERS)  # one arrive per consumer
    mbarrier.init(gu_ready, count=1)
    mbarrier.init(gu_empty, count=NUM_CONSUMERS)
    if ROUTER:
        wt_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        wt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        wt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(wt_ready.index(i), count=1)
            mbarrier.init(wt_empty.index(i), count=NUM_CONSUMERS)
    else:
        wt_bufs = gu_bufs  # placeholders, never used without ROUTER
        wt_ready = gu_ready
        wt_empty = gu_empty
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    H = d_y_desc.shape[1]
    I = w_desc.shape[2]
    # (Tuples of arguments are spelled out per partition: a constexpr inside a concatenated tuple would
    # reach the partition as a tensor.)
    if ROUTER:
        gl.warp_specialize([
            (_consumer, (d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars,
                         gu_ready, gu_empty, wt_ready, wt_empty, d_w_part_ptr, block_range_ptr, H, I, 0, SPLIT, GROUP_M,
                         BLOCK_M, BLOCK_N, BLOCK_K, ROUTER, STORE_H_W, GU_RELEASE_STEP)),
            (_consumer, (d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars,
                         gu_ready, gu_empty, wt_ready, wt_empty, d_w_part_ptr, block_range_ptr, H, I, 1, SPLIT, GROUP_M,
                         BLOCK_M, BLOCK_N, BLOCK_K, ROUTER, STORE_H_W, GU_RELEASE_STEP)),
            (_producer, (d_y_desc, w_desc, gu_desc, a_bufs, b_bufs, gu_bufs, ready_bars, empty_bars, gu_ready,
                         gu_empty, block_expert_ptr, block_range_ptr, SPLIT, GROUP_M, GU_PREFETCH_STEP)),
            (_router_weight_loader, (row_src_ptr, weights_ptr, wt_bufs, wt_ready, wt_empty, block_range_ptr, I, SPLIT,
                                     GROUP_M, BLOCK_M, BLOCK_N)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars,
                         gu_ready, gu_empty, wt_ready, wt_empty, d_w_part_ptr, block_range_ptr, H, I, 0, SPLIT, GROUP_M,
                         BLOCK_M, BLOCK_N, BLOCK_K, ROUTER, STORE_H_W, GU_RELEASE_STEP)),
            (_consumer, (d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars,
                         gu_ready, gu_empty, wt_ready, wt_empty, d_w_part_ptr, block_range_ptr, H, I, 1, SPLIT, GROUP_M,
                         BLOCK_M, BLOCK_N, BLOCK_K, ROUTER, STORE_H_W, GU_RELEASE_STEP)),
            (_producer, (d_y_desc, w_desc, gu_desc, a_bufs, b_bufs, gu_bufs, ready_bars, empty_bars, gu_ready,
                         gu_empty, block_expert_ptr, block_range_ptr, SPLIT, GROUP_M, GU_PREFETCH_STEP)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Config and host launchers


@dataclasses.dataclass(frozen=True)
class GluonDownDgradConfig:
    """The tile (128 x 128 x 64: the TMA table's down_dgrad tile, which d_w_part's column blocks and the
    bitwise match depend on), the ring depth (stages with h_w staging buffers; without them a deeper ring
    fits the same shared memory) and the gate_up prefetch points (K steps of a tile, see the module
    docstring)."""

    stages: int = 4
    stages_without_h_w: int = 5
    gu_prefetch_step: int = 4
    gu_release_step: int = 2
    group_m: int = 8
    producer_regs: int = 40
    consumer_regs: int = 232
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64

    def ring_stages(self, h_w: bool) -> int:
        """Ring depth when the kernel stages h_w (ROUTER and STORE_H_W) or not."""
        return self.stages if h_w else self.stages_without_h_w

    def smem_bytes(self, router: bool, store_h_w: bool, elem: int = 2) -> int:
        """Ring + gate_up buffers + h_w buffers + router weights (without the barriers)."""
        h_w = router and store_h_w
        ring = self.ring_stages(h_w) * (self.block_m + self.block_n) * self.block_k * elem
        gate_up = self.block_m * self.block_n * 2 * elem
        h_w_bufs = self.block_m * self.block_n * elem if h_w else 0
        weights = 2 * self.block_m * 4 if router else 0
        return ring + gate_up + h_w_bufs + weights


DEFAULT_CONFIG = GluonDownDgradConfig()


def constexprs(cfg: GluonDownDgradConfig, split: int, router: bool, store_h_w: bool) -> dict:
    """The kernel's constexpr arguments (the launcher and tests/test_gluon_down_dgrad_compile.py share them)."""
    return dict(ROUTER=router, STORE_H_W=store_h_w, SPLIT=split, GROUP_M=cfg.group_m,
                STAGES=cfg.ring_stages(router and store_h_w), GU_PREFETCH_STEP=cfg.gu_prefetch_step,
                GU_RELEASE_STEP=cfg.gu_release_step, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs)


def _desc(t: torch.Tensor, shape: list, strides: list, block: list) -> TensorDescriptor:
    return TensorDescriptor(t, shape, strides, block, nvmma_layout(block, t.dtype))


def _pairs_desc(t_R2I: torch.Tensor, block_m: int, block_n: int) -> TensorDescriptor:
    """[R, 2I] as [R, 2, I] (tma_gemm._pairs_desc): a box of gate (or up) columns clips at I."""
    rows, inter2 = t_R2I.shape
    return _desc(t_R2I, [rows, 2, inter2 // 2], [inter2, inter2 // 2, 1], [block_m, 1, block_n])


def descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI, cfg: GluonDownDgradConfig) -> dict:
    """Host-side TMA descriptors (Gluon's TensorDescriptor carries the shared-memory layout)."""
    half_n, wg_m = cfg.block_n // 2, cfg.block_m // NUM_CONSUMERS.value
    return dict(
        d_y_desc=_desc(d_rows_RH, list(d_rows_RH.shape), list(d_rows_RH.stride()), [cfg.block_m, cfg.block_k]),
        w_desc=_desc(w_down_EHI, list(w_down_EHI.shape), list(w_down_EHI.stride()), [1, cfg.block_k, cfg.block_n]),
        gu_desc=_pairs_desc(gate_up_R2I, cfg.block_m, half_n),
        d_gu_desc=_pairs_desc(d_gate_up_R2I, wg_m, half_n),
        h_w_desc=_desc(h_w_RI, list(h_w_RI.shape), list(h_w_RI.stride()), [wg_m, half_n]),
    )


def _launch(d_rows_RH, w_down_EHI, gate_up_R2I, router, block_expert, blocks, store_h_w, cfg, return_kernel):
    """Validate and allocate as grouped_gemm._down_dgrad does, then launch down_dgrad_ws_kernel."""
    check(d_rows_RH.dtype in (torch.bfloat16, torch.float16), "bf16/fp16 rows (wgmma, TMA)")
    check_matrix(d_rows_RH, None, None, "d_y_rows")
    rows, hidden = d_rows_RH.shape
    check(w_down_EHI.dim() == 3 and w_down_EHI.shape[1] == hidden, "w_down must be [E_l, H, I]")
    inter = w_down_EHI.shape[2]
    check_weight(w_down_EHI, d_rows_RH, (w_down_EHI.shape[0], hidden, inter), "w_down")
    check_matrix(gate_up_R2I, rows, 2 * inter, "gate_up")
    check(gate_up_R2I.dtype == d_rows_RH.dtype, "gate_up must have the rows' dtype")
    split, block_range = check_rows(rows, block_expert, blocks, cfg.block_m)
    d_gate_up = torch.empty(rows, 2 * inter, dtype=d_rows_RH.dtype, device=d_rows_RH.device)
    # Unused outputs still take a descriptor (of one tile's rows) or a pointer.
    h_w = d_gate_up.new_empty(rows if store_h_w else cfg.block_m, inter)
    d_w_part = torch.empty(rows if router else 1, triton.cdiv(inter, cfg.block_n), dtype=torch.float32,
                           device=d_rows_RH.device)
    row_src, weights = router if router else (block_expert, d_w_part)
    check(tma_addressable(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, h_w),
          "TMA needs 16-byte aligned operands and row strides (H, I multiples of 8 in bf16)")
    descs = descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, h_w, cfg)
    tiles = rows // cfg.block_m * triton.cdiv(inter, cfg.block_n)
    grid = (max(1, min(num_sms(d_rows_RH.device), tiles)), )
    kernel = down_dgrad_ws_kernel[grid](
        descs["d_y_desc"], descs["w_desc"], descs["gu_desc"], descs["d_gu_desc"], descs["h_w_desc"], row_src, weights,
        d_w_part, block_expert, block_range, **constexprs(cfg, split, router is not None, store_h_w), num_warps=4)
    out = d_gate_up, (h_w if store_h_w else None), d_w_part
    return (out, kernel) if return_kernel else out


def launch_down_dgrad(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
                      block_range, split, config: TileConfig, *, router: bool, store_h_w: bool) -> None:
    """grouped_gemm._down_dgrad's Gluon branch (config.gluon): operands validated and outputs allocated there
    (its placeholders where router / store_h_w are off); the tile table's entry as this kernel's tile."""
    cfg = GluonDownDgradConfig(stages=config.num_stages, group_m=config.group_m, block_m=config.block_m,
                               block_n=config.block_n, block_k=config.block_k)
    check(tma_addressable(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI),
          "TMA needs 16-byte aligned operands and row strides (H, I multiples of 8 in bf16)")
    descs = descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI, cfg)
    tiles = d_rows_RH.shape[0] // cfg.block_m * triton.cdiv(w_down_EHI.shape[2], cfg.block_n)
    down_dgrad_ws_kernel[(max(1, min(num_sms(d_rows_RH.device), tiles)),)](
        descs["d_y_desc"], descs["w_desc"], descs["gu_desc"], descs["d_gu_desc"], descs["h_w_desc"], row_src, weights,
        d_w_part, block_expert, block_range, **constexprs(cfg, split, router, store_h_w), num_warps=4)


def down_dgrad_router_gluon(d_out_rows_RH: torch.Tensor, w_down_EHI: torch.Tensor, gate_up_R2I: torch.Tensor,
                            row_src: torch.Tensor, weights_TK: torch.Tensor, block_expert: torch.Tensor,
                            blocks: torch.Tensor, *, store_h_w: bool, config: GluonDownDgradConfig = DEFAULT_CONFIG,
                            return_kernel: bool = False):
    """grouped_gemm.down_dgrad_router on this kernel: (d_gate_up [R, 2I], h_w [R, I] or None, d_w_part fp32
    [R, cdiv(I, 128)]); the same arguments and results, bit for bit (with the TMA table's config there)."""
    rows = d_out_rows_RH.shape[0]
    check(row_src.dtype == torch.int32 and tuple(row_src.shape) == (rows, ) and row_src.is_contiguous(),
          f"row_src must be a contiguous int32 [{rows}] tensor, got {row_src.dtype} {tuple(row_src.shape)}")
    check(weights_TK.is_floating_point() and weights_TK.is_contiguous(), "weights must be a contiguous float tensor")
    return _launch(d_out_rows_RH, w_down_EHI, gate_up_R2I, (row_src, weights_TK), block_expert, blocks, store_h_w,
                   config, return_kernel)


def down_dgrad_gluon(d_y_rows_RH: torch.Tensor, w_down_EHI: torch.Tensor, gate_up_R2I: torch.Tensor,
                     block_expert: torch.Tensor, blocks: torch.Tensor, *, config: GluonDownDgradConfig = DEFAULT_CONFIG,
                     return_kernel: bool = False):
    """grouped_gemm.down_dgrad (weighted rows, no router epilogue) on this kernel: d_gate_up [R, 2I]."""
    out = _launch(d_y_rows_RH, w_down_EHI, gate_up_R2I, None, block_expert, blocks, False, config, return_kernel)
    return (out[0][0], out[1]) if return_kernel else out[0]
