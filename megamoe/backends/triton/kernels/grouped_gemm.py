"""Row-block grouped GEMMs over the schedule's expert-major receive rows (forward and data grads).

Every kernel here walks the same tile space: row block m (BLOCK_M schedule rows, all of one expert, so
one weight matrix per tile) x column block n. The grid is persistent and sized for the worst case;
each program reads the real number of row blocks from device memory (`num_blocks`) and strides over
the tiles that exist, so no host ever learns the routing. Each output element is written by exactly
one tile with a fixed K order: results are bitwise reproducible.

Row sources: row r holds pair src = row_src[r] = t * k + j (token t, slot j), -1 for padding. Rows
that start from tokens (x, d_out) are gathered by pointer (Hopper has no TMA row-gather); padding rows
load zeros. Rows that end at pairs (y, d_x) are scattered to their own row of a [T * k, H] buffer,
conflict-free; padding rows are not written.

Shapes: x [T, H], w_gate_up [E_l, 2I, H] (gate rows first), w_down [E_l, H, I], R receive rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import check, persistent_grid, tile_coords


@triton.jit
def gate_up_fwd_kernel(
    x_ptr, w_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr, h_ptr, gate_up_ptr,
    H, I, top_k,
    STORE_GATE_UP: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """h[r, n] = silu(g) * u with g = x[tok(r)] . w_gate_up[e, n], u = x[tok(r)] . w_gate_up[e, I + n].

    Two accumulators (gate columns and the matching up columns) so the SwiGLU is the epilogue and the
    pre-activation never round-trips memory unless STORE_GATE_UP keeps it for the backward.
    SPLIT = schedule block_m // BLOCK_M (kernel row blocks per schedule block).
    """
    num_m = tl.load(num_blocks_ptr) * SPLIT
    num_n = tl.cdiv(I, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m // SPLIT).to(tl.int64)
        rows = pid_m.to(tl.int64) * BLOCK_M + offs_m
        src = tl.load(row_src_ptr + rows)
        valid = src >= 0
        token = tl.where(valid, src // top_k, 0).to(tl.int64)
        cols = pid_n * BLOCK_N + offs_n
        # Columns past I read a clamped (in-bounds) weight row, dropped at the store: clamping the
        # strided dimension keeps the loads unmasked (masks go on contiguous dimensions only, where
        # they keep 16-byte vector copies; a clamp there would break the contiguity analysis).
        w_cols = tl.minimum(cols, I - 1)
        a_ptrs = x_ptr + token[:, None] * H + offs_k[None, :]
        wg_ptrs = w_ptr + expert * (2 * I) * H + w_cols[None, :] * H + offs_k[:, None]
        wu_ptrs = wg_ptrs + I * H
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                bg = tl.load(wg_ptrs)
                bu = tl.load(wu_ptrs)
            else:
                k_ok = offs_k + k0 < H
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                bg = tl.load(wg_ptrs, mask=k_ok[:, None], other=0.0)
                bu = tl.load(wu_ptrs, mask=k_ok[:, None], other=0.0)
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
        out_mask = (cols < I)[None, :]
        if STORE_GATE_UP:
            gu_ptrs = gate_up_ptr + rows[:, None] * (2 * I) + cols[None, :]
            tl.store(gu_ptrs, acc_g.to(gate_up_ptr.dtype.element_ty), mask=out_mask)
            tl.store(gu_ptrs + I, acc_u.to(gate_up_ptr.dtype.element_ty), mask=out_mask)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + rows[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def down_fwd_kernel(
    h_ptr, w_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr, y_ptr,
    H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y_pairs[row_src[r], n] = h[r] . w_down[e, n]; each row lands in its own (token, slot) row."""
    num_m = tl.load(num_blocks_ptr) * SPLIT
    num_n = tl.cdiv(H, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m // SPLIT).to(tl.int64)
        rows = pid_m.to(tl.int64) * BLOCK_M + offs_m
        src = tl.load(row_src_ptr + rows)
        valid = src >= 0
        cols = pid_n * BLOCK_N + offs_n
        w_cols = tl.minimum(cols, H - 1)
        a_ptrs = h_ptr + rows[:, None] * I + offs_k[None, :]
        b_ptrs = w_ptr + expert * H * I + w_cols[None, :] * I + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k + k0 < I
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        dst = tl.where(valid, src, 0).to(tl.int64)
        tl.store(
            y_ptr + dst[:, None] * H + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=valid[:, None] & (cols < H)[None, :],
        )


@triton.jit
def down_dgrad_kernel(
    d_out_ptr, topk_w_ptr, w_ptr, gate_up_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr, d_gate_up_ptr,
    H, I, top_k,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """d_h[r] = w[src] * (d_out[tok] @ w_down[e]), then the SwiGLU backward into d_gate_up [R, 2I].

    The router weight scales the fp32 accumulator (a per-row scalar commutes with the GEMM), so it costs
    nothing and d_h is never rounded before the SwiGLU backward. Padding rows get zeros.
    """
    num_m = tl.load(num_blocks_ptr) * SPLIT
    num_n = tl.cdiv(I, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m // SPLIT).to(tl.int64)
        rows = pid_m.to(tl.int64) * BLOCK_M + offs_m
        src = tl.load(row_src_ptr + rows)
        valid = src >= 0
        safe_src = tl.where(valid, src, 0)
        token = (safe_src // top_k).to(tl.int64)
        cols = pid_n * BLOCK_N + offs_n
        col_ok = (cols < I)[None, :]
        a_ptrs = d_out_ptr + token[:, None] * H + offs_k[None, :]
        b_ptrs = w_ptr + expert * H * I + offs_k[:, None] * I + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok, other=0.0)
            else:
                k_ok = offs_k + k0 < H
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * I
        weight = tl.load(topk_w_ptr + safe_src, mask=valid, other=0.0)
        d_h = acc * weight[:, None]
        out_mask = (cols < I)[None, :]
        gu_ptrs = gate_up_ptr + rows[:, None] * (2 * I) + cols[None, :]
        g = tl.load(gu_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptrs + I, mask=out_mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        d_u = tl.where(valid[:, None], d_h * g * sig, 0.0)
        d_g = tl.where(valid[:, None], d_h * u * sig * (1.0 + g * (1.0 - sig)), 0.0)
        dgu_ptrs = d_gate_up_ptr + rows[:, None] * (2 * I) + cols[None, :]
        tl.store(dgu_ptrs, d_g.to(d_gate_up_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dgu_ptrs + I, d_u.to(d_gate_up_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def gate_up_dgrad_kernel(
    d_gate_up_ptr, w_ptr, row_src_ptr, block_expert_ptr, num_blocks_ptr, d_xpairs_ptr,
    H, I,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """d_xpairs[row_src[r], n] = d_gate_up[r] . w_gate_up[e, :, n] (reduction over 2I)."""
    num_m = tl.load(num_blocks_ptr) * SPLIT
    num_n = tl.cdiv(H, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m // SPLIT).to(tl.int64)
        rows = pid_m.to(tl.int64) * BLOCK_M + offs_m
        src = tl.load(row_src_ptr + rows)
        valid = src >= 0
        cols = pid_n * BLOCK_N + offs_n
        col_ok = (cols < H)[None, :]
        a_ptrs = d_gate_up_ptr + rows[:, None] * (2 * I) + offs_k[None, :]
        b_ptrs = w_ptr + expert * (2 * I) * H + offs_k[:, None] * H + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, 2 * I, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs, mask=col_ok, other=0.0)
            else:
                k_ok = offs_k + k0 < 2 * I
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * H
        dst = tl.where(valid, src, 0).to(tl.int64)
        tl.store(
            d_xpairs_ptr + dst[:, None] * H + cols[None, :],
            acc.to(d_xpairs_ptr.dtype.element_ty),
            mask=valid[:, None] & (cols < H)[None, :],
        )


# ----------------------------------------------------------------------------------------------------
# Launchers: validate, allocate, build the grid.


def _check_rows(row_src: torch.Tensor, block_expert: torch.Tensor, num_blocks: torch.Tensor, block_m: int) -> int:
    """SPLIT, the kernel row blocks per schedule block (the schedule's block_m is R // len(block_expert))."""
    check(row_src.dtype == torch.int32 and row_src.dim() == 1, f"row_src must be int32 [R], got {row_src.dtype} {tuple(row_src.shape)}")
    check(block_expert.dtype == torch.int32 and block_expert.dim() == 1, "block_expert must be int32 [R // block_m]")
    check(num_blocks.dtype == torch.int32 and num_blocks.numel() == 1, "num_blocks must be int32 [1]")
    rows = row_src.numel()
    check(block_expert.numel() > 0 and rows % block_expert.numel() == 0, f"R={rows} is not a multiple of len(block_expert)={block_expert.numel()}")
    sched_block = rows // block_expert.numel()
    check(sched_block % block_m == 0, f"kernel row tile {block_m} must divide the schedule's block_m {sched_block}")
    return sched_block // block_m


def _check_weight(w: torch.Tensor, x: torch.Tensor, shape: tuple, name: str) -> None:
    check(w.is_contiguous(), f"{name} must be contiguous")
    check(tuple(w.shape) == shape, f"{name} must have shape {shape}, got {tuple(w.shape)}")
    check(w.dtype == x.dtype, f"{name} dtype {w.dtype} must match the activations' {x.dtype}")


def _meta(config: TileConfig, k_dim: int, split: int) -> dict:
    return dict(
        EVEN_K=k_dim % config.block_k == 0,
        SPLIT=split,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def gate_up_fwd(
    x_TH: torch.Tensor,
    w_gate_up_E2IH: torch.Tensor,
    row_src_R: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    top_k: int,
    *,
    store_gate_up: bool,
    config: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [R, I] = SwiGLU of the gathered rows' gate/up projections; gate_up [R, 2I] too if store_gate_up.

    Rows past num_blocks * block_m are left unwritten (never read downstream); padding rows are zero.
    """
    check(x_TH.dim() == 2 and x_TH.is_contiguous(), "x must be a contiguous [T, H] tensor")
    num_tokens, hidden = x_TH.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] % 2 == 0, "w_gate_up must be [E_l, 2I, H]")
    inter = w_gate_up_E2IH.shape[1] // 2
    _check_weight(w_gate_up_E2IH, x_TH, (w_gate_up_E2IH.shape[0], 2 * inter, hidden), "w_gate_up")
    split = _check_rows(row_src_R, block_expert, num_blocks, config.block_m)
    rows = row_src_R.numel()
    h = torch.empty(rows, inter, dtype=x_TH.dtype, device=x_TH.device)
    gate_up = torch.empty(rows if store_gate_up else 0, 2 * inter, dtype=x_TH.dtype, device=x_TH.device)
    max_tiles = rows // config.block_m * triton.cdiv(inter, config.block_n)
    gate_up_fwd_kernel[persistent_grid(x_TH.device, max_tiles)](
        x_TH, w_gate_up_E2IH, row_src_R, block_expert, num_blocks, h, gate_up,
        hidden, inter, top_k,
        STORE_GATE_UP=store_gate_up,
        **_meta(config, hidden, split),
    )
    return h, (gate_up if store_gate_up else None)


def down_fwd(
    h_RI: torch.Tensor,
    w_down_EHI: torch.Tensor,
    row_src_R: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    num_pairs: int,
    *,
    config: TileConfig,
) -> torch.Tensor:
    """y_pairs [T * k, H]: row t * k + j = expert output of pair (t, j). Pairs without a row stay unwritten."""
    check(h_RI.dim() == 2 and h_RI.is_contiguous(), "h must be a contiguous [R, I] tensor")
    rows, inter = h_RI.shape
    check(w_down_EHI.dim() == 3, "w_down must be [E_l, H, I]")
    hidden = w_down_EHI.shape[1]
    _check_weight(w_down_EHI, h_RI, (w_down_EHI.shape[0], hidden, inter), "w_down")
    check(row_src_R.numel() == rows, f"row_src has {row_src_R.numel()} rows, h has {rows}")
    split = _check_rows(row_src_R, block_expert, num_blocks, config.block_m)
    y_pairs = torch.empty(num_pairs, hidden, dtype=h_RI.dtype, device=h_RI.device)
    max_tiles = rows // config.block_m * triton.cdiv(hidden, config.block_n)
    down_fwd_kernel[persistent_grid(h_RI.device, max_tiles)](
        h_RI, w_down_EHI, row_src_R, block_expert, num_blocks, y_pairs,
        hidden, inter,
        **_meta(config, inter, split),
    )
    return y_pairs


def down_dgrad(
    d_out_TH: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_down_EHI: torch.Tensor,
    gate_up_R2I: torch.Tensor,
    row_src_R: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    *,
    config: TileConfig,
) -> torch.Tensor:
    """d_gate_up [R, 2I] (d_out's dtype): SwiGLU backward of d_h = w * d_out[tok] @ w_down[e]."""
    check(d_out_TH.dim() == 2 and d_out_TH.is_contiguous(), "d_out must be a contiguous [T, H] tensor")
    num_tokens, hidden = d_out_TH.shape
    check(topk_weights_TK.dim() == 2 and topk_weights_TK.shape[0] == num_tokens and topk_weights_TK.is_contiguous(),
          "topk_weights must be a contiguous [T, k] tensor")
    check(topk_weights_TK.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights_TK.dtype}")
    top_k = topk_weights_TK.shape[1]
    check(w_down_EHI.dim() == 3 and w_down_EHI.shape[1] == hidden, "w_down must be [E_l, H, I]")
    inter = w_down_EHI.shape[2]
    _check_weight(w_down_EHI, d_out_TH, (w_down_EHI.shape[0], hidden, inter), "w_down")
    rows = row_src_R.numel()
    check(tuple(gate_up_R2I.shape) == (rows, 2 * inter) and gate_up_R2I.is_contiguous(),
          f"gate_up must be a contiguous [{rows}, {2 * inter}] tensor, got {tuple(gate_up_R2I.shape)}")
    split = _check_rows(row_src_R, block_expert, num_blocks, config.block_m)
    d_gate_up = torch.empty(rows, 2 * inter, dtype=d_out_TH.dtype, device=d_out_TH.device)
    max_tiles = rows // config.block_m * triton.cdiv(inter, config.block_n)
    down_dgrad_kernel[persistent_grid(d_out_TH.device, max_tiles)](
        d_out_TH, topk_weights_TK, w_down_EHI, gate_up_R2I, row_src_R, block_expert, num_blocks, d_gate_up,
        hidden, inter, top_k,
        **_meta(config, hidden, split),
    )
    return d_gate_up


def gate_up_dgrad(
    d_gate_up_R2I: torch.Tensor,
    w_gate_up_E2IH: torch.Tensor,
    row_src_R: torch.Tensor,
    block_expert: torch.Tensor,
    num_blocks: torch.Tensor,
    num_pairs: int,
    *,
    config: TileConfig,
) -> torch.Tensor:
    """d_xpairs [T * k, H]: row t * k + j = d_gate_up of pair (t, j) @ w_gate_up[e]. Unrouted pairs unwritten."""
    check(d_gate_up_R2I.dim() == 2 and d_gate_up_R2I.is_contiguous(), "d_gate_up must be a contiguous [R, 2I] tensor")
    rows, inter2 = d_gate_up_R2I.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] == inter2, "w_gate_up must be [E_l, 2I, H]")
    hidden = w_gate_up_E2IH.shape[2]
    _check_weight(w_gate_up_E2IH, d_gate_up_R2I, (w_gate_up_E2IH.shape[0], inter2, hidden), "w_gate_up")
    check(row_src_R.numel() == rows, f"row_src has {row_src_R.numel()} rows, d_gate_up has {rows}")
    split = _check_rows(row_src_R, block_expert, num_blocks, config.block_m)
    d_xpairs = torch.empty(num_pairs, hidden, dtype=d_gate_up_R2I.dtype, device=d_gate_up_R2I.device)
    max_tiles = rows // config.block_m * triton.cdiv(hidden, config.block_n)
    gate_up_dgrad_kernel[persistent_grid(d_gate_up_R2I.device, max_tiles)](
        d_gate_up_R2I, w_gate_up_E2IH, row_src_R, block_expert, num_blocks, d_xpairs,
        hidden, inter2 // 2,
        **_meta(config, inter2, split),
    )
    return d_xpairs
