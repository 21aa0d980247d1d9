"""Expert weight gradients without split-K: each output tile is owned by one program that loops over
all rows of its expert (expert_offsets[e] .. expert_offsets[e+1]) in row order, so the reduction
order is fixed and no atomics are needed. An empty expert's loop runs zero times: its tiles are
written as zeros. Rows that start from tokens (d_out, x) are gathered by pointer; padding rows are
masked to zero on both operands, so padding contents never matter (not even NaN). Each expert's
segment is a multiple of the schedule's block_m and the row step BLOCK_K divides it, so the row loop
needs no bounds mask.

Tiles are expert-major (all tiles of one expert are consecutive), so the programs running at once
stream the same rows of activations through L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import check, persistent_grid, tile_coords


@triton.jit
def dw_down_kernel(
    d_out_ptr, topk_w_ptr, h_ptr, row_src_ptr, expert_offsets_ptr, dw_ptr,
    H, I, top_k, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """d_w_down[e, m, n] = sum over rows r of e of (w[src] * d_out[tok, m]) * h[r, n]; m over H, n over I."""
    num_m = tl.cdiv(H, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    per_expert = num_m * num_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # row indices: int64 pointer math
    for tile in range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0)):
        expert = tile // per_expert
        pid_m, pid_n = tile_coords(tile % per_expert, num_m, num_n, GROUP_M)
        start = tl.load(expert_offsets_ptr + expert)
        end = tl.load(expert_offsets_ptr + expert + 1)
        cols_m = pid_m * BLOCK_M + offs_m
        cols_n = pid_n * BLOCK_N + offs_n
        m_ok = (cols_m < H)[None, :]
        n_ok = (cols_n < I)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            rows = r0 + offs_k
            src = tl.load(row_src_ptr + rows)
            valid = src >= 0
            safe_src = tl.where(valid, src, 0)
            token = (safe_src // top_k).to(tl.int64)
            weight = tl.load(topk_w_ptr + safe_src, mask=valid, other=0.0)
            a = tl.load(d_out_ptr + token[:, None] * H + cols_m[None, :], mask=valid[:, None] & m_ok, other=0.0)
            # The router weight scales d_out rows (rounded to the input dtype, as autograd of the
            # reference does) because a per-row scale does not commute out of this reduction over rows.
            a = (a.to(tl.float32) * weight[:, None]).to(d_out_ptr.dtype.element_ty)
            b = tl.load(h_ptr + rows[:, None] * I + cols_n[None, :], mask=valid[:, None] & n_ok, other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
        mask = (cols_m < H)[:, None] & (cols_n < I)[None, :]
        dst = dw_ptr + expert.to(tl.int64) * H * I + cols_m[:, None] * I + cols_n[None, :]
        tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dw_gate_up_kernel(
    d_gate_up_ptr, x_ptr, row_src_ptr, expert_offsets_ptr, dw_ptr,
    H, I, top_k, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """d_w_gate_up[e, m, n] = sum over rows r of e of d_gate_up[r, m] * x[tok, n]; m over 2I, n over H."""
    num_m = tl.cdiv(2 * I, BLOCK_M)
    num_n = tl.cdiv(H, BLOCK_N)
    per_expert = num_m * num_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # row indices: int64 pointer math
    for tile in range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0)):
        expert = tile // per_expert
        pid_m, pid_n = tile_coords(tile % per_expert, num_m, num_n, GROUP_M)
        start = tl.load(expert_offsets_ptr + expert)
        end = tl.load(expert_offsets_ptr + expert + 1)
        cols_m = pid_m * BLOCK_M + offs_m
        cols_n = pid_n * BLOCK_N + offs_n
        m_ok = (cols_m < 2 * I)[None, :]
        n_ok = (cols_n < H)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            rows = r0 + offs_k
            src = tl.load(row_src_ptr + rows)
            valid = src >= 0
            token = (tl.where(valid, src, 0) // top_k).to(tl.int64)
            a = tl.load(d_gate_up_ptr + rows[:, None] * (2 * I) + cols_m[None, :], mask=valid[:, None] & m_ok, other=0.0)
            b = tl.load(x_ptr + token[:, None] * H + cols_n[None, :], mask=valid[:, None] & n_ok, other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
        mask = (cols_m < 2 * I)[:, None] & (cols_n < H)[None, :]
        dst = dw_ptr + expert.to(tl.int64) * (2 * I) * H + cols_m[:, None] * H + cols_n[None, :]
        tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=mask)


def _check_offsets(expert_offsets: torch.Tensor, row_src: torch.Tensor, num_experts: int, block_k: int) -> None:
    check(expert_offsets.dtype == torch.int32 and tuple(expert_offsets.shape) == (num_experts + 1,),
          f"expert_offsets must be int32 [{num_experts + 1}], got {expert_offsets.dtype} {tuple(expert_offsets.shape)}")
    check(row_src.dtype == torch.int32 and row_src.dim() == 1, "row_src must be int32 [R]")
    check(row_src.numel() % block_k == 0, f"the row step {block_k} must divide R={row_src.numel()} (and block_m)")


def dw_down(
    d_out_TH: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    h_RI: torch.Tensor,
    row_src_R: torch.Tensor,
    expert_offsets: torch.Tensor,
    num_experts: int,
    *,
    config: TileConfig,
) -> torch.Tensor:
    """d_w_down [E_l, H, I] in d_out's dtype. config.block_k is the row step and must divide block_m."""
    check(d_out_TH.dim() == 2 and d_out_TH.is_contiguous(), "d_out must be a contiguous [T, H] tensor")
    hidden = d_out_TH.shape[1]
    check(h_RI.dim() == 2 and h_RI.is_contiguous() and h_RI.dtype == d_out_TH.dtype, "h must be a contiguous [R, I] tensor of d_out's dtype")
    rows, inter = h_RI.shape
    check(row_src_R.numel() == rows, f"row_src has {row_src_R.numel()} rows, h has {rows}")
    check(topk_weights_TK.dtype == torch.float32 and topk_weights_TK.is_contiguous(), "topk_weights must be contiguous float32 [T, k]")
    _check_offsets(expert_offsets, row_src_R, num_experts, config.block_k)
    dw = torch.empty(num_experts, hidden, inter, dtype=d_out_TH.dtype, device=d_out_TH.device)
    max_tiles = num_experts * triton.cdiv(hidden, config.block_m) * triton.cdiv(inter, config.block_n)
    dw_down_kernel[persistent_grid(d_out_TH.device, max_tiles)](
        d_out_TH, topk_weights_TK, h_RI, row_src_R, expert_offsets, dw,
        hidden, inter, topk_weights_TK.shape[1], num_experts,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return dw


def dw_gate_up(
    d_gate_up_R2I: torch.Tensor,
    x_TH: torch.Tensor,
    row_src_R: torch.Tensor,
    expert_offsets: torch.Tensor,
    num_experts: int,
    top_k: int,
    *,
    config: TileConfig,
) -> torch.Tensor:
    """d_w_gate_up [E_l, 2I, H] in x's dtype. config.block_k is the row step and must divide block_m."""
    check(x_TH.dim() == 2 and x_TH.is_contiguous(), "x must be a contiguous [T, H] tensor")
    hidden = x_TH.shape[1]
    check(d_gate_up_R2I.dim() == 2 and d_gate_up_R2I.is_contiguous() and d_gate_up_R2I.dtype == x_TH.dtype,
          "d_gate_up must be a contiguous [R, 2I] tensor of x's dtype")
    rows, inter2 = d_gate_up_R2I.shape
    check(row_src_R.numel() == rows, f"row_src has {row_src_R.numel()} rows, d_gate_up has {rows}")
    _check_offsets(expert_offsets, row_src_R, num_experts, config.block_k)
    dw = torch.empty(num_experts, inter2, hidden, dtype=x_TH.dtype, device=x_TH.device)
    max_tiles = num_experts * triton.cdiv(inter2, config.block_m) * triton.cdiv(hidden, config.block_n)
    dw_gate_up_kernel[persistent_grid(x_TH.device, max_tiles)](
        d_gate_up_R2I, x_TH, row_src_R, expert_offsets, dw,
        hidden, inter2 // 2, top_k, num_experts,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return dw
