"""down_dgrad on Hopper in Gluon: one warpgroup runs the tensor cores without pause, two others run the
SwiGLU-backward epilogue beside it.

What it computes (bit for bit what tma_gemm.down_dgrad_tma_kernel computes with the TMA tile table's
128 x 128 x 64 tile, kernels.down_dgrad / down_dgrad_router):

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
    zeros, never the next expert).
  * MMA warpgroup (the default partition): every tile's main loop whole: acc [128, 128] (two m64n128k16
    wgmmas per k16 step, one K step in flight, the previous step's slot released when its wgmma retires).
    Then, once the epilogue warpgroups have taken the previous tile's accumulator ("acc_empty"), it writes
    acc to shared memory as four fp32 [64, 64] pieces (row half, column half; register renaming into
    HALF_LAYOUT, then conflict-free 8-byte stores) and arrives on "acc_ready" -- about 0.3 us -- and goes on
    with the next tile's main loop.
  * epilogue warpgroups 0 and 1: rows [64 w, 64 w + 64) of every tile, one column half (piece) at a time:
    acc from its piece into registers, then (proxy fence, warpgroup barrier) g and u of the piece by TMA
    into the piece's own two bf16 boxes ("gu_ready"), the rows' router weights by pointer loads, the math in
    registers, then h_w written over g and TMA-stored, d_u over u, and d_g over g once the h_w store has read
    it (cp.async.bulk.wait_group.read), both TMA-stored (clipped at I and at the rows' end). After the second
    piece, every store's read is awaited, then "acc_empty". There are no staging buffers: their 32 KB are the
    ring's 5th stage, and g, u are no longer prefetched (each piece waits for its copies; the epilogue runs
    beside the main loop, so its length matters only past the main loop's).

Why this split (benchmarks/results/h200-down-dgrad-*-v1.json, docs/perf-notes.md "GEMM core v4"): in the
previous, cooperative design both warpgroups ran the main loop on 64 rows each and then the epilogue
together, the tensor cores idle meanwhile; here the epilogue (~9 us a tile at qwen3-30b-a3b, against a
~16 us main loop) runs beside the next main loop: 1.00-1.09x and 1.04-1.08x the old kernel in two A/B
runs. A ping-pong of two warpgroups with a 128-row tile each lost (its one-warpgroup epilogue, with 128
accumulator registers live, took 28 us a tile). The main loop beside the epilogue is bound by the bytes the
ring keeps in flight (16.2 us a tile against 11.2 with no epilogue at all; 3 stages instead of 4 made the
kernel 1.2-1.24x slower, h200-down-dgrad-stages-ab-v1.json), hence the 5th stage (against 4: 1.19x at
qwen3-30b-a3b, 1.03x at gpt-oss-120b, 0.97x at qwen3-235b-a22b, h200-down-dgrad-5stage-ab-v1.json). What bounds
it now is L2 throughput (83% of peak at mixtral-8x7b under Nsight Compute, the tensor pipe 80%): a 128 x 128
tile asks a third more operand bytes per FLOP than the row GEMMs' 128 x 256.

Shared memory (bf16, the default 5 stages): ring 5 x (128 x 64 + 64 x 128) x 2 B = 160 KB, accumulator
pieces 4 x 64 x 64 x 4 B = 64 KB (each piece's bytes then hold g and u, then h_w, d_g and d_u), barriers:
224 KB of the 227 KB an SM allows.

Registers: 16 warps (the MMA warpgroup, two epilogue warpgroups, the producer's warp padded to a fourth);
setmaxnreg gives the epilogue warpgroups 160 (the accumulator piece stays in registers while g and u
arrive; at 152 ptxas spilled 16 bytes), the producer 24 and the MMA warpgroup the rest, 168 (its accumulator
takes 128).

Barrier protocol (phase parities; a fresh mbarrier counts as having completed the phase before phase 0):
  ready[s] (count 1: expect + TMA bytes)   MMA waits parity (c // STAGES) & 1 for slot counter c
  empty[s] (count 1)                       producer waits ((p // STAGES) & 1) ^ 1
  acc_ready (count 1)                      epilogue warpgroups wait parity j & 1 for the CTA's j-th tile
  acc_empty (count 2: one per epilogue)    MMA waits (j & 1) ^ 1 before writing tile j's accumulator
  gu_ready[w] (count 1: expect + bytes)    warpgroup w's two pieces a tile: parities 0, then 1 (each copy is
                                           issued after the previous one was waited for)
Every partition walks the same tiles in the same order, so the counters agree.
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
    check, check_matrix, check_row_src, check_rows, check_weight, column_halves, load_range, num_sms, pair_weights,
    router_epilogue, swiglu_bwd, tile_coords,
)
from megamoe.backends.triton.kernels.gluon_common import (
    nvmma_layout, smem_reinterpret, thread_barrier, tma_load, tma_store,
)
from megamoe.backends.triton.kernels.tma_gemm import tma_addressable

PIECE_M = gl.constexpr(64)  # rows of an epilogue warpgroup's part of a tile
# An accumulator piece [64, 64] (the column-64 and row-64 bits of the MMA warpgroup's [128, 128] wgmma
# accumulator taken out): the layout Triton gives the epilogue of down_dgrad_tma_kernel (its 128-row tile
# over 8 warps: the same bases plus a third warp bit for rows 64..127), so the row sums of d_w_part run over
# the same registers and lanes in the same order.
HALF_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
# An fp32 piece in shared memory: offset bits 0-5 are one HALF_LAYOUT access's 8 rows x 8 columns (column
# bits 0-2, row bits 0-2), so each 8-byte store of the MMA warpgroup and load of an epilogue warpgroup is two
# wavefronts of 32 banks, the fewest 256 bytes take.
ACC_SMEM_LAYOUT = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [0, 8], [0, 16], [0, 32], [8, 0], [16, 0], [32, 0]]))


@triton.jit
def row_halves(acc):
    """acc [M, N] -> (acc[:M/2], acc[M/2:])."""
    m: tl.constexpr = acc.shape[0]
    n: tl.constexpr = acc.shape[1]
    return acc.reshape(2, m // 2, n).permute(1, 2, 0).split()


# ----------------------------------------------------------------------------------------------------
# Kernel partitions


@gluon.jit
def _producer(d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
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
def _acc_piece(acc_out, i: gl.constexpr):
    """Accumulator piece i (2 * row half + column half): fp32 [64, 64] over the bytes of d_gate_up boxes
    2i and 2i + 1."""
    PM: gl.constexpr = acc_out.shape[1]
    HALF_N: gl.constexpr = acc_out.shape[3]
    return smem_reinterpret(acc_out, gl.float32, [4, PM, HALF_N], ACC_SMEM_LAYOUT).index(i)


@gluon.jit
def _store_piece(acc_out, i: gl.constexpr, piece):
    # Register renaming only (assert_trivial): the piece already is in HALF_LAYOUT.
    _acc_piece(acc_out, i).store(gl.convert_layout(piece, HALF_LAYOUT, assert_trivial=True))


@gluon.jit
def _mma(a_bufs, b_bufs, acc_out, ready_bars, empty_bars, acc_ready, acc_empty, block_range_ptr, H, I,
         SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr):
    """One warpgroup: every tile's [128, 128] accumulator over the ring, then into shared memory."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = 0  # slot counter, as the producer's
    j = 0  # this CTA's tile counter
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        # K step 0 outside the loop (H >= 1: every tile has it): the accumulator's zeros then reach only a
        # wgmma. With the zeros also on the path of an empty loop, LLVM may copy them into the accumulator
        # where that path meets the loop's exit, with a wgmma still in flight, and ptxas answers by
        # serialising every wgmma (C7515).
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c, 0)
        for ki in range(1, k_steps):
            acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c + ki, ki)
        c += k_steps
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
        # The epilogue warpgroups are done with tile j - 1's pieces (their stores have read them).
        mbarrier.wait(acc_empty, (j & 1) ^ 1)
        acc_r0, acc_r1 = row_halves(acc)
        piece0, piece1 = column_halves(acc_r0)
        piece2, piece3 = column_halves(acc_r1)
        _store_piece(acc_out, 0, piece0)
        _store_piece(acc_out, 1, piece1)
        _store_piece(acc_out, 2, piece2)
        _store_piece(acc_out, 3, piece3)
        mbarrier.arrive(acc_ready)
        j += 1


@gluon.jit
def _epilogue_piece(acc_out, P: gl.constexpr, gu_desc, gu_ready, PARITY: gl.constexpr, weight, d_gu_desc, h_w_desc,
                    row, col, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    """tma_gemm._down_dgrad_half on accumulator piece P (this warpgroup's rows, one column half): the fp32
    piece into registers, then g and u by TMA into the piece's own two boxes (no staging buffers: their 32 KB
    are the ring's 5th stage), h_w written over g and TMA-stored, d_u over u, d_g over g once the h_w store has
    read it, and both TMA-stored. Returns the router-weight gradient's partial sum over the half's columns (ROUTER), else
    0. The caller has waited for the accumulator; gu_ready's phase for this piece has parity PARITY."""
    g_box = acc_out.index(2 * P)
    u_box = acc_out.index(2 * P + 1)
    PM: gl.constexpr = g_box.shape[0]
    HALF_N: gl.constexpr = g_box.shape[2]
    acc = _acc_piece(acc_out, P).load(HALF_LAYOUT)
    # Every thread's reads of the piece, ordered before the async proxy's writes over it (the TMA copies),
    # and done before one thread issues them.
    fence_async_shared()
    thread_barrier()
    mbarrier.expect(gu_ready, 2 * gu_desc.block_type.nbytes)
    tma_load(gu_desc, [row, 0, col], gu_ready, g_box)
    tma_load(gu_desc, [row, 1, col], gu_ready, u_box)
    mbarrier.wait(gu_ready, PARITY)
    g = g_box.reshape([PM, HALF_N]).load(HALF_LAYOUT)
    u = u_box.reshape([PM, HALF_N]).load(HALF_LAYOUT)
    thread_barrier()  # every thread has read g and u before any thread writes over them
    d_w_part = gl.zeros([PM], gl.float32, gl.SliceLayout(1, HALF_LAYOUT))
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
    # Every thread's generic-proxy writes, then its proxy fence, then a barrier of the warpgroup, then the
    # TMA stores (issued by one thread).
    fence_async_shared()
    thread_barrier()
    tma_store(d_gu_desc, [row, 0, col], g_box)
    tma_store(d_gu_desc, [row, 1, col], u_box)
    return d_w_part


@gluon.jit
def _epilogue(gu_desc, d_gu_desc, h_w_desc, acc_out, acc_ready, acc_empty, gu_ready, row_src_ptr, weights_ptr,
              d_w_part_ptr, block_range_ptr, I, WG: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    """One warpgroup: rows [64 WG, 64 WG + 64) of every tile, its two pieces (column halves) in turn, and the
    d_w_part store."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    j = 0  # this CTA's tile counter
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        row = (first_m + pid_m) * BLOCK_M + WG * PIECE_M
        col = pid_n * BLOCK_N
        rows = row + gl.arange(0, PIECE_M, layout=gl.SliceLayout(1, HALF_LAYOUT))
        weight = gl.zeros([PIECE_M], gl.float32, gl.SliceLayout(1, HALF_LAYOUT))  # read only with ROUTER
        if ROUTER:
            weight = pair_weights(row_src_ptr, weights_ptr, rows)
        mbarrier.wait(acc_ready, j & 1)
        d_w_part = _epilogue_piece(acc_out, 2 * WG, gu_desc, gu_ready, 0, weight, d_gu_desc, h_w_desc, row, col,
                                   ROUTER, STORE_H_W)
        d_w_part += _epilogue_piece(acc_out, 2 * WG + 1, gu_desc, gu_ready, 1, weight, d_gu_desc, h_w_desc, row,
                                    col + HALF_N, ROUTER, STORE_H_W)
        if ROUTER:
            gl.store(d_w_part_ptr + rows * num_n + pid_n, d_w_part)
        tma.store_wait(pendings=0)  # every store has read its box: the pieces are free
        mbarrier.arrive(acc_empty)
        j += 1


@gluon.jit
def down_dgrad_ws_kernel(d_y_desc, w_desc, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, d_w_part_ptr,
                         block_expert_ptr, block_range_ptr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr,
                         SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, EPILOGUE_REGS: gl.constexpr):
    """down_dgrad_tma_kernel's tiles (module docstring). Descriptors: d_y_desc d_y_rows [R, H] block
    [128, BLOCK_K]; w_desc w_down [E, H, I] block [1, BLOCK_K, BLOCK_N]; gu_desc gate_up and d_gu_desc
    d_gate_up, both as [R, 2, I] with block [64, 1, BLOCK_N / 2]; h_w_desc h_w [*, I] block [64, BLOCK_N / 2]
    (unused without ROUTER and STORE_H_W). row_src, weights, d_w_part: unused without ROUTER. Launch with
    num_warps=4 (the default partition is the MMA warpgroup)."""
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    gl.static_assert(BLOCK_M == 2 * PIECE_M, "128-row tiles: one row half per epilogue warpgroup")
    gl.static_assert(BLOCK_N == 128, "HALF_LAYOUT: column halves of a 128-column accumulator")
    gl.static_assert(gu_desc.block_type.shape[0] == PIECE_M and d_gu_desc.block_type.shape[0] == PIECE_M,
                     "gate_up and d_gate_up boxes: a piece's rows")
    gl.static_assert(2 * gu_desc.block_type.shape[2] == BLOCK_N, "gate_up boxes: column halves")
    dtype: gl.constexpr = d_y_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + d_y_desc.block_type.shape, d_y_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # The accumulator's four fp32 pieces; piece P is reused for its d_g and d_u (boxes 2P and 2P + 1).
    acc_out = gl.allocate_shared_memory(dtype, [8] + d_gu_desc.block_type.shape, d_gu_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_ready0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_ready1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; the bytes complete it
        mbarrier.init(empty_bars.index(i), count=1)  # the MMA warpgroup's arrive
    mbarrier.init(acc_ready, count=1)
    mbarrier.init(acc_empty, count=2)  # one arrive per epilogue warpgroup
    mbarrier.init(gu_ready0, count=1)
    mbarrier.init(gu_ready1, count=1)
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    H = d_y_desc.shape[1]
    I = w_desc.shape[2]
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, acc_out, ready_bars, empty_bars, acc_ready, acc_empty, block_range_ptr, H, I, SPLIT,
                GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K)),
        (_epilogue, (gu_desc, d_gu_desc, h_w_desc, acc_out, acc_ready, acc_empty, gu_ready0, row_src_ptr,
                     weights_ptr, d_w_part_ptr, block_range_ptr, I, 0, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER,
                     STORE_H_W)),
        (_epilogue, (gu_desc, d_gu_desc, h_w_desc, acc_out, acc_ready, acc_empty, gu_ready1, row_src_ptr,
                     weights_ptr, d_w_part_ptr, block_range_ptr, I, 1, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER,
                     STORE_H_W)),
        (_producer, (d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr,
                     SPLIT, GROUP_M)),
    ], [4, 4, 1], [EPILOGUE_REGS, EPILOGUE_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Config and host launchers


@dataclasses.dataclass(frozen=True)
class GluonDownDgradConfig:
    """The tile (128 x 128 x 64: the TMA table's down_dgrad tile, which d_w_part's column blocks and the
    bitwise match depend on), the ring depth and the registers of the epilogue warpgroups and the producer
    (the MMA warpgroup gets the rest)."""

    stages: int = 5
    group_m: int = 8
    producer_regs: int = 24
    epilogue_regs: int = 160
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64

    def smem_bytes(self, elem: int = 2) -> int:
        """Ring + accumulator pieces (fp32; g, u and the outputs pass through them too), without the barriers."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * elem
        return ring + self.block_m * self.block_n * 4


DEFAULT_CONFIG = GluonDownDgradConfig()


def constexprs(cfg: GluonDownDgradConfig, split: int, router: bool, store_h_w: bool) -> dict:
    """The kernel's constexpr arguments (the launcher and tests/test_gluon_down_dgrad_compile.py share them)."""
    return dict(ROUTER=router, STORE_H_W=store_h_w, SPLIT=split, GROUP_M=cfg.group_m, STAGES=cfg.stages,
                PRODUCER_REGS=cfg.producer_regs, EPILOGUE_REGS=cfg.epilogue_regs)


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
         block_range, split, cfg, router: bool, store_h_w: bool):
    check(tma_addressable(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI),
          "TMA needs 16-byte aligned operands and row strides (H, I multiples of 8 in bf16)")
    descs = descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI, cfg)
    tiles = d_rows_RH.shape[0] // cfg.block_m * triton.cdiv(w_down_EHI.shape[2], cfg.block_n)
    return down_dgrad_ws_kernel[(max(1, min(num_sms(d_rows_RH.device), tiles)), )](
        descs["d_y_desc"], descs["w_desc"], descs["gu_desc"], descs["d_gu_desc"], descs["h_w_desc"], row_src, weights,
        d_w_part, block_expert, block_range, **constexprs(cfg, split, router, store_h_w), num_warps=4)


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
    kernel = _run(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, row_src, weights, h_w, d_w_part, block_expert,
                  block_range, split, cfg, router is not None, store_h_w)
    out = d_gate_up, (h_w if store_h_w else None), d_w_part
    return (out, kernel) if return_kernel else out


def launch_down_dgrad(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
                      block_range, split, config: TileConfig, *, router: bool, store_h_w: bool) -> None:
    """grouped_gemm._down_dgrad's Gluon branch (config.gluon): operands validated and outputs allocated there
    (its placeholders where router / store_h_w are off); the tile table's entry as this kernel's tile."""
    cfg = GluonDownDgradConfig(stages=config.num_stages, group_m=config.group_m, block_m=config.block_m,
                               block_n=config.block_n, block_k=config.block_k)
    _run(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
         block_range, split, cfg, router, store_h_w)


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
