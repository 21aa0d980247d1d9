"""Expert weight gradients without split-K: each output tile is owned by one program that loops over
all rows of its expert (expert_offsets[e] .. expert_offsets[e+1]) in row order, so the reduction
order is fixed and no atomics are needed. An empty expert's loop runs zero times: its tiles are
written as zeros.

Both operands are contiguous [R, *] row tensors (d_y_rows and h; d_gate_up and x_rows): the row loop
is two strided loads and a dot, with no index load and no arithmetic on the operands, so Triton
software-pipelines it. Padding rows are zero in d_y_rows, h, d_gate_up and x_rows (gather.py and
the dispatch write them so, and the GEMMs keep them so), hence they add nothing and need no mask.
Each expert's segment is a multiple of the schedule's block_m and the row step BLOCK_K divides it, so
the row loop needs no bounds mask either; masks remain on the contiguous (column) dimension only.

Tiles are expert-major (all tiles of one expert are consecutive), so the programs running at once
stream the same rows of activations through L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels import gluon_dw, tma_gemm
from megamoe.backends.triton.kernels._common import (
    check, check_expert_offsets, check_row_operands, mma, persistent_grid, tile_coords,
)


@triton.jit
def dw_tile(
    expert, tile, a_ptr, b_ptr, M, N, expert_offsets_ptr, dw_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):
    """Tile number `tile` of expert `expert` (of cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N)):
    dw[e, m, n] = sum over rows r of expert e of a[r, m] * b[r, n]; a [R, M], b [R, N], dw [E, M, N]."""
    pid_m, pid_n = tile_coords(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    start = tl.load(expert_offsets_ptr + expert).to(tl.int64)  # row indices: int64 pointer math
    end = tl.load(expert_offsets_ptr + expert + 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    cols_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = (cols_m < M)[None, :]
    n_ok = (cols_n < N)[None, :]
    a_ptrs = a_ptr + (start + offs_k)[:, None] * M + cols_m[None, :]
    b_ptrs = b_ptr + (start + offs_k)[:, None] * N + cols_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(start, end, BLOCK_K, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=m_ok, other=0.0)
        b = tl.load(b_ptrs, mask=n_ok, other=0.0)
        acc = mma(tl.trans(a), b, acc)
        a_ptrs += BLOCK_K * M
        b_ptrs += BLOCK_K * N
    mask = (cols_m < M)[:, None] & (cols_n < N)[None, :]
    dst = dw_ptr + expert.to(tl.int64) * M * N + cols_m[:, None] * N + cols_n[None, :]
    tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dw_kernel(
    a_ptr, b_ptr, expert_offsets_ptr, dw_ptr, M, N, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
):
    """Every dw_tile of every expert, expert-major, on the persistent grid: d_w_down (a = d_out rows, b = h_w;
    m over H, n over I) and d_w_gate_up (a = d_gate_up, b = x_rows; m over 2I, n over H)."""
    per_expert = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0)):
        dw_tile(tile // per_expert, tile % per_expert, a_ptr, b_ptr, M, N, expert_offsets_ptr, dw_ptr,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)


def _launch(a, b, expert_offsets, num_experts, config, gather_b=None, row_src=None):
    """dw [E_l, M, N] = a^T b per expert, in a's dtype: every tile of every expert, on the persistent grid.
    gather_b = (row_src, top_k): b is the tokens [T, N], gathered in the Gluon kernel's loads; row_src: see
    dw_down."""
    check(num_experts >= 1, f"num_experts must be >= 1, got {num_experts}")
    check_expert_offsets(expert_offsets, a.shape[0], num_experts, config.block_k)
    m_dim, n_dim = a.shape[1], b.shape[1]
    out = torch.empty(num_experts, m_dim, n_dim, dtype=a.dtype, device=a.device)
    if config.gluon:  # gluon_dw.py's warp-specialized kernel (operands TMA can address, checked there)
        gluon_dw.launch_dw(a, b, out, expert_offsets, config, gather_b=gather_b, row_src=row_src)
        return out
    check(gather_b is None, f"gathering in the loads needs the Gluon kernel (config.gluon), got {config}")
    max_tiles = num_experts * triton.cdiv(m_dim, config.block_m) * triton.cdiv(n_dim, config.block_n)
    grid = persistent_grid(a.device, max_tiles)
    if config.tma:  # tma_gemm.py's kernel (operands TMA can address, checked there)
        tma_gemm.launch_dw(a, b, out, expert_offsets, config, grid)
        return out
    dw_kernel[grid](
        a, b, expert_offsets, out, m_dim, n_dim, num_experts,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        STAGES=config.num_stages, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def dw_down(
    d_y_rows_RH: torch.Tensor,
    h_RI: torch.Tensor,
    expert_offsets: torch.Tensor,
    num_experts: int,
    *,
    config: TileConfig,
    row_src: torch.Tensor | None = None,
) -> torch.Tensor:
    """d_w_down [E_l, H, I] = d_y_rows^T h per expert, in the rows' dtype.

    d_y_rows [R, H] and h [R, I], zero for padding, the router weight in one of them (both paths pass the
    unweighted d_out rows and h_w = w * h); expert_offsets int32 [E_l + 1].
    config.block_k is the row step and must divide block_m. row_src (the schedule's, int32 [R], -1 on
    padding): the Gluon kernel (config.gluon) skips an expert's last row step where it holds padding rows
    only, the same sum for less work; the Triton kernels do not read it.
    """
    check_row_operands(d_y_rows_RH, h_RI, ("d_y_rows", "h"))
    return _launch(d_y_rows_RH, h_RI, expert_offsets, num_experts, config, row_src=row_src)


def dw_gate_up(
    d_gate_up_R2I: torch.Tensor,
    x_rows_RH: torch.Tensor,
    expert_offsets: torch.Tensor,
    num_experts: int,
    *,
    config: TileConfig,
    gather: tuple[torch.Tensor, int] | None = None,
    row_src: torch.Tensor | None = None,
) -> torch.Tensor:
    """d_w_gate_up [E_l, 2I, H] = d_gate_up^T x_rows per expert, in the rows' dtype.

    d_gate_up [R, 2I], x_rows [R, H], both zero for padding; expert_offsets int32 [E_l + 1]. With gather =
    (row_src int32 [R], top_k) (the Gluon kernel only: config.gluon), x_rows is the tokens x [T, H] and row r
    reads x[row_src[r] // top_k] (zeros where row_src[r] is -1) inside the kernel's loads: no x_rows pass.
    row_src: as dw_down's (with gather, the same tensor).
    """
    check(d_gate_up_R2I.dim() == 2 and d_gate_up_R2I.shape[1] % 2 == 0,
          f"d_gate_up must be a [R, 2I] tensor, got {tuple(d_gate_up_R2I.shape)}")
    if gather is None:
        check_row_operands(d_gate_up_R2I, x_rows_RH, ("d_gate_up", "x_rows"))
    return _launch(d_gate_up_R2I, x_rows_RH, expert_offsets, num_experts, config, gather_b=gather, row_src=row_src)
