"""Row-block grouped GEMMs over the schedule's expert-major receive rows (forward and data grads).

Every kernel here walks the same tile space: row block m (BLOCK_M schedule rows, all of one expert, so
one weight matrix per tile) x column block n. The grid is persistent and sized for the worst case;
each program reads the range of schedule blocks [first, end) to cover from device memory (`blocks`:
[0, num_blocks] for the whole schedule, or any sub-range of it) and strides over the tiles that exist,
so no host ever learns the routing. Each output element is written by exactly one tile with a fixed K
order, whatever the grid size or the block range: results are bitwise reproducible.

Rows are contiguous on both sides: every operand and result is an [R, *] tensor indexed by the receive
row r (x_rows, h, gate_up, y_rows, d_y_rows, d_gate_up, d_x_rows), materialised expert-contiguous by
kernels/gather.py or by the expert-parallel dispatch. No kernel loads a row index, so the K loops are
plain strided loads that Triton software-pipelines. Padding rows hold zeros in x_rows and d_y_rows, so
every result is zero there too without a mask; rows outside the block range are never touched.

Each kernel is a loop over one tile function (gate_up_fwd_tile, down_fwd_tile, down_dgrad_tile,
gate_up_dgrad_tile); the fused expert-parallel kernels (ep_fused.py) run the same tile functions, with
the second GEMM's rows stored into the token owners' pairs buffers (store_rows with PUSH, which loads
each row's owner and pair) instead of locally.

Shapes: w_gate_up [E_l, 2I, H] (gate rows first), w_down [E_l, H, I], R receive rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import (
    check, check_matrix, check_row_src, check_rows, check_weight, column_halves, load_range, mma, pair_weights,
    expert_segments, expert_tile_coords, persistent_grid, router_epilogue, swiglu, swiglu_bwd,
)
from megamoe.backends.triton.kernels import gluon_down_dgrad, gluon_gate_up, gluon_rows, tma_gemm
from megamoe.backends.triton.kernels.gluon_common import ConsumerTile
from megamoe.backends.triton.kernels.comm_tiles import RowPush, push_pointers


@triton.jit
def store_rows(out_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr, rows, cols, acc, N,
               PUSH: tl.constexpr, ALIGNED: tl.constexpr):
    """Store a tile's rows [BLOCK_M] x cols [BLOCK_N] of an [R, N] result: locally, or with PUSH into the
    token owners' pairs rows (comm_tiles.py; padding rows dropped, out_ptr only gives the dtype)."""
    elem = out_ptr.dtype.element_ty
    col_ok = (cols < N)[None, :]
    if PUSH:
        dst, live = push_pointers(push_table_ptr, push_rank_ptr, push_pair_ptr, rows, N, elem, ALIGNED)
        tl.store(dst[:, None] + cols[None, :], acc.to(elem), mask=live[:, None] & col_ok)
    else:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(elem), mask=col_ok)


# ----------------------------------------------------------------------------------------------------
# One output tile of each GEMM, at absolute (row block pid_m, column block pid_n). The kernels below
# and the fused expert-parallel kernels (ep_fused.py) differ only in which tiles they run and when.
# STAGES: the K loop's software-pipeline depth (a fused kernel runs loops of different depths).


@triton.jit
def tile_indices(pid_m, pid_n, block_expert_ptr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Tile (pid_m, pid_n)'s expert (int64), receive rows [BLOCK_M] (int64), output columns [BLOCK_N] and the
    offsets [BLOCK_K] of a K step."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(block_expert_ptr + pid_m // SPLIT).to(tl.int64)
    rows = pid_m.to(tl.int64) * BLOCK_M + offs_m
    cols = pid_n * BLOCK_N + offs_n
    return expert, rows, cols, offs_k


@triton.jit
def k_loop(acc, a_ptrs, b_ptrs, b_step, b_mask, offs_k, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
           STAGES: tl.constexpr):
    """acc + A @ B over K in BLOCK_K steps: A's [BLOCK_M, BLOCK_K] tiles from a_ptrs (K contiguous), B's
    [BLOCK_K, BLOCK_N] from b_ptrs, advanced by b_step a step; b_mask [1, BLOCK_N] masks B's columns (all true
    where they were clamped in bounds instead); without EVEN_K the last step's K tail reads zeros."""
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & b_mask, other=0.0)
        acc = mma(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += b_step
    return acc


@triton.jit
def gate_up_fwd_tile(
    pid_m, pid_n, a_ptr, w_ptr, block_expert_ptr, h_ptr, gate_up_ptr, H, I,
    STORE_GATE_UP: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """h[r, n] = silu(g) * u with g = x_rows[r] . w_gate_up[e, n], u = x_rows[r] . w_gate_up[e, I + n].

    Two accumulators (gate columns and the matching up columns) so the SwiGLU is the epilogue and the
    pre-activation never round-trips memory unless STORE_GATE_UP keeps it for the backward. h is computed
    from g and u rounded to the dtype (swiglu), so the backward recomputes it from the saved gate_up bit
    for bit.
    """
    expert, rows, cols, offs_k = tile_indices(pid_m, pid_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    # Columns past I read a clamped (in-bounds) weight row, dropped at the store: clamping the
    # strided dimension keeps the loads unmasked (masks go on contiguous dimensions only, where
    # they keep 16-byte vector copies; a clamp there would break the contiguity analysis).
    w_cols = tl.minimum(cols, I - 1)
    a_ptrs = a_ptr + rows[:, None] * H + offs_k[None, :]
    wg_ptrs = w_ptr + expert * (2 * I) * H + w_cols[None, :] * H + offs_k[:, None]
    wu_ptrs = wg_ptrs + I * H
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            bg = tl.load(wg_ptrs)
            bu = tl.load(wu_ptrs)
        else:
            k_ok = offs_k + k0 < H
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            bg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
            bu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = mma(a, bg, acc_g)
        acc_u = mma(a, bu, acc_u)
        a_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    out_mask = (cols < I)[None, :]
    g = acc_g.to(h_ptr.dtype.element_ty)
    u = acc_u.to(h_ptr.dtype.element_ty)
    if STORE_GATE_UP:
        gu_ptrs = gate_up_ptr + rows[:, None] * (2 * I) + cols[None, :]
        tl.store(gu_ptrs, g, mask=out_mask)
        tl.store(gu_ptrs + I, u, mask=out_mask)
    tl.store(h_ptr + rows[:, None] * I + cols[None, :], swiglu(g, u).to(h_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def down_fwd_tile(
    pid_m, pid_n, h_ptr, w_ptr, block_expert_ptr, y_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr, H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PUSH: tl.constexpr, ALIGNED: tl.constexpr,
):
    """y_rows[r, n] = h[r] . w_down[e, n] (stored as store_rows does)."""
    expert, rows, cols, offs_k = tile_indices(pid_m, pid_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    w_cols = tl.minimum(cols, H - 1)  # clamped in bounds, as gate_up_fwd_tile's: B needs no column mask
    a_ptrs = h_ptr + rows[:, None] * I + offs_k[None, :]
    b_ptrs = w_ptr + expert * H * I + w_cols[None, :] * I + offs_k[:, None]
    acc = k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs, BLOCK_K,
                 tl.full((1, BLOCK_N), True, tl.int1), offs_k, I, EVEN_K, BLOCK_K, STAGES)
    store_rows(y_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr, rows, cols, acc, H, PUSH, ALIGNED)


@triton.jit
def down_dgrad_tile(
    pid_m, pid_n, d_y_ptr, w_ptr, gate_up_ptr, block_expert_ptr, d_gate_up_ptr,
    row_src_ptr, weights_ptr, h_w_ptr, d_w_part_ptr, H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ROUTER: tl.constexpr, STORE_H_W: tl.constexpr,
):
    """acc = d_y_rows[r] @ w_down[e], then the SwiGLU backward in the epilogue from the saved g, u:
    d_gate_up[r] = [d_h * u * silu'(g), d_h * silu(g)].

    Without ROUTER the router weight is already in d_y_rows and d_h = acc. With ROUTER d_y_rows are the
    unweighted d_out rows and the epilogue does what needs the router weight (router_epilogue)."""
    expert, rows, cols, offs_k = tile_indices(pid_m, pid_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    col_ok = (cols < I)[None, :]
    a_ptrs = d_y_ptr + rows[:, None] * H + offs_k[None, :]
    b_ptrs = w_ptr + expert * H * I + offs_k[:, None] * I + cols[None, :]
    acc = k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs, BLOCK_K * I, col_ok,
                 offs_k, H, EVEN_K, BLOCK_K, STAGES)
    # The epilogue runs on the two column halves in turn (on a whole tile, g, u and h spill registers).
    acc0, acc1 = column_halves(acc)
    d_w_part = _down_dgrad_half(acc0, rows, pid_n * BLOCK_N, gate_up_ptr, d_gate_up_ptr, row_src_ptr, weights_ptr,
                                h_w_ptr, I, ROUTER, STORE_H_W)
    d_w_part += _down_dgrad_half(acc1, rows, pid_n * BLOCK_N + BLOCK_N // 2, gate_up_ptr, d_gate_up_ptr, row_src_ptr,
                                 weights_ptr, h_w_ptr, I, ROUTER, STORE_H_W)
    if ROUTER:
        tl.store(d_w_part_ptr + rows * tl.cdiv(I, BLOCK_N) + pid_n, d_w_part)


@triton.jit
def _down_dgrad_half(acc, rows, first_col, gate_up_ptr, d_gate_up_ptr, row_src_ptr, weights_ptr, h_w_ptr, I,
                     ROUTER: tl.constexpr, STORE_H_W: tl.constexpr):
    """down_dgrad_tile's epilogue on acc's columns from first_col: stores d_gate_up (and h_w); returns the
    router-weight gradient's partial sum over these columns (ROUTER), else 0."""
    cols = first_col + tl.arange(0, acc.shape[1])
    col_ok = (cols < I)[None, :]
    gu_ptrs = gate_up_ptr + rows[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gu_ptrs, mask=col_ok, other=0.0)
    u = tl.load(gu_ptrs + I, mask=col_ok, other=0.0)
    d_w_part = tl.zeros((acc.shape[0],), dtype=tl.float32)
    if ROUTER:
        acc, h_w, d_w_part = router_epilogue(acc, g, u, pair_weights(row_src_ptr, weights_ptr, rows))
        if STORE_H_W:
            tl.store(h_w_ptr + rows[:, None] * I + cols[None, :], h_w.to(h_w_ptr.dtype.element_ty), mask=col_ok)
    d_g, d_u = swiglu_bwd(acc, g, u)
    dgu_ptrs = d_gate_up_ptr + rows[:, None] * (2 * I) + cols[None, :]
    tl.store(dgu_ptrs, d_g.to(d_gate_up_ptr.dtype.element_ty), mask=col_ok)
    tl.store(dgu_ptrs + I, d_u.to(d_gate_up_ptr.dtype.element_ty), mask=col_ok)
    return d_w_part


@triton.jit
def gate_up_dgrad_tile(
    pid_m, pid_n, d_gate_up_ptr, w_ptr, block_expert_ptr, d_x_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr, H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PUSH: tl.constexpr, ALIGNED: tl.constexpr,
):
    """d_x_rows[r, n] = d_gate_up[r] . w_gate_up[e, :, n] (reduction over 2I; stored as store_rows does)."""
    expert, rows, cols, offs_k = tile_indices(pid_m, pid_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    col_ok = (cols < H)[None, :]
    a_ptrs = d_gate_up_ptr + rows[:, None] * (2 * I) + offs_k[None, :]
    b_ptrs = w_ptr + expert * (2 * I) * H + offs_k[:, None] * H + cols[None, :]
    acc = k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs, BLOCK_K * H, col_ok,
                 offs_k, 2 * I, EVEN_K, BLOCK_K, STAGES)
    store_rows(d_x_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr, rows, cols, acc, H, PUSH, ALIGNED)


# ----------------------------------------------------------------------------------------------------
# The one-GPU kernels: each program strides over the tiles of the block range.


@triton.jit
def gate_up_fwd_kernel(
    a_ptr, w_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, h_ptr, gate_up_ptr,
    H, I,
    STORE_GATE_UP: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):
    """gate_up_fwd_tile over the block range. SPLIT = schedule block_m // BLOCK_M (kernel row blocks per
    schedule block)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(I, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n, _ = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                             BLOCK_M, GROUP_M)
        gate_up_fwd_tile(pid_m, pid_n, a_ptr, w_ptr, block_expert_ptr, h_ptr, gate_up_ptr,
                         H, I, STORE_GATE_UP, EVEN_K, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)


@triton.jit
def down_fwd_kernel(
    h_ptr, w_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, y_ptr,
    H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):
    """down_fwd_tile over the block range, stored locally."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(H, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n, _ = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                             BLOCK_M, GROUP_M)
        down_fwd_tile(pid_m, pid_n, h_ptr, w_ptr, block_expert_ptr, y_ptr, y_ptr, y_ptr, y_ptr, H, I,
                      EVEN_K, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, False, False)


@triton.jit
def down_dgrad_kernel(
    d_y_ptr, w_ptr, gate_up_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, d_gate_up_ptr,
    row_src_ptr, weights_ptr, h_w_ptr, d_w_part_ptr, H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
    ROUTER: tl.constexpr, STORE_H_W: tl.constexpr,
):
    """down_dgrad_tile over the block range."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(I, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n, _ = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                             BLOCK_M, GROUP_M)
        down_dgrad_tile(pid_m, pid_n, d_y_ptr, w_ptr, gate_up_ptr, block_expert_ptr, d_gate_up_ptr,
                        row_src_ptr, weights_ptr, h_w_ptr, d_w_part_ptr, H, I,
                        EVEN_K, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, ROUTER, STORE_H_W)


@triton.jit
def gate_up_dgrad_kernel(
    d_gate_up_ptr, w_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, d_x_ptr,
    H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):
    """gate_up_dgrad_tile over the block range, stored locally."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(H, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n, _ = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                             BLOCK_M, GROUP_M)
        gate_up_dgrad_tile(pid_m, pid_n, d_gate_up_ptr, w_ptr, block_expert_ptr, d_x_ptr, d_x_ptr, d_x_ptr, d_x_ptr,
                           H, I, EVEN_K, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, False, False)


# ----------------------------------------------------------------------------------------------------
# Launchers: validate, allocate, build the grid.


def _meta(config: TileConfig, k_dim: int, split: int) -> dict:
    return dict(
        EVEN_K=k_dim % config.block_k == 0,
        SPLIT=split,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# Shared by every launcher below:
#   config: the tile; with config.tma the kernel of tma_gemm.py runs (operands TMA can address, checked).
#   blocks: int32 [2] on the device, the schedule blocks (first, end) to compute, inside [0, num_blocks] (or int32
#       [1]: the count, first = 0; schedule.num_blocks covers every row in use; blocks past it have no expert, whose
#       offsets the tile order would read). Rows outside are left unwritten.
#   expert_offsets: the schedule's int32 [E_l + 1], which the tile order reads (tiles grouped inside one expert's
#       row blocks, _common.expert_tile_coords); None derives it from block_expert (a few small device ops).


def gate_up_fwd(
    x_rows_RH: torch.Tensor,
    w_gate_up_E2IH: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    *,
    store_gate_up: bool,
    config: TileConfig,
    gather: tuple[torch.Tensor, int] | None = None,
    expert_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [R, I] = SwiGLU of the rows' gate/up projections; gate_up [R, 2I] too if store_gate_up.

    x_rows [R, H]: padding rows zero. With gather = (row_src int32 [R], top_k) (TMA core only), x_rows is
    the token rows x [T, H] instead, gathered inside the kernel's loads (row r reads x[row_src[r] // top_k]).
    """
    check_matrix(x_rows_RH, None, None, "x_rows")
    rows, hidden = x_rows_RH.shape
    if gather is not None:
        check(config.tma, "gate_up_fwd gathers in its loads on the TMA and Gluon cores only")
        rows = gather[0].numel()
        check_row_src(gather[0], rows)
        check(gather[1] >= 1, f"top_k must be >= 1, got {gather[1]}")
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] % 2 == 0, "w_gate_up must be [E_l, 2I, H]")
    inter = w_gate_up_E2IH.shape[1] // 2
    check_weight(w_gate_up_E2IH, x_rows_RH, (w_gate_up_E2IH.shape[0], 2 * inter, hidden), "w_gate_up")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    offsets = expert_segments(expert_offsets, block_expert, w_gate_up_E2IH.shape[0], rows)
    h = torch.empty(rows, inter, dtype=x_rows_RH.dtype, device=x_rows_RH.device)
    if config.gluon:
        gate_up = h.new_empty(rows, 2 * inter) if store_gate_up else None
        gluon_gate_up.launch_gate_up_fwd(x_rows_RH, w_gate_up_E2IH, h, gate_up, block_expert, offsets, blocks, split,
                                         config, store_gate_up, gather)
        return h, gate_up
    if config.tma:
        # Without store_gate_up the TMA kernel never writes gate_up, but takes a descriptor of one block.
        gate_up = h.new_empty(rows if store_gate_up else config.block_m, 2 * inter)
        tma_gemm.launch_gate_up_fwd(x_rows_RH, w_gate_up_E2IH, h, gate_up, block_expert, offsets, blocks, split, config,
                                    store_gate_up, gather)
        return h, (gate_up if store_gate_up else None)
    gate_up = h.new_empty(rows, 2 * inter) if store_gate_up else h.new_empty(0, 2 * inter)
    max_tiles = rows // config.block_m * triton.cdiv(inter, config.block_n)
    gate_up_fwd_kernel[persistent_grid(h.device, max_tiles)](
        x_rows_RH, w_gate_up_E2IH, block_expert, offsets, blocks, h, gate_up,
        hidden, inter,
        STORE_GATE_UP=store_gate_up,
        **_meta(config, hidden, split),
    )
    return h, (gate_up if store_gate_up else None)


def down_fwd(
    h_RI: torch.Tensor,
    w_down_EHI: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    *,
    config: TileConfig,
    push: RowPush | None = None,
    expert_offsets: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """y_rows [R, H] = h[r] @ w_down[e]^T; with push (the expert-parallel path, the Gluon kernel only) each row
    goes to its (token, slot) row of its token owner's pairs buffer instead, and None is returned."""
    check_matrix(h_RI, None, None, "h")
    rows, inter = h_RI.shape
    check(w_down_EHI.dim() == 3, "w_down must be [E_l, H, I]")
    hidden = w_down_EHI.shape[1]
    check_weight(w_down_EHI, h_RI, (w_down_EHI.shape[0], hidden, inter), "w_down")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    offsets = expert_segments(expert_offsets, block_expert, w_down_EHI.shape[0], rows)
    if push is not None:
        check(config.gluon, f"only the Gluon kernel pushes its rows, got {config}")
        return gluon_rows.launch_push(h_RI, w_down_EHI, True, block_expert, offsets, blocks, config, push)
    y_rows = torch.empty(rows, hidden, dtype=h_RI.dtype, device=h_RI.device)
    if config.gluon:
        return gluon_rows.launch(h_RI, w_down_EHI, y_rows, True, block_expert, offsets, blocks, config)
    if config.tma:
        tma_gemm.launch_down_fwd(h_RI, w_down_EHI, y_rows, block_expert, offsets, blocks, split, config)
        return y_rows
    max_tiles = rows // config.block_m * triton.cdiv(hidden, config.block_n)
    down_fwd_kernel[persistent_grid(h_RI.device, max_tiles)](
        h_RI, w_down_EHI, block_expert, offsets, blocks, y_rows,
        hidden, inter,
        **_meta(config, inter, split),
    )
    return y_rows


def down_dgrad(
    d_y_rows_RH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    gate_up_R2I: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    *,
    config: TileConfig,
    expert_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """d_gate_up [R, 2I] (d_y_rows' dtype): SwiGLU backward of d_h = d_y_rows[r] @ w_down[e].

    d_y_rows [R, H]: the weighted upstream gradient of each row (zero for padding; the expert-parallel
    path's rows); gate_up [R, 2I] the saved pre-activation (zero for padding, as gate_up_fwd writes it).
    """
    return _down_dgrad(d_y_rows_RH, w_down_EHI, gate_up_R2I, None, block_expert, blocks, False, config,
                       expert_offsets)[0]


def down_dgrad_router(
    d_out_rows_RH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    gate_up_R2I: torch.Tensor,
    row_src: torch.Tensor,
    weights_TK: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    *,
    store_h_w: bool,
    config: TileConfig,
    expert_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """down_dgrad for unweighted rows, with the router weight applied in the epilogue (router_epilogue):
    (d_gate_up [R, 2I], h_w [R, I] = w * h or None without store_h_w, d_w_part fp32
    [R, cdiv(I, config.block_n)]: row r's router-weight gradient, summed in order over its columns, is
    d_w_part[r].sum()). Rows outside the block range are left unwritten.

    d_out_rows [R, H]: each row's d_out row, unweighted (zero for padding); row_src int32 [R]: the pair of
    each row (-1: padding), whose router weight weights.flat[pair] (fp32 or the activations' dtype) is w;
    gate_up as in down_dgrad.
    """
    check_row_src(row_src, d_out_rows_RH.shape[0])
    check(weights_TK.is_floating_point() and weights_TK.is_contiguous(), "weights must be a contiguous float tensor")
    return _down_dgrad(d_out_rows_RH, w_down_EHI, gate_up_R2I, (row_src, weights_TK), block_expert, blocks, store_h_w,
                       config, expert_offsets)


def _down_dgrad(d_rows_RH, w_down_EHI, gate_up_R2I, router, block_expert, blocks, store_h_w, config, expert_offsets):
    """router: None (weighted rows) or (row_src, weights) (down_dgrad_router)."""
    check_matrix(d_rows_RH, None, None, "d_y_rows")
    rows, hidden = d_rows_RH.shape
    check(w_down_EHI.dim() == 3 and w_down_EHI.shape[1] == hidden, "w_down must be [E_l, H, I]")
    inter = w_down_EHI.shape[2]
    check_weight(w_down_EHI, d_rows_RH, (w_down_EHI.shape[0], hidden, inter), "w_down")
    check_matrix(gate_up_R2I, rows, 2 * inter, "gate_up")
    check(gate_up_R2I.dtype == d_rows_RH.dtype,
          f"gate_up ({gate_up_R2I.dtype}) must have the rows' dtype ({d_rows_RH.dtype})")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    offsets = expert_segments(expert_offsets, block_expert, w_down_EHI.shape[0], rows)
    d_gate_up = torch.empty(rows, 2 * inter, dtype=d_rows_RH.dtype, device=d_rows_RH.device)
    # Unused outputs still take a pointer (a TMA descriptor: of one tile's rows).
    h_w = d_gate_up.new_empty(rows if store_h_w else config.block_m, inter)
    d_w_part = torch.empty(rows if router else 1, triton.cdiv(inter, config.block_n), dtype=torch.float32,
                           device=d_rows_RH.device)
    row_src, weights = router if router else (block_expert, d_w_part)
    if config.gluon:
        gluon_down_dgrad.launch_down_dgrad(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, row_src, weights, h_w, d_w_part,
                                           block_expert, offsets, blocks, split, config, router=router is not None,
                                           store_h_w=store_h_w)
    elif config.tma:
        tma_gemm.launch_down_dgrad(d_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up, row_src, weights, h_w, d_w_part,
                                   block_expert, offsets, blocks, split, config, router=router is not None,
                                   store_h_w=store_h_w)
    else:
        max_tiles = rows // config.block_m * triton.cdiv(inter, config.block_n)
        down_dgrad_kernel[persistent_grid(d_rows_RH.device, max_tiles)](
            d_rows_RH, w_down_EHI, gate_up_R2I, block_expert, offsets, blocks, d_gate_up, row_src, weights, h_w,
            d_w_part, hidden, inter,
            ROUTER=router is not None, STORE_H_W=store_h_w,
            **_meta(config, hidden, split),
        )
    return d_gate_up, (h_w if store_h_w else None), d_w_part


def gate_up_dgrad_spreads_x(config: TileConfig, x_TH: torch.Tensor) -> bool:
    """Whether gate_up_dgrad with this config can take spread_x of x (the Gluon kernel, with room for x's rows,
    and x a tensor TMA can copy)."""
    return (config.gluon and x_TH.dim() == 2 and gluon_rows.spreads_x(ConsumerTile.of(config), x_TH.shape[1])
            and tma_gemm.tma_addressable(x_TH))


def gate_up_dgrad(
    d_gate_up_R2I: torch.Tensor,
    w_gate_up_E2IH: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    *,
    config: TileConfig,
    spread_x: tuple | None = None,
    push: RowPush | None = None,
    expert_offsets: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """d_x_rows [R, H] = d_gate_up[r] @ w_gate_up[e]. spread_x: (x [T, H], dest_row [T, k], x_rows [R, H]) to fill
    x_rows[dest_row[t, j]] = x[t] beside the GEMM, on a warp of the Gluon kernel (config.gluon and
    gluon_rows.spreads_x); the padding rows of x_rows are left to the caller. push: as down_fwd's (None returned)."""
    check_matrix(d_gate_up_R2I, None, None, "d_gate_up")
    rows, inter2 = d_gate_up_R2I.shape
    check(inter2 % 2 == 0, f"d_gate_up must be a [R, 2I] tensor, got {tuple(d_gate_up_R2I.shape)}")
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] == inter2, "w_gate_up must be [E_l, 2I, H]")
    hidden = w_gate_up_E2IH.shape[2]
    check_weight(w_gate_up_E2IH, d_gate_up_R2I, (w_gate_up_E2IH.shape[0], inter2, hidden), "w_gate_up")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    offsets = expert_segments(expert_offsets, block_expert, w_gate_up_E2IH.shape[0], rows)
    if push is not None:
        check(config.gluon and spread_x is None, f"only the Gluon kernel pushes its rows, spreading nothing; got {config}")
        return gluon_rows.launch_push(d_gate_up_R2I, w_gate_up_E2IH, False, block_expert, offsets, blocks, config, push)
    d_x_rows = torch.empty(rows, hidden, dtype=d_gate_up_R2I.dtype, device=d_gate_up_R2I.device)
    if config.gluon:
        check(spread_x is None or (isinstance(spread_x, tuple) and len(spread_x) == 3),
              f"spread_x must be None or (x, dest_row, x_rows), got {type(spread_x).__name__}")
        return gluon_rows.launch(d_gate_up_R2I, w_gate_up_E2IH, d_x_rows, False, block_expert, offsets, blocks, config,
                                 spread_x)
    check(spread_x is None, f"only the Gluon kernel spreads x beside gate_up_dgrad, got {config}")
    if config.tma:
        tma_gemm.launch_gate_up_dgrad(d_gate_up_R2I, w_gate_up_E2IH, d_x_rows, block_expert, offsets, blocks, split,
                                      config)
        return d_x_rows
    max_tiles = rows // config.block_m * triton.cdiv(hidden, config.block_n)
    gate_up_dgrad_kernel[persistent_grid(d_gate_up_R2I.device, max_tiles)](
        d_gate_up_R2I, w_gate_up_E2IH, block_expert, offsets, blocks, d_x_rows,
        hidden, inter2 // 2,
        **_meta(config, inter2, split),
    )
    return d_x_rows
