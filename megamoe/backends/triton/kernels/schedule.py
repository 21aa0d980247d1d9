"""The schedule's placement in two kernels (build_schedule's place_routing, fused).

After a stable sort of the flat expert ids (torch; as 16-bit keys where the expert count allows: two radix
passes instead of eight) and the expert boundaries in the sorted order (searchsorted), `layout` (one
program per BLOCKS_PER_STEP schedule blocks) computes every expert's padded segment start per owner rank,
this rank's expert_offsets and num_blocks (program 0) and its blocks' block_expert, and `place` (one
program per BLOCK pairs) writes each pair's row: dest_row for every pair, row_src for this rank's rows,
and the overflow count.
Same tensors, bit for bit, as megamoe.schedule.place_routing_torch, in a handful of launches instead of
~45 (the launches, not the GPU work, were the schedule's cost: ~0.7 ms of host time per forward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.schedule import Placement

PLACE_BLOCK = 1024
BLOCKS_PER_STEP = 32


@triton.jit
def layout_kernel(
    bounds_ptr, starts_ptr, counts_ptr, offsets_ptr, block_expert_ptr, num_blocks_ptr,
    world_size, num_local, rank, block_m, num_rows, num_row_blocks,
    BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    w = tl.arange(0, BLOCK_W)[:, None]
    l = tl.arange(0, BLOCK_L)[None, :]
    ok = (w < world_size) & (l < num_local)
    e = w * num_local + l
    lo = tl.load(bounds_ptr + e, mask=ok, other=0)
    hi = tl.load(bounds_ptr + e + 1, mask=ok, other=0)
    counts = hi - lo
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=1)  # per owner rank: segment ends in its receive rows
    starts = ends - padded
    # This rank's row: its experts' segment starts (and the total), clamped to the capacity.
    mine = (w == rank) & ok
    mine_end = tl.minimum(tl.sum(tl.where(mine, ends, 0), axis=0), num_rows)  # [BLOCK_L]
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < num_local
    in_use = tl.max(tl.where(l_ok, mine_end, 0), axis=0)
    if pid == 0:
        tl.store(starts_ptr + e, starts, mask=ok)
        tl.store(counts_ptr + e, counts.to(tl.int32), mask=ok)
        tl.store(offsets_ptr + 1 + offs_l, mine_end.to(tl.int32), mask=l_ok)
        tl.store(offsets_ptr + offs_l, tl.minimum(tl.sum(tl.where(mine, starts, 0), axis=0), num_rows).to(tl.int32),
                 mask=offs_l == 0)
        tl.store(num_blocks_ptr, (in_use // block_m).to(tl.int32))
    # block_expert[b] for this program's BLOCKS blocks: the first local expert whose segment ends past block b's
    # first row; -1 past the end. int32 (rows < num_rows, an int32) and a [BLOCKS, BLOCK_L] comparison that fits
    # the registers (one program over every block, 256 a step in int64, spilled: 74 us at qwen3-30b-a3b).
    mine_end32 = tl.where(l_ok, mine_end, num_rows).to(tl.int32)
    b = pid * BLOCKS + tl.arange(0, BLOCKS)
    row = b * block_m
    before = tl.sum((mine_end32[None, :] <= row[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.where(row < in_use.to(tl.int32), before, -1), mask=b < num_row_blocks)


@triton.jit
def place_kernel(
    sorted_ptr, perm_ptr, bounds_ptr, starts_ptr, dest_row_ptr, row_src_ptr, overflow_ptr,
    num_pairs, num_local, rank, num_rows,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_pairs
    expert = tl.load(sorted_ptr + i, mask=ok, other=0)
    pair = tl.load(perm_ptr + i, mask=ok, other=0)
    row = tl.load(starts_ptr + expert, mask=ok, other=0) + i - tl.load(bounds_ptr + expert, mask=ok, other=0)
    fits = row < num_rows
    tl.store(dest_row_ptr + pair, tl.where(fits, row, -1).to(tl.int32), mask=ok)
    tl.store(row_src_ptr + row, pair.to(tl.int32), mask=ok & fits & (expert // num_local == rank))
    # Integer counts: the sum is the same whatever order the programs add in.
    tl.atomic_add(overflow_ptr, tl.sum((ok & ~fits).to(tl.int32), axis=0))


def place_routing(
    flat_ids: torch.Tensor, *, num_experts: int, world_size: int, rank: int, block_m: int, num_rows: int
) -> Placement:
    """megamoe.schedule.place_routing_torch's result from two kernels (CUDA, or the Triton interpreter)."""
    device, num_pairs = flat_ids.device, flat_ids.numel()
    num_local = num_experts // world_size
    # Expert ids < 2^15 - 1 sort as int16 keys: the radix sort's passes follow the key's width, the order is the same.
    key_dtype = torch.int16 if num_experts < torch.iinfo(torch.int16).max else flat_ids.dtype
    sorted_ids, perm = torch.sort(flat_ids.to(key_dtype), stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=device, dtype=key_dtype))
    starts = torch.empty(num_experts, dtype=torch.int64, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty(num_local + 1, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    layout_kernel[(max(1, triton.cdiv(num_rows // block_m, BLOCKS_PER_STEP)),)](
        bounds, starts, counts, offsets, block_expert, num_blocks,
        world_size, num_local, rank, block_m, num_rows, num_rows // block_m,
        BLOCK_W=triton.next_power_of_2(world_size), BLOCK_L=triton.next_power_of_2(num_local), BLOCKS=BLOCKS_PER_STEP,
    )
    dest_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    row_src = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    overflow = torch.zeros((), dtype=torch.int32, device=device)
    place_kernel[(triton.cdiv(num_pairs, PLACE_BLOCK),)](
        sorted_ids, perm, bounds, starts, dest_row, row_src, overflow,
        num_pairs, num_local, rank, num_rows, BLOCK=PLACE_BLOCK,
    )
    return Placement(counts, offsets, row_src, block_expert, num_blocks, dest_row, overflow)
