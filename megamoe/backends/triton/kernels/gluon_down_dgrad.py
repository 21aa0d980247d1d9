"""down_dgrad on Hopper in Gluon: two consumer warpgroups on alternate tiles (a ping-pong), each running the
SwiGLU-backward epilogue of its own tile while the other runs its main loop.

What it computes (bit for bit what tma_gemm.down_dgrad_tma_kernel computes with the TMA tile table's
128 x 128 x 64 tile, kernels.down_dgrad / down_dgrad_router):

    acc [128, 128] = d_y_rows[rows] @ w_down[e][:, cols]        K = H in steps of 64, in order, fp32
    then per row half and column half (a 64 x 64 piece), as tma_gemm._down_dgrad_half:
      ROUTER:  d_h, h_w, part = router_epilogue(acc, g, u, w[row]);  h_w stored if STORE_H_W
      else:    d_h = acc
      d_gate_up[rows, cols] = swiglu_bwd(d_h, g, u)                  (gate half, up half)
    ROUTER: d_w_part[row, tile column] = part(column half 0) + part(column half 1)

with g, u the piece's saved gate_up columns ([R, 2I] read as [R, 2, I]: the gate and up halves clip at I
separately). The epilogue math is _common's own jit functions (router_epilogue, swiglu_bwd), called from Gluon,
on the layout the Triton kernel's epilogue has (HALF_LAYOUT: each row's 64 columns in the same registers and
lanes), so the row sums of d_w_part are reduced in the same order (tests/test_gluon_down_dgrad_compile.py
compares the layouts and the fused multiply-adds).

Structure of a CTA (persistent: one per SM, tiles in the order of _common.expert_tile_coords, local tile j to
consumer j % 2; tiles past the device block range are never visited, so no host sync):

  * producer (1 warp): per (tile, K step) waits for a free slot of the STAGES-deep operand ring ("empty"
    mbarrier), arms the slot's "ready" mbarrier with the byte count and issues two TMA copies: the d_y rows
    [128, 64] and the weight tile [1, 64, 128] of w_down [E, H, I] (N-contiguous; a K or N tail reads zeros,
    never the next expert).
  * z producers (1 warp per consumer; z is the saved pre-activation gate_up, g and u, as SonicMoE names it): for
    every piece of that consumer's tiles, in the epilogue's order, the
    piece's g and u boxes by TMA into the consumer's own Z_STAGES ring, and (ROUTER) the 64 rows' router
    weights (pair_weights' pointer loads, issued before the stage is free) written into the stage's w buffer
    before the arrive that the consumer's wait acquires. The epilogue never waits on global memory.
  * consumers 0 and 1 (a warpgroup each, 232 and 240 registers): in turn (the "order" mbarriers: a consumer issues its
    K loop once the other has issued its own), the tile's main loop whole (two m64n128k16 wgmmas a k16 step, one
    K step kept in flight, each slot released when its wgmma retires); then the epilogue straight from the
    accumulator registers, while the other consumer runs its main loop: a loop over the two row halves, each
    two pieces: wait for the piece's z stage, g, u and the weights into registers, release the previous piece's
    stage once its TMA stores have read it, the math, h_w written over g and TMA-stored, d_u over u, d_g over g
    once the h_w store has read it, both TMA-stored and left in flight; after a row half, its d_w_part.

Why a ping-pong, and why the epilogue is a loop (benchmarks/results/h200-down-dgrad-pingpong-*.json,
docs/perf-notes.md "GEMM core v17"): the kernel before this one ran the main loop on one MMA warpgroup and the
epilogue on two others, through the accumulator written to shared memory (64 KB of it, so 5 operand stages at
most beside it). Here no accumulator passes through shared memory and each consumer's epilogue runs beside the
other's main loop; that lost while the epilogue was straight-line code: four unrolled pieces in each of the two
consumers made 10,144 SASS instructions (162 KB), more than the SM's instruction cache holds, and Nsight Compute
sampled the consumer warps stalled on instruction fetch ("no instruction") 37% of the time. With the row halves
as a loop (one copy of two pieces, the second row half rotated into the first's registers) the kernel is ~6,000
instructions and the fetch stalls 2.5%: against the kernel before it (router epilogue, h_w stored; 3 alternating
rounds) qwen3-30b-a3b 0.855 ms / 0.891, qwen3-235b-a22b 3.260 / 3.427, gpt-oss-120b 2.460 / 2.411; this kernel,
whose consumers read the weights per piece instead of carrying them across pieces (no longer spilling), 0.787 /
3.036 / 2.262 in a later run.

Shared memory (bf16): operand ring 5 x (128 x 64 + 64 x 128) x 2 B = 160 KB, each consumer's z ring 2 stages x
(g, u) x 64 x 64 x 2 B = 32 KB, the weights 2 x 2 x 64 x 4 B = 1 KB, barriers: 230,840 B (225.4 KiB; 1 KiB less
without the router) of the 227 KiB an SM allows.
Registers: 12 warps start at 168 a thread (65536 / 384, rounded down to 8), 504 over the three warpgroups;
setmaxnreg gives consumer 1 240 and the warpgroup of the producer, the two z producers and one idle warp 24, which
leaves consumer 0 (the default partition) 240; the accumulator takes 128 of them. In the router variant with h_w
Triton 3.6's ptxas keeps 4 bytes in local memory; Triton 3.9's keeps the thread index there instead, in both router
variants (tests/test_gluon_down_dgrad_compile.py bounds both). With the producers at 32 (consumer 0 at 232), the
expert-grouped tile order (each partition loading its tile's expert and offsets) had consumer 0 keep 20 bytes there.

Barrier protocol (phase parities; a fresh mbarrier counts as having completed the phase before phase 0):
  ready[s] (count 1: expect + TMA bytes)   consumer waits parity (c // STAGES) & 1 for slot counter c
  empty[s] (count 1)                       producer waits ((p // STAGES) & 1) ^ 1
  order[w] (count 1)                       consumer w waits parity (turn & 1) ^ (1 - w) before its turn-th K loop;
                                           the other consumer arrives once it has issued its own K loop
  z_ready[w Z + s] (count 1: expect + TMA bytes; the weights' shared stores precede the expect's arrive)
                                           consumer w waits parity (q // Z) & 1 for its piece counter q
  z_empty[w Z + s] (count 1)               z producer w waits ((q // Z) & 1) ^ 1; consumer w arrives for piece q
                                           at piece q + 1, once piece q's stores have read the stage
The consumers' slot counters skip the other's K steps (tiles alternate); every partition walks the tiles in the
same order, so the counters agree.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import (
    check, check_matrix, check_row_src, check_rows, check_weight, column_halves, expert_segments, load_range, num_sms,
    pair_weights, router_epilogue, swiglu_bwd,
)
from megamoe.backends.triton.kernels.gluon_common import (
    expert_tile_origin, nvmma_layout, smem_reinterpret, thread_barrier, tma_load, tma_store,
)
from megamoe.backends.triton.kernels.tma_gemm import check_tma

PIECE_M = gl.constexpr(64)  # rows of a piece: half a tile
PIECES = gl.constexpr(4)  # pieces of a tile: two row halves x two column halves
# An accumulator piece [64, 64] (the column-64 and row-64 bits of a consumer's [128, 128] wgmma accumulator taken
# out): the layout Triton gives the epilogue of down_dgrad_tma_kernel (its 128-row tile over 8 warps: the same
# bases plus a third warp bit for rows 64..127), so the row sums of d_w_part run over the same registers and lanes
# in the same order.
HALF_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
ROWS_LAYOUT = gl.constexpr(gl.SliceLayout(1, HALF_LAYOUT))  # a value per row of a piece


@triton.jit
def row_halves(acc):
    """acc [M, N] -> (acc[:M/2], acc[M/2:])."""
    m: tl.constexpr = acc.shape[0]
    n: tl.constexpr = acc.shape[1]
    return acc.reshape(2, m // 2, n).permute(1, 2, 0).split()


# ----------------------------------------------------------------------------------------------------
# Kernel partitions


@gluon.jit
def _producer(d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, expert_offsets_ptr,
              block_range_ptr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    """One warp: TMA copies of every (tile, K step) of this CTA into the slot ring, in order."""
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    STAGES: gl.constexpr = a_bufs.shape[0]
    STEP_BYTES: gl.constexpr = d_y_desc.block_type.nbytes + w_desc.block_type.nbytes
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(w_desc.shape[2], BLOCK_N)
    k_steps = gl.cdiv(d_y_desc.shape[1], BLOCK_K)
    p = 0  # slot counter: slot p % STAGES, its use number p // STAGES
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row, col, expert = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                              BLOCK_M, BLOCK_N, GROUP_M)
        for ki in range(k_steps):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, STEP_BYTES)
            tma_load(d_y_desc, [row, ki * BLOCK_K], bar, a_bufs.index(s))
            tma_load(w_desc, [expert, ki * BLOCK_K, col], bar, b_bufs.index(s))
            p += 1


@gluon.jit
def _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c, ki):
    """K step ki of a tile (slot counter c): async wgmma from the slot, one step kept in flight, the previous
    step's slot released."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = acc.shape[1]
    s = c % STAGES
    mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).reshape([BLOCK_K, BLOCK_N]), acc, is_async=True)
    # The wgmma of step c - 1 has retired: its slot goes back to the producer.
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
    return acc


@gluon.jit
def _z_producer(gu_desc, z_bufs, weight_bufs, z_ready, z_empty, row_src_ptr, weights_ptr, block_expert_ptr,
                expert_offsets_ptr, block_range_ptr, I,
                WG: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, ROUTER: gl.constexpr):
    """One warp per consumer WG: g and u of every piece of WG's tiles (the CTA's local tiles WG, WG + 2, ...),
    pieces in the epilogue's order, by TMA into WG's Z-stage ring (a stage: a g box, a u box and, with ROUTER, the
    piece rows' router weights)."""
    Z: gl.constexpr = z_ready.shape[0] // 2
    HALF_N: gl.constexpr = BLOCK_N // 2
    NBYTES: gl.constexpr = 2 * gu_desc.block_type.nbytes
    w_layout: gl.constexpr = gl.BlockedLayout([PIECE_M // 32], [32], [1], [0])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    q = 0  # pieces of WG's tiles so far: stage q % Z, its use number q // Z
    for tile in range(gl.program_id(0) + WG * gl.num_programs(0), num_m * num_n, 2 * gl.num_programs(0)):
        tile_row, tile_col, _ = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr,
                                                   SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
        for piece in gl.static_range(PIECES):
            s = WG * Z + q % Z
            row = tile_row + (piece // 2) * PIECE_M
            col = tile_col + (piece % 2) * HALF_N
            if ROUTER:  # loaded while the stage may still be in use
                weight = pair_weights(row_src_ptr, weights_ptr, row + gl.arange(0, PIECE_M, layout=w_layout))
            mbarrier.wait(z_empty.index(s), ((q // Z) & 1) ^ 1)
            if ROUTER:
                weight_bufs.index(s).store(weight)
                thread_barrier()  # every lane's store before the one arrive below releases them
            bar = z_ready.index(s)
            mbarrier.expect(bar, NBYTES)
            tma_load(gu_desc, [row, 0, col], bar, z_bufs.index(2 * s))
            tma_load(gu_desc, [row, 1, col], bar, z_bufs.index(2 * s + 1))
            q += 1


@gluon.jit
def _epilogue_piece(acc, z_bufs, weight_bufs, z_ready, z_empty, q, d_gu_desc, h_w_desc, row, col, WG: gl.constexpr,
                    ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    """tma_gemm._down_dgrad_half on a piece held in registers (HALF_LAYOUT) with its g, u (and router weights) from
    this consumer's z stage of piece counter q; the outputs are written over g and u and TMA-stored, left in flight
    (the stage is released at the next piece, once they have read it). Returns the router weight gradient's
    partial sums over the piece's columns (ROUTER), else 0."""
    Z: gl.constexpr = z_ready.shape[0] // 2
    s = WG * Z + q % Z
    g_box = z_bufs.index(2 * s)
    u_box = z_bufs.index(2 * s + 1)
    PM: gl.constexpr = g_box.shape[0]
    HALF_N: gl.constexpr = g_box.shape[2]
    mbarrier.wait(z_ready.index(s), (q // Z) & 1)
    g = g_box.reshape([PM, HALF_N]).load(HALF_LAYOUT)
    u = u_box.reshape([PM, HALF_N]).load(HALF_LAYOUT)
    d_w_part = gl.zeros([PM], gl.float32, ROWS_LAYOUT)
    if ROUTER:
        weight = weight_bufs.index(s).load(ROWS_LAYOUT)
    # Piece q - 1's stores (issued at its end, while this piece waited and loaded) have read its stage: release it.
    tma.store_wait(pendings=0)
    thread_barrier()  # every thread has read g and u before any thread writes over them
    mbarrier.arrive(z_empty.index(WG * Z + (q + Z - 1) % Z), pred=q > 0)
    if ROUTER:
        acc, h_w, d_w_part = router_epilogue(acc, g, u, weight)
        if STORE_H_W:  # first, through the g box: its registers are free before d_g and d_u take theirs
            hw_buf = smem_reinterpret(g_box, h_w_desc.dtype, h_w_desc.block_type.shape, h_w_desc.layout)
            hw_buf.store(h_w.to(h_w_desc.dtype))
            fence_async_shared()
            thread_barrier()
            tma_store(h_w_desc, [row, col], hw_buf)
    d_g, d_u = swiglu_bwd(acc, g, u)
    u_box.reshape([PM, HALF_N]).store(d_u.to(d_gu_desc.dtype))
    if ROUTER and STORE_H_W:
        tma.store_wait(pendings=0)  # the h_w store has read the g box
        thread_barrier()
    g_box.reshape([PM, HALF_N]).store(d_g.to(d_gu_desc.dtype))
    # Every thread's generic-proxy writes, then its proxy fence, then a barrier of the warpgroup, then the TMA
    # stores (issued by one thread).
    fence_async_shared()
    thread_barrier()
    tma_store(d_gu_desc, [row, 0, col], g_box)
    tma_store(d_gu_desc, [row, 1, col], u_box)
    return d_w_part


@gluon.jit
def _consumer(a_bufs, b_bufs, ready_bars, empty_bars, order_bars, z_bufs, weight_bufs, z_ready, z_empty, d_gu_desc,
              h_w_desc, d_w_part_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, WG: gl.constexpr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    """Consumer warpgroup WG: the CTA's local tiles WG, WG + 2, ..., each a [128, 128] main loop over the ring (in
    turn with the other consumer) and then its epilogue on the accumulator in registers, piece by piece."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    HALF_N: gl.constexpr = BLOCK_N // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = WG * k_steps  # the producer's fill counter at this consumer's first K step
    turn = 0  # tiles of this consumer so far
    q = 0  # pieces so far (the z producer's counter)
    for tile in range(gl.program_id(0) + WG * gl.num_programs(0), num_m * num_n, 2 * gl.num_programs(0)):
        row, col, _ = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                         BLOCK_M, BLOCK_N, GROUP_M)
        # Turn `turn` = phase `turn` (consumer 1) or `turn - 1` (consumer 0, whose turn 0 passes on the fresh
        # barrier) of order[WG], completed when the other consumer has issued its previous tile's K loop.
        mbarrier.wait(order_bars.index(WG), (turn & 1) ^ (1 - WG))
        # K step 0 outside the loop (H >= 1: every tile has it): the accumulator's zeros then reach only a wgmma.
        # With the zeros also on the path of an empty loop, LLVM may copy them into the accumulator where that
        # path meets the loop's exit, with a wgmma still in flight, and ptxas answers by serialising every wgmma.
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c, 0)
        for ki in range(1, k_steps):
            acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c + ki, ki)
        mbarrier.arrive(order_bars.index(1 - WG))  # the whole K loop is issued: the other's turn
        turn += 1
        c += k_steps
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
        c += k_steps  # the other consumer's tile
        # The epilogue: a loop over the row halves (one copy of the code: unrolled, the pieces of both consumers
        # overflow the instruction cache), the second half's pieces rotated into the first's registers.
        acc_r0, acc_r1 = row_halves(acc)
        piece0, piece1 = column_halves(acc_r0)
        piece2, piece3 = column_halves(acc_r1)
        piece0 = gl.convert_layout(piece0, HALF_LAYOUT, assert_trivial=True)
        piece1 = gl.convert_layout(piece1, HALF_LAYOUT, assert_trivial=True)
        piece2 = gl.convert_layout(piece2, HALF_LAYOUT, assert_trivial=True)
        piece3 = gl.convert_layout(piece3, HALF_LAYOUT, assert_trivial=True)
        for half in range(2):
            r = row + half * PIECE_M
            d_w_part = _epilogue_piece(piece0, z_bufs, weight_bufs, z_ready, z_empty, q, d_gu_desc, h_w_desc, r, col,
                                       WG, ROUTER, STORE_H_W)
            d_w_part += _epilogue_piece(piece1, z_bufs, weight_bufs, z_ready, z_empty, q + 1, d_gu_desc, h_w_desc, r,
                                        col + HALF_N, WG, ROUTER, STORE_H_W)
            if ROUTER:
                rows = r + gl.arange(0, PIECE_M, layout=ROWS_LAYOUT)
                gl.store(d_w_part_ptr + rows * num_n + col // BLOCK_N, d_w_part)
            q += 2
            piece0, piece1 = piece2, piece3
    tma.store_wait(pendings=0)  # the last stores have read their boxes before the CTA exits


@gluon.jit
def down_dgrad_ws_kernel(d_y_desc, w_desc, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, d_w_part_ptr,
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, ROUTER: gl.constexpr,
                         STORE_H_W: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         Z_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """down_dgrad (ROUTER: down_dgrad_router) on [128, 128] tiles. d_y_desc: the rows [R, H], box [128, 64];
    w_desc: w_down [E, H, I], box [1, 64, 128]; gu_desc / d_gu_desc: gate_up / d_gate_up [R, 2I] as [R, 2, I], box
    [64, 1, 64]; h_w_desc: h_w [R, I] (a placeholder without STORE_H_W), box [64, 64]; row_src_ptr, weights_ptr:
    the schedule's row_src and the router weights (ROUTER); d_w_part_ptr: fp32 [R, cdiv(I, 128)] (ROUTER);
    block_expert_ptr, block_range_ptr: the schedule's block experts and the device block range (SPLIT kernel row
    blocks a schedule block). Launch with num_warps=4, one CTA per SM at most."""
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    gl.static_assert(BLOCK_M == 2 * PIECE_M and BLOCK_N == 128, "128 x 128 tiles: pieces of 64 x 64")
    gl.static_assert(gu_desc.block_type.shape == [PIECE_M, 1, BLOCK_N // 2], "g and u boxes: a piece's rows and columns")
    gl.static_assert(d_gu_desc.block_type.shape == [PIECE_M, 1, BLOCK_N // 2], "d_g and d_u boxes: a piece")
    gl.static_assert(h_w_desc.block_type.shape == [PIECE_M, BLOCK_N // 2], "h_w box: a piece")
    dtype: gl.constexpr = d_y_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + d_y_desc.block_type.shape, d_y_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    z_bufs = gl.allocate_shared_memory(dtype, [2 * 2 * Z_STAGES] + gu_desc.block_type.shape, gu_desc.layout)
    weight_bufs = gl.allocate_shared_memory(gl.float32, [2 * Z_STAGES, PIECE_M],
                                       gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    z_ready = gl.allocate_shared_memory(gl.int64, [2 * Z_STAGES, 1], mbarrier.MBarrierLayout())
    z_empty = gl.allocate_shared_memory(gl.int64, [2 * Z_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)  # one reader per slot
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
    for i in gl.static_range(2 * Z_STAGES):
        mbarrier.init(z_ready.index(i), count=1)
        mbarrier.init(z_empty.index(i), count=1)
    fence_async_shared()
    H = d_y_desc.shape[1]
    I = w_desc.shape[2]
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, z_bufs, weight_bufs, z_ready, z_empty, d_gu_desc,
                     h_w_desc, d_w_part_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, 0, SPLIT,
                     GROUP_M, BLOCK_M, BLOCK_N, ROUTER, STORE_H_W)),
        (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, z_bufs, weight_bufs, z_ready, z_empty, d_gu_desc,
                     h_w_desc, d_w_part_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I, 1, SPLIT,
                     GROUP_M, BLOCK_M, BLOCK_N, ROUTER, STORE_H_W)),
        (_producer, (d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, expert_offsets_ptr,
                     block_range_ptr, SPLIT, GROUP_M)),
        (_z_producer, (gu_desc, z_bufs, weight_bufs, z_ready, z_empty, row_src_ptr, weights_ptr, block_expert_ptr,
                       expert_offsets_ptr, block_range_ptr, I, 0,
                       SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER)),
        (_z_producer, (gu_desc, z_bufs, weight_bufs, z_ready, z_empty, row_src_ptr, weights_ptr, block_expert_ptr,
                       expert_offsets_ptr, block_range_ptr, I, 1,
                       SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER)),
    ], [4, 1, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Config and host launchers


@dataclasses.dataclass(frozen=True)
class GluonDownDgradConfig:
    """The tile (128 x 128 x 64: the TMA table's down_dgrad tile, which d_w_part's column blocks and the bitwise
    match depend on), the operand ring's depth, the depth of each consumer's ring of g and u, the tile order and
    the registers of the consumer warpgroups and of the producers' warpgroup."""

    stages: int = 5
    z_stages: int = 2
    group_m: int = 8
    producer_regs: int = 24
    consumer_regs: int = 240
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64

    def __post_init__(self):
        # A piece's z stage is released at the next piece, after that piece's wait: one stage would deadlock.
        if self.z_stages < 2:
            raise ValueError(f"z_stages must be at least 2, got {self.z_stages}")

    def smem_bytes(self, router: bool = True, elem: int = 2) -> int:
        """The operand ring, both consumers' g and u stages and (router) their router weights; without the
        barriers."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * elem
        z_ring = 2 * self.z_stages * 2 * PIECE_M.value * (self.block_n // 2) * elem
        return ring + z_ring + (2 * self.z_stages * PIECE_M.value * 4 if router else 0)


DEFAULT_CONFIG = GluonDownDgradConfig()


def constexprs(cfg: GluonDownDgradConfig, split: int, router: bool, store_h_w: bool) -> dict:
    """The kernel's constexpr arguments (the launcher and tests/test_gluon_down_dgrad_compile.py share them)."""
    return dict(ROUTER=router, STORE_H_W=store_h_w, SPLIT=split, GROUP_M=cfg.group_m, STAGES=cfg.stages,
                Z_STAGES=cfg.z_stages, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs)


def _desc(t: torch.Tensor, shape: list, strides: list, block: list) -> TensorDescriptor:
    return TensorDescriptor(t, shape, strides, block, nvmma_layout(block, t.dtype))


def _pairs_desc(t_R2I: torch.Tensor, block_m: int, block_n: int) -> TensorDescriptor:
    """[R, 2I] as [R, 2, I] (tma_gemm._pairs_desc): a box of gate (or up) columns clips at I."""
    rows, inter2 = t_R2I.shape
    return _desc(t_R2I, [rows, 2, inter2 // 2], [inter2, inter2 // 2, 1], [block_m, 1, block_n])


def descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI, cfg: GluonDownDgradConfig) -> dict:
    """Host-side TMA descriptors (Gluon's TensorDescriptor carries the shared-memory layout)."""
    half_n, piece_m = cfg.block_n // 2, PIECE_M.value
    return dict(
        d_y_desc=_desc(d_rows_RH, list(d_rows_RH.shape), list(d_rows_RH.stride()), [cfg.block_m, cfg.block_k]),
        w_desc=_desc(w_down_EHI, list(w_down_EHI.shape), list(w_down_EHI.stride()), [1, cfg.block_k, cfg.block_n]),
        gu_desc=_pairs_desc(gate_up_R2I, piece_m, half_n),
        d_gu_desc=_pairs_desc(d_gate_up_R2I, piece_m, half_n),
        h_w_desc=_desc(h_w_RI, list(h_w_RI.shape), list(h_w_RI.stride()), [piece_m, half_n]),
    )


def _run(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
         expert_offsets, block_range, split, cfg, router: bool, store_h_w: bool):
    check_tma(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI)
    descs = descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI, cfg)
    tiles = d_rows_RH.shape[0] // cfg.block_m * triton.cdiv(w_down_EHI.shape[2], cfg.block_n)
    return down_dgrad_ws_kernel[(max(1, min(num_sms(d_rows_RH.device), tiles)), )](
        descs["d_y_desc"], descs["w_desc"], descs["gu_desc"], descs["d_gu_desc"], descs["h_w_desc"], row_src, weights,
        d_w_part, block_expert, expert_offsets, block_range, **constexprs(cfg, split, router, store_h_w), num_warps=4)


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
    offsets = expert_segments(None, block_expert, w_down_EHI.shape[0], rows)
    kernel = _run(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, row_src, weights, h_w, d_w_part, block_expert, offsets,
                  block_range, split, cfg, router is not None, store_h_w)
    out = d_gate_up, (h_w if store_h_w else None), d_w_part
    return (out, kernel) if return_kernel else out


def launch_down_dgrad(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
                      expert_offsets, block_range, split, config: TileConfig, *, router: bool, store_h_w: bool) -> None:
    """grouped_gemm._down_dgrad's Gluon branch (config.gluon): operands validated and outputs allocated there
    (its placeholders where router / store_h_w are off; expert_offsets: _common.expert_segments'); the tile table's
    entry as this kernel's tile."""
    cfg = GluonDownDgradConfig(stages=config.num_stages, group_m=config.group_m, block_m=config.block_m,
                               block_n=config.block_n, block_k=config.block_k)
    _run(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
         expert_offsets, block_range, split, cfg, router, store_h_w)


def down_dgrad_router_gluon(d_out_rows_RH: torch.Tensor, w_down_EHI: torch.Tensor, gate_up_R2I: torch.Tensor,
                            row_src: torch.Tensor, weights_TK: torch.Tensor, block_expert: torch.Tensor,
                            blocks: torch.Tensor, *, store_h_w: bool, config: GluonDownDgradConfig = DEFAULT_CONFIG,
                            return_kernel: bool = False):
    """grouped_gemm.down_dgrad_router on this kernel: (d_gate_up [R, 2I], h_w [R, I] or None, d_w_part fp32
    [R, cdiv(I, 128)]); the same arguments and results, bit for bit (with the TMA table's config there)."""
    check_row_src(row_src, d_out_rows_RH.shape[0])
    check(weights_TK.is_floating_point() and weights_TK.is_contiguous(), "weights must be a contiguous float tensor")
    return _launch(d_out_rows_RH, w_down_EHI, gate_up_R2I, (row_src, weights_TK), block_expert, blocks, store_h_w,
                   config, return_kernel)


def down_dgrad_gluon(d_y_rows_RH: torch.Tensor, w_down_EHI: torch.Tensor, gate_up_R2I: torch.Tensor,
                     block_expert: torch.Tensor, blocks: torch.Tensor, *, config: GluonDownDgradConfig = DEFAULT_CONFIG,
                     return_kernel: bool = False):
    """grouped_gemm.down_dgrad (weighted rows, no router epilogue) on this kernel: d_gate_up [R, 2I]."""
    out = _launch(d_y_rows_RH, w_down_EHI, gate_up_R2I, None, block_expert, blocks, False, config, return_kernel)
    return (out[0][0], out[1]) if return_kernel else out[0]
