"""Row copies between this GPU and its peers' symmetric buffers: the dispatch and combine data movement.

One kernel serves all four directions (pull/push x dispatch/combine): row i moves
    src[src_peer[i]] + src_row[i] * row_elems  ->  dst[dst_peer[i]] + dst_row[i] * row_elems
where src and dst are either a local tensor (the peer index then only marks rows) or a table of the
base addresses of every rank's copy of a symmetric buffer (int64 [W], mapped into this process).
src_peer[i] < 0 writes a zero row (padding), dst_peer[i] < 0 skips row i. Each destination row is
written by one program, so the result does not depend on timing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_RAW_TYPES = {2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _base(ptr, peer, IS_TABLE: tl.constexpr, RAW: tl.constexpr):
    if IS_TABLE:
        return tl.load(ptr + tl.maximum(peer, 0)).to(tl.pointer_type(RAW))
    return ptr.to(tl.pointer_type(RAW), bitcast=True)


@triton.jit
def _copy_rows_kernel(
    src_ptr, src_peer_ptr, src_row_ptr,
    dst_ptr, dst_peer_ptr, dst_row_ptr,
    num_rows, row_elems,
    SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, RAW: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    for i in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        dst_peer = tl.load(dst_peer_ptr + i)
        if dst_peer >= 0:
            dst = _base(dst_ptr, dst_peer, DST_TABLE, RAW) + tl.load(dst_row_ptr + i).to(tl.int64) * row_elems
            src_peer = tl.load(src_peer_ptr + i)
            src = _base(src_ptr, src_peer, SRC_TABLE, RAW) + tl.load(src_row_ptr + i).to(tl.int64) * row_elems
            for start in range(0, row_elems, BLOCK):
                mask = start + offs < row_elems
                value = tl.load(src + start + offs, mask=mask & (src_peer >= 0), other=0)
                tl.store(dst + start + offs, value, mask=mask)


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
    num_programs: int | None = None,
) -> None:
    """Launch the row copy. peers/rows: int32 [N]; rows of row_elems elements of element_size bytes,
    copied as raw bits (any dtype of that size). A table is int64 [W] base addresses."""
    num_rows = src_peer.numel()
    if not (src_row.numel() == dst_peer.numel() == dst_row.numel() == num_rows):
        raise ValueError("copy_rows: src_peer, src_row, dst_peer and dst_row must have the same length")
    if element_size not in _RAW_TYPES:
        raise ValueError(f"copy_rows: element_size must be one of {sorted(_RAW_TYPES)}, got {element_size}")
    if num_rows == 0:
        return
    block = min(triton.next_power_of_2(row_elems), 8192 // element_size)
    if num_programs is None:
        sms = torch.cuda.get_device_properties(src_peer.device).multi_processor_count if src_peer.is_cuda else 4
        num_programs = min(num_rows, 4 * sms)
    _copy_rows_kernel[(num_programs,)](
        src, src_peer, src_row, dst, dst_peer, dst_row, num_rows, row_elems,
        SRC_TABLE=src_is_table, DST_TABLE=dst_is_table, RAW=_RAW_TYPES[element_size], BLOCK=block, num_warps=4,
    )
