"""Combine: out[t] = sum_j w[t, j] * y_pairs[t * k + j] (+ shared[t]) and its router-weight gradient.

Both are memory-bound, one program per [BLOCK_T tokens x BLOCK_H columns] tile; the slot loop runs
j = 0..k-1 in order with an fp32 accumulator (the reference's order), and the shared expert's output is
added last. A pair whose dest_row is -1 (cut by a declared capacity) has no row in y_pairs and counts
as zero. With HAS_WEIGHTS off the same kernel sums d_x pairs in the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import check


@triton.jit
def combine_kernel(
    y_ptr, w_ptr, dest_row_ptr, shared_ptr, out_ptr,
    T, H, top_k,
    HAS_WEIGHTS: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    h_ok = (h < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(0, top_k):
        pair = t * top_k + j
        routed = t_ok & (tl.load(dest_row_ptr + pair, mask=t_ok, other=-1) >= 0)
        y = tl.load(y_ptr + pair[:, None] * H + h[None, :], mask=routed[:, None] & h_ok, other=0.0)
        if HAS_WEIGHTS:
            weight = tl.load(w_ptr + pair, mask=routed, other=0.0)
            acc += weight[:, None] * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
    mask = t_ok[:, None] & h_ok
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t[:, None] * H + h[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * H + h[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine_bwd_kernel(
    d_out_ptr, y_ptr, dest_row_ptr, d_w_ptr,
    T, H, top_k,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """d_w[t, j] = <d_out[t], y_pairs[t * k + j]> in fp32, columns in a fixed order; 0 for unrouted pairs."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    offs_h = tl.arange(0, BLOCK_H)
    for j in range(0, top_k):
        pair = t * top_k + j
        routed = t_ok & (tl.load(dest_row_ptr + pair, mask=t_ok, other=-1) >= 0)
        acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + offs_h
            h_ok = (h < H)[None, :]
            d = tl.load(d_out_ptr + t[:, None] * H + h[None, :], mask=routed[:, None] & h_ok, other=0.0)
            y = tl.load(y_ptr + pair[:, None] * H + h[None, :], mask=routed[:, None] & h_ok, other=0.0)
            acc += tl.sum(d.to(tl.float32) * y.to(tl.float32), axis=1)
        tl.store(d_w_ptr + pair, acc, mask=t_ok)


def combine(
    y_pairs_PH: torch.Tensor,
    weights_TK: torch.Tensor | None,
    dest_row_TK: torch.Tensor,
    shared_TH: torch.Tensor | None,
    *,
    config: TileConfig,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out [T, H] = sum_j weights[t, j] * y_pairs[t * k + j] (+ shared[t], last); weights None means 1.

    y_pairs [T * k, H]; weights [T, k] fp32 or None; dest_row [T, k] int32 (-1: pair has no row);
    shared [T, H] or None. config.block_m tokens x config.block_n columns per program.
    """
    check(dest_row_TK.dim() == 2 and dest_row_TK.dtype == torch.int32 and dest_row_TK.is_contiguous(),
          "dest_row must be a contiguous int32 [T, k] tensor")
    num_tokens, top_k = dest_row_TK.shape
    check(y_pairs_PH.dim() == 2 and y_pairs_PH.shape[0] == num_tokens * top_k and y_pairs_PH.is_contiguous(),
          f"y_pairs must be a contiguous [{num_tokens * top_k}, H] tensor, got {tuple(y_pairs_PH.shape)}")
    hidden = y_pairs_PH.shape[1]
    if weights_TK is not None:
        check(weights_TK.dtype == torch.float32 and tuple(weights_TK.shape) == (num_tokens, top_k) and weights_TK.is_contiguous(),
              "weights must be a contiguous float32 [T, k] tensor")
    if shared_TH is not None:
        check(tuple(shared_TH.shape) == (num_tokens, hidden) and shared_TH.is_contiguous(), "shared must be a contiguous [T, H] tensor")
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or y_pairs_PH.dtype, device=y_pairs_PH.device)
    grid = (triton.cdiv(num_tokens, config.block_m), triton.cdiv(hidden, config.block_n))
    combine_kernel[grid](
        y_pairs_PH, weights_TK if weights_TK is not None else y_pairs_PH, dest_row_TK,
        shared_TH if shared_TH is not None else y_pairs_PH, out,
        num_tokens, hidden, top_k,
        HAS_WEIGHTS=weights_TK is not None, HAS_SHARED=shared_TH is not None,
        BLOCK_T=config.block_m, BLOCK_H=config.block_n, num_warps=config.num_warps,
    )
    return out


def combine_bwd(d_out_TH: torch.Tensor, y_pairs_PH: torch.Tensor, dest_row_TK: torch.Tensor, *, config: TileConfig) -> torch.Tensor:
    """d_topk_weights [T, k] fp32: <d_out[t], y_pairs[t * k + j]>; 0 where dest_row is -1."""
    check(dest_row_TK.dim() == 2 and dest_row_TK.dtype == torch.int32 and dest_row_TK.is_contiguous(),
          "dest_row must be a contiguous int32 [T, k] tensor")
    num_tokens, top_k = dest_row_TK.shape
    check(d_out_TH.dim() == 2 and d_out_TH.shape[0] == num_tokens and d_out_TH.is_contiguous(), "d_out must be a contiguous [T, H] tensor")
    hidden = d_out_TH.shape[1]
    check(tuple(y_pairs_PH.shape) == (num_tokens * top_k, hidden) and y_pairs_PH.is_contiguous(),
          f"y_pairs must be a contiguous [{num_tokens * top_k}, {hidden}] tensor")
    d_w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=d_out_TH.device)
    combine_bwd_kernel[(triton.cdiv(num_tokens, config.block_m),)](
        d_out_TH, y_pairs_PH, dest_row_TK, d_w,
        num_tokens, hidden, top_k,
        BLOCK_T=config.block_m, BLOCK_H=config.block_n, num_warps=config.num_warps,
    )
    return d_w
