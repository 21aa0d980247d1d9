"""EXPERIMENT: down_dgrad ping-pong with 128-row tiles per warpgroup (see gluon_down_dgrad.py for the math).

Each consumer warpgroup owns every other tile of the CTA whole (acc [128, 128], two m64n128k16 wgmmas per
k16); the warpgroups' main loops alternate (order barriers), so one warpgroup's epilogue runs beside the
other's main loop. The ring and weight traffic per tile are the cooperative kernel's. One gate_up buffer set
(64 KB) serves both warpgroups in turn: a loader warp fills it for tile j once tile j - 1's epilogue has
stored from it; the epilogue runs in four [64, 64] pieces (row half, column half) in HALF_LAYOUT.
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
    check, column_halves, load_range, num_sms, pair_weights, router_epilogue, swiglu_bwd, tile_coords,
)
from megamoe.backends.triton.kernels import gluon_down_dgrad as coop
from megamoe.backends.triton.kernels.tma_gemm import tma_addressable

GU_BUFFERS = gl.constexpr(4)
PIECE_M = gl.constexpr(64)
HALF_LAYOUT = coop.HALF_LAYOUT


@triton.jit
def row_halves(acc):
    """acc [M, N] -> (acc[:M/2], acc[M/2:])."""
    m: tl.constexpr = acc.shape[0]
    n: tl.constexpr = acc.shape[1]
    return acc.reshape(2, m // 2, n).permute(1, 2, 0).split()





@gluon.jit
def _producer(d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    STAGES: gl.constexpr = a_bufs.shape[0]
    STEP_BYTES: gl.constexpr = d_y_desc.block_type.nbytes + w_desc.block_type.nbytes
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(w_desc.shape[2], BLOCK_N)
    k_steps = gl.cdiv(d_y_desc.shape[1], BLOCK_K)
    p = 0
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


@gluon.jit
def _epilogue_loader(gu_desc, gu_bufs, gu_ready, gu_empty, row_src_ptr, weights_ptr, wt_bufs, wt_ready, wt_empty,
                     block_range_ptr, I, SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, ROUTER: gl.constexpr, times_ptr, TIMING: gl.constexpr):
    """One warp: per tile j, the router weights into wt_bufs[j % 2] (ROUTER), then, once tile j - 1's
    epilogue has stored from the gate_up buffers, tile j's gate_up boxes into them."""
    HALF_N: gl.constexpr = gu_desc.block_type.shape[2]
    GU_BYTES: gl.constexpr = GU_BUFFERS * gu_desc.block_type.nbytes
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    j = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        row = (first_m + pid_m) * BLOCK_M
        col = pid_n * BLOCK_N
        if ROUTER:
            weight = pair_weights(row_src_ptr, weights_ptr, row + gl.arange(0, BLOCK_M, layout=layout))
            b = j % 2
            mbarrier.wait(wt_empty.index(b), ((j // 2) & 1) ^ 1)
            wt_bufs.index(b).store(weight)
            mbarrier.arrive(wt_ready.index(b))
        mbarrier.wait(gu_empty, (j & 1) ^ 1)
        _stamp(times_ptr, j, 6, TIMING, 1)
        mbarrier.expect(gu_ready, GU_BYTES)
        for i in gl.static_range(GU_BUFFERS):
            tma.async_copy_global_to_shared(gu_desc, [row, i % 2, col + (i // 2) * HALF_N], gu_ready,
                                            gu_bufs.index(i))
        j += 1


@gluon.jit
def _epilogue_piece(acc, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, row, col, HALF: gl.constexpr,
                    RH: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    """Rows [RH * 64, RH * 64 + 64) of the tile, column half HALF (coop._epilogue_half's math)."""
    TILE_M: gl.constexpr = gu_bufs.shape[1]
    HALF_N: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    g_box = gu_bufs.index(2 * HALF).slice(RH * PIECE_M, PIECE_M)
    u_box = gu_bufs.index(2 * HALF + 1).slice(RH * PIECE_M, PIECE_M)
    g_tile = gu_bufs.index(2 * HALF).reshape([TILE_M, HALF_N]).slice(RH * PIECE_M, PIECE_M)
    u_tile = gu_bufs.index(2 * HALF + 1).reshape([TILE_M, HALF_N]).slice(RH * PIECE_M, PIECE_M)
    g = g_tile.load(layout)
    u = u_tile.load(layout)
    d_w_part = gl.zeros([PIECE_M], gl.float32, gl.SliceLayout(1, layout))
    if ROUTER:
        acc, h_w, d_w_part = router_epilogue(acc, g, u, weight)
        if STORE_H_W:
            hw_buf = hw_bufs.index(2 * RH + HALF)
            hw_buf.store(h_w.to(h_w_desc.dtype))
    d_g, d_u = swiglu_bwd(acc, g, u)
    g_tile.store(d_g.to(d_gu_desc.dtype))
    u_tile.store(d_u.to(d_gu_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    if ROUTER and STORE_H_W:
        tma.async_copy_shared_to_global(h_w_desc, [row + RH * PIECE_M, col], hw_buf)
    tma.async_copy_shared_to_global(d_gu_desc, [row + RH * PIECE_M, 0, col], g_box)
    tma.async_copy_shared_to_global(d_gu_desc, [row + RH * PIECE_M, 1, col], u_box)
    return d_w_part


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
def _rows_epilogue(acc_r, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, d_w_part_ptr, row, col, pid_n, num_n,
                   RH: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr):
    BLOCK_N: gl.constexpr = acc_r.shape[1]
    acc0, acc1 = column_halves(acc_r)
    acc0 = gl.convert_layout(acc0, HALF_LAYOUT, assert_trivial=True)
    acc1 = gl.convert_layout(acc1, HALF_LAYOUT, assert_trivial=True)
    d_w_part = _epilogue_piece(acc0, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, row, col, 0, RH, ROUTER,
                               STORE_H_W)
    d_w_part += _epilogue_piece(acc1, weight, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, row, col + BLOCK_N // 2, 1, RH,
                                ROUTER, STORE_H_W)
    if ROUTER:
        rows = row + RH * PIECE_M + gl.arange(0, PIECE_M, layout=gl.SliceLayout(1, HALF_LAYOUT))
        gl.store(d_w_part_ptr + rows * num_n + pid_n, d_w_part)


@gluon.jit
def _stamp(times_ptr, j, idx: gl.constexpr, TIMING: gl.constexpr, WARPS: gl.constexpr = 4):
    if TIMING:
        pid = gl.program_id(0)
        if pid < 8:
            if j < 64:
                layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
                t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                              [gl.full([32 * WARPS], 0, gl.int32, layout)],
                                              dtype=gl.int64, is_pure=False, pack=1)
                offs = gl.arange(0, 32 * WARPS, layout=layout)
                gl.store(times_ptr + (pid * 64 + j) * 8 + idx + offs * 0, t, mask=offs == 0)


@gluon.jit
def _consumer(d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars, gu_ready,
              gu_empty, wt_ready, wt_empty, order_bars, d_w_part_ptr, block_range_ptr, H, I, WG: gl.constexpr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr, times_ptr, TIMING: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for tile in range(pid + WG * nprog, num_m * num_n, 2 * nprog):
        j = (tile - pid) // nprog
        c = j * k_steps
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        row = (first_m + pid_m) * BLOCK_M
        col = pid_n * BLOCK_N
        _stamp(times_ptr, j, 0, TIMING)
        mbarrier.wait(order_bars.index(WG), ((j // 2) & 1) ^ (1 - WG))
        _stamp(times_ptr, j, 1, TIMING)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c, 0)
        for ki in range(1, k_steps):
            acc = _k_step(a_bufs, b_bufs, ready_bars, empty_bars, acc, c + ki, ki)
        mbarrier.arrive(order_bars.index(1 - WG))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + k_steps - 1) % STAGES))
        _stamp(times_ptr, j, 2, TIMING)
        weight0 = gl.zeros([PIECE_M], gl.float32, gl.SliceLayout(1, HALF_LAYOUT))
        weight1 = weight0
        if ROUTER:
            mbarrier.wait(wt_ready.index(WG), (j // 2) & 1)
            weight0 = wt_bufs.index(WG).slice(0, PIECE_M).load(gl.SliceLayout(1, HALF_LAYOUT))
            weight1 = wt_bufs.index(WG).slice(PIECE_M, PIECE_M).load(gl.SliceLayout(1, HALF_LAYOUT))
            mbarrier.arrive(wt_empty.index(WG))
        mbarrier.wait(gu_ready, j & 1)
        _stamp(times_ptr, j, 3, TIMING)
        acc_r0, acc_r1 = row_halves(acc)
        _rows_epilogue(acc_r0, weight0, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, d_w_part_ptr, row, col, pid_n, num_n,
                       0, ROUTER, STORE_H_W)
        _rows_epilogue(acc_r1, weight1, gu_bufs, hw_bufs, d_gu_desc, h_w_desc, d_w_part_ptr, row, col, pid_n, num_n,
                       1, ROUTER, STORE_H_W)
        _stamp(times_ptr, j, 4, TIMING)
        tma.store_wait(pendings=0)
        mbarrier.arrive(gu_empty)
        _stamp(times_ptr, j, 5, TIMING)


@gluon.jit
def down_dgrad_pp_kernel(d_y_desc, w_desc, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, d_w_part_ptr,
                         block_expert_ptr, block_range_ptr, ROUTER: gl.constexpr, STORE_H_W: gl.constexpr,
                         SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, times_ptr, TIMING: gl.constexpr):
    BLOCK_M: gl.constexpr = d_y_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = d_y_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[2]
    gl.static_assert(BLOCK_M == 2 * PIECE_M, "128-row tiles in two row halves")
    gl.static_assert(BLOCK_N == 128, "HALF_LAYOUT: column halves of a 128-column accumulator")
    dtype: gl.constexpr = d_y_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + d_y_desc.block_type.shape, d_y_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    gu_bufs = gl.allocate_shared_memory(dtype, [GU_BUFFERS] + gu_desc.block_type.shape, gu_desc.layout)
    if ROUTER and STORE_H_W:
        hw_bufs = gl.allocate_shared_memory(dtype, [4] + h_w_desc.block_type.shape, h_w_desc.layout)
    else:
        hw_bufs = gu_bufs
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    gu_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    gu_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    wt_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    wt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    wt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    mbarrier.init(gu_ready, count=1)
    mbarrier.init(gu_empty, count=1)
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
        mbarrier.init(wt_ready.index(i), count=1)
        mbarrier.init(wt_empty.index(i), count=1)
    fence_async_shared()
    H = d_y_desc.shape[1]
    I = w_desc.shape[2]
    gl.warp_specialize([
        (_consumer, (d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars,
                     gu_ready, gu_empty, wt_ready, wt_empty, order_bars, d_w_part_ptr, block_range_ptr, H, I, 0, SPLIT,
                     GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, ROUTER, STORE_H_W, times_ptr, TIMING)),
        (_consumer, (d_gu_desc, h_w_desc, a_bufs, b_bufs, gu_bufs, hw_bufs, wt_bufs, ready_bars, empty_bars,
                     gu_ready, gu_empty, wt_ready, wt_empty, order_bars, d_w_part_ptr, block_range_ptr, H, I, 1, SPLIT,
                     GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, ROUTER, STORE_H_W, times_ptr, TIMING)),
        (_producer, (d_y_desc, w_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, block_range_ptr,
                     SPLIT, GROUP_M)),
        (_epilogue_loader, (gu_desc, gu_bufs, gu_ready, gu_empty, row_src_ptr, weights_ptr, wt_bufs, wt_ready,
                            wt_empty, block_range_ptr, I, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, ROUTER, times_ptr, TIMING)),
    ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


def constexprs(cfg: coop.GluonDownDgradConfig, split: int, router: bool, store_h_w: bool) -> dict:
    return dict(ROUTER=router, STORE_H_W=store_h_w, SPLIT=split, GROUP_M=cfg.group_m,
                STAGES=cfg.ring_stages(router and store_h_w), PRODUCER_REGS=cfg.producer_regs,
                CONSUMER_REGS=cfg.consumer_regs)


TIMES = None


def _launch(d_rows_RH, w_down_EHI, gate_up_R2I, router, block_expert, blocks, store_h_w, cfg, return_kernel):
    from megamoe.backends.triton.kernels._common import check_rows
    rows, hidden = d_rows_RH.shape
    inter = w_down_EHI.shape[2]
    split, block_range = check_rows(rows, block_expert, blocks, cfg.block_m)
    d_gate_up = torch.empty(rows, 2 * inter, dtype=d_rows_RH.dtype, device=d_rows_RH.device)
    h_w = d_gate_up.new_empty(rows if store_h_w else cfg.block_m, inter)
    d_w_part = torch.empty(rows if router else 1, triton.cdiv(inter, cfg.block_n), dtype=torch.float32,
                           device=d_rows_RH.device)
    row_src, weights = router if router else (block_expert, d_w_part)
    check(tma_addressable(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, h_w), "TMA alignment")
    descs = coop.descriptors(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, h_w, cfg)
    tiles = rows // cfg.block_m * triton.cdiv(inter, cfg.block_n)
    grid = (max(1, min(num_sms(d_rows_RH.device), tiles)), )
    kernel = down_dgrad_pp_kernel[grid](
        descs["d_y_desc"], descs["w_desc"], descs["gu_desc"], descs["d_gu_desc"], descs["h_w_desc"], row_src, weights,
        d_w_part, block_expert, block_range, **constexprs(cfg, split, router is not None, store_h_w),
        times_ptr=TIMES if TIMES is not None else d_w_part, TIMING=TIMES is not None, num_warps=4)
    out = d_gate_up, (h_w if store_h_w else None), d_w_part
    return (out, kernel) if return_kernel else out


def down_dgrad_router_gluon(d_out_rows_RH, w_down_EHI, gate_up_R2I, row_src, weights_TK, block_expert, blocks, *,
                            store_h_w, config=coop.DEFAULT_CONFIG, return_kernel=False):
    return _launch(d_out_rows_RH, w_down_EHI, gate_up_R2I, (row_src, weights_TK), block_expert, blocks, store_h_w,
                   config, return_kernel)


def down_dgrad_gluon(d_y_rows_RH, w_down_EHI, gate_up_R2I, block_expert, blocks, *, config=coop.DEFAULT_CONFIG,
                     return_kernel=False):
    out = _launch(d_y_rows_RH, w_down_EHI, gate_up_R2I, None, block_expert, blocks, False, config, return_kernel)
    return (out[0][0], out[1]) if return_kernel else out[0]
