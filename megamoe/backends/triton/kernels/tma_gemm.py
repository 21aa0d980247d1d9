"""Row-block grouped GEMMs with operands loaded by the Tensor Memory Accelerator (Hopper and newer).

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
    check, check_expert_offsets, check_matrix, check_row_operands, check_rows, check_weight, load_range,
    persistent_grid, tile_coords,
)


@triton.jit
def _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first column, expert) of a linear tile index over the block range."""
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    m = first_m + pid_m
    expert = tl.load(block_expert_ptr + m // SPLIT)
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
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def gate_up_fwd_tma_kernel(
    x_desc, w_desc, h_desc, gu_desc, block_expert_ptr, block_range_ptr, H, I,
    STORE_GATE_UP: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """h[r, n] = silu(x_rows[r] . gate[e, n]) * (x_rows[r] . up[e, n]); gate_up too if STORE_GATE_UP."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = x_desc.load([row, k0])
            bg = w_desc.load([expert, col, k0]).reshape(BLOCK_N, BLOCK_K)
            bu = w_desc.load([expert, I + col, k0]).reshape(BLOCK_N, BLOCK_K)
            acc_g = tl.dot(a, bg.T, acc_g)
            acc_u = tl.dot(a, bu.T, acc_u)
        dtype = h_desc.dtype
        if STORE_GATE_UP:
            gu_desc.store([row, 0, col], acc_g.to(dtype).reshape(BLOCK_M, 1, BLOCK_N))
            gu_desc.store([row, 1, col], acc_u.to(dtype).reshape(BLOCK_M, 1, BLOCK_N))
        h_desc.store([row, col], (acc_g * tl.sigmoid(acc_g) * acc_u).to(dtype))


@triton.jit
def down_fwd_tma_kernel(
    h_desc, w_desc, y_desc, block_expert_ptr, block_range_ptr, H, I,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """y_rows[r, n] = h[r] . w_down[e, n]."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(H, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _k_loop(h_desc, w_desc, row, col, expert, I, True, BLOCK_M, BLOCK_N, BLOCK_K)
        y_desc.store([row, col], acc.to(y_desc.dtype))


@triton.jit
def down_dgrad_tma_kernel(
    d_y_desc, w_desc, gu_desc, d_gu_desc, block_expert_ptr, block_range_ptr, H, I,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """d_h[r] = d_y_rows[r] @ w_down[e]; d_gate_up[r] = [d_h * u * silu'(g), d_h * silu(g)]."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _k_loop(d_y_desc, w_desc, row, col, expert, H, False, BLOCK_M, BLOCK_N, BLOCK_K)
        g = gu_desc.load([row, 0, col]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
        u = gu_desc.load([row, 1, col]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
        sig = tl.sigmoid(g)
        dtype = d_gu_desc.dtype
        d_gu_desc.store([row, 0, col], (acc * u * sig * (1.0 + g * (1.0 - sig))).to(dtype).reshape(BLOCK_M, 1, BLOCK_N))
        d_gu_desc.store([row, 1, col], (acc * g * sig).to(dtype).reshape(BLOCK_M, 1, BLOCK_N))


@triton.jit
def gate_up_dgrad_tma_kernel(
    d_gu_desc, w_desc, d_x_desc, block_expert_ptr, block_range_ptr, H, I,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
):
    """d_x_rows[r, n] = d_gate_up[r] . w_gate_up[e, :, n] (reduction over 2I)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    num_n = tl.cdiv(H, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        row, col, expert = _tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, SPLIT, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _k_loop(d_gu_desc, w_desc, row, col, expert, 2 * I, False, BLOCK_M, BLOCK_N, BLOCK_K)
        d_x_desc.store([row, col], acc.to(d_x_desc.dtype))


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
            acc = tl.dot(a.T, b, acc)
        dw_desc.store([expert, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(dw_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))


# ----------------------------------------------------------------------------------------------------
# Launchers: the signatures and contracts of grouped_gemm.py's and weight_grad.py's (blocks: the device
# block range; rows outside it are left unwritten), for operands TMA can address (tma_addressable).


def tma_addressable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can copy these tensors: 16-byte aligned base addresses and row strides (for bf16/fp16:
    H and I multiples of 8). Host metadata only; never synchronises."""
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or s * t.element_size() % 16 == 0 for s in t.stride())
               for t in tensors)


def _rows_desc(t_RK: torch.Tensor, block_m: int, block_k: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t_RK, [block_m, block_k])


def _pairs_desc(t_R2I: torch.Tensor, block_m: int, block_n: int) -> TensorDescriptor:
    """[R, 2I] as [R, 2, I]: a tile of gate (or up) columns clips at I, never spilling into the other half."""
    rows, inter2 = t_R2I.shape
    return TensorDescriptor(t_R2I, [rows, 2, inter2 // 2], [inter2, inter2 // 2, 1], [block_m, 1, block_n])


def _meta(config: TileConfig, split: int) -> dict:
    return dict(SPLIT=split, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                GROUP_M=config.group_m, FLATTEN=config.flatten, num_warps=config.num_warps,
                num_stages=config.num_stages)


def _check_tma(*tensors: torch.Tensor) -> None:
    check(tma_addressable(*tensors), "TMA needs 16-byte aligned operands and row strides (H, I multiples of 8 in bf16)")


def gate_up_fwd_tma(
    x_rows_RH: torch.Tensor, w_gate_up_E2IH: torch.Tensor, block_expert: torch.Tensor, blocks: torch.Tensor,
    *, store_gate_up: bool, config: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [R, I] = SwiGLU of the rows' gate/up projections; gate_up [R, 2I] too if store_gate_up."""
    check_matrix(x_rows_RH, None, None, "x_rows")
    rows, hidden = x_rows_RH.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] % 2 == 0, "w_gate_up must be [E_l, 2I, H]")
    inter = w_gate_up_E2IH.shape[1] // 2
    check_weight(w_gate_up_E2IH, x_rows_RH, (w_gate_up_E2IH.shape[0], 2 * inter, hidden), "w_gate_up")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    h = torch.empty(rows, inter, dtype=x_rows_RH.dtype, device=x_rows_RH.device)
    # Without store_gate_up the kernel never touches gu_desc; it still needs a descriptor of the right type.
    gate_up = torch.empty(rows if store_gate_up else config.block_m, 2 * inter, dtype=h.dtype, device=h.device)
    _check_tma(x_rows_RH, w_gate_up_E2IH, h, gate_up)
    c = config
    gate_up_fwd_tma_kernel[persistent_grid(h.device, rows // c.block_m * triton.cdiv(inter, c.block_n))](
        _rows_desc(x_rows_RH, c.block_m, c.block_k), TensorDescriptor.from_tensor(w_gate_up_E2IH, [1, c.block_n, c.block_k]),
        _rows_desc(h, c.block_m, c.block_n), _pairs_desc(gate_up, c.block_m, c.block_n),
        block_expert, blocks, hidden, inter, STORE_GATE_UP=store_gate_up, **_meta(c, split),
    )
    return h, (gate_up if store_gate_up else None)


def down_fwd_tma(
    h_RI: torch.Tensor, w_down_EHI: torch.Tensor, block_expert: torch.Tensor, blocks: torch.Tensor, *, config: TileConfig,
) -> torch.Tensor:
    """y_rows [R, H] = h[r] @ w_down[e]^T."""
    check_matrix(h_RI, None, None, "h")
    rows, inter = h_RI.shape
    check(w_down_EHI.dim() == 3, "w_down must be [E_l, H, I]")
    hidden = w_down_EHI.shape[1]
    check_weight(w_down_EHI, h_RI, (w_down_EHI.shape[0], hidden, inter), "w_down")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    y_rows = torch.empty(rows, hidden, dtype=h_RI.dtype, device=h_RI.device)
    _check_tma(h_RI, w_down_EHI, y_rows)
    c = config
    down_fwd_tma_kernel[persistent_grid(h_RI.device, rows // c.block_m * triton.cdiv(hidden, c.block_n))](
        _rows_desc(h_RI, c.block_m, c.block_k), TensorDescriptor.from_tensor(w_down_EHI, [1, c.block_n, c.block_k]),
        _rows_desc(y_rows, c.block_m, c.block_n), block_expert, blocks, hidden, inter, **_meta(c, split),
    )
    return y_rows


def down_dgrad_tma(
    d_y_rows_RH: torch.Tensor, w_down_EHI: torch.Tensor, gate_up_R2I: torch.Tensor, block_expert: torch.Tensor,
    blocks: torch.Tensor, *, config: TileConfig,
) -> torch.Tensor:
    """d_gate_up [R, 2I]: SwiGLU backward of d_h = d_y_rows[r] @ w_down[e] (as grouped_gemm.down_dgrad)."""
    check_matrix(d_y_rows_RH, None, None, "d_y_rows")
    rows, hidden = d_y_rows_RH.shape
    check(w_down_EHI.dim() == 3 and w_down_EHI.shape[1] == hidden, "w_down must be [E_l, H, I]")
    inter = w_down_EHI.shape[2]
    check_weight(w_down_EHI, d_y_rows_RH, (w_down_EHI.shape[0], hidden, inter), "w_down")
    check_matrix(gate_up_R2I, rows, 2 * inter, "gate_up")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    d_gate_up = torch.empty(rows, 2 * inter, dtype=d_y_rows_RH.dtype, device=d_y_rows_RH.device)
    _check_tma(d_y_rows_RH, w_down_EHI, gate_up_R2I, d_gate_up)
    c = config
    down_dgrad_tma_kernel[persistent_grid(d_gate_up.device, rows // c.block_m * triton.cdiv(inter, c.block_n))](
        _rows_desc(d_y_rows_RH, c.block_m, c.block_k), TensorDescriptor.from_tensor(w_down_EHI, [1, c.block_k, c.block_n]),
        _pairs_desc(gate_up_R2I, c.block_m, c.block_n), _pairs_desc(d_gate_up, c.block_m, c.block_n),
        block_expert, blocks, hidden, inter, **_meta(c, split),
    )
    return d_gate_up


def gate_up_dgrad_tma(
    d_gate_up_R2I: torch.Tensor, w_gate_up_E2IH: torch.Tensor, block_expert: torch.Tensor, blocks: torch.Tensor,
    *, config: TileConfig,
) -> torch.Tensor:
    """d_x_rows [R, H] = d_gate_up[r] @ w_gate_up[e]."""
    check_matrix(d_gate_up_R2I, None, None, "d_gate_up")
    rows, inter2 = d_gate_up_R2I.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] == inter2, "w_gate_up must be [E_l, 2I, H]")
    hidden = w_gate_up_E2IH.shape[2]
    check_weight(w_gate_up_E2IH, d_gate_up_R2I, (w_gate_up_E2IH.shape[0], inter2, hidden), "w_gate_up")
    split, blocks = check_rows(rows, block_expert, blocks, config.block_m)
    d_x_rows = torch.empty(rows, hidden, dtype=d_gate_up_R2I.dtype, device=d_gate_up_R2I.device)
    _check_tma(d_gate_up_R2I, w_gate_up_E2IH, d_x_rows)
    c = config
    gate_up_dgrad_tma_kernel[persistent_grid(d_x_rows.device, rows // c.block_m * triton.cdiv(hidden, c.block_n))](
        _rows_desc(d_gate_up_R2I, c.block_m, c.block_k), TensorDescriptor.from_tensor(w_gate_up_E2IH, [1, c.block_k, c.block_n]),
        _rows_desc(d_x_rows, c.block_m, c.block_n), block_expert, blocks, hidden, inter2 // 2, **_meta(c, split),
    )
    return d_x_rows


def _dw(a_RM: torch.Tensor, b_RN: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int, config: TileConfig):
    """dw [E_l, M, N] = a^T b per expert, in a's dtype."""
    check(num_experts >= 1, f"num_experts must be >= 1, got {num_experts}")
    check_expert_offsets(expert_offsets, a_RM.shape[0], num_experts, config.block_k)
    m_dim, n_dim = a_RM.shape[1], b_RN.shape[1]
    c = config
    out = torch.empty(num_experts, m_dim, n_dim, dtype=a_RM.dtype, device=a_RM.device)
    _check_tma(a_RM, b_RN, out)
    max_tiles = num_experts * triton.cdiv(m_dim, c.block_m) * triton.cdiv(n_dim, c.block_n)
    dw_tma_kernel[persistent_grid(a_RM.device, max_tiles)](
        TensorDescriptor.from_tensor(a_RM, [c.block_k, c.block_m]), TensorDescriptor.from_tensor(b_RN, [c.block_k, c.block_n]),
        TensorDescriptor.from_tensor(out, [1, c.block_m, c.block_n]), expert_offsets, m_dim, n_dim, num_experts,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, FLATTEN=c.flatten,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out


def dw_down_tma(d_y_rows_RH, h_RI, expert_offsets, num_experts, *, config: TileConfig) -> torch.Tensor:
    """d_w_down [E_l, H, I] = d_y_rows^T h per expert (as weight_grad.dw_down)."""
    check_row_operands(d_y_rows_RH, h_RI, ("d_y_rows", "h"))
    return _dw(d_y_rows_RH, h_RI, expert_offsets, num_experts, config)


def dw_gate_up_tma(d_gate_up_R2I, x_rows_RH, expert_offsets, num_experts, *, config: TileConfig) -> torch.Tensor:
    """d_w_gate_up [E_l, 2I, H] = d_gate_up^T x_rows per expert (as weight_grad.dw_gate_up)."""
    check_row_operands(d_gate_up_R2I, x_rows_RH, ("d_gate_up", "x_rows"))
    return _dw(d_gate_up_R2I, x_rows_RH, expert_offsets, num_experts, config)
