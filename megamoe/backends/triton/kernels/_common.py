"""Helpers shared by the kernel files: tile ordering (jit) and launch-time checks (host)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Programs of a persistent kernel when there are no SMs to count (CPU, interpreter): small, so the
# interpreter still exercises the "one program, many tiles" loop.
_CPU_PROGRAMS = 3


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Programs of a persistent grid: one per SM (host-side query, cached; never synchronises)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return _CPU_PROGRAMS


def persistent_grid(device: torch.device, max_tiles: int) -> tuple[int]:
    """Worst-case grid: min(SMs, tiles of the worst case); programs skip tiles past the real count.
    (The fused expert-parallel kernels size their own grid, kernels/ep_fused.py.)"""
    return (max(1, min(num_sms(device), max_tiles)),)


def range_of(bounds: torch.Tensor, name: str) -> torch.Tensor:
    """A device range as int32 [2] (first, end): bounds itself, or [0, bounds[0]] for an int32 [1]
    count (the one-GPU callers' num_blocks / rows in use). Device ops only: no host sync."""
    check(bounds.dtype == torch.int32 and bounds.dim() == 1 and bounds.numel() in (1, 2) and bounds.is_contiguous(),
          f"{name} must be a contiguous int32 [2] (first, end) or [1] (end) tensor, got {bounds.dtype} {tuple(bounds.shape)}")
    if bounds.numel() == 2:
        return bounds
    return torch.cat([bounds.new_zeros(1), bounds])


@triton.jit
def load_range(range_ptr, SCALE: tl.constexpr):
    """(first, end) of a device range [2], each times SCALE. The .to is a no-op on the int32 ranges the
    launchers pass (range_of); it keeps the kernels compilable for any integer pointer type."""
    first = tl.load(range_ptr).to(tl.int32) * SCALE
    end = tl.load(range_ptr + 1).to(tl.int32) * SCALE
    return first, end


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a linear tile index, GROUP_M row blocks swept together.

    Inside a group, consecutive tiles walk down the row blocks for one column block, so the
    programs running at once share that weight tile in L2 (row blocks of one expert are adjacent).
    """
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    in_group = tile % per_group
    return first_m + in_group % size_m, in_group // size_m
