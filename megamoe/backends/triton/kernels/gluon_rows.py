"""The plain row-block GEMMs (down_fwd, gate_up_dgrad) as warp-specialized Gluon kernels for Hopper (sm_90a).

Same GEMMs, tile space and numerics as row_gemm_tma_kernel in kernels/tma_gemm.py (the TMA path of
grouped_gemm.down_fwd and grouped_gemm.gate_up_dgrad), written at the level of warps, shared-memory
buffers and barriers instead of leaving the pipeline to the Triton compiler:

    down_fwd:       y_rows [R, H]   = h [R, I]         @ w_down[e]^T    w_down    [E_l, H, I] (W_NK: B tiles
                                                                         [BLOCK_N, BLOCK_K], K-major)
    gate_up_dgrad:  d_x_rows [R, H] = d_gate_up [R, 2I] @ w_gate_up[e]   w_gate_up [E_l, 2I, H] (B tiles
                                                                         [BLOCK_K, BLOCK_N], N-contiguous:
                                                                         an MN-major B operand)

e = block_expert[row block // SPLIT]. Tiles (row block m, column block n) cover the device block range
[first, end) (kernels/_common.load_range, times SPLIT) in the order of kernels/_common.expert_tile_coords
(groups of GROUP_M row blocks inside one expert, so an expert's weight columns are read once per group; both
called from here, so the tile order is the Triton kernel's); the grid is persistent (one CTA per SM, at
most one per tile) and sized for the worst case, and a CTA whose tiles lie past the range does nothing:
no host synchronisation. Rows outside the range are never written.

Structure of a CTA (gl.warp_specialize, 12 warps = 3 warpgroups):
  * producer (1 warp, PRODUCER_REGS registers): walks the CTA's tiles and their K steps in order. Step p
    goes to slot p % STAGES of a shared-memory ring of A tiles [BLOCK_M, BLOCK_K] and B tiles: wait for the
    slot's "empty" mbarrier, arm its "ready" mbarrier with the byte count (expect-tx), issue the two TMA
    copies into the slot (A from a 2-D descriptor over the rows; B from a 3-D descriptor over
    [E_l, N, K] or [E_l, K, N] whose first coordinate is the expert, so a K or N tail reads zeros, never
    the next expert's weights). The copy engine completes "ready" when the bytes have landed.
  * two consumer warpgroups (4 warps each, CONSUMER_REGS registers): per K step wait "ready", issue async
    wgmma (m64 x BLOCK_N x k16 instructions from the slot's shared memory), keep one wgmma group in
    flight, and once the previous step's group retired (warpgroup_mma_wait(1)) arrive on its slot's
    "empty" barrier; then the epilogue: fp32 accumulator -> the output dtype (round to nearest even, as
    Triton's .to) -> the warpgroup's own shared buffer -> TMA store (clipped at the tensor's edge).
    Gluon issues an mbarrier.arrive from one thread after a warpgroup-wide bar.sync, so one arrive per
    warpgroup covers all its warps.
  * with SPREAD (gate_up_dgrad only), one more warp in the producer's warpgroup (_spread_x, at PRODUCER_REGS):
    the backward's x rows for dw_gate_up, x_rows[dest_row[t, j]] = x[t], copied beside the GEMM instead of by a
    pass of their own (the GEMM is tensor-bound; its producer warp mostly waits). Per token of the CTA a TMA
    load of the whole row into one of two buffers (its own mbarrier each), then a TMA store to each of the
    token's rows; the next token's load goes out once the previous token's stores have read their buffer.
    Nothing is shared with the GEMM's partitions but the SM.

Two ways to use the two consumers (ConsumerTile.pingpong):
  * "coop" (CUTLASS "cooperative"): both warpgroups work on every tile, rows [0, BLOCK_M/2) and
    [BLOCK_M/2, BLOCK_M) of it (128 x 256: 64 x 256 each, 128 fp32 accumulator registers per thread); both
    read every slot, whose "empty" barrier counts 2 arrives.
  * "pingpong": each warpgroup owns whole tiles, alternating (local tile j -> warpgroup j % 2), so one
    warpgroup's epilogue overlaps the other's main loop; every slot is read by one warpgroup ("empty"
    counts 1). The producer fills the ring in tile order, so a consumer's slot counter for its i-th tile is
    (2 i + wg) * k_steps.

    The order barrier. Two more mbarriers (count 1), order[wg] = "warpgroup wg may start its next K loop":
    a warpgroup waits on its own before a tile's K loop and, once it has issued the whole loop (before
    waiting for the last wgmma to retire), arrives on the other's. So the main loops take turns in tile
    order (warpgroup 1 starts tile j+1's K loop only after warpgroup 0 issued tile j's, warpgroup 0 starts
    j+2's only after warpgroup 1 issued j+1's), the tensor cores see one warpgroup's wgmma stream at a
    time, and the epilogue of one runs under the other's loop. Warpgroup 0's first wait passes on the
    fresh barrier (parity 1, the phase "before" phase 0). Each order barrier is at most one phase from its
    waiter too: the other warpgroup cannot hand over twice before this one has taken its turn.

    Why the ping-pong of the first prototype (commit fbd1888, benchmarks/gluon_gemm.py) crashed: it had no
    order barrier (the mechanism is inferred from its code and reproduced on the protocol model of the tests,
    not observed on the GPU). An mbarrier wait is a parity wait: try_wait.parity(u & 1), meant for use u of a
    slot, returns as soon as the barrier's current phase differs in parity from u, which is right only while
    the barrier is in phase u or u + 1. Warpgroup 1's first wait is for fill k_steps, use k_steps // STAGES of
    its slot (qwen3-30b-a3b's down_fwd: 12 steps over 4 stages, use 3, parity 1), typically while the producer
    is still filling use 0: phase 0 differs in parity from 1, so the wait passed at once. Warpgroup 1 then ran
    wgmma on slots holding other tiles' data (or none yet) and arrived on "empty" barriers for uses it did not
    own; such extra arrives complete "empty" phases early, so the producer's own parity waits alias in turn
    and it refills slots still being read; TMA bytes can then land on "ready" barriers in phases that did not
    expect them, and the consumers can finish, and the CTA retire, with bulk copies still in flight into its
    shared memory: undefined behaviour, reported as "unspecified launch failure". With the order barrier the
    consumers' ready-waits happen in the producer's fill order (each warpgroup's own steps in order, across
    warpgroups through the order barrier), so when fill c is waited for, fill c - STAGES (the slot's previous
    use u - 1) has been waited for: the slot's "ready" barrier has completed phase u - 1 and cannot complete
    u + 1 before this consumer releases use u, so every ring-slot wait is within one phase. The producer's
    "empty" waits were and are within one phase (fill u follows fill u - 1, which needed release u - 2, and no
    slot is released before it is filled). tests/test_gluon_rows_compile.py checks both claims on a model of
    the protocol that implements the parity waits, under random interleavings of the warps and of the TMA
    completions.

Numerics (bitwise equal to row_gemm_tma_kernel with the same BLOCK_K): every output element is one fp32
accumulator, zero-initialised, updated by k16 wgmma steps in increasing K order (K steps of BLOCK_K, the
tail zero-filled by TMA as in the Triton kernel), then rounded once to the output dtype. tl.dot in the
Triton kernel compiles to the same chain of wgmma k16 instructions (the same instruction, shared-memory
layouts and transposition flags: tests/test_gluon_rows_compile.py) on the same operands; "coop" 128 x 256
issues exactly the Triton kernel's instructions (per warpgroup and k16 step one m64n256k16). Other tiles
rely on an element's result not depending on how a tile's rows and columns are split across instructions
and warpgroups (the prototype's 128 x 128 tile was bitwise equal to the 128 x 256 Triton kernel on an
H200). No split-K, no atomics: the result is independent of the grid and of the block range's split.

Registers: the kernel runs 12 warps at .maxnreg 168 (384 threads x 168 = the 64K register file); setmaxnreg
moves them to CONSUMER_REGS (232) for the two consumer warpgroups and PRODUCER_REGS (40) for the producer's.

Shared memory (bf16): ring STAGES x (BLOCK_M + BLOCK_N) x BLOCK_K x 2 B plus two epilogue buffers
(coop: 2 x 64 x BLOCK_N, pingpong: 2 x BLOCK_M x BLOCK_N elements), within the 227 KB of an SM for the
tiles of TILES; SPREAD adds two row buffers (rows longer than 4096 in parts of 4096 columns).
Compile-only checks: tests/test_gluon_rows_compile.py; GPU check against the Triton kernels and timings:
benchmarks/gluon_rows_bench.py.
"""

from __future__ import annotations

import functools

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
    check, check_matrix, check_rows, check_weight, expert_segments, load_range, persistent_grid,
)
from megamoe.backends.triton.kernels.comm_tiles import RowPush, check_push
from megamoe.backends.triton.kernels.gluon_common import (
    GL_DTYPES, SMEM_PER_CTA, ConsumerTile, expert_tile_origin, nvmma_layout, thread_barrier, tma_load, tma_store,
)
from megamoe.backends.triton.kernels.tma_gemm import check_tma, tma_addressable


# ----------------------------------------------------------------------------------------------------
# Kernel


@gluon.jit
def _producer(a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, block_expert_ptr, expert_offsets_ptr,
              block_range_ptr, N, K, W_NK: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    """One warp: the TMA copies of every (tile, K step) of this CTA, in order, into the slot ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.shape[2] if W_NK else w_bufs.shape[3]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    p = 0  # the ring's fill counter: slot p % STAGES, its use number p // STAGES
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        row, col, expert = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                              BLOCK_M, BLOCK_N, GROUP_M)
        for ki in range(k_steps):
            s = p % STAGES
            # Wait for the release of the slot's previous use; a fresh barrier counts as having completed
            # the phase before phase 0, so the first pass over the ring (parity 1) does not wait.
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            ready = ready_bars.index(s)
            mbarrier.expect(ready, NBYTES)
            k = ki * BLOCK_K
            tma_load(a_desc, [row, k], ready, a_bufs.index(s))
            if W_NK:
                tma_load(w_desc, [expert, col, k], ready, w_bufs.index(s))
            else:
                tma_load(w_desc, [expert, k, col], ready, w_bufs.index(s))
            p += 1


@gluon.jit
def _consumer(out_desc, a_bufs, w_bufs, ready_bars, empty_bars, order_bars, out_smem, block_expert_ptr,
              expert_offsets_ptr, block_range_ptr, N, K, push_table_ptr, push_rank_ptr, push_pair_ptr,
              WG: gl.constexpr, PINGPONG: gl.constexpr, W_NK: gl.constexpr, SPLIT: gl.constexpr,
              GROUP_M: gl.constexpr, PUSH: gl.constexpr):
    """Consumer warpgroup WG (0 or 1): async wgmma over the slots of its tiles, then the epilogue: a TMA store,
    or with PUSH each row pushed to its token owner (_push_tile). PINGPONG: whole tiles, the CTA's local tiles
    WG, WG + 2, ..., main loops in turn with the other warpgroup (order_bars); else rows
    [WG * BLOCK_M / 2, (WG + 1) * BLOCK_M / 2) of every tile."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = out_smem.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    WG_M: gl.constexpr = out_smem.shape[0]  # this warpgroup's rows of a tile
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    if PINGPONG:
        first = gl.program_id(0) + WG * gl.num_programs(0)
        stride = 2 * gl.num_programs(0)
        c = WG * k_steps  # the producer's fill counter at this warpgroup's first K step
        skip = k_steps  # the other warpgroup's K steps between two tiles of this one
    else:
        first = gl.program_id(0)
        stride = gl.num_programs(0)
        c = 0
        skip = 0
    turn = 0  # PINGPONG: tiles of this warpgroup so far
    for tile in range(first, num_m * num_n, stride):
        row, col, _ = expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                         BLOCK_M, BLOCK_N, GROUP_M)
        if PINGPONG:
            # Turn `turn` of this warpgroup = phase `turn` (warpgroup 1) or `turn - 1` (warpgroup 0, whose
            # turn 0 passes on the fresh barrier) of order[WG], completed when the other warpgroup has
            # issued its previous tile's K loop.
            mbarrier.wait(order_bars.index(WG), (turn & 1) ^ (1 - WG))
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, acc_layout)
        for ki in range(k_steps):
            s = c % STAGES
            mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
            a = a_bufs.index(s)
            if not PINGPONG:
                a = a.slice(WG * WG_M, WG_M)
            if W_NK:
                b = w_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
            else:
                b = w_bufs.index(s).reshape([BLOCK_K, BLOCK_N])
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # The wgmma group of step c - 1 has retired: its slot goes back to the producer.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
            c += 1
        if PINGPONG:
            mbarrier.arrive(order_bars.index(1 - WG))  # the whole K loop is issued: the other's turn
            turn += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
        c += skip
        out = acc.to(out_desc.dtype)
        if not PINGPONG:
            row += WG * WG_M
        if PUSH:
            _push_tile(out, out_smem, push_table_ptr, push_rank_ptr, push_pair_ptr, row, col, N)
        else:
            tma.store_wait(pendings=0)  # the previous tile's store has read out_smem
            out_smem.store(out)
            fence_async_shared()
            tma_store(out_desc, [row, col], out_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _push_tile(out, out_smem, table_ptr, rank_ptr, pair_ptr, row, col, N):
    """PUSH's epilogue of one warpgroup: its rows [row, row + WG_M) x columns [col, col + BLOCK_N) of the result,
    each row stored into its (token, slot) row of the token owner's pairs buffer [T*k, N] (table_ptr: int64 [W]
    base addresses; rank_ptr, pair_ptr: int32 [R] per receive row, rank -1 for padding: not stored), as
    kernels/comm_tiles.push_pointers addresses them. Through out_smem into rows of 16-byte pieces (a warp
    stores 32 x 16 contiguous bytes of a row), as plain global stores: the same bits as the TMA store."""
    WG_M: gl.constexpr = out_smem.shape[0]
    BLOCK_N: gl.constexpr = out_smem.shape[1]
    dtype: gl.constexpr = out_smem.dtype
    VEC: gl.constexpr = 128 // dtype.primitive_bitwidth  # elements per 16-byte store
    COL_THREADS: gl.constexpr = BLOCK_N // VEC if BLOCK_N // VEC < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // COL_THREADS, COL_THREADS],
                                            warps_per_cta=[4, 1], order=[1, 0])
    out_smem.store(out)
    thread_barrier()  # every thread's part of the tile is in out_smem
    value = out_smem.load(layout)
    rows = row + gl.arange(0, WG_M, layout=gl.SliceLayout(1, layout))
    cols = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    rank = gl.load(rank_ptr + rows)
    live = rank >= 0
    pair = gl.load(pair_ptr + rows, mask=live, other=0)
    base = gl.load(table_ptr + gl.maximum(rank, 0)).to(gl.pointer_type(dtype))
    # N is a multiple of VEC (the launcher's TMA check; written as one, the compiler sees it) and the buffers are
    # 16-byte aligned (symmetric memory): every row starts 16-byte aligned and the column tail masks whole
    # vectors, so the stores stay 16-byte vectors.
    N = N // VEC * VEC
    dst = gl.multiple_of(base + pair.to(gl.int64) * N, 16)
    mask = gl.expand_dims(live, 1) & gl.expand_dims(cols < N, 0)
    gl.store(gl.expand_dims(dst, 1) + gl.expand_dims(cols, 0), value, mask=mask)
    thread_barrier()  # every thread has read out_smem before the next tile writes it


@gluon.jit
def _spread_x(x_desc, x_rows_desc, bufs, bars, dest_row_ptr, T, top_k):
    """One warp beside the GEMM (gate_up_dgrad's SPREAD): x_rows[dest_row[t, j]] = x[t] for this CTA's tokens t =
    program, program + programs, ...: each token row loaded once by TMA, in parts of one buffer each (one part
    where the row fits a box), into one of two buffers, then stored by TMA to each of its rows (dest_row >= 0);
    the next part's load is issued before this one's stores."""
    NBYTES: gl.constexpr = x_desc.block_type.nbytes
    BOX: gl.constexpr = x_desc.block_type.shape[1]  # 64-column boxes a part
    parts = gl.cdiv(x_desc.shape[1], BOX)
    first = gl.program_id(0)
    stride = gl.num_programs(0)
    if first < T:
        mbarrier.expect(bars.index(0), NBYTES)
        tma_load(x_desc, [first, 0, 0], bars.index(0), bufs.index(0))
    i = 0
    for t in range(first, T, stride):
        for part in range(parts):
            s = i % 2
            mbarrier.wait(bars.index(s), (i // 2) & 1)
            tma.store_wait(pendings=0)  # the previous part's stores have read the other buffer
            next_t = t
            next_part = part + 1
            if next_part == parts:
                next_t = t + stride
                next_part = 0
            if next_t < T:
                mbarrier.expect(bars.index(1 - s), NBYTES)
                tma_load(x_desc, [next_t, next_part * BOX, 0], bars.index(1 - s), bufs.index(1 - s))
            for j in range(top_k):
                row = gl.load(dest_row_ptr + t * top_k + j)
                if row >= 0:
                    tma_store(x_rows_desc, [row, part * BOX, 0], bufs.index(s))
            i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def row_gemm_ws_kernel(a_desc, w_desc, out_desc, block_expert_ptr, expert_offsets_ptr, block_range_ptr, x_desc,
                       x_rows_desc, dest_row_ptr, T, top_k, push_table_ptr, push_rank_ptr, push_pair_ptr,
                       W_NK: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       PINGPONG: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       SPREAD: gl.constexpr, PUSH: gl.constexpr):
    """out_rows[r, n] = a_rows[r] . w[e][:, n] over K for the row blocks of the range (module docstring).

    a_desc: a [R, K], block [BLOCK_M, BLOCK_K]; w_desc: w [E_l, N, K] block [1, BLOCK_N, BLOCK_K] (W_NK)
    or w [E_l, K, N] block [1, BLOCK_K, BLOCK_N]; out_desc: out [R, N], block [BLOCK_M (PINGPONG) or
    BLOCK_M / 2, BLOCK_N]. block_range_ptr: int32 [2], the schedule blocks (first, end). SPREAD: a warp beside
    the producer also spreads x's token rows to x_rows (_spread_x; x_desc, x_rows_desc: x [T, H] and x_rows [R, H]
    as [rows, H / 64, 64], box one whole row rounded up to a power of two boxes; dest_row_ptr: int32 [T, top_k]);
    without it those five arguments (with T, top_k) are unused. PUSH: the result rows go to the token owners' pairs
    buffers instead of out (_push_tile: push_table_ptr int64 [W], push_rank_ptr and push_pair_ptr int32 [R]; out_desc
    then only gives the epilogue buffer's shape); without it those three are unused. Launch with num_warps=4 (the
    default partition is consumer warpgroup 0)."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; the copied bytes complete it
        mbarrier.init(empty_bars.index(i), count=1 if PINGPONG else 2)  # one arrive per reading warpgroup
    if PINGPONG:
        order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(order_bars.index(0), count=1)
        mbarrier.init(order_bars.index(1), count=1)
    else:
        order_bars = empty_bars  # a stand-in: coop's warpgroups share every tile and take no turns
    if SPREAD:
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2] + x_desc.block_type.shape, x_desc.layout)
        x_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(x_bars.index(0), count=1)  # the spread warp's expect; the row's bytes complete it
        mbarrier.init(x_bars.index(1), count=1)
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    N = out_desc.shape[1]
    K = a_desc.shape[1]
    if SPREAD:
        gl.warp_specialize([
            (_consumer, (out_desc, a_bufs, w_bufs, ready_bars, empty_bars, order_bars, out_bufs.index(0),
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, N, K, push_table_ptr, push_rank_ptr,
                         push_pair_ptr, 0, PINGPONG, W_NK, SPLIT, GROUP_M, PUSH)),
            (_consumer, (out_desc, a_bufs, w_bufs, ready_bars, empty_bars, order_bars, out_bufs.index(1),
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, N, K, push_table_ptr, push_rank_ptr,
                         push_pair_ptr, 1, PINGPONG, W_NK, SPLIT, GROUP_M, PUSH)),
            (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, block_expert_ptr,
                         expert_offsets_ptr, block_range_ptr, N, K, W_NK, SPLIT, GROUP_M)),
            (_spread_x, (x_desc, x_rows_desc, x_bufs, x_bars, dest_row_ptr, T, top_k)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (out_desc, a_bufs, w_bufs, ready_bars, empty_bars, order_bars, out_bufs.index(0),
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, N, K, push_table_ptr, push_rank_ptr,
                         push_pair_ptr, 0, PINGPONG, W_NK, SPLIT, GROUP_M, PUSH)),
            (_consumer, (out_desc, a_bufs, w_bufs, ready_bars, empty_bars, order_bars, out_bufs.index(1),
                         block_expert_ptr, expert_offsets_ptr, block_range_ptr, N, K, push_table_ptr, push_rank_ptr,
                         push_pair_ptr, 1, PINGPONG, W_NK, SPLIT, GROUP_M, PUSH)),
            (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready_bars, empty_bars, block_expert_ptr,
                         expert_offsets_ptr, block_range_ptr, N, K, W_NK, SPLIT, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Tiles and the host launchers


def constexprs(tile: ConsumerTile, w_nk: bool, split: int, spread: bool = False, push: bool = False) -> dict:
    """The kernel's constexpr arguments (the launcher and the compile tests share them)."""
    return dict(W_NK=w_nk, SPLIT=split, GROUP_M=tile.group_m, STAGES=tile.stages, PINGPONG=tile.pingpong,
                PRODUCER_REGS=tile.producer_regs, CONSUMER_REGS=tile.consumer_regs, SPREAD=spread, PUSH=push)


# The tiles the benchmark compares (benchmarks/gluon_rows_bench.py). Accumulators: 128 fp32 registers per
# consumer thread in each (64 x 256 or 128 x 128 per warpgroup); shared memory within 227 KB.
TILES = {
    "coop": ConsumerTile(128, 256, stages=3, pingpong=False),  # ring 144 KB + 2 x 32 KB
    "pingpong": ConsumerTile(128, 128, stages=4, pingpong=True),  # ring 128 KB + 2 x 32 KB
    "pingpong-s5": ConsumerTile(128, 128, stages=5, pingpong=True),  # ring 160 KB + 2 x 32 KB
    "pingpong-64x256": ConsumerTile(64, 256, stages=4, pingpong=True),  # ring 160 KB + 2 x 32 KB
}


def descriptors(a_RK: torch.Tensor, w: torch.Tensor, out_RN: torch.Tensor, w_nk: bool, tile: ConsumerTile) -> tuple:
    """Host-side TMA descriptors (a Gluon TensorDescriptor carries its shared-memory layout): a [R, K],
    w [E_l, N, K] (w_nk) or [E_l, K, N], out [R, N]."""
    blocks = ([tile.block_m, tile.block_k],
              [1, tile.block_n, tile.block_k] if w_nk else [1, tile.block_k, tile.block_n],
              [tile.store_m, tile.block_n])
    return tuple(TensorDescriptor.from_tensor(t, b, nvmma_layout(b, a_RK.dtype)) for t, b in zip((a_RK, w, out_RN), blocks))


SPREAD_BOX_COLS = 64  # x and x_rows seen as [rows, H / 64, 64]
SPREAD_MAX_BOXES = 64  # a part of a row: at most 64 boxes of 64 columns (8 KB of bf16); longer rows go in parts


def _spread_box(hidden: int) -> list[int]:
    """The SPREAD kernel's TMA box over [rows, H / 64, 64]: a whole row, or a part of SPREAD_MAX_BOXES boxes of a
    longer one, its middle dimension rounded up to a power of two (block shapes are; the load zero-fills past H /
    64 and the store clips there)."""
    return [1, min(triton.next_power_of_2(hidden // SPREAD_BOX_COLS), SPREAD_MAX_BOXES), SPREAD_BOX_COLS]


def spreads_x(tile: ConsumerTile, hidden: int) -> bool:
    """Whether gate_up_dgrad's kernel with this tile can spread x's rows beside its GEMM (SPREAD): H a multiple of
    64, and two buffers of a row's box beside the tile's ring and epilogue buffers within an SM's shared memory (1
    KB kept for the barriers)."""
    if hidden % SPREAD_BOX_COLS:
        return False
    box = _spread_box(hidden)
    return tile.smem_bytes() + 2 * box[1] * box[2] * 2 + 1024 <= SMEM_PER_CTA  # 16-bit rows


def spread_descriptors(x_TH: torch.Tensor, x_rows_RH: torch.Tensor) -> tuple:
    """The SPREAD kernel's x and x_rows descriptors: [rows, H / 64, 64] views, a box of one whole row."""
    hidden = x_TH.shape[1]
    block = _spread_box(hidden)
    return tuple(TensorDescriptor.from_tensor(t.view(t.shape[0], hidden // SPREAD_BOX_COLS, SPREAD_BOX_COLS), block,
                                              nvmma_layout(block, x_TH.dtype)) for t in (x_TH, x_rows_RH))


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _launch(a_RK, w, out_RN, w_nk, block_expert, blocks, tile, spread=None, push: RowPush | None = None,
            expert_offsets=None):
    """Validated operands -> row_gemm_ws_kernel over the worst-case tiles (out_RN's rows x columns); spread: (x
    [T, H], dest_row [T, k], x_rows [R, H]) to spread beside the GEMM (gate_up_dgrad only); push: the rows go to
    their token owners instead (out_RN None); expert_offsets: the schedule's (_common.expert_segments)."""
    device = a_RK.device
    if push is not None:
        check(out_RN is None and spread is None, "a pushing GEMM has no local output and spreads nothing")
        check_push(push, a_RK.shape[0])
        # Not written: only the epilogue buffer's shape and layout come from its descriptor.
        out_RN = a_RK.new_empty(tile.store_m, w.shape[1] if w_nk else w.shape[2])
    index = device.index if device.index is not None else torch.cuda.current_device()
    check(device.type == "cuda" and _is_hopper(index), "the Gluon row GEMMs run on Hopper GPUs (sm_90: wgmma, TMA)")
    check(a_RK.dtype in GL_DTYPES, f"16-bit operands (bf16, fp16), got {a_RK.dtype}")
    check_tma(a_RK, w, out_RN)
    check(out_RN.dtype == a_RK.dtype and out_RN.shape[1] == (w.shape[1] if w_nk else w.shape[2])
          and (push is not None or out_RN.shape[0] == a_RK.shape[0]) and out_RN.is_contiguous(),
          "out must be a contiguous [R, N] tensor of the operands' dtype")
    split, block_range = check_rows(a_RK.shape[0], block_expert, blocks, tile.block_m)
    descs = descriptors(a_RK, w, out_RN, w_nk, tile)
    if spread is None:
        spread_args = (*descs[:2], block_range, 0, 0)  # unused without SPREAD
    else:
        x_TH, dest_row_TK, x_rows_RH = spread
        check(not w_nk, "only gate_up_dgrad spreads x beside its GEMM")
        check(x_TH.dim() == 2 and x_TH.is_contiguous() and x_TH.dtype == a_RK.dtype and x_TH.device == device
              and x_TH.shape[1] == out_RN.shape[1],
              f"x must be a contiguous [T, {out_RN.shape[1]}] {a_RK.dtype} tensor on {device}, got "
              f"{x_TH.dtype} {tuple(x_TH.shape)} on {x_TH.device}")
        check(x_rows_RH.is_contiguous() and x_rows_RH.shape == out_RN.shape and x_rows_RH.dtype == x_TH.dtype
              and x_rows_RH.device == device, f"x_rows must be a contiguous {tuple(out_RN.shape)} {x_TH.dtype} tensor "
              f"on {device}, got {x_rows_RH.dtype} {tuple(x_rows_RH.shape)} on {x_rows_RH.device}")
        check(dest_row_TK.dtype == torch.int32 and dest_row_TK.dim() == 2 and dest_row_TK.shape[0] == x_TH.shape[0]
              and dest_row_TK.is_contiguous() and dest_row_TK.device == device,
              f"dest_row must be a contiguous int32 [{x_TH.shape[0]}, k] tensor on {device}, got {dest_row_TK.dtype} "
              f"{tuple(dest_row_TK.shape)} on {dest_row_TK.device}")
        check(spreads_x(tile, x_TH.shape[1]) and tma_addressable(x_TH, x_rows_RH),
              f"x of H={x_TH.shape[1]} cannot be spread beside tile {tile} (H a multiple of 64, rows that fit, "
              "16-byte aligned)")
        spread_args = (*spread_descriptors(x_TH, x_rows_RH), dest_row_TK, x_TH.shape[0], dest_row_TK.shape[1])
    push_args = (block_expert,) * 3 if push is None else (push.table, push.dst_rank, push.dst_pair)  # unused without
    max_tiles = a_RK.shape[0] // tile.block_m * triton.cdiv(out_RN.shape[1], tile.block_n)
    offsets = expert_segments(expert_offsets, block_expert, w.shape[0], a_RK.shape[0])
    row_gemm_ws_kernel[persistent_grid(device, max_tiles)](
        *descs, block_expert, offsets, block_range, *spread_args, *push_args,
        **constexprs(tile, w_nk, split, spread is not None, push is not None), num_warps=4,
    )
    return out_RN


def launch(a_RK: torch.Tensor, w: torch.Tensor, out_RN: torch.Tensor, w_nk: bool, block_expert: torch.Tensor,
           expert_offsets: torch.Tensor, blocks: torch.Tensor, config: TileConfig,
           spread: tuple | None = None) -> torch.Tensor:
    """grouped_gemm.down_fwd's and gate_up_dgrad's Gluon branch (config.gluon): the tile table's entry as this
    kernel's tile; operands validated there; spread as in _launch."""
    return _launch(a_RK, w, out_RN, w_nk, block_expert, blocks, ConsumerTile.of(config), spread,
                   expert_offsets=expert_offsets)


def launch_push(a_RK: torch.Tensor, w: torch.Tensor, w_nk: bool, block_expert: torch.Tensor,
                expert_offsets: torch.Tensor, blocks: torch.Tensor, config: TileConfig, push: RowPush) -> None:
    """The expert-parallel path's down_fwd (w_nk, w_down) or gate_up_dgrad (w_gate_up): launch's GEMM with every
    result row of the block range pushed into its (token, slot) row of its token owner's pairs buffer (padding
    rows dropped) instead of stored locally; the same bits. Operands validated by the caller."""
    _launch(a_RK, w, None, w_nk, block_expert, blocks, ConsumerTile.of(config), push=push,
            expert_offsets=expert_offsets)


# Shared by both launchers (as grouped_gemm.down_fwd / gate_up_dgrad with a TMA config):
#   blocks: int32 [2] on the device, the schedule blocks (first, end) to compute, or int32 [1], the count
#       (first = 0). Rows outside are not written: of a fresh output they hold whatever torch.empty left,
#       of `out` what it held.
#   out: the [R, H] result tensor to write into (default: a new one).


def down_fwd(h_RI: torch.Tensor, w_down_EHI: torch.Tensor, block_expert: torch.Tensor, blocks: torch.Tensor, *,
             tile: ConsumerTile = TILES["coop"], out: torch.Tensor | None = None) -> torch.Tensor:
    """y_rows [R, H] = h[r] @ w_down[e]^T; bitwise equal to grouped_gemm.down_fwd with the TMA config."""
    check_matrix(h_RI, None, None, "h")
    rows, inter = h_RI.shape
    check(w_down_EHI.dim() == 3, "w_down must be [E_l, H, I]")
    hidden = w_down_EHI.shape[1]
    check_weight(w_down_EHI, h_RI, (w_down_EHI.shape[0], hidden, inter), "w_down")
    y_rows = out if out is not None else h_RI.new_empty(rows, hidden)
    return _launch(h_RI, w_down_EHI, y_rows, True, block_expert, blocks, tile)


def gate_up_dgrad(d_gate_up_R2I: torch.Tensor, w_gate_up_E2IH: torch.Tensor, block_expert: torch.Tensor,
                  blocks: torch.Tensor, *, tile: ConsumerTile = TILES["coop"],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """d_x_rows [R, H] = d_gate_up[r] @ w_gate_up[e]; bitwise equal to grouped_gemm.gate_up_dgrad with the TMA
    config."""
    check_matrix(d_gate_up_R2I, None, None, "d_gate_up")
    rows, inter2 = d_gate_up_R2I.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] == inter2, "w_gate_up must be [E_l, 2I, H]")
    hidden = w_gate_up_E2IH.shape[2]
    check_weight(w_gate_up_E2IH, d_gate_up_R2I, (w_gate_up_E2IH.shape[0], inter2, hidden), "w_gate_up")
    d_x_rows = out if out is not None else d_gate_up_R2I.new_empty(rows, hidden)
    return _launch(d_gate_up_R2I, w_gate_up_E2IH, d_x_rows, False, block_expert, blocks, tile)
