"""Row copies between this GPU and its peers' symmetric buffers: the dispatch and combine data movement.

One kernel serves all four directions (pull/push x dispatch/combine): row i moves
    src[src_peer[i]] + src_row[i] * row_elems  ->  dst[dst_peer[i]] + dst_row[i] * row_elems
where src and dst are either a local tensor (the peer index then only marks rows) or a table of the
base addresses of every rank's copy of a symmetric buffer (int64 [W], mapped into this process).
src_peer[i] < 0 writes a zero row (padding), dst_peer[i] < 0 skips row i. Each destination row is
written by one program, so the result does not depend on timing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_RAW_TYPES = {2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _row_bases(ptr, peer, IS_TABLE: tl.constexpr, RAW: tl.constexpr):
    """Per-row base pointers [ROWS]: the peer's buffer from the table, or the local tensor."""
    if IS_TABLE:
        return tl.load(ptr + tl.maximum(peer, 0)).to(tl.pointer_type(RAW))
    return ptr.to(tl.pointer_type(RAW), bitcast=True) + tl.zeros_like(peer).to(tl.int64)


@triton.jit
def _copy_rows_kernel(
    src_ptr, src_peer_ptr, src_row_ptr,
    dst_ptr, dst_peer_ptr, dst_row_ptr,
    num_rows, row_elems,
    SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, RAW: tl.constexpr,
    ALIGNED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    # ROWS rows per step keep several independent NVLink transactions in flight per program.
    offs = tl.arange(0, BLOCK)
    for first in range(tl.program_id(0) * ROWS, num_rows, tl.num_programs(0) * ROWS):
        i = first + tl.arange(0, ROWS)
        in_range = i < num_rows
        dst_peer = tl.load(dst_peer_ptr + i, mask=in_range, other=-1)
        live = dst_peer >= 0
        src_peer = tl.load(src_peer_ptr + i, mask=live, other=-1)
        dst = _row_bases(dst_ptr, dst_peer, DST_TABLE, RAW) + tl.load(dst_row_ptr + i, mask=live, other=0).to(tl.int64) * row_elems
        src = _row_bases(src_ptr, src_peer, SRC_TABLE, RAW) + tl.load(src_row_ptr + i, mask=live, other=0).to(tl.int64) * row_elems
        if ALIGNED:
            # Every row starts 16-byte aligned (the launcher checked the bases and the row size). A base
            # loaded from a table carries no alignment Triton can see: without the hint each element is
            # its own 2-byte load, with it 16-byte vectors (8x fewer NVLink transactions).
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        for start in range(0, row_elems, BLOCK):
            cols = start + offs
            mask = live[:, None] & (cols < row_elems)[None, :]
            value = tl.load(src[:, None] + cols[None, :], mask=mask & (src_peer >= 0)[:, None], other=0)
            tl.store(dst[:, None] + cols[None, :], value, mask=mask)


class CopyShape(NamedTuple):
    """Launch shape of a row copy: programs per SM, bytes each program moves per step (at most 8 rows
    of up to 4 KB), warps per program."""

    programs_per_sm: int = 4
    step_bytes: int = 16384
    num_warps: int = 4


# The default: 4 programs per SM (an exchange has the GPU to itself), 16 KB per program in flight.
# benchmarks/comm_bench.py --sweep on 2x H200: within 1-2% of the best of 24 shapes in every direction
# (306-339 GB/s at qwen3-30b-a3b); 1 program per SM with 8 KB steps loses up to 30% (docs/perf-notes.md).
COPY_SHAPE = CopyShape()
_MAX_ROWS = 8


def _aligned(t: torch.Tensor, is_table: bool) -> bool:
    """16-byte aligned base(s). A table's entries are symmetric-memory allocations (aligned by the
    allocator); reading them here would be a device-to-host copy, so they are taken as aligned."""
    return is_table or t.data_ptr() % 16 == 0


def copy_rows(
    src: torch.Tensor,
    src_peer: torch.Tensor,
    src_row: torch.Tensor,
    dst: torch.Tensor,
    dst_peer: torch.Tensor,
    dst_row: torch.Tensor,
    *,
    row_elems: int,
    element_size: int,
    src_is_table: bool,
    dst_is_table: bool,
    shape: CopyShape = COPY_SHAPE,
) -> None:
    """Launch the row copy of all N rows. peers/rows: contiguous int32 [N]; rows of row_elems elements of
    element_size bytes, copied as raw bits (any dtype of that size). A table is int64 [W] base
    addresses; a local tensor is contiguous, of element_size-byte elements. The grid is
    shape.programs_per_sm programs per SM (4 SMs without a GPU), fewer when the rows need fewer steps.
    """
    num_rows = src_peer.numel()
    if not (src_row.numel() == dst_peer.numel() == dst_row.numel() == num_rows):
        raise ValueError("copy_rows: src_peer, src_row, dst_peer and dst_row must have the same length")
    if element_size not in _RAW_TYPES:
        raise ValueError(f"copy_rows: element_size must be one of {sorted(_RAW_TYPES)}, got {element_size}")
    for name, t in (("src_peer", src_peer), ("src_row", src_row), ("dst_peer", dst_peer), ("dst_row", dst_row)):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"copy_rows: {name} must be a contiguous int32 [N] tensor, got {t.dtype} {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    for name, t, is_table in (("src", src, src_is_table), ("dst", dst, dst_is_table)):
        if is_table and (t.dtype != torch.int64 or t.dim() != 1):
            raise ValueError(f"copy_rows: {name} (a table) must be an int64 [W] tensor of base addresses, got "
                             f"{t.dtype} {tuple(t.shape)}")
        if not is_table and (t.element_size() != element_size or not t.is_contiguous()):
            raise ValueError(f"copy_rows: {name} (a local tensor) must be contiguous, of {element_size}-byte elements "
                             f"(element_size), got {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")
    if num_rows == 0:
        return
    block = min(triton.next_power_of_2(row_elems), 4096 // element_size)
    rows_per_step = max(1, min(_MAX_ROWS, shape.step_bytes // (block * element_size)))
    sms = torch.cuda.get_device_properties(src_peer.device).multi_processor_count if src_peer.is_cuda else 4
    num_programs = max(1, min(triton.cdiv(num_rows, rows_per_step), shape.programs_per_sm * sms))
    _copy_rows_kernel[(num_programs,)](
        src, src_peer, src_row, dst, dst_peer, dst_row,
        num_rows, row_elems,
        SRC_TABLE=src_is_table, DST_TABLE=dst_is_table, RAW=_RAW_TYPES[element_size],
        ALIGNED=_aligned(src, src_is_table) and _aligned(dst, dst_is_table) and row_elems * element_size % 16 == 0,
        ROWS=rows_per_step, BLOCK=block, num_warps=shape.num_warps,
    )
