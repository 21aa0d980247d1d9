"""The row passes that materialise the GEMMs' token-sourced operands once, expert-contiguous, so that every
GEMM reads its rows contiguously (TMA-friendly, software pipelined) instead of gathering them by pointer
inside its K loop.

spread_rows (one GPU): x_rows = x[row_src // k] (forward, where gate_up_fwd does not gather x in its own
loads; backward, for dw_gate_up) and d_out_rows = d_out[row_src // k] (backward), computed token-major:
    out[dest_row[t, j]] = src[t]    for every pair (t, j) with a row
    out[r] = 0                      for the rows r in use with row_src[r] < 0 (padding)
Each token row is read once and written to its k rows; a row-major gather (row r reads src[row_src[r] // k])
reads every token row k times, from HBM once the tokens outgrow L2: 1.16-1.49x slower on the benchmark
workloads (h200-spread-ab-v1.json; the A/B script is in the commit that added spread_rows).

It writes the rows in use only (a device range, no host sync); rows past it are left unwritten. Every row
is written by one program: no order between programs matters, and the results are bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.kernels._common import check, load_range, num_sms, range_of

# Rows (tokens) per program step, columns per inner step and programs per SM (4 warps a program): a copy needs
# several CTAs per SM in flight to reach HBM bandwidth. spread_rows writes k rows for each row it reads, and at
# 4 x 512 with 16 programs per SM it runs 1.0-1.8% faster than at 8 x 256 with 8 on the four workloads timed, at
# the rate of a plain fill of the same rows (benchmarks/combine_bench.py, h200-spread-tile-v1.json; the copies'
# bits do not depend on the tile).
_SPREAD_TILE = (4, 512, 16)


@triton.jit
def spread_rows_kernel(
    src_ptr, dest_row_ptr, row_src_ptr, rows_in_use_ptr, out_ptr,
    T, H, top_k,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[dest_row[t, j]] = src[t] for every pair (t, j) with a row (dest_row >= 0), then out[r] = 0 for the
    rows r in use with row_src[r] < 0."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    for t0 in range(tl.program_id(0) * BLOCK_T, T, tl.num_programs(0) * BLOCK_T):
        tokens = t0 + offs_t
        t_ok = tokens < T
        src_rows = tokens.to(tl.int64)[:, None] * H
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            col_ok = (cols < H)[None, :]
            v = tl.load(src_ptr + src_rows + cols[None, :], mask=t_ok[:, None] & col_ok)
            for j in range(top_k):
                row = tl.load(dest_row_ptr + tokens * top_k + j, mask=t_ok, other=-1)
                tl.store(out_ptr + row.to(tl.int64)[:, None] * H + cols[None, :], v, mask=(row >= 0)[:, None] & col_ok)
    first, end = load_range(rows_in_use_ptr, 1)
    for r0 in range(first + tl.program_id(0) * BLOCK_T, end, tl.num_programs(0) * BLOCK_T):
        rows = r0 + offs_t
        pad = (rows < end) & (tl.load(row_src_ptr + rows, mask=rows < end, other=0) < 0)
        zeros = tl.zeros([BLOCK_T, BLOCK_H], dtype=out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], zeros,
                     mask=pad[:, None] & (cols < H)[None, :])


def spread_rows(src_TH: torch.Tensor, dest_row_TK: torch.Tensor, row_src_R: torch.Tensor,
                rows_in_use: torch.Tensor, *, padding_only: bool = False) -> torch.Tensor:
    """out [R, H]: src's token rows spread to their receive rows (module docstring), for a schedule's inverse
    maps: dest_row [T, k] the row of pair (t, j), -1 where it has none; row_src [R] the pair t * k + j of row
    r, -1 for padding. rows_in_use: on the device, int32 [2] (first, end) or int32 [1] (end, first = 0;
    schedule.expert_offsets[-1:]); rows past it are left unwritten. padding_only: only the padding rows are
    written (zeros), the token rows left to a spread beside a GEMM (gate_up_dgrad's spread_x)."""
    check(src_TH.dim() == 2 and src_TH.is_contiguous(), "src must be a contiguous [T, H] tensor")
    tokens, hidden = src_TH.shape
    check(dest_row_TK.dtype == torch.int32 and dest_row_TK.dim() == 2 and dest_row_TK.shape[0] == tokens
          and dest_row_TK.is_contiguous(), f"dest_row must be a contiguous int32 [{tokens}, k] tensor, got "
          f"{dest_row_TK.dtype} {tuple(dest_row_TK.shape)}")
    check(row_src_R.dtype == torch.int32 and row_src_R.dim() == 1 and row_src_R.is_contiguous(),
          f"row_src must be a contiguous int32 [R] tensor, got {row_src_R.dtype} {tuple(row_src_R.shape)}")
    row_range = range_of(rows_in_use, "rows_in_use")
    out = torch.empty(row_src_R.numel(), hidden, dtype=src_TH.dtype, device=src_TH.device)
    block_t, block_h, per_sm = _SPREAD_TILE
    grid = (max(1, min(per_sm * num_sms(src_TH.device), triton.cdiv(max(tokens, row_src_R.numel()), block_t))),)
    spread_rows_kernel[grid](
        src_TH, dest_row_TK, row_src_R, row_range, out, 0 if padding_only else tokens, hidden, dest_row_TK.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
    )
    return out
