"""Combine: out[t] = sum_j w[t, j] * rows[index[t, j]] (+ shared[t]), and the router-weight gradient from
down_dgrad_router's per-row partial sums (row_sums).

Both are memory-bound, one program per [BLOCK_T tokens x BLOCK_H columns] tile; the slot loop runs j = 0..k-1
in order with an fp32 accumulator (the reference's order), and the shared expert's output is added last.
combine's slot loop is unrolled at compile time (k a constexpr), so a program's k row loads are in flight
together: on an H200 1.01-1.04x the rolled loop with weights and 1.06-1.10x without (same bits;
benchmarks/combine_bench.py, docs/perf-notes.md). index[t, j] is the row holding pair (t, j): on one GPU the
receive row (schedule.dest_row, rows = y_rows [R, H]); with expert parallelism t * k + j in the exchanged
pairs buffer [T * k, H]. -1 (a pair cut by a declared capacity) counts as zero. With HAS_WEIGHTS off the same
kernel sums the d_x rows in the backward. The router weights come in fp32 or in the rows' dtype
(megamoe.experts takes either) and are widened to fp32 in registers, so a 16-bit router costs no cast kernel
and fp32 weights keep their bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import check


@triton.jit
def combine_kernel(
    y_ptr, w_ptr, index_ptr, shared_ptr, out_ptr,
    T, H,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    h_ok = (h < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: the k rows' loads issue together, the sum keeps its order
        pair = t * TOP_K + j
        row = tl.load(index_ptr + pair, mask=t_ok, other=-1)
        routed = t_ok & (row >= 0)
        row = tl.where(routed, row, 0).to(tl.int64)
        y = tl.load(y_ptr + row[:, None] * H + h[None, :], mask=routed[:, None] & h_ok, other=0.0)
        if HAS_WEIGHTS:
            weight = tl.load(w_ptr + pair, mask=routed, other=0.0).to(tl.float32)
            acc += weight[:, None] * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
    mask = t_ok[:, None] & h_ok
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t[:, None] * H + h[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * H + h[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_index(index_TK: torch.Tensor, rows_NH: torch.Tensor) -> tuple[int, int, int]:
    check(index_TK.dim() == 2 and index_TK.dtype == torch.int32 and index_TK.is_contiguous(),
          "index must be a contiguous int32 [T, k] tensor")
    check(rows_NH.dim() == 2 and rows_NH.is_contiguous(), f"rows must be a contiguous [N, H] tensor, got {tuple(rows_NH.shape)}")
    return index_TK.shape[0], index_TK.shape[1], rows_NH.shape[1]


def combine(
    rows_NH: torch.Tensor,
    weights_TK: torch.Tensor | None,
    index_TK: torch.Tensor,
    shared_TH: torch.Tensor | None,
    *,
    config: TileConfig,
) -> torch.Tensor:
    """out [T, H] = sum_j weights[t, j] * rows[index[t, j]] (+ shared[t], last); weights None means 1.

    rows [N, H] (y_rows / d_x_rows [R, H] on one GPU, the pairs buffer [T * k, H] with EP); weights
    [T, k] fp32 or the rows' dtype, or None; index [T, k] int32, the row of each pair (-1: none, counts as
    zero; every other value must be < N); shared [T, H] or None. config.block_m tokens x config.block_n
    columns per program.
    """
    num_tokens, top_k, hidden = _check_index(index_TK, rows_NH)
    if weights_TK is not None:
        check(weights_TK.dtype in (torch.float32, rows_NH.dtype) and tuple(weights_TK.shape) == (num_tokens, top_k)
              and weights_TK.is_contiguous(),
              f"weights must be a contiguous float32 (or the rows' {rows_NH.dtype}) [{num_tokens}, {top_k}] tensor, "
              f"got {weights_TK.dtype} {tuple(weights_TK.shape)}")
    if shared_TH is not None:
        check(tuple(shared_TH.shape) == (num_tokens, hidden) and shared_TH.is_contiguous(), "shared must be a contiguous [T, H] tensor")
    out = torch.empty(num_tokens, hidden, dtype=rows_NH.dtype, device=rows_NH.device)
    grid = (triton.cdiv(num_tokens, config.block_m), triton.cdiv(hidden, config.block_n))
    combine_kernel[grid](
        rows_NH, weights_TK if weights_TK is not None else rows_NH, index_TK,
        shared_TH if shared_TH is not None else rows_NH, out,
        num_tokens, hidden,
        TOP_K=top_k, HAS_WEIGHTS=weights_TK is not None, HAS_SHARED=shared_TH is not None,
        BLOCK_T=config.block_m, BLOCK_H=config.block_n, num_warps=config.num_warps,
    )
    return out


@triton.jit
def row_sums_kernel(parts_ptr, index_ptr, out_ptr, num_pairs, P, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_pairs
    row = tl.load(index_ptr + i, mask=ok, other=-1)
    routed = row >= 0
    base = tl.where(routed, row, 0).to(tl.int64) * P
    acc = tl.zeros([BLOCK], tl.float32)
    for p0 in range(0, P, BLOCK_P):  # fixed chunks in order, a fixed tree within each: deterministic
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.sum(tl.load(parts_ptr + base[:, None] + p[None, :], mask=routed[:, None] & (p[None, :] < P),
                              other=0.0), axis=1)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


ROW_SUMS_BLOCK = 256  # pairs per program
ROW_SUMS_BLOCK_P = 16  # partials per step


def row_sums(parts_RP: torch.Tensor, index_TK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, k] in dtype: sum_p parts[index[t, j], p] (fp32, in a fixed order), 0 where index is -1: the router
    weights' gradient from down_dgrad_router's partial sums (parts fp32 [R, P]), in one launch."""
    check(parts_RP.dim() == 2 and parts_RP.dtype == torch.float32 and parts_RP.is_contiguous(),
          f"parts must be a contiguous fp32 [R, P] tensor, got {parts_RP.dtype} {tuple(parts_RP.shape)}")
    check(index_TK.dim() == 2 and index_TK.dtype == torch.int32 and index_TK.is_contiguous(),
          f"index must be a contiguous int32 [T, k] tensor, got {index_TK.dtype} {tuple(index_TK.shape)}")
    out = torch.empty(index_TK.shape, dtype=dtype, device=parts_RP.device)
    if out.numel():
        row_sums_kernel[(triton.cdiv(out.numel(), ROW_SUMS_BLOCK),)](
            parts_RP, index_TK, out, out.numel(), parts_RP.shape[1], BLOCK=ROW_SUMS_BLOCK, BLOCK_P=ROW_SUMS_BLOCK_P)
    return out
