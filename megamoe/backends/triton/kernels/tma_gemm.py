"""Row-block grouped GEMMs with operands loaded by the Tensor Memory Accelerator (Hopper and newer).

The launchers of grouped_gemm.py and weight_grad.py run these kernels when their tile config has `tma`
(configs.tma_kernel_configs: the one-GPU path on Hopper for 16-bit rows TMA can address).

The same four GEMMs and the same tile space as grouped_gemm.py (row block m of BLOCK_M schedule rows,
all of one expert, x column block n; persistent grid over the device block range; one tile per output
element, fixed K order, so results are bitwise reproducible), but every operand tile is a TMA copy
(`cp.async.bulk.tensor`) described by a host-built tensor descriptor instead of per-thread pointer
loads, and the outputs are TMA stores. Bounds come from the descriptors: the copy engine zero-fills
what lies outside the tensor and clips stores at its edge, so no tile carries a mask.

Descriptors (host-side, passed by value):
    rows operands [R, K]:          block [BLOCK_M, BLOCK_K]
    weights [E_l, N, K] (or K, N): 3-D, block [1, BLOCK_N, BLOCK_K] (or [1, BLOCK_K, BLOCK_N]); the
                                   expert index is the first coordinate, so a K or N tail reads zeros,
                                   never the next expert's rows
    gate/up pairs [R, 2, I]:       3-D view of an [R, 2I] tensor, block [BLOCK_M, 1, BLOCK_N]: the gate
                                   and up halves clip at I separately
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import (
    check, column_halves, expert_tile_coords, load_range, mma, pair_weights, persistent_grid, router_epilogue, swiglu,
    swiglu_bwd, tile_coords,
)


@triton.jit
def _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first column, expert) of a linear tile index over the block range (_common.expert_tile_coords)."""
    m, pid_n, expert = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                          BLOCK_M, GROUP_M)
    return m * BLOCK_M, pid_n * BLOCK_N, expert


@triton.jit
def _k_loop(a_desc, w_desc, row, col, expert, K,
            W_NK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] = a[row : row + BLOCK_M, :K] @ w[expert] over columns col : col + BLOCK_N,
    K in order. W_NK: the weight is stored [E_l, N, K] (else [E_l, K, N])."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row, k0])
        if W_NK:
            b = w_desc.load([expert, col, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = w_desc.load([expert, k0, col]).reshape(BLOCK_K, BLOCK_N)
        acc = mma(a, b, acc)
    return acc


@triton.jit
def gate_up_fwd_tma_kernel(
    x_desc, w_desc, h_desc, gu_desc, x_ptr, row_src_ptr, block_expert_ptr, expert_offsets_ptr, block_range_ptr, H, I,
    top_k,
    STORE_GATE_UP: tl.constexpr, GATHER: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """h[r, n] = silu(g) * u, g = x_rows[r] . gate[e, n], u = x_rows[r] . up[e, n] (both rounded to the dtype
    first, as grouped_gemm.gate_up_fwd_tile); gate_up too if STORE_GATE_UP. x_rows by x_desc, or with GATHER
    gathered in the loads: x_rows[r] = x[row_src[r] // top_k] by pointer (0 for a padding row, row_src -1)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(I, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                        BLOCK_M, BLOCK_N, GROUP_M)
        if GATHER:
            src = tl.load(row_src_ptr + row + tl.arange(0, BLOCK_M))
            has_src = src >= 0
            a_ptrs = x_ptr + (tl.where(has_src, src, 0) // top_k).to(tl.int64)[:, None] * H + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if GATHER:
                a = tl.load(a_ptrs + k0, mask=has_src[:, None] & (k0 + offs_k < H)[None, :], other=0.0)
            else:
                a = x_desc.load([row, k0])
            bg = w_desc.load([expert, col, k0]).reshape(BLOCK_N, BLOCK_K)
            bu = w_desc.load([expert, I + col, k0]).reshape(BLOCK_N, BLOCK_K)
            acc_g = mma(a, bg.T, acc_g)
            acc_u = mma(a, bu.T, acc_u)
        g = acc_g.to(h_desc.dtype)
        u = acc_u.to(h_desc.dtype)
        if STORE_GATE_UP:
            gu_desc.store([row, 0, col], g.reshape(BLOCK_M, 1, BLOCK_N))
            gu_desc.store([row, 1, col], u.reshape(BLOCK_M, 1, BLOCK_N))
        h_desc.store([row, col], swiglu(g, u).to(h_desc.dtype))


@triton.jit
def row_gemm_tma_kernel(
    a_desc, w_desc, out_desc, block_expert_ptr, expert_offsets_ptr, block_range_ptr, N, K,
    W_NK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """out_rows[r, n] = a_rows[r] . w[e][:, n] over K, the row-block GEMMs without an epilogue: down_fwd
    (y_rows = h @ w_down[e]^T, w_down stored [E_l, N = H, K = I]: W_NK) and gate_up_dgrad
    (d_x_rows = d_gate_up @ w_gate_up[e], w_gate_up stored [E_l, K = 2I, N = H])."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                        BLOCK_M, BLOCK_N, GROUP_M)
        acc = _k_loop(a_desc, w_desc, row, col, expert, K, W_NK, BLOCK_M, BLOCK_N, BLOCK_K)
        out_desc.store([row, col], acc.to(out_desc.dtype))


@triton.jit
def _down_dgrad_half(acc, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, row, col,
                     ROUTER: tl.constexpr, STORE_H_W: tl.constexpr):
    """down_dgrad's epilogue on BLOCK_N / 2 columns from col: stores d_gate_up (and h_w); returns the
    router-weight gradient's partial sum over these columns (ROUTER), else 0."""
    block_m: tl.constexpr = acc.shape[0]
    block_n: tl.constexpr = acc.shape[1]
    g = gu_desc.load([row, 0, col]).reshape(block_m, block_n)
    u = gu_desc.load([row, 1, col]).reshape(block_m, block_n)
    d_w_part = tl.zeros((block_m,), dtype=tl.float32)
    if ROUTER:
        acc, h_w, d_w_part = router_epilogue(acc, g, u, pair_weights(row_src_ptr, weights_ptr, row + tl.arange(0, block_m)))
        if STORE_H_W:
            h_w_desc.store([row, col], h_w.to(h_w_desc.dtype))
    d_g, d_u = swiglu_bwd(acc, g, u)
    d_gu_desc.store([row, 0, col], d_g.to(d_gu_desc.dtype).reshape(block_m, 1, block_n))
    d_gu_desc.store([row, 1, col], d_u.to(d_gu_desc.dtype).reshape(block_m, 1, block_n))
    return d_w_part


@triton.jit
def down_dgrad_tma_kernel(
    d_y_desc, w_desc, gu_desc, d_gu_desc, row_src_ptr, weights_ptr, h_w_desc, d_w_part_ptr, block_expert_ptr,
    expert_offsets_ptr, block_range_ptr, H, I,
    ROUTER: tl.constexpr, STORE_H_W: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """acc = d_y_rows[r] @ w_down[e]; d_gate_up[r] = [d_h * u * silu'(g), d_h * silu(g)] with d_h = acc, or
    with ROUTER (unweighted d_out rows) the router weight applied here (grouped_gemm.down_dgrad_tile). The
    epilogue runs on the two column halves in turn (the gate/up/h tiles of a whole one spill registers);
    gu/d_gu/h_w descriptors have BLOCK_N / 2 columns."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                        BLOCK_M, BLOCK_N, GROUP_M)
        acc = _k_loop(d_y_desc, w_desc, row, col, expert, H, False, BLOCK_M, BLOCK_N, BLOCK_K)
        acc0, acc1 = column_halves(acc)
        d_w_part = _down_dgrad_half(acc0, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, row, col,
                                    ROUTER, STORE_H_W)
        d_w_part += _down_dgrad_half(acc1, gu_desc, d_gu_desc, h_w_desc, row_src_ptr, weights_ptr, row,
                                     col + BLOCK_N // 2, ROUTER, STORE_H_W)
        if ROUTER:
            tl.store(d_w_part_ptr + (row + tl.arange(0, BLOCK_M)) * num_n + col // BLOCK_N, d_w_part)


@triton.jit
def dw_tma_kernel(
    a_desc, b_desc, dw_desc, expert_offsets_ptr, M, N, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """dw[e, m, n] = sum over the rows r of expert e, in order, of a[r, m] * b[r, n] (no split-K)."""
    per_expert = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0), flatten=FLATTEN):
        expert = tile // per_expert
        pid_m, pid_n = tile_coords(tile % per_expert, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        start = tl.load(expert_offsets_ptr + expert)
        end = tl.load(expert_offsets_ptr + expert + 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            a = a_desc.load([r0, pid_m * BLOCK_M])
            b = b_desc.load([r0, pid_n * BLOCK_N])
            acc = mma(a.T, b, acc)
        dw_desc.store([expert, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(dw_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))


# ----------------------------------------------------------------------------------------------------
# Launches, called by the launchers of grouped_gemm.py and weight_grad.py (which validate and allocate)
# when the tile config says `tma`. Here: descriptors, the TMA addressing check, the grid.


def tma_addressable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can copy these tensors: 16-byte aligned base addresses, the last dimension contiguous and every
    other stride a multiple of 16 bytes (for bf16/fp16: H and I multiples of 8), a dimension of size 1 too (torch
    calls x [1, H] with strides (1, 1) contiguous; a TMA descriptor does not take it). Host metadata only; never
    synchronises."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def check_tma(*tensors: torch.Tensor) -> None:
    check(tma_addressable(*tensors), "TMA needs 16-byte aligned operands and row strides (H, I multiples of 8 in bf16)")


def _rows_desc(t_RK: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t_RK, [block_m, block_k])


def _pairs_desc(t_R2I: torch.Tensor, block_m: int, block_n: int) -> TensorDescriptor:
    """[R, 2I] as [R, 2, I]: a tile of gate (or up) columns clips at I, never spilling into the other half."""
    rows, inter2 = t_R2I.shape
    return TensorDescriptor(t_R2I, [rows, 2, inter2 // 2], [inter2, inter2 // 2, 1], [block_m, 1, block_n])


def _row_block_launch(kernel, rows_RK: torch.Tensor, out_cols: int, split: int, config: TileConfig, descriptors: list,
                      *args, **extra):
    """Launch a row-block GEMM kernel over the worst-case tiles: rows_RK's rows x out_cols columns."""
    c = config
    kernel[persistent_grid(rows_RK.device, rows_RK.shape[0] // c.block_m * triton.cdiv(out_cols, c.block_n))](
        *descriptors, *args, SPLIT=split, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_M=c.group_m, FLATTEN=c.flatten, num_warps=c.num_warps, num_stages=c.num_stages, **extra,
    )


def launch_gate_up_fwd(x_RH, w_gate_up_E2IH, h_RI, gate_up_R2I, block_expert, expert_offsets, blocks, split, config,
                       store_gate_up, gather=None):
    """gate_up_R2I: written if store_gate_up; otherwise any [*, 2I] tensor (the kernel needs a descriptor).
    x_RH: the rows, or with gather = (row_src [R], top_k) the token rows x [T, H] that the kernel gathers."""
    check_tma(x_RH, w_gate_up_E2IH, h_RI, gate_up_R2I)
    c = config
    row_src, top_k = gather if gather is not None else (block_expert, 1)  # unread without gather
    _row_block_launch(
        gate_up_fwd_tma_kernel, h_RI, h_RI.shape[1], split, c,
        [_rows_desc(x_RH, c.block_m, c.block_k), TensorDescriptor.from_tensor(w_gate_up_E2IH, [1, c.block_n, c.block_k]),
         _rows_desc(h_RI, c.block_m, c.block_n), _pairs_desc(gate_up_R2I, c.block_m, c.block_n)],
        x_RH, row_src, block_expert, expert_offsets, blocks, x_RH.shape[1], h_RI.shape[1], top_k,
        STORE_GATE_UP=store_gate_up,
        GATHER=gather is not None,
    )


def _launch_row_gemm(a_RK, w, out_RN, w_nk: bool, block_expert, expert_offsets, blocks, split, config):
    """row_gemm_tma_kernel: out_RN = a_RK @ w[e] per row block; w is [E_l, N, K] if w_nk, else [E_l, K, N]."""
    check_tma(a_RK, w, out_RN)
    c = config
    w_block = [1, c.block_n, c.block_k] if w_nk else [1, c.block_k, c.block_n]
    _row_block_launch(
        row_gemm_tma_kernel, a_RK, out_RN.shape[1], split, c,
        [_rows_desc(a_RK, c.block_m, c.block_k), TensorDescriptor.from_tensor(w, w_block),
         _rows_desc(out_RN, c.block_m, c.block_n)],
        block_expert, expert_offsets, blocks, out_RN.shape[1], a_RK.shape[1], W_NK=w_nk,
    )


def launch_down_fwd(h_RI, w_down_EHI, y_rows_RH, block_expert, expert_offsets, blocks, split, config):
    _launch_row_gemm(h_RI, w_down_EHI, y_rows_RH, True, block_expert, expert_offsets, blocks, split, config)


def launch_down_dgrad(d_y_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, row_src, weights, h_w_RI, d_w_part, block_expert,
                      expert_offsets, blocks, split, config, *, router, store_h_w):
    """row_src, weights, h_w, d_w_part: see grouped_gemm.down_dgrad_router (placeholders without router)."""
    check_tma(d_y_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up_R2I, h_w_RI)
    c = config
    _row_block_launch(
        down_dgrad_tma_kernel, d_y_rows_RH, gate_up_R2I.shape[1] // 2, split, c,
        [_rows_desc(d_y_rows_RH, c.block_m, c.block_k), TensorDescriptor.from_tensor(w_down_EHI, [1, c.block_k, c.block_n]),
         _pairs_desc(gate_up_R2I, c.block_m, c.block_n // 2), _pairs_desc(d_gate_up_R2I, c.block_m, c.block_n // 2),
         row_src, weights, _rows_desc(h_w_RI, c.block_m, c.block_n // 2), d_w_part],
        block_expert, expert_offsets, blocks, d_y_rows_RH.shape[1], gate_up_R2I.shape[1] // 2, ROUTER=router,
        STORE_H_W=store_h_w,
    )


def launch_gate_up_dgrad(d_gate_up_R2I, w_gate_up_E2IH, d_x_rows_RH, block_expert, expert_offsets, blocks, split,
                         config):
    _launch_row_gemm(d_gate_up_R2I, w_gate_up_E2IH, d_x_rows_RH, False, block_expert, expert_offsets, blocks, split,
                     config)


def launch_dw(a_RM, b_RN, dw_EMN, expert_offsets, config, grid):
    """dw [E_l, M, N] = a^T b per expert (both weight grads)."""
    check_tma(a_RM, b_RN, dw_EMN)
    c = config
    dw_tma_kernel[grid](
        TensorDescriptor.from_tensor(a_RM, [c.block_k, c.block_m]), TensorDescriptor.from_tensor(b_RN, [c.block_k, c.block_n]),
        TensorDescriptor.from_tensor(dw_EMN, [1, c.block_m, c.block_n]), expert_offsets,
        a_RM.shape[1], b_RN.shape[1], dw_EMN.shape[0],
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, FLATTEN=c.flatten,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
