"""The schedule's placement in three kernels and no sort (build_schedule's place_routing, fused).

A counting placement over chunks of CHUNK pairs in flat source order:
  * count_kernel (one program per chunk): the chunk's pairs per expert (a histogram), and how many of its ids
    lie outside [0, E) (counted, then clamped into range, so that a bad id never indexes out of bounds);
  * layout_kernel (one program per BLOCKS_PER_STEP schedule blocks): every expert's count (the chunks' sum),
    its padded segment start per owner rank; program 0 writes the starts, this rank's expert_offsets,
    num_blocks, the counts, the overflow (pairs past the capacity, from the segments alone) and whether every
    id was in range; each program writes its blocks' block_expert and -1 into row_src for their rows no pair
    fills (an expert's padding, the blocks past the end);
  * place_kernel (one program per chunk): a pair's row is its expert's segment start + the expert's pairs in
    earlier chunks + its rank among the chunk's pairs of that expert, the last from a sort of the chunk's
    (expert, index) keys; dest_row for every pair, row_src for this rank's rows, dest_rank for this rank's pairs.
The rank within an expert follows the flat source order, as the stable sort of place_routing_torch does: the
same tensors, bit for bit (integer counts: no order of additions changes them). A bad id fails a device assert
(torch._assert_async, no host sync) at the caller's next synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.schedule import Placement

BLOCKS_PER_STEP = 32  # schedule blocks per layout program
ROWS_PER_STEP = 128  # row_src entries per block and step of the padding fill
LOAD_ELEMENTS = 8192  # elements of one [chunks, experts] load of the chunk counts


def chunk_size(num_pairs: int) -> int:
    """Pairs per chunk: 1024, more for large groups (at most ~128 chunks up to 8192 a chunk), so that the
    place programs' sums over earlier chunks stay small."""
    return min(8192, max(1024, triton.next_power_of_2(triton.cdiv(num_pairs, 128))))


@triton.jit
def count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, num_experts, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """chunk_counts[c, e] (e < E): pairs of chunk c routed to expert e; chunk_counts[c, E]: its ids outside
    [0, E) (counted at the clamped expert too)."""
    c = tl.program_id(0)
    i = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ok = i < num_pairs
    ids = tl.load(ids_ptr + i, mask=ok, other=0)
    bad = ok & ((ids < 0) | (ids >= num_experts))
    expert = tl.minimum(tl.maximum(ids, 0), num_experts - 1).to(tl.int32)
    b = tl.arange(0, BINS)
    counts = tl.histogram(expert, BINS, mask=ok)
    counts = tl.where(b == num_experts, tl.sum(bad.to(tl.int32), axis=0), counts)
    tl.store(chunk_counts_ptr + c * (num_experts + 1) + b, counts, mask=b <= num_experts)


@triton.jit
def layout_kernel(
    chunk_counts_ptr, starts_ptr, counts_ptr, offsets_ptr, block_expert_ptr, num_blocks_ptr, overflow_ptr, ids_ok_ptr,
    row_src_ptr, num_chunks, num_experts, world_size, num_local, rank, block_m, num_rows, num_row_blocks,
    BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr, CHUNKS: tl.constexpr, BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    w = tl.arange(0, BLOCK_W)[:, None]
    l = tl.arange(0, BLOCK_L)[None, :]
    ok = (w < world_size) & (l < num_local)
    e = w * num_local + l
    counts = tl.zeros([BLOCK_W, BLOCK_L], tl.int32)
    for c0 in range(0, num_chunks, CHUNKS):
        c = c0 + tl.arange(0, CHUNKS)[:, None, None]
        counts += tl.sum(tl.load(chunk_counts_ptr + c * (num_experts + 1) + e[None], mask=(c < num_chunks) & ok[None],
                                 other=0), axis=0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=1)  # per owner rank: segment ends in its receive rows
    starts = ends - padded
    # This rank's row: its experts' segment starts and ends (clamped to the capacity), and the total.
    mine = (w == rank) & ok
    mine_start = tl.sum(tl.where(mine, starts, 0), axis=0)  # [BLOCK_L]
    mine_fill = mine_start + tl.sum(tl.where(mine, counts, 0), axis=0)  # end of each expert's pairs
    mine_end = tl.minimum(tl.sum(tl.where(mine, ends, 0), axis=0), num_rows)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < num_local
    in_use = tl.max(tl.where(l_ok, mine_end, 0), axis=0)
    if pid == 0:
        tl.store(starts_ptr + e, starts, mask=ok)
        tl.store(counts_ptr + e, counts, mask=ok)
        tl.store(offsets_ptr + 1 + offs_l, mine_end, mask=l_ok)
        tl.store(offsets_ptr + offs_l, tl.minimum(mine_start, num_rows), mask=offs_l == 0)
        tl.store(num_blocks_ptr, in_use // block_m)
        # Pairs past the capacity: an expert's rows run from its start on, so those at or past num_rows.
        cut = tl.minimum(tl.maximum(starts + counts - num_rows, 0), counts)
        tl.store(overflow_ptr, tl.sum(tl.sum(tl.where(ok, cut, 0), axis=1), axis=0))
        bad = tl.zeros([CHUNKS], tl.int32)
        for c0 in range(0, num_chunks, CHUNKS):
            c = c0 + tl.arange(0, CHUNKS)
            bad += tl.load(chunk_counts_ptr + c * (num_experts + 1) + num_experts, mask=c < num_chunks, other=0)
        tl.store(ids_ok_ptr, (tl.sum(bad, axis=0) == 0).to(tl.int32))
    # block_expert[b] for this program's BLOCKS blocks: the first local expert whose segment ends past block b's
    # first row; -1 past the end. A [BLOCKS, BLOCK_L] comparison that fits the registers.
    b = pid * BLOCKS + tl.arange(0, BLOCKS)
    row = b * block_m
    before = tl.sum((tl.where(l_ok, mine_end, num_rows)[None, :] <= row[:, None]).to(tl.int32), axis=1)
    expert = tl.where(row < in_use, before, -1)
    tl.store(block_expert_ptr + b, expert, mask=b < num_row_blocks)
    # row_src = -1 where no pair lands: a segment's pairs fill a prefix of each of its blocks (segments start at
    # multiples of block_m), the rest is padding; blocks past the end hold none.
    fill = tl.sum(tl.where(offs_l[None, :] == expert[:, None], mine_fill[None, :], 0), axis=1)
    filled = tl.minimum(tl.maximum(fill - row, 0), block_m)  # [BLOCKS]; 0 for blocks past the end
    for j0 in range(0, block_m, ROWS):
        j = j0 + tl.arange(0, ROWS)[None, :]
        tl.store(row_src_ptr + row[:, None] + j, tl.full([BLOCKS, ROWS], -1, tl.int32),
                 mask=(j >= filled[:, None]) & (j < block_m) & (b < num_row_blocks)[:, None])


@triton.jit
def place_kernel(
    ids_ptr, chunk_counts_ptr, starts_ptr, dest_row_ptr, row_src_ptr, dest_rank_ptr,
    num_pairs, num_experts, num_local, rank, num_rows, local_first, local_pairs,
    CHUNK: tl.constexpr, BINS: tl.constexpr, CHUNKS: tl.constexpr,
):
    c = tl.program_id(0)
    idx = tl.arange(0, CHUNK)
    i = c.to(tl.int64) * CHUNK + idx
    ok = i < num_pairs
    ids = tl.load(ids_ptr + i, mask=ok, other=0)
    expert = tl.minimum(tl.maximum(ids, 0), num_experts - 1).to(tl.int32)  # as count_kernel counted it
    mine = ok & (i >= local_first) & (i < local_first + local_pairs)
    tl.store(dest_rank_ptr + (i - local_first), expert // num_local, mask=mine)
    # base[e]: the row of the chunk's first pair of expert e, less its position among the chunk's pairs sorted by
    # (expert, index): the segment start + the expert's pairs in chunks before this one - the chunk's pairs of
    # lower experts.
    e = tl.arange(0, BINS)
    earlier = tl.zeros([BINS], tl.int32)
    for c0 in range(0, c, CHUNKS):
        cc = c0 + tl.arange(0, CHUNKS)[:, None]
        earlier += tl.sum(tl.load(chunk_counts_ptr + cc * (num_experts + 1) + e[None, :],
                                  mask=(cc < c) & (e[None, :] < num_experts), other=0), axis=0)
    here = tl.histogram(expert, BINS, mask=ok)
    lower = tl.cumsum(here, axis=0) - here
    base = tl.load(starts_ptr + e, mask=e < num_experts, other=0) + earlier - lower
    key = tl.sort(tl.where(ok, expert * CHUNK + idx, num_experts * CHUNK + idx))
    key_expert = key // CHUNK
    placed = key_expert < num_experts
    pair = c * CHUNK + key % CHUNK
    row = tl.gather(base, tl.minimum(key_expert, num_experts - 1), 0) + idx
    fits = row < num_rows
    tl.store(dest_row_ptr + pair, tl.where(fits, row, -1), mask=placed)
    tl.store(row_src_ptr + row, pair, mask=placed & fits & (key_expert // num_local == rank))


def place_routing(
    flat_ids: torch.Tensor, *, num_experts: int, world_size: int, rank: int, block_m: int, num_rows: int
) -> Placement:
    """megamoe.schedule.place_routing_torch's result from three kernels (CUDA, or the Triton interpreter), and a
    device assert that every id lies in [0, E)."""
    device, num_pairs = flat_ids.device, flat_ids.numel()
    num_local = num_experts // world_size
    flat_ids = flat_ids.contiguous()
    chunk = chunk_size(num_pairs)
    num_chunks = max(1, triton.cdiv(num_pairs, chunk))
    bins = triton.next_power_of_2(num_experts + 1)
    chunk_counts = torch.empty(num_chunks, num_experts + 1, dtype=torch.int32, device=device)
    count_kernel[(num_chunks,)](flat_ids, chunk_counts, num_pairs, num_experts, CHUNK=chunk, BINS=bins,
                                num_warps=4 if chunk <= 2048 else 8)
    block_w, block_l = triton.next_power_of_2(world_size), triton.next_power_of_2(num_local)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty(num_local + 1, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    overflow = torch.empty((), dtype=torch.int32, device=device)
    ids_ok = torch.empty((), dtype=torch.int32, device=device)
    row_src = torch.empty(num_rows, dtype=torch.int32, device=device)
    layout_kernel[(max(1, triton.cdiv(num_rows // block_m, BLOCKS_PER_STEP)),)](
        chunk_counts, starts, counts, offsets, block_expert, num_blocks, overflow, ids_ok, row_src,
        num_chunks, num_experts, world_size, num_local, rank, block_m, num_rows, num_rows // block_m,
        BLOCK_W=block_w, BLOCK_L=block_l, CHUNKS=max(1, LOAD_ELEMENTS // (block_w * block_l)),
        BLOCKS=BLOCKS_PER_STEP, ROWS=ROWS_PER_STEP,
    )
    local_pairs = num_pairs // world_size
    dest_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    dest_rank = torch.empty(local_pairs, dtype=torch.int32, device=device)
    place_kernel[(num_chunks,)](
        flat_ids, chunk_counts, starts, dest_row, row_src, dest_rank,
        num_pairs, num_experts, num_local, rank, num_rows, rank * local_pairs, local_pairs,
        CHUNK=chunk, BINS=bins, CHUNKS=max(1, LOAD_ELEMENTS // bins), num_warps=4 if chunk <= 2048 else 8,
    )
    # NOTE: no host sync; a bad id fails the device assert at the caller's next synchronisation.
    torch._assert_async(ids_ok, f"megamoe: topk_ids must hold expert ids in [0, {num_experts})")
    return Placement(counts, offsets, row_src, block_expert, num_blocks, dest_row, overflow, dest_rank)
