"""EXPERIMENT: down_dgrad with one MMA warpgroup and two epilogue warpgroups (see gluon_down_dgrad.py for the math).

The MMA warpgroup runs every tile's main loop whole (acc [128, 128], two m64n128k16 wgmmas per k16), then
writes the accumulator to shared memory (fp32, four [64, 64] pieces) and goes on with the next tile; epilogue
warpgroup w takes rows [64 w, 64 w + 64) of it, in HALF_LAYOUT (the cooperative kernel's epilogue layout, so
the same bits), with g and u loaded from global memory and every output stored from registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from megamoe.backends.triton.kernels._common import (
    check, check_rows, column_halves, load_range, num_sms, pair_weights, router_epilogue, swiglu_bwd, tile_coords,
)
from megamoe.backends.triton.kernels import gluon_down_dgrad as coop
from megamoe.backends.triton.kernels.tma_gemm import tma_addressable

PIECE_M = gl.constexpr(64)
HALF_LAYOUT = coop.HALF_LAYOUT
# fp32 accumulator pieces [64, 64] in shared memory: offset bits 0-4 (the banks) are a warp's 8 rows x 8
# columns of HALF_LAYOUT (column bits 0-2, row bits 0-1), so every access of the write and the read is two
# wavefronts of 64 words.
ACC_SMEM_LAYOUT = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [0, 8], [0, 16], [0, 32], [8, 0], [16, 0], [32, 0]]))


@triton.jit
def row_halves(acc):
    """acc [M, N] -> (acc[:M/2], acc[M/2:])."""
    m: tl.constexpr = acc.shape[0]
    n: tl.constexpr = acc.shape[1]
    return acc.reshape(2, m // 2, n).permute(1, 2, 0).split()


@gluon.jit
def _stamp(times_ptr, j, idx: gl.constexpr, TIMING: gl.constexpr):
    if TIMING:
        pid = gl.program_id(0)
        if pid < 8:
            if j < 64:
                layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
                t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [gl.full([128], 0, gl.int32, layout)],
                                              dtype=gl.int64, is_pure=False, pack=1)
                offs = gl.arange(0, 128, layout=layout)
                gl.store(times_ptr + (pid * 64 + j) * 8 + idx + offs * 0, t, mask=offs == 0)


@gluon.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each address (one 128-byte line each)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_step(d_rows_ptr, w_ptr, H, I, row, expert, col, ki, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """L2 prefetch of K step ki of a tile: BLOCK_M rows x 128 B of d_y rows, BLOCK_K rows x 256 B of w_down."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    i = gl.arange(0, BLOCK_M, layout=layout)
    _prefetch_l2(d_rows_ptr + (row + i).to(gl.int64) * H + ki * BLOCK_K)
    # w_down [E, H, I]: rows ki * BLOCK_K + i // 2, columns col + (i % 2) * 64 (two 128-byte lines a row)
    w_row = (expert * H + ki * BLOCK_K + i // 2).to(gl.int64)
    _prefetch_l2(w_ptr + w_row * I + col + (i % 2) * (BLOCK_N // 2))


@gluon.jit
def _producer(d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr, d_rows_ptr,
              w_ptr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr, PREFETCH: gl.constexpr):
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    STAGES: gl.constexpr = a_bufs.shape[0]
    STEP_BYTES: gl.constexpr = d_y_desc.block_type.nbytes + w_desc.block_type.nbytes
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(w_desc.shape[2], BLOCK_N)
    num_tiles = num_m * num_n
    H = d_y_desc.shape[1]
    I = w_desc.shape[2]
    k_steps = gl.cdiv(H, BLOCK_K)
    p = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        m = first_m + pid_m
        expert = gl.load(block_expert_ptr + m // SPLIT)
        row = m * BLOCK_M
        col = pid_n * BLOCK_N
        if PREFETCH > 0:
            next_tile = tile + gl.num_programs(0)
            has_next = next_tile < num_tiles
            nm, nn = tile_coords(next_tile, num_m, num_n, GROUP_M)
            next_expert = gl.load(block_expert_ptr + (first_m + nm) // SPLIT, mask=has_next, other=0)
            if tile == gl.program_id(0):
                for ki in range(gl.minimum(PREFETCH, k_steps)):
                    _prefetch_step(d_rows_ptr, w_ptr, H, I, row, expert, col, ki, BLOCK_M, BLOCK_K, BLOCK_N)
        for ki in range(k_steps):
            if PREFETCH > 0:
                if ki + PREFETCH < k_steps:
                    _prefetch_step(d_rows_ptr, w_ptr, H, I, row, expert, col, ki + PREFETCH, BLOCK_M, BLOCK_K, BLOCK_N)
                elif has_next & (ki + PREFETCH - k_steps < k_steps):
                    _prefetch_step(d_rows_ptr, w_ptr, H, I, (first_m + nm) * BLOCK_M, next_expert, nn * BLOCK_N,
                                   ki + PREFETCH - k_steps, BLOCK_M, BLOCK_K, BLOCK_N)
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, STEP_BYTES)
            tma.async_copy_global_to_shared(d_y_desc, [row, ki * BLOCK_K], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [expert, ki * BLOCK_K, col], bar, b_bufs.index(s))
            p += 1


@gluon.jit
def _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c, ki):
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = acc.shape[1]
    s = c % STAGES
    mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
    b = b_bufs.index(s).reshape([BLOCK_K, BLOCK_N])
    acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
    return acc


@gluon.jit
def _acc_view(acc_out, i: gl.constexpr):
    """Accumulator piece i: fp32 [64, 64] over the bytes of d_gate_up boxes 2i, 2i + 1."""
    PM: gl.constexpr = acc_out.shape[1]
    HALF_N: gl.constexpr = acc_out.shape[3]
    return acc_out._reinterpret(gl.float32, [4, PM, HALF_N], ACC_SMEM_LAYOUT).index(i)


@gluon.jit
def _store_piece(acc_out, i: gl.constexpr, piece):
    view = _acc_view(acc_out, i)
    view.store(gl.convert_layout(piece, HALF_LAYOUT, assert_trivial=True))


@gluon.jit
def _mma(a_bufs, b_bufs, acc_out, ready_bars, empty_bars, acc_ready, acc_empty, block_range_ptr, H, I,
         SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr, times_ptr, TIMING: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = 0
    j = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        _stamp(times_ptr, j, 0, TIMING)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c, 0)
        for ki in range(1, k_steps):
            acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c + ki, ki)
        c += k_steps
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
        _stamp(times_ptr, j, 1, TIMING)
        # The epilogue warpgroups have read tile j - 1's accumulator.
        mbarrier.wait(acc_empty, (j & 1) ^ 1)
        _stamp(times_ptr, j, 2, TIMING)
        acc_r0, acc_r1 = row_halves(acc)
        p00, p01 = column_halves(acc_r0)
        p10, p11 = column_halves(acc_r1)
        _store_piece(acc_out, 0, p00)
        _store_piece(acc_out, 1, p01)
        _store_piece(acc_out, 2, p10)
        _store_piece(acc_out, 3, p11)
        mbarrier.arrive(acc_ready)
        _stamp(times_ptr, j, 3, TIMING)
        j += 1


@gluon.jit
def _load_gate_up(gu_desc, stage, gu_ready, row, col):
    """TMA copies of g and u [64, 1, 64] of a piece into this warpgroup's staging buffers."""
    mbarrier.expect(gu_ready, 2 * gu_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(gu_desc, [row, 0, col], gu_ready, stage.index(0))
    tma.async_copy_global_to_shared(gu_desc, [row, 1, col], gu_ready, stage.index(1))


@gluon.jit
def _epilogue_piece(acc_view, out_view0, out_view1, stage, weight, d_gu_desc, h_w_desc, row, col, ROUTER: gl.constexpr,
                    STORE_H_W: gl.constexpr, MODE: gl.constexpr = 0):
    """coop._epilogue_half's math on one [64, 64] piece: acc from acc_view (fp32), g and u from the staging
    buffers; d_g, d_u written over the accumulator piece (out_view0/1, bf16 [64, 1, 64]) and h_w over g, then
    TMA-stored. The caller has waited for the accumulator and the staging buffers."""
    PM: gl.constexpr = stage.shape[1]
    HALF_N: gl.constexpr = stage.shape[3]
    acc = acc_view.load(HALF_LAYOUT)
    g = stage.index(0).reshape([PM, HALF_N]).load(HALF_LAYOUT)
    u = stage.index(1).reshape([PM, HALF_N]).load(HALF_LAYOUT)
    gl.thread_barrier()  # every thread has read the piece before any thread writes over it
    d_w_part = gl.zeros([PM], gl.float32, gl.SliceLayout(1, HALF_LAYOUT))
    if MODE == 2:
        hw_buf = stage.index(0)._reinterpret(h_w_desc.dtype, h_w_desc.block_type.shape, h_w_desc.layout)
        hw_buf.store(u)
        d_g = acc
        d_u = g
    else:
        if ROUTER:
            acc, h_w, d_w_part = router_epilogue(acc, g, u, weight)
            if STORE_H_W:
                hw_buf = stage.index(0)._reinterpret(h_w_desc.dtype, h_w_desc.block_type.shape, h_w_desc.layout)
                hw_buf.store(h_w.to(h_w_desc.dtype))
        d_g, d_u = swiglu_bwd(acc, g, u)
    out_view0.reshape([PM, HALF_N]).store(d_g.to(d_gu_desc.dtype))
    out_view1.reshape([PM, HALF_N]).store(d_u.to(d_gu_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    if MODE != 3:
        if ROUTER and STORE_H_W:
            tma.async_copy_shared_to_global(h_w_desc, [row, col], hw_buf)
        tma.async_copy_shared_to_global(d_gu_desc, [row, 0, col], out_view0)
        tma.async_copy_shared_to_global(d_gu_desc, [row, 1, col], out_view1)
    return d_w_part


@gluon.jit
def _epilogue(gu_desc, d_gu_desc, h_w_desc, acc_out, stage, acc_ready, acc_empty, gu_ready, row_src_ptr, weights_ptr,
              d_w_part_ptr, block_range_ptr, I, WG: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr,
              times_ptr, TIMING: gl.constexpr, MODE: gl.constexpr):
    """Rows [64 WG, 64 WG + 64) of every tile: two pieces (column halves), each from the accumulator in shared
    memory and g, u staged by TMA (one piece at a time)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    num_tiles = num_m * num_n
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if pid < num_tiles:
        pid_m, pid_n = tile_coords(pid, num_m, num_n, GROUP_M)
        _load_gate_up(gu_desc, stage, gu_ready, (first_m + pid_m) * BLOCK_M + WG * PIECE_M, pid_n * BLOCK_N)
    j = 0
    for tile in range(pid, num_tiles, nprog):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        row = (first_m + pid_m) * BLOCK_M + WG * PIECE_M
        col = pid_n * BLOCK_N
        rows = row + gl.arange(0, PIECE_M, layout=gl.SliceLayout(1, HALF_LAYOUT))
        weight = gl.zeros([PIECE_M], gl.float32, gl.SliceLayout(1, HALF_LAYOUT))
        if ROUTER:
            weight = pair_weights(row_src_ptr, weights_ptr, rows)
        mbarrier.wait(acc_ready, j & 1)
        mbarrier.wait(gu_ready, 0)
        if WG == 0:
            _stamp(times_ptr, j, 4, TIMING)
        d_w_part = _epilogue_piece(_acc_view(acc_out, 2 * WG), acc_out.index(4 * WG), acc_out.index(4 * WG + 1), stage, weight, d_gu_desc, h_w_desc, row, col,
                                   ROUTER, STORE_H_W, MODE)
        tma.store_wait(pendings=0)  # h_w has left the staging buffer
        if WG == 0:
            _stamp(times_ptr, j, 5, TIMING)
        _load_gate_up(gu_desc, stage, gu_ready, row, col + BLOCK_N // 2)
        mbarrier.wait(gu_ready, 1)
        if WG == 0:
            _stamp(times_ptr, j, 6, TIMING)
        d_w_part += _epilogue_piece(_acc_view(acc_out, 2 * WG + 1), acc_out.index(4 * WG + 2), acc_out.index(4 * WG + 3),
                                    stage, weight, d_gu_desc, h_w_desc, row,
                                    col + BLOCK_N // 2, ROUTER, STORE_H_W, MODE)
        if ROUTER:
            gl.store(d_w_part_ptr + rows * num_n + pid_n, d_w_part)
        tma.store_wait(pendings=0)
        mbarrier.arrive(acc_empty)
        if WG == 0:
            _stamp(times_ptr, j, 7, TIMING)
        if tile + nprog < num_tiles:
            next_m, next_n = tile_coords(tile + nprog, num_m, num_n, GROUP_M)
            _load_gate_up(gu_desc, stage, gu_ready, (first_m + next_m) * BLOCK_M + WG * PIECE_M, next_n * BLOCK_N)
        j += 1


@gluon.jit
def _no_epilogue(acc_ready, acc_empty, block_range_ptr, I, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr):
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_tiles = (end_m - first_m) * gl.cdiv(I, BLOCK_N)
    j = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        mbarrier.wait(acc_ready, j & 1)
        mbarrier.arrive(acc_empty)
        j += 1


@gluon.jit
def down_dgrad_split_kernel(d_y_desc, w_desc, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr,
                            d_w_part_ptr, block_expert_ptr, block_range_ptr, d_rows_ptr, w_ptr, ROUTER: gl.constexpr,
                            STORE_H_W: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                            PRODUCER_REGS: gl.constexpr, EPILOGUE_REGS: gl.constexpr, times_ptr, TIMING: gl.constexpr,
                            NO_EPI: gl.constexpr = False, MODE: gl.constexpr = 0, PREFETCH: gl.constexpr = 0):
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    gl.static_assert(BLOCK_M == 2 * PIECE_M, "128-row tiles, one row half per epilogue warpgroup")
    gl.static_assert(BLOCK_N == 128, "HALF_LAYOUT: column halves of a 128-column accumulator")
    dtype: gl.constexpr = d_y_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + d_y_desc.block_type.shape, d_y_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # The accumulator's four [64, 64] fp32 pieces; piece p is reused for its d_g and d_u (boxes 2p, 2p + 1).
    acc_out = gl.allocate_shared_memory(dtype, [8] + d_gu_desc.block_type.shape, d_gu_desc.layout)
    stage0 = gl.allocate_shared_memory(dtype, [2] + gu_desc.block_type.shape, gu_desc.layout)
    stage1 = gl.allocate_shared_memory(dtype, [2] + gu_desc.block_type.shape, gu_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_ready0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_ready1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    mbarrier.init(acc_ready, count=1)
    mbarrier.init(acc_empty, count=2)
    mbarrier.init(gu_ready0, count=1)
    mbarrier.init(gu_ready1, count=1)
    fence_async_shared()
    H = d_y_desc.shape[1]
    I = w_desc.shape[2]
    if NO_EPI:
        gl.warp_specialize([
            (_mma, (a_bufs, b_bufs, acc_out, ready_bars, empty_bars, acc_ready, acc_empty, block_range_ptr, H, I, SPLIT,
                    GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, times_ptr, TIMING)),
            (_no_epilogue, (acc_ready, acc_empty, block_range_ptr, I, SPLIT, BLOCK_N)),
            (_no_epilogue, (acc_ready, acc_empty, block_range_ptr, I, SPLIT, BLOCK_N)),
            (_producer, (d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr,
                         d_rows_ptr, w_ptr, SPLIT, GROUP_M, PREFETCH)),
        ], [4, 4, 1], [EPILOGUE_REGS, EPILOGUE_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_mma, (a_bufs, b_bufs, acc_out, ready_bars, empty_bars, acc_ready, acc_empty, block_range_ptr, H, I, SPLIT,
                    GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, times_ptr, TIMING)),
            (_epilogue, (gu_desc, d_gu_desc, h_w_desc, acc_out, stage0, acc_ready, acc_empty, gu_ready0, row_src_ptr,
                         weights_ptr, d_w_part_ptr, block_range_ptr, I, 0, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER,
                         STORE_H_W, times_ptr, TIMING, MODE)),
            (_epilogue, (gu_desc, d_gu_desc, h_w_desc, acc_out, stage1, acc_ready, acc_empty, gu_ready1, row_src_ptr,
                         weights_ptr, d_w_part_ptr, block_range_ptr, I, 1, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER,
                         STORE_H_W, times_ptr, TIMING, MODE)),
            (_producer, (d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr,
                         d_rows_ptr, w_ptr, SPLIT, GROUP_M, PREFETCH)),
        ], [4, 4, 1], [EPILOGUE_REGS, EPILOGUE_REGS, PRODUCER_REGS])


STAGES_DEFAULT = 4
EPILOGUE_REGS_DEFAULT = 152


def constexprs(split: int, router: bool, store_h_w: bool, stages: int = STAGES_DEFAULT,
               epilogue_regs: int = EPILOGUE_REGS_DEFAULT) -> dict:
    return dict(ROUTER=router, STORE_H_W=store_h_w, SPLIT=split, GROUP_M=coop.DEFAULT_CONFIG.group_m, STAGES=stages,
                PRODUCER_REGS=40, EPILOGUE_REGS=epilogue_regs)


def descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI, cfg=coop.DEFAULT_CONFIG) -> dict:
    half_n = cfg.block_n // 2
    return dict(
        d_y_desc=coop._desc(d_rows_RH, list(d_rows_RH.shape), list(d_rows_RH.stride()), [cfg.block_m, cfg.block_k]),
        w_desc=coop._desc(w_down_EHI, list(w_down_EHI.shape), list(w_down_EHI.stride()), [1, cfg.block_k, cfg.block_n]),
        gu_desc=coop._pairs_desc(gate_up_R2I, PIECE_M.value, half_n),
        d_gu_desc=coop._pairs_desc(d_gate_up_R2I, PIECE_M.value, half_n),
        h_w_desc=coop._desc(h_w_RI, list(h_w_RI.shape), list(h_w_RI.stride()), [PIECE_M.value, half_n]),
    )


TIMES = None
NO_EPI = False
MODE = 0
PREFETCH = 0


def _launch(d_rows_RH, w_down_EHI, gate_up_R2I, router, block_expert, blocks, store_h_w, return_kernel, **kw):
    cfg = coop.DEFAULT_CONFIG
    rows, hidden = d_rows_RH.shape
    inter = w_down_EHI.shape[2]
    split, block_range = check_rows(rows, block_expert, blocks, cfg.block_m)
    d_gate_up = torch.empty(rows, 2 * inter, dtype=d_rows_RH.dtype, device=d_rows_RH.device)
    h_w = d_gate_up.new_empty(rows if store_h_w else cfg.block_m, inter)
    d_w_part = torch.empty(rows if router else 1, triton.cdiv(inter, cfg.block_n), dtype=torch.float32,
                           device=d_rows_RH.device)
    row_src, weights = router if router else (block_expert, d_w_part)
    check(tma_addressable(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, h_w), "TMA alignment")
    descs = descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, h_w)
    tiles = rows // cfg.block_m * triton.cdiv(inter, cfg.block_n)
    grid = (max(1, min(num_sms(d_rows_RH.device), tiles)), )
    kernel = down_dgrad_split_kernel[grid](
        descs["d_y_desc"], descs["w_desc"], descs["gu_desc"], descs["d_gu_desc"], descs["h_w_desc"], row_src, weights,
        d_w_part, block_expert, block_range, d_rows_RH, w_down_EHI, **constexprs(split, router is not None, store_h_w, **kw),
        times_ptr=TIMES if TIMES is not None else d_w_part, TIMING=TIMES is not None, NO_EPI=NO_EPI, MODE=MODE, PREFETCH=PREFETCH, num_warps=4)
    out = d_gate_up, (h_w if store_h_w else None), d_w_part
    return (out, kernel) if return_kernel else out


def down_dgrad_router_gluon(d_out_rows_RH, w_down_EHI, gate_up_R2I, row_src, weights_TK, block_expert, blocks, *,
                            store_h_w, return_kernel=False, **kw):
    return _launch(d_out_rows_RH, w_down_EHI, gate_up_R2I, (row_src, weights_TK), block_expert, blocks, store_h_w,
                   return_kernel, **kw)


def down_dgrad_gluon(d_y_rows_RH, w_down_EHI, gate_up_R2I, block_expert, blocks, *, return_kernel=False, **kw):
    out = _launch(d_y_rows_RH, w_down_EHI, gate_up_R2I, None, block_expert, blocks, False, return_kernel, **kw)
    return (out[0][0], out[1]) if return_kernel else out[0]
