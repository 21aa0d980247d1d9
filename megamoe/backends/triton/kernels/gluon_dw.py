"""Expert weight gradients on a warp-specialized Hopper GEMM core written in Gluon (sm_90a).

The same GEMM as tma_gemm.dw_tma_kernel (launched by weight_grad.dw_down / dw_gate_up with the TMA tile
config), computed the same way so that the outputs are bitwise equal:

    dw[e, m, n] = sum over the rows r of expert e of a[r, m] * b[r, n]      (fp32 accumulation, bf16/fp16 out)

a [R, M] and b [R, N] row-major row tensors, expert e's rows expert_offsets[e] .. expert_offsets[e+1], taken
in order in steps of BLOCK_K rows (every segment is a multiple of the schedule's block_m, which BLOCK_K
divides; padding rows are zero). An expert without rows writes zeros. Uses: d_w_down (a = d_out rows
[R, H], b = h_w [R, I] -> [E, H, I]) and d_w_gate_up (a = d_gate_up [R, 2I], b = x_rows [R, H] ->
[E, 2I, H]). One program owns each output tile and reduces over its expert's rows in a fixed order (no
split-K, no atomics on the data). Tiles are numbered in the production kernel's order: expert-major, then
kernels/_common.tile_coords (GROUP_M row blocks swept per column block) inside an expert. A tile costs its
expert's row steps, which routing makes uneven, so the persistent CTAs deal only the first STATIC_QUARTERS / 4
of the full waves round-robin (CTA p: tiles p, p + grid, ...; at least the first wave) and then claim the
rest one at a time from a device counter (tile = static_end + atomic_add(counter, 1), the counter zeroed per
launch), a tile ahead of need so the atomic's latency hides behind a tile's copies: whichever CTA is free
takes the next tile, so the hot experts' costly tiles even out over the CTAs. (Claiming every tile evened
skewed routing out as well but cost balanced routing 1-6% in the weight-grad kernels on an H100, dealing them
all none: docs/perf-notes.md, "Forty-seventh session".) Which CTA runs a tile does not change its sum, so the
bits do not depend on the claims. The row range comes from expert_offsets on the device: nothing is read
back to the host. With SKIP_PADDING (the launch given the schedule's row_src, as the one-GPU path does) an
expert's last row step is left out where it holds padding rows only (_expert_rows): zero rows, so the sum
and its bits are the same.

Operands, by TMA (host-built Gluon TensorDescriptors carrying the NVMMA shared-memory layout):
    a  [R, M]     block [BLOCK_K, BLOCK_M]  (M contiguous)
    b  [R, N]     block [BLOCK_K, BLOCK_N]  (N contiguous)
    dw [E, M, N]  3-D, block [1, rows per store, BLOCK_N]: an M or N tail is clipped at the expert's edge
The reduction runs over the rows, so both operand tiles arrive MN-major: b is wgmma's [K, N] B operand as
loaded (N-major), and A is the permuted view [BLOCK_M, BLOCK_K] of the a tile, an MN-major A operand that
wgmma reads from shared memory with its transpose bit (16-bit types only). Columns past M or N are
zero-filled by the copy engine, so no tile needs a mask.

Structure of a CTA (gl.warp_specialize, 12 warps):
  * producer (1 warp, 40 registers): claims this CTA's tiles, publishes each (tile, row steps) to the
    consumers through a TILE_SLOTS-deep shared-memory ring of its own ("tile_ready" / "tile_empty" mbarriers;
    after the last tile an index past the end, which stops them), and walks its row steps; per step it waits
    for a free slot of a STAGES-deep shared-memory ring (the slot's "empty" mbarrier), arms the slot's
    "ready" mbarrier with the byte count (expect_tx) and issues the two TMA copies into the slot.
    With GATHER (b is the tokens [T, N], row r of the step read as row row_src[r] // top_k: dw_gate_up's x
    under MoEConfig.recompute, no x_rows pass) the producer is a warpgroup: a by TMA as above, b by cp.async
    from every thread (16-byte copies, zero-fill for padding rows and the N tail), each thread arriving on
    the slot's "ready" barrier when its copies land (count 1 + 128); the step's row sources are loaded a
    step ahead, so their latency hides behind the wait for a free slot. The consumers then fence the
    generic-proxy writes before wgmma reads them. It measured 1.5-5% slower than TMA on gathered rows in the
    layer (docs/perf-notes.md, "GEMM core v3"), for a quarter less backward peak memory.
  * two consumer warpgroups (232 registers each): per tile read the tile ring's next entry, per step wait
    "ready", issue async wgmma (m64nBLOCK_Nk16, BLOCK_K / 16 of them per 64 rows of the tile), keep one step
    in flight and release the previous step's slot ("empty" arrive) once its wgmma has retired; after the
    last step: the epilogue fp32 -> dtype in registers -> the warpgroup's own shared buffer -> TMA store
    (the previous store is waited for just before the buffer is rewritten, so a store overlaps the next
    tile's main loop).
  Two ways to split the work between the consumers (ConsumerTile.pingpong):
  * "coop" (CUTLASS "cooperative"): both warpgroups work on every tile, warpgroup w on the tile's output
    rows [64 w, 64 w + 64) (the a tile's columns: a slice of the MN-major operand along M). Each slot is
    read by both, so its "empty" mbarrier counts 2 arrivals. A 128 x 256 tile is 128 fp32 accumulator
    registers per thread, the production tile.
  * "pingpong": each warpgroup owns whole tiles, alternating (the CTA's local tile j -> warpgroup j % 2), so one
    warpgroup's epilogue overlaps the other's main loop. The producer fills the ring in tile order; a consumer's
    slot counter at its tile is the sum of the row steps of all the CTA's earlier tiles (both read every entry
    of the tile ring and add the other warpgroup's tiles' steps). Each slot is read once ("empty" counts 1). An
    order barrier pair makes the main loops take turns: warpgroup w starts a tile's main loop only after the
    other one has waited for every slot of the tile before it. Without it the second warpgroup would wait on
    slots more than one mbarrier phase ahead of the producer, where the parity wait cannot tell phase n from
    phase n - 2 (the crash of the pingpong of the first prototype, commit fbd1888, benchmarks/gluon_gemm.py).
    With the order barrier, a consumer waiting for slot counter c knows that counter c - 1 was filled, hence
    c - STAGES: the slot's ready barrier is exactly one phase short of the one it waits for.

Barriers: ready[s] (count 1: the producer's expect_tx, completed by the copies' bytes), empty[s] (count: readers
of a slot), tile_ready[t] (count 1) and tile_empty[t] (count 2: both consumers read every entry), order[2]
(pingpong only, count 1). A fresh mbarrier counts as having completed the phase before phase 0, so the
producer's first pass over each ring (parity 1) and warpgroup 0's first tile do not wait. Gluon issues an
mbarrier arrive from one thread after a named barrier over the partition's warps, so one arrive stands for the
whole warpgroup.

Numerics: per output element the same sum as the Triton kernel, which Triton also compiles to wgmma
m64nNk16 with an fp32 register accumulator: products of one 16-row chunk summed by the tensor core, chunks
added into the accumulator in row order, rounded to the output dtype once ("coop" issues exactly the
production kernel's m64n256k16 with both operands transposed; tests/test_gluon_dw_compile.py compares the
two). Each output element is its own dot product inside an instruction, so the N width should not change
its bits: the prototype's 128-column tiles matched the 256-column Triton kernel bit for bit, and
benchmarks/gluon_dw_bench.py checks the pingpong configs' 128- and 64-row tiles here the same way.
"""

from __future__ import annotations

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
    check, check_expert_offsets, check_row_operands, check_row_src, persistent_grid,
)
from megamoe.backends.triton.kernels.gluon_common import (
    ConsumerTile, cp_async_load, nvmma_layout, tma_load, tma_store,
)
from megamoe.backends.triton.kernels.tma_gemm import check_tma

WGMMA_M = 64  # rows of one wgmma instruction (a warpgroup's row granule)
GATHER_WARPS = 4  # the gathering producer: one warpgroup of cp.async threads
_GATHER_WARPS = gl.constexpr(GATHER_WARPS)  # the same, as the kernels see it


# ----------------------------------------------------------------------------------------------------
# Kernel


@gluon.jit
def _tile_of(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """(expert, row block, column block) of a linear tile index: expert-major, then the grouped order of
    kernels/_common.tile_coords inside the expert (tma_gemm.dw_tma_kernel's order)."""
    per_expert = num_m * num_n
    expert = tile // per_expert
    in_expert = tile % per_expert
    per_group = GROUP_M * num_n
    first_m = in_expert // per_group * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    in_group = in_expert % per_group
    return expert, first_m + in_group % size_m, in_group // size_m


@gluon.jit
def _expert_rows(expert_offsets_ptr, row_src_ptr, expert, BLOCK_K: gl.constexpr, SKIP_PADDING: gl.constexpr):
    """(first row, row steps) of an expert's segment: the trip count of range(start, end, BLOCK_K), less the
    last step where SKIP_PADDING and that step holds padding rows only (row_src of its first row is -1: a
    segment's rows in use come first, and the schedule pads it by fewer than block_m rows, so with BLOCK_K =
    block_m / 2 at most that one step is padding). Padding rows are zero in both operands: the sum is the
    same without them."""
    start = gl.load(expert_offsets_ptr + expert)
    end = gl.load(expert_offsets_ptr + expert + 1)
    steps = gl.maximum(gl.cdiv(end - start, BLOCK_K), 0)
    if SKIP_PADDING:
        last_src = gl.load(row_src_ptr + start + (steps - 1) * BLOCK_K, mask=steps > 0, other=0)
        steps -= (last_src < 0).to(gl.int32)
    return start, steps


TILE_SLOTS = 4  # entries of the tile ring (producer -> consumers): how far the producer may run ahead in tiles
_TILE_SLOTS = gl.constexpr(TILE_SLOTS)


STATIC_QUARTERS = 3  # quarters of the full waves of tiles dealt round-robin before the CTAs claim the rest
_STATIC_QUARTERS = gl.constexpr(STATIC_QUARTERS)


@gluon.jit
def _static_end(num_tiles):
    """Tiles [0, static_end) are dealt round-robin (CTA p: p, p + grid, ...), the rest claimed; the first wave
    always dealt (the grid is at most num_tiles programs)."""
    nprog = gl.num_programs(0)
    return gl.maximum(num_tiles // nprog * _STATIC_QUARTERS // 4, 1) * nprog


@gluon.jit
def _claim(counter_ptr, need, WARPS: gl.constexpr):
    """Start claiming a tile where `need`: atomic_add(counter, 1) by one thread of the partition (WARPS
    warps). Returns a tensor holding the old counter value in that thread and 0 elsewhere; _next_tile reads
    it. Split in two so that the atomic's round trip overlaps the work between them (a scalar atomic would
    wait for it here)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    lane = gl.arange(0, 32 * WARPS, layout=layout)
    zero = lane * 0  # (Gluon broadcasts no scalar operand: the pointer and the increment as tensors)
    return gl.atomic_add(counter_ptr + zero, zero + 1, mask=(lane == 0) & need, sem="relaxed")


@gluon.jit
def _next_tile(tile, claim, static_end):
    """The CTA's tile after `tile`: the next one dealt to it, else the one its claim (started with need =
    the next dealt tile is past static_end) got."""
    dealt = tile + gl.num_programs(0)
    return gl.where(dealt < static_end, dealt, static_end + gl.max(claim, axis=0))


@gluon.jit
def _publish(tile_info, tile_ready, tile_empty, j, tile, k_steps):
    """Entry j of the tile ring: (tile, row steps), once both consumers have read entry j - TILE_SLOTS."""
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    t = j % _TILE_SLOTS
    mbarrier.wait(tile_empty.index(t), ((j // _TILE_SLOTS) & 1) ^ 1)
    field = gl.arange(0, 2, layout=layout)
    tile_info.index(t).store(gl.where(field == 0, field * 0 + tile, field * 0 + k_steps))
    mbarrier.arrive(tile_ready.index(t))


@gluon.jit
def _take(tile_info, tile_ready, tile_empty, j):
    """(tile, row steps) of entry j of the tile ring, the entry then given back."""
    layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    t = j % _TILE_SLOTS
    mbarrier.wait(tile_ready.index(t), (j // _TILE_SLOTS) & 1)
    entry = tile_info.index(t).load(layout)
    field = gl.arange(0, 2, layout=layout)
    tile = gl.sum(gl.where(field == 0, entry, 0), axis=0)
    k_steps = gl.sum(gl.where(field == 1, entry, 0), axis=0)
    mbarrier.arrive(tile_empty.index(t))
    return tile, k_steps


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, tile_info, tile_ready, tile_empty, counter_ptr,
              expert_offsets_ptr, row_src_ptr, num_experts, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, SKIP_PADDING: gl.constexpr):
    """One warp: claims this CTA's tiles, publishes each to the consumers and issues the TMA copies of its row
    steps, in order, into the slot ring."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_m = gl.cdiv(a_desc.shape[1], BLOCK_M)
    num_n = gl.cdiv(b_desc.shape[1], BLOCK_N)
    num_tiles = num_experts * num_m * num_n
    p = 0  # slot counter: slot p % STAGES, its use number p // STAGES
    j = 0  # tiles published
    static_end = _static_end(num_tiles)
    tile = gl.program_id(0)
    claim = _claim(counter_ptr, tile + gl.num_programs(0) >= static_end, 1)
    while tile < num_tiles:
        expert, pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        start, k_steps = _expert_rows(expert_offsets_ptr, row_src_ptr, expert, BLOCK_K, SKIP_PADDING)
        _publish(tile_info, tile_ready, tile_empty, j, tile, k_steps)
        for ki in range(k_steps):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, NBYTES)
            row = start + ki * BLOCK_K
            tma_load(a_desc, [row, pid_m * BLOCK_M], bar, a_bufs.index(s))
            tma_load(b_desc, [row, pid_n * BLOCK_N], bar, b_bufs.index(s))
            p += 1
        tile = _next_tile(tile, claim, static_end)
        claim = _claim(counter_ptr, tile + gl.num_programs(0) >= static_end, 1)
        j += 1
    _publish(tile_info, tile_ready, tile_empty, j, num_tiles, 0)  # past the end: the consumers stop


@gluon.jit
def _producer_gather(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, tile_info, tile_ready, tile_empty,
                     counter_ptr, expert_offsets_ptr, row_src_ptr, num_experts, src_ptr, top_k, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, SKIP_PADDING: gl.constexpr):
    """One warpgroup: claims and publishes this CTA's tiles as _producer does, a tile further ahead (the next
    tile's first row sources are loaded during the current tile's last step); per (tile, row step), in order, the a
    tile by TMA (one thread) and the gathered b tile [BLOCK_K, BLOCK_N] by cp.async (every thread, 16-byte
    copies): row r of it is src[row_src[r] // top_k], zeros where row_src[r] is -1 (padding) and past column N."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    C = b_desc.shape[1]
    VEC: gl.constexpr = 128 // a_desc.dtype.primitive_bitwidth  # elements per 16-byte copy
    COL_THREADS: gl.constexpr = 8  # 8 threads x 16 bytes: one 128-byte line of a row per copy instruction
    copy_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // COL_THREADS, COL_THREADS],
                                                 warps_per_cta=[_GATHER_WARPS, 1], order=[1, 0])
    step_rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, copy_layout))
    tile_cols = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, copy_layout)), 0)
    # C is a multiple of VEC (the launcher's TMA check: 16-byte row strides); written as one, the compiler sees
    # that every copy is 16-byte aligned and the column tail masks whole copies.
    C = C // VEC * VEC
    num_m = gl.cdiv(a_desc.shape[1], BLOCK_M)
    num_n = gl.cdiv(b_desc.shape[1], BLOCK_N)
    num_tiles = num_experts * num_m * num_n
    # Each step's row sources are loaded one step ahead (the last step of a tile loads the first of the CTA's
    # next tile), so the load's latency overlaps the wait for a free slot and the previous step's copies.
    # src holds row_src[src_row : src_row + BLOCK_K]; a tile whose first rows are not those (the first tile,
    # or the one after an empty expert's) loads them itself.
    src = gl.full([BLOCK_K], -1, gl.int32, gl.SliceLayout(1, copy_layout))
    src_row = -1
    p = 0  # slot counter, as in _producer
    j = 0  # tiles published
    static_end = _static_end(num_tiles)
    tile = gl.program_id(0)
    next_tile = _next_tile(tile, _claim(counter_ptr, tile + gl.num_programs(0) >= static_end, _GATHER_WARPS),
                           static_end)
    while tile < num_tiles:
        # the tile after next_tile
        claim = _claim(counter_ptr, next_tile + gl.num_programs(0) >= static_end, _GATHER_WARPS)
        expert, pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
        start, k_steps = _expert_rows(expert_offsets_ptr, row_src_ptr, expert, BLOCK_K, SKIP_PADDING)
        _publish(tile_info, tile_ready, tile_empty, j, tile, k_steps)
        next_start, next_steps = _expert_rows(expert_offsets_ptr, row_src_ptr,
                                              _tile_of(gl.minimum(next_tile, num_tiles - 1), num_m, num_n, GROUP_M)[0],
                                              BLOCK_K, SKIP_PADDING)
        next_ok = (next_tile < num_tiles) & (next_steps > 0)
        cols = pid_n * BLOCK_N + tile_cols
        col_ok = cols < C
        if (src_row != start) & (k_steps > 0):
            src = gl.load(row_src_ptr + start + step_rows)
        for ki in range(k_steps):
            row = start + ki * BLOCK_K
            in_tile = ki + 1 < k_steps
            ahead = gl.where(in_tile, row + BLOCK_K, next_start)
            ahead_ok = in_tile | next_ok
            src_next = gl.load(row_src_ptr + ahead + step_rows, mask=ahead_ok, other=-1)
            has_src = gl.expand_dims(src >= 0, 1)
            row_ptrs = gl.expand_dims(src_ptr + (gl.where(src >= 0, src, 0) // top_k).to(gl.int64) * C, 1)
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes)
            tma_load(a_desc, [row, pid_m * BLOCK_M], bar, a_bufs.index(s))
            cp_async_load(b_bufs.index(s), row_ptrs + cols, mask=has_src & col_ok)
            # This thread's copies (all it issued so far) complete -> one arrive; .noinc: the barrier's count
            # includes these _GATHER_WARPS * 32 arrivals.
            async_copy.mbarrier_arrive(bar, increment_count=False)
            src = src_next
            src_row = gl.where(ahead_ok, ahead, -1)
            p += 1
        tile = next_tile
        next_tile = _next_tile(tile, claim, static_end)
        j += 1
    _publish(tile_info, tile_ready, tile_empty, j, num_tiles, 0)  # past the end: the consumers stop


@gluon.jit
def _consumer(dw_desc, a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_smem, tile_info, tile_ready, tile_empty,
              num_experts, M, N, WG: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, GATHER: gl.constexpr):
    """One warpgroup (4 warps): per entry of the tile ring, async wgmma over the slots of its tile, then the
    TMA-store epilogue. PINGPONG: whole tiles, the CTA's local tiles WG, WG + 2, ... (the other warpgroup's
    row steps counted, not read); else output rows [WG * 64, WG * 64 + 64) of every tile."""
    BLOCK_K: gl.constexpr = a_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    WG_M: gl.constexpr = BLOCK_M if PINGPONG else BLOCK_M // 2
    ROW_IN_TILE: gl.constexpr = 0 if PINGPONG else WG * WG_M  # the tile's first output row of this warpgroup
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_experts * num_m * num_n
    c = 0  # the producer's slot counter at this warpgroup's next row step
    turn = 0  # pingpong: this warpgroup's tiles so far (the order barrier's phase)
    j = 0  # entries of the tile ring read
    tile, k_steps = _take(tile_info, tile_ready, tile_empty, 0)
    while tile < num_tiles:
        if PINGPONG:
            mine = j % 2 == WG
        else:
            mine = True
        if mine:
            expert, pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
            if PINGPONG:
                # Wait until the other warpgroup has waited for every slot of the tile before this one
                # (warpgroup 0's first tile: parity 1 on a fresh barrier, no wait).
                mbarrier.wait(order_bars.index(WG), (turn & 1) ^ (1 - WG))
            acc = gl.zeros([WG_M, BLOCK_N], gl.float32, acc_layout)
            for ki in range(k_steps):
                s = c % STAGES
                mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
                if GATHER:
                    # The gathered tile was written by cp.async (generic proxy); wgmma reads through the async proxy.
                    fence_async_shared()
                a = a_bufs.index(s)  # [BLOCK_K, BLOCK_M], M contiguous
                if not PINGPONG:
                    a = a.slice(ROW_IN_TILE, WG_M, dim=1)
                acc = warpgroup_mma(a.permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                # The wgmma of step c - 1 has retired: its slot goes back to the producer.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
                c += 1
            if PINGPONG:
                mbarrier.arrive(order_bars.index(1 - WG))  # the other warpgroup's main loop may start
                turn += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=k_steps > 0)
            out = acc.to(dw_desc.dtype)
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            c_smem.reshape([WG_M, BLOCK_N]).store(out)
            fence_async_shared()
            tma_store(dw_desc, [expert, pid_m * BLOCK_M + ROW_IN_TILE, pid_n * BLOCK_N], c_smem)
        else:
            c += k_steps  # the other warpgroup's tile: its row steps took slots too
        j += 1
        tile, k_steps = _take(tile_info, tile_ready, tile_empty, j)
    tma.store_wait(pendings=0)


@gluon.jit
def dw_ws_kernel(a_desc, b_desc, dw_desc, expert_offsets_ptr, row_src_ptr, counter_ptr, num_experts, src_ptr, top_k,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, GATHER: gl.constexpr,
                 SKIP_PADDING: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """dw[e] = a[rows of e]^T b[rows of e] for every expert e < num_experts, one tile per output element.
    a_desc: [R, M] block [BLOCK_K, BLOCK_M]; b_desc: [R, N] block [BLOCK_K, BLOCK_N]; dw_desc: [E, M, N]
    block [1, BLOCK_M (pingpong) or BLOCK_M / 2 (coop), BLOCK_N]. row_src_ptr: int32 [R], the schedule's
    row_src (-1: padding), read with GATHER or SKIP_PADDING (an expert's last row step skipped where it holds
    padding rows only). GATHER: b is gathered, row r = src[row_src[r] // top_k] (src_ptr: the tokens [T, N],
    which b_desc describes for the tile shape and the shared layout only); else src_ptr and top_k are unread.
    counter_ptr: int32 [1], zero: the tile claims' counter. Launch with num_warps=4 (the default partition is
    consumer 0)."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    gl.static_assert(b_desc.block_type.shape[0] == BLOCK_K, "a and b tiles step over the same rows")
    gl.static_assert(dw_desc.block_type.shape[1] * (1 if PINGPONG else 2) == BLOCK_M, "store rows per consumer")
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(dw_desc.dtype, [2] + dw_desc.block_type.shape, dw_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # The tile ring: entry t = (tile, row steps). (A rank-1 layout: an entry, indexed out of it, is rank 1.)
    tile_info = gl.allocate_shared_memory(gl.int32, [_TILE_SLOTS, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready = gl.allocate_shared_memory(gl.int64, [_TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [_TILE_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_TILE_SLOTS):
        mbarrier.init(tile_ready.index(i), count=1)
        mbarrier.init(tile_empty.index(i), count=2)  # both consumers read every entry
    for i in gl.static_range(STAGES):
        # ready: the producer's expect (the TMA bytes complete it), plus every gathering thread's cp.async arrive
        mbarrier.init(ready_bars.index(i), count=1 + GATHER * _GATHER_WARPS * 32)
        mbarrier.init(empty_bars.index(i), count=1 if PINGPONG else 2)  # one arrive per reader
    if PINGPONG:
        for i in gl.static_range(2):
            mbarrier.init(order_bars.index(i), count=1)
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    M = a_desc.shape[1]
    N = b_desc.shape[1]
    # (Gluon takes the partitions as a literal list: a partition cannot be held in a variable.)
    if GATHER:
        gl.warp_specialize([
            (_consumer, (dw_desc, a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_bufs.index(0), tile_info,
                         tile_ready, tile_empty, num_experts, M, N, 0, PINGPONG, BLOCK_M, BLOCK_N, GROUP_M, GATHER)),
            (_consumer, (dw_desc, a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_bufs.index(1), tile_info,
                         tile_ready, tile_empty, num_experts, M, N, 1, PINGPONG, BLOCK_M, BLOCK_N, GROUP_M, GATHER)),
            (_producer_gather, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, tile_info, tile_ready,
                                tile_empty, counter_ptr, expert_offsets_ptr, row_src_ptr, num_experts, src_ptr, top_k,
                                BLOCK_M, BLOCK_N, GROUP_M, SKIP_PADDING)),
        ], [4, _GATHER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (dw_desc, a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_bufs.index(0), tile_info,
                         tile_ready, tile_empty, num_experts, M, N, 0, PINGPONG, BLOCK_M, BLOCK_N, GROUP_M, GATHER)),
            (_consumer, (dw_desc, a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_bufs.index(1), tile_info,
                         tile_ready, tile_empty, num_experts, M, N, 1, PINGPONG, BLOCK_M, BLOCK_N, GROUP_M, GATHER)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, tile_info, tile_ready, tile_empty,
                         counter_ptr, expert_offsets_ptr, row_src_ptr, num_experts, BLOCK_M, BLOCK_N, GROUP_M,
                         SKIP_PADDING)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Configs and the host launcher


# NAME: tile. Shared memory (ring + epilogue buffers) within the 227 KB of an SM.
CONFIGS = {
    "coop": ConsumerTile(128, 256, stages=3, pingpong=False),  # the production tile, 2 x 64 rows: 208 KB
    "pingpong": ConsumerTile(128, 128, stages=4, pingpong=True),  # 2 warpgroups, alternate tiles: 192 KB
    "pingpong-64x256": ConsumerTile(64, 256, stages=4, pingpong=True),  # m64n256 wgmma per warpgroup: 224 KB
}
DEFAULT_CONFIG = "coop"


def constexprs(cfg: ConsumerTile, gather: bool = False, skip_padding: bool = False) -> dict:
    """The kernel's constexpr arguments for a tile (the launcher and tests/test_gluon_dw_compile.py share them);
    gather: b gathered in the loads; skip_padding: row steps of padding only are skipped (row_src read)."""
    return dict(GROUP_M=cfg.group_m, STAGES=cfg.stages, PINGPONG=cfg.pingpong, GATHER=gather,
                SKIP_PADDING=skip_padding, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs)


def descriptors(a_RM: torch.Tensor, b_RN: torch.Tensor, dw_EMN: torch.Tensor, cfg: ConsumerTile) -> tuple:
    """Host-side TMA descriptors of a [R, M], b [R, N] and dw [E, M, N] (Gluon's carry the shared layout)."""
    blocks = ([cfg.block_k, cfg.block_m], [cfg.block_k, cfg.block_n], [1, cfg.store_m, cfg.block_n])
    return tuple(TensorDescriptor.from_tensor(t, block, nvmma_layout(block, a_RM.dtype))
                 for t, block in zip((a_RM, b_RN, dw_EMN), blocks))


def dw_gluon(a_RM: torch.Tensor, b_RN: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int,
             cfg: ConsumerTile = CONFIGS[DEFAULT_CONFIG], out: torch.Tensor | None = None, return_kernel: bool = False,
             gather_b: tuple[torch.Tensor, int] | None = None, row_src: torch.Tensor | None = None):
    """dw [E_l, M, N] = a^T b per expert, in a's dtype (weight_grad._launch's contract: a [R, M], b [R, N]
    contiguous, zero on padding rows; expert_offsets int32 [E_l + 1] on the device, segments multiples of
    cfg.block_k). gather_b = (row_src int32 [R], top_k): b is the tokens [T, N] instead, its row r read as
    row row_src[r] // top_k (zeros where row_src[r] is -1) inside the kernel's loads. row_src (the schedule's,
    the same tensor as gather_b's if both are given): an expert's last row step is skipped where it holds
    padding rows only (the same sum: they are zero). out, if given, is written in full (an empty expert's
    slice with zeros). No host sync."""
    check(a_RM.dtype in (torch.bfloat16, torch.float16), f"bf16/fp16 operands, got {a_RM.dtype}")
    skip_padding = row_src is not None
    if gather_b is not None:
        check(row_src is None or row_src is gather_b[0], "row_src and gather_b's row_src must be one tensor")
        row_src, top_k = gather_b
    else:
        top_k = 1  # unread
    if row_src is None:
        row_src = expert_offsets  # unread
    else:
        check_row_src(row_src, a_RM.shape[0])
    if gather_b is None:
        check_row_operands(a_RM, b_RN, ("a", "b"))
    else:
        check(top_k >= 1, f"top_k must be >= 1, got {top_k}")
        for t, name in ((a_RM, "a"), (b_RN, "b")):
            check(t.dim() == 2 and t.is_contiguous(), f"{name} must be a contiguous 2-D tensor, got {tuple(t.shape)}")
        check(a_RM.dtype == b_RN.dtype, f"a ({a_RM.dtype}) and b ({b_RN.dtype}) must have one dtype")
    check(num_experts >= 1, f"num_experts must be >= 1, got {num_experts}")
    check_expert_offsets(expert_offsets, a_RM.shape[0], num_experts, cfg.block_k)
    m_dim, n_dim = a_RM.shape[1], b_RN.shape[1]
    if out is None:
        out = torch.empty(num_experts, m_dim, n_dim, dtype=a_RM.dtype, device=a_RM.device)
    check(out.shape == (num_experts, m_dim, n_dim) and out.dtype == a_RM.dtype and out.is_contiguous(),
          f"out must be a contiguous {a_RM.dtype} [{num_experts}, {m_dim}, {n_dim}] tensor")
    check_tma(a_RM, b_RN, out)
    max_tiles = num_experts * triton.cdiv(m_dim, cfg.block_m) * triton.cdiv(n_dim, cfg.block_n)
    counter = torch.zeros(1, dtype=torch.int32, device=a_RM.device)  # the tile claims' (a memset: sync-free)
    kernel = dw_ws_kernel[persistent_grid(a_RM.device, max_tiles)](
        *descriptors(a_RM, b_RN, out, cfg), expert_offsets, row_src, counter, num_experts, b_RN, top_k,
        **constexprs(cfg, gather_b is not None, skip_padding), num_warps=4)
    return (out, kernel) if return_kernel else out


def launch_dw(a_RM: torch.Tensor, b_RN: torch.Tensor, dw_EMN: torch.Tensor, expert_offsets: torch.Tensor,
              config: TileConfig, gather_b: tuple[torch.Tensor, int] | None = None,
              row_src: torch.Tensor | None = None) -> None:
    """weight_grad._launch's Gluon branch: dw_EMN = a^T b per expert, with the tile table's entry (gluon=True);
    gather_b and row_src as dw_gluon's."""
    dw_gluon(a_RM, b_RN, expert_offsets, dw_EMN.shape[0], ConsumerTile.of(config), out=dw_EMN, gather_b=gather_b,
             row_src=row_src)

