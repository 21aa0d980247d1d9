"""The expert-parallel forward's first GEMM on the Gluon core (Hopper): gate_up_fwd over receive rows that its own
warps pull from the token owners while its tensor cores compute.

gate_up_fwd_pull_kernel computes what gluon_gate_up.gate_up_fwd_ws_kernel computes on x rows read by TMA (the same
main loop, epilogue and bits: h, gate_up), and gate_up_fwd_pull_handoff_kernel what gate_up_fwd_handoff_kernel
computes (the epilogue handed off to two warps of its own: the table's choice where one GPU makes it, H > 2048; its
pulls on HANDOFF_PULL_WARPS warps, the epilogue warps a third reader of the claimed tiles), with three differences,
the protocol of the fused Triton kernels (kernels/comm_tiles.py, kernels/ep_fused.py) on the Gluon kernel's
partitions:

  * Pulls. A partition of PULL_WARPS warps beside the producer's (in its warpgroup, at its registers) runs the
    pull loop (pull_groups) in the first `pull_programs` CTAs while the consumers compute: claim a unit of
    PULL_UNIT_ROWS receive rows (a device counter), copy them from the token owners' published rows (symmetric
    memory, read through the peers' mapped addresses; zeros for padding rows) into x_rows, and count the unit on
    its group's ready flag (a barrier of the pull warps, then one release add at GPU scope), until no unit is
    left. A group (of group_blocks schedule blocks) is ready when its flag holds its unit count; small units let
    many CTAs fill one group together, so the first tiles wait for a few rows' copies, not for one CTA to copy a
    whole group. No SM is taken from the GEMM: the pulls use the memory system and the issue slots the
    tensor-bound main loop leaves. (A first version pulled with the default partition's 4 warps of the first 32 CTAs before they
    joined the GEMM, as the pointer-load core's communication programs do: those SMs computed nothing while
    they pulled; 6.4 ms at qwen3-235b-a22b, EP = 1, against 5.7 now; docs/perf-notes.md, "EP v9".)
    Not for free: at one GPU the copies slow the GEMM by 0-6% (more with more bytes), and the kernel without any
    copy runs 2-5% behind the one-GPU kernel on the same rows (~2% of it the claims), so there it loses to a spread
    pass + the one-GPU kernel (docs/perf-notes.md, "GEMM core v23").
  * Claimed tiles. Tiles are claimed in order from a device counter by each CTA's producer warp, not dealt
    round-robin: a CTA whose tiles wait for their rows takes fewer (static dealing would leave its share for
    last). The producer passes each claimed tile to the two consumer warpgroups through a two-slot ring in
    shared memory (the tile index, written by the producer's 32 lanes, "full" mbarrier count 1, "empty" count 2,
    one arrive per consumer once it has read the index); a claim past the last tile ends all three partitions.
  * Ready flags. Before a tile's first TMA copy, the producer acquires the ready flag of the tile's row group at its
    unit count (GPU scope, bounded: comm_tiles.wait_at_least traps after timeout_ns), then issues
    `fence.proxy.async.global`: the rows were written by other threads' generic-proxy stores, the TMA engine reads
    through the async proxy.
    A producer that already acquired the group's flag does not wait again.

No deadlock by construction: the pull warps wait for nothing (each unit they claim is copied and counted), they
run beside the producer and consumers of their CTA, every CTA is resident at once (the grid is at most one CTA per
SM, which the shared memory allows only one of), and the pulling CTAs have the lowest ids, which the hardware starts
first. Which CTA computes a tile does not change its math: results are bitwise those of gate_up_fwd_ws_kernel on the
pulled rows, whatever the pull programs and group size.

Compile-only checks: tests/test_gluon_ep_compile.py. On a GPU: tests/gpu/ep_worker.py (the expert-parallel path,
one GPU included).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import check, check_matrix, check_rows, check_weight, load_range, num_sms
from megamoe.backends.triton.kernels.comm_tiles import (
    RowPull, check_pull, claim_task, pull_claim, pull_flag, wait_at_least, work_buffer,
)
from megamoe.backends.triton.kernels.gluon_common import thread_barrier, tile_origin
from megamoe.backends.triton.kernels.gluon_gate_up import (
    BLOCK_K, BLOCK_M, EPILOGUE_WARPS, consumer_epilogue, consumer_main_loop, descriptors, epilogue_tile, hand_off,
    handoff_smem, produce_tile, tile_of,
)
from megamoe.backends.triton.kernels.tma_gemm import check_tma

PULL_WARPS = 2  # the pull partition's warps (beside the producer's, in its warpgroup: its registers)
HANDOFF_PULL_WARPS = 1  # with the epilogue handed off, its two warps take two of the producer warpgroup's three
PULL_UNIT_ROWS = 8  # rows per claim of the pull loop: a group's rows land together from many CTAs (divides block_m)
PULL_COLS = 1024  # columns per step: 4 16-byte copies in flight per thread
_TILE_SLOTS = gl.constexpr(2)  # the claimed-tile ring: the producer runs at most a tile ahead of the consumers
_BLOCK_M_C = gl.constexpr(BLOCK_M)  # the same, as the kernels see it
_EPILOGUE_WARPS_C = gl.constexpr(EPILOGUE_WARPS)


@gluon.jit
def _fence_proxy_async_global():
    """fence.proxy.async.global: this thread's generic-proxy view of global memory (what it acquired) is ordered
    before its later async-proxy accesses (TMA copies)."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def pull_groups(rows_ptr, table_ptr, src_rank_ptr, src_token_ptr, work_ptr, first_block, end_block, group_blocks, H,
                BLOCK_ROWS: gl.constexpr, UNIT_ROWS: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                WARPS: gl.constexpr):
    """The pull loop (the module docstring), on WARPS warps: units of UNIT_ROWS receive rows of the schedule blocks
    [first_block, end_block) (BLOCK_ROWS rows each), claimed in order; row r = the token row src_token[r] of rank
    src_rank[r]'s published rows (table_ptr: int64 [W] base addresses), zeros where src_rank[r] < 0; then one more
    unit counted on its group's ready flag (group = block // group_blocks). ROWS divides UNIT_ROWS, which divides
    BLOCK_ROWS."""
    elem: gl.constexpr = rows_ptr.dtype.element_ty
    VEC: gl.constexpr = 128 // elem.primitive_bitwidth  # elements per 16-byte copy
    COL_THREADS: gl.constexpr = COLS // VEC if COLS // VEC < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // COL_THREADS, COL_THREADS],
                                            warps_per_cta=[WARPS, 1], order=[1, 0])
    offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    H = H // VEC * VEC  # a multiple of VEC (16-byte rows: the launcher's check); written as one for the compiler
    first_row = first_block * BLOCK_ROWS
    num_units = (end_block - first_block) * (BLOCK_ROWS // UNIT_ROWS)
    unit = pull_claim(work_ptr)
    while unit < num_units:
        unit_row = first_row + unit * UNIT_ROWS
        for r0 in range(unit_row, unit_row + UNIT_ROWS, ROWS):
            rows = r0 + offs_r
            rank = gl.load(src_rank_ptr + rows)
            live = rank >= 0
            token = gl.load(src_token_ptr + rows, mask=live, other=0)
            base = gl.load(table_ptr + gl.maximum(rank, 0)).to(gl.pointer_type(elem))
            # Symmetric buffers and x_rows are 16-byte aligned (the launcher checks x_rows), rows are 16-byte strided.
            src = gl.expand_dims(gl.multiple_of(base + token.to(gl.int64) * H, 16), 1)
            dst = gl.expand_dims(gl.multiple_of(rows_ptr + rows.to(gl.int64) * H, 16), 1)
            live = gl.expand_dims(live, 1)
            for c0 in range(0, H, COLS):
                cols = gl.expand_dims(c0 + offs_c, 0)
                col_ok = cols < H
                value = gl.load(src + cols, mask=live & col_ok, other=0.0)
                gl.store(dst + cols, value, mask=col_ok)
        thread_barrier()  # every thread's stores are done before one release publishes them GPU-wide
        gl.atomic_add(pull_flag(work_ptr, unit_row // BLOCK_ROWS // group_blocks), 1, sem="release", scope="gpu")
        unit = pull_claim(work_ptr)


@gluon.jit
def _group_units(group, group_blocks, first_block, end_block, UNITS_PER_BLOCK: gl.constexpr):
    """The pull units of a group of schedule blocks within [first_block, end_block): its ready flag's final count."""
    blocks = gl.minimum((group + 1) * group_blocks, end_block) - gl.maximum(group * group_blocks, first_block)
    return blocks * UNITS_PER_BLOCK


@gluon.jit
def _publish_tile(tile_ids, id_full, id_empty, tile, j):
    """The producer hands claimed tile number j (its index `tile`) to the consumers: slot j % 2 of the ring, once
    both consumers have read that slot's previous index (a fresh barrier passes the first two). Returns j + 1."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0])
    slot = j % _TILE_SLOTS
    mbarrier.wait(id_empty.index(slot), ((j // _TILE_SLOTS) & 1) ^ 1)
    tile_ids.index(slot).store(gl.full([32], tile, gl.int32, layout))
    mbarrier.arrive(id_full.index(slot))
    return j + 1


@gluon.jit
def _claimed_tile(tile_ids, id_full, id_empty, j, WARPS: gl.constexpr):
    """A reader's (a consumer warpgroup's, or the WARPS epilogue warps') claimed tile number j: wait for slot j % 2's
    index, read it, release the slot."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[WARPS],
                                            order=[0])
    slot = j % _TILE_SLOTS
    mbarrier.wait(id_full.index(slot), (j // _TILE_SLOTS) & 1)
    tile = gl.max(tile_ids.index(slot).load(layout), axis=0)
    mbarrier.arrive(id_empty.index(slot))
    return tile


@gluon.jit
def _producer_claims(x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, tile_ids, id_full, id_empty,
                     work_ptr, block_expert_ptr, block_range_ptr, H, I, group_blocks, timeout_ns,
                     SPLIT: gl.constexpr, GROUP_M: gl.constexpr, UNIT_ROWS: gl.constexpr):
    """One warp: claim tiles in order, hand each to the consumers, acquire its row group's ready flag (+ the proxy
    fence), then the TMA copies of its K steps (gluon_gate_up.produce_tile). The claim past the last tile is
    handed over too: it ends the consumers."""
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    p = 0  # the ring's fill counter
    j = 0  # tiles handed over
    acquired = -1  # the row group whose flag this warp acquired last
    tile = claim_task(work_ptr, 1)
    while tile < num_m * num_n:
        j = _publish_tile(tile_ids, id_full, id_empty, tile, j)
        row, col, m = tile_origin(tile, first_m, num_m, num_n, _BLOCK_M_C, BLOCK_N, GROUP_M)
        group = m // SPLIT // group_blocks
        if group != acquired:
            first_block, end_block = load_range(block_range_ptr, 1)
            units = _group_units(group, group_blocks, first_block, end_block, _BLOCK_M_C * SPLIT // UNIT_ROWS)
            wait_at_least(pull_flag(work_ptr, group), units, timeout_ns)
            _fence_proxy_async_global()
            acquired = group
        expert = gl.load(block_expert_ptr + m // SPLIT)
        p = produce_tile(x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, row, col, expert, p, H, I)
        tile = claim_task(work_ptr, 1)
    _publish_tile(tile_ids, id_full, id_empty, tile, j)


@gluon.jit
def _consumer_claims(h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs, ready_bars, empty_bars, tile_ids, id_full,
                     id_empty, block_range_ptr, H, I, WG: gl.constexpr, SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    """One consumer warpgroup: gluon_gate_up's main loop and epilogue (h and gate_up stored) over the claimed
    tiles, in the producer's order, until the index past the last."""
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = 0  # slot counter: the producer's p for the same (tile, K step)
    n_stored = 0
    j = 0
    tile = _claimed_tile(tile_ids, id_full, id_empty, j, 4)
    while tile < num_m * num_n:
        row, col, _ = tile_origin(tile, first_m, num_m, num_n, _BLOCK_M_C, BLOCK_N, GROUP_M)
        acc_g, acc_u, c = consumer_main_loop(a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, c, k_steps, WG, False)
        n_stored = consumer_epilogue(h_desc, gu_desc, acc_g, acc_u, row, col, out_bufs, n_stored, WG, True)
        j += 1
        tile = _claimed_tile(tile_ids, id_full, id_empty, j, 4)
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_claims_handoff(a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free,
                             tile_ids, id_full, id_empty, block_range_ptr, H, I, WG: gl.constexpr,
                             SPLIT: gl.constexpr):
    """One consumer warpgroup of the hand-off kernel: gluon_gate_up's main loop over the claimed tiles, in the
    producer's order, each handed off to the epilogue warps (hand_off), until the index past the last."""
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = gate_bufs.shape[2]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_tiles = (end_m - first_m) * gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    c = 0  # slot counter: the producer's p for the same (tile, K step)
    j = 0  # claimed tiles so far: use j of the hand-off buffers
    tile = _claimed_tile(tile_ids, id_full, id_empty, j, 4)
    while tile < num_tiles:
        acc_g, acc_u, c = consumer_main_loop(a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, c, k_steps, WG, False)
        hand_off(acc_g, acc_u, g_buf, u_buf, gu_ready, gu_free, j, WG)
        j += 1
        tile = _claimed_tile(tile_ids, id_full, id_empty, j, 4)


@gluon.jit
def _epilogue_claims(h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, tile_ids, id_full, id_empty, block_range_ptr, I,
                     SPLIT: gl.constexpr, GROUP_M: gl.constexpr, ROWS: gl.constexpr):
    """The hand-off kernel's epilogue warps: gluon_gate_up.epilogue_tile (g, u and h stored) for every claimed tile,
    in the producer's order (a third reader of the claimed-tile ring), until the index past the last."""
    BLOCK_N: gl.constexpr = g_buf.shape[1]
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = gl.cdiv(I, BLOCK_N)
    j = 0
    tile = _claimed_tile(tile_ids, id_full, id_empty, j, _EPILOGUE_WARPS_C)
    while tile < num_m * num_n:
        row, col, _ = tile_origin(tile, first_m, num_m, num_n, _BLOCK_M_C, BLOCK_N, GROUP_M)
        epilogue_tile(h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, row, col, j, True, ROWS)
        j += 1
        tile = _claimed_tile(tile_ids, id_full, id_empty, j, _EPILOGUE_WARPS_C)


@gluon.jit
def gate_up_fwd_pull_kernel(x_desc, w_desc, h_desc, gu_desc, block_expert_ptr, block_range_ptr, H, I,
                            x_rows_ptr, pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr, pull_programs,
                            group_blocks, timeout_ns,
                            SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, OUT_BUFS: gl.constexpr,
                            PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PULL_UNIT_ROWS: gl.constexpr,
                            PULL_WARPS: gl.constexpr, PULL_COLS: gl.constexpr):
    """h and gate_up of the row blocks in block_range (int32 [first, end] schedule blocks) over x_rows [R, H]
    (x_rows_ptr, and x_desc over it), pulled by this kernel (module docstring): pull_table_ptr int64 [W],
    pull_rank_ptr / pull_token_ptr int32 [R]; work_ptr: comm_tiles.work_buffer's (zeroed). Descriptors as
    gluon_gate_up.gate_up_fwd_ws_kernel's with STORE_GATE_UP. Launch with num_warps=4."""
    dtype: gl.constexpr = x_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    gate_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    up_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    out_bufs0 = gl.allocate_shared_memory(dtype, [OUT_BUFS] + h_desc.block_type.shape, h_desc.layout)
    out_bufs1 = gl.allocate_shared_memory(dtype, [OUT_BUFS] + h_desc.block_type.shape, h_desc.layout)
    tile_ids = gl.allocate_shared_memory(gl.int32, [_TILE_SLOTS, 32],
                                         gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    id_full = gl.allocate_shared_memory(gl.int64, [_TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    id_empty = gl.allocate_shared_memory(gl.int64, [_TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; the TMA bytes complete it
        mbarrier.init(empty_bars.index(i), count=2)  # one arrive per consumer warpgroup
    for i in gl.static_range(_TILE_SLOTS):
        mbarrier.init(id_full.index(i), count=1)  # the producer's hand-over
        mbarrier.init(id_empty.index(i), count=2)  # each consumer has read the index
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    gl.warp_specialize([
        (_consumer_claims, (h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs0, ready_bars, empty_bars, tile_ids,
                            id_full, id_empty, block_range_ptr, H, I, 0, SPLIT, GROUP_M)),
        (_consumer_claims, (h_desc, gu_desc, a_bufs, gate_bufs, up_bufs, out_bufs1, ready_bars, empty_bars, tile_ids,
                            id_full, id_empty, block_range_ptr, H, I, 1, SPLIT, GROUP_M)),
        (_producer_claims, (x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, tile_ids, id_full,
                            id_empty, work_ptr, block_expert_ptr, block_range_ptr, H, I, group_blocks, timeout_ns,
                            SPLIT, GROUP_M, PULL_UNIT_ROWS)),
        (_puller, (x_rows_ptr, pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr, block_range_ptr, pull_programs,
                   group_blocks, H, SPLIT, PULL_UNIT_ROWS, PULL_COLS, PULL_WARPS)),
    ], [4, 1, PULL_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


@gluon.jit
def gate_up_fwd_pull_handoff_kernel(x_desc, w_desc, h_desc, gu_desc, block_expert_ptr, block_range_ptr, H, I,
                                    x_rows_ptr, pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr, pull_programs,
                                    group_blocks, timeout_ns,
                                    SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                    EPILOGUE_ROWS: gl.constexpr, PULL_UNIT_ROWS: gl.constexpr, PULL_WARPS: gl.constexpr,
                                    PULL_COLS: gl.constexpr):
    """gate_up_fwd_pull_kernel with gluon_gate_up.gate_up_fwd_handoff_kernel's epilogue: the consumers round g and u
    into two [128, BLOCK_N] hand-off buffers and go on with the next claimed tile; EPILOGUE_WARPS warps store g, u
    and h, reading the claimed tiles from the same ring (its empty barriers count 3 readers); PULL_WARPS warps pull.
    The producer's warpgroup holds the producer, the epilogue and the pull warps. h_desc / gu_desc boxes cover a
    whole tile ([128, 1, BLOCK_N]). Launch with num_warps=4."""
    a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free = handoff_smem(
        x_desc, w_desc, h_desc, STAGES)
    tile_ids = gl.allocate_shared_memory(gl.int32, [_TILE_SLOTS, 32],
                                         gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    id_full = gl.allocate_shared_memory(gl.int64, [_TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    id_empty = gl.allocate_shared_memory(gl.int64, [_TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_TILE_SLOTS):
        mbarrier.init(id_full.index(i), count=1)  # the producer's hand-over
        mbarrier.init(id_empty.index(i), count=3)  # each consumer and the epilogue warps have read the index
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    gl.warp_specialize([
        (_consumer_claims_handoff, (a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free,
                                    tile_ids, id_full, id_empty, block_range_ptr, H, I, 0, SPLIT)),
        (_consumer_claims_handoff, (a_bufs, gate_bufs, up_bufs, g_buf, u_buf, ready_bars, empty_bars, gu_ready, gu_free,
                                    tile_ids, id_full, id_empty, block_range_ptr, H, I, 1, SPLIT)),
        (_producer_claims, (x_desc, w_desc, a_bufs, gate_bufs, up_bufs, ready_bars, empty_bars, tile_ids, id_full,
                            id_empty, work_ptr, block_expert_ptr, block_range_ptr, H, I, group_blocks, timeout_ns,
                            SPLIT, GROUP_M, PULL_UNIT_ROWS)),
        (_epilogue_claims, (h_desc, gu_desc, g_buf, u_buf, gu_ready, gu_free, tile_ids, id_full, id_empty,
                            block_range_ptr, I, SPLIT, GROUP_M, EPILOGUE_ROWS)),
        (_puller, (x_rows_ptr, pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr, block_range_ptr, pull_programs,
                   group_blocks, H, SPLIT, PULL_UNIT_ROWS, PULL_COLS, PULL_WARPS)),
    ], [4, 1, _EPILOGUE_WARPS_C, PULL_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])


@gluon.jit
def _puller(x_rows_ptr, table_ptr, src_rank_ptr, src_token_ptr, work_ptr, block_range_ptr, pull_programs, group_blocks,
            H, SPLIT: gl.constexpr, UNIT_ROWS: gl.constexpr, COLS: gl.constexpr, WARPS: gl.constexpr):
    """The pull partition (WARPS warps beside the producer's): in the first pull_programs CTAs, the pull loop over the
    whole block range, a row per warp and step; elsewhere nothing."""
    if gl.program_id(0) < pull_programs:
        first_block, end_block = load_range(block_range_ptr, 1)
        pull_groups(x_rows_ptr, table_ptr, src_rank_ptr, src_token_ptr, work_ptr, first_block, end_block, group_blocks,
                    H, _BLOCK_M_C * SPLIT, UNIT_ROWS, WARPS, COLS, WARPS)


# ----------------------------------------------------------------------------------------------------
# Host launcher


def constexprs(config: TileConfig, split: int) -> dict:
    """The constexpr arguments of the kernel the config runs (gate_up_fwd_pull_handoff_kernel with config.handoff,
    else gate_up_fwd_pull_kernel; the launcher and tests/test_gluon_ep_compile.py share them)."""
    tile = tile_of(config)
    shared = dict(SPLIT=split, GROUP_M=tile.group_m, STAGES=tile.stages, PRODUCER_REGS=tile.producer_regs,
                  CONSUMER_REGS=tile.consumer_regs, PULL_UNIT_ROWS=PULL_UNIT_ROWS, PULL_COLS=PULL_COLS)
    if tile.handoff:
        return dict(shared, EPILOGUE_ROWS=tile.epilogue_rows, PULL_WARPS=HANDOFF_PULL_WARPS)
    return dict(shared, OUT_BUFS=tile.out_bufs, PULL_WARPS=PULL_WARPS)


def gate_up_fwd_pull(x_rows: torch.Tensor, w_gate_up_E2IH: torch.Tensor, block_expert: torch.Tensor,
                     blocks: torch.Tensor, pull: RowPull, *, config: TileConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [R, I], gate_up [R, 2I]) of the schedule blocks in `blocks` (device range: no host sync), the rows of
    x_rows [R, H] pulled by the kernel itself (pull: comm_tiles.RowPull; its programs: the CTAs whose pull warps pull,
    at most the grid). config: the tile table's gate_up_fwd entry for x rows by TMA (not gathering); with handoff,
    the hand-off kernel (3 stages)."""
    check(x_rows.dtype in (torch.bfloat16, torch.float16), f"16-bit activations, got {x_rows.dtype}")
    check_matrix(x_rows, None, None, "x_rows")
    rows, hidden = x_rows.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] % 2 == 0, "w_gate_up must be [E_l, 2I, H]")
    inter = w_gate_up_E2IH.shape[1] // 2
    check_weight(w_gate_up_E2IH, x_rows, (w_gate_up_E2IH.shape[0], 2 * inter, hidden), "w_gate_up")
    check(config.gluon and config.block_m == BLOCK_M and config.block_k == BLOCK_K and not config.gather
          and (not config.handoff or config.num_stages == 3),
          f"the pulling gate_up_fwd runs the Gluon kernel's {BLOCK_M} x n x {BLOCK_K} tile on x rows by TMA (the "
          f"hand-off kernel through 3 stages), got {config}")
    check_pull(pull, x_rows)
    split, block_range = check_rows(rows, block_expert, blocks, BLOCK_M)
    check(rows // block_expert.numel() % PULL_UNIT_ROWS == 0,
          f"the schedule's blocks must be multiples of {PULL_UNIT_ROWS} rows")
    h = x_rows.new_empty(rows, inter)
    gate_up = x_rows.new_empty(rows, 2 * inter)
    check_tma(x_rows, w_gate_up_E2IH, h, gate_up)
    tile = tile_of(config)
    descs = descriptors(x_rows, w_gate_up_E2IH, h, gate_up, tile)
    grid = max(1, min(num_sms(x_rows.device), rows // BLOCK_M * triton.cdiv(inter, tile.block_n)))
    work, _ = work_buffer(triton.cdiv(block_expert.numel(), pull.group_blocks), 0, x_rows.device)
    kernel = gate_up_fwd_pull_handoff_kernel if tile.handoff else gate_up_fwd_pull_kernel
    kernel[(grid,)](
        *descs, block_expert, block_range, hidden, inter,
        x_rows, pull.table, pull.src_rank, pull.src_token, work, min(pull.programs, grid), pull.group_blocks,
        pull.timeout_ns, **constexprs(config, split), num_warps=4,
    )
    return h, gate_up
