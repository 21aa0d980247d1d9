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


@triton.jit
def expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block, expert) of a linear tile index over the row blocks [first_m, first_m + num_m) of
    a row-block GEMM: groups of up to GROUP_M row blocks of one expert, swept column block by column block.

    A group never spans two experts, so the tiles running at once read one expert's weight columns, each once
    per group (an expert of 1-8 row blocks is one group: its weights are read once). Row block m belongs to
    expert block_expert[m // SPLIT], whose rows are [expert_offsets[e], expert_offsets[e + 1]) (multiples of
    BLOCK_M * SPLIT). The group of tile t is the one holding row block first_m + t // num_n: the groups
    partition the range in order, each owning num_n tiles per row block."""
    m = first_m + tile // num_n
    expert = tl.load(block_expert_ptr + m // SPLIT)
    lo = tl.maximum(tl.load(expert_offsets_ptr + expert) // BLOCK_M, first_m)
    hi = tl.minimum(tl.load(expert_offsets_ptr + expert + 1) // BLOCK_M, first_m + num_m)
    start = lo + (m - lo) // GROUP_M * GROUP_M
    size = tl.minimum(hi - start, GROUP_M)
    in_group = tile - (start - first_m) * num_n
    return start + in_group % size, in_group // size, expert


# ----------------------------------------------------------------------------------------------------
# The SwiGLU epilogues, shared by both GEMM cores (grouped_gemm.py, tma_gemm.py).


@triton.jit
def mma(a, b, acc):
    """acc + a @ b, accumulated in fp32. fp32 operands multiply in full fp32 ("ieee"), as torch's float32 matmul
    does by default; Triton's default would round them to TF32 (a 10-bit mantissa) on NVIDIA GPUs, far outside the
    fp32 error budget. 16-bit operands take the default (the dtype decides at compile time: one branch is built)."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def swiglu(g, u):
    """h = silu(g) * u in fp32, from g and u in the activations' dtype: the forward's h (gate_up_fwd) and the
    backward's recompute of it from the saved gate_up (router_epilogue) run this one function on the same
    values, so they agree bit for bit."""
    g = g.to(tl.float32)
    return g * tl.sigmoid(g) * u.to(tl.float32)


@triton.jit
def swiglu_bwd(d_h, g, u):
    """(d_g, d_u) in fp32 of h = silu(g) * u, for the upstream gradient d_h (fp32) and g, u as saved."""
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    sig = tl.sigmoid(g)
    return d_h * u * sig * (1.0 + g * (1.0 - sig)), d_h * g * sig


@triton.jit
def pair_weights(row_src_ptr, weights_ptr, rows):
    """fp32 router weight of each receive row: its pair's weight, weights.flat[row_src[r]]; 0 on padding."""
    pair = tl.load(row_src_ptr + rows)
    return tl.load(weights_ptr + pair, mask=pair >= 0, other=0.0).to(tl.float32)


@triton.jit
def column_halves(acc):
    """acc [M, N] -> (acc[:, :N/2], acc[:, N/2:]): an epilogue run on each half holds half the values in registers."""
    m: tl.constexpr = acc.shape[0]
    n: tl.constexpr = acc.shape[1]
    return acc.reshape(m, 2, n // 2).permute(0, 2, 1).split()


@triton.jit
def router_epilogue(acc, g, u, weight):
    """The router weight's part of the down GEMM's backward, for a tile of unweighted d_out rows:
    acc [M, N] = d_out[t] @ w_down[e] over the tile's columns, weight [M] the rows' router weights (0 on
    padding rows). Returns (d_h = weight * acc, h_w = weight * h, d_w_part [M] = sum over the columns of
    acc * h), with h = swiglu(g, u) rounded to the dtype: the forward's h, recomputed.

    The router weight's gradient <d_out[t], y_rows[r]> equals <d_out[t] @ w_down[e], h[r]>: the sum of
    d_w_part over the column blocks, which needs neither y_rows nor h kept from the forward. h_w feeds
    d_w_down = d_out_rows^T h_w."""
    h = swiglu(g, u).to(g.dtype).to(tl.float32)
    return acc * weight[:, None], h * weight[:, None], tl.sum(acc * h, axis=1)


# ----------------------------------------------------------------------------------------------------
# Launch-time checks of the GEMM operands (grouped_gemm.py, weight_grad.py, tma_gemm.py).


def check_rows(rows: int, block_expert: torch.Tensor, blocks: torch.Tensor, block_m: int) -> tuple[int, torch.Tensor]:
    """(SPLIT, the block range as int32 [2]). SPLIT: kernel row blocks per schedule block (the schedule's
    block_m is R // len(block_expert))."""
    check(block_expert.dtype == torch.int32 and block_expert.dim() == 1 and block_expert.is_contiguous(),
          f"block_expert must be a contiguous int32 [R // block_m] tensor, got {block_expert.dtype} "
          f"{tuple(block_expert.shape)}{'' if block_expert.is_contiguous() else ' (not contiguous)'}")
    check(block_expert.numel() > 0 and rows % block_expert.numel() == 0, f"R={rows} is not a multiple of len(block_expert)={block_expert.numel()}")
    sched_block = rows // block_expert.numel()
    check(sched_block % block_m == 0, f"kernel row tile {block_m} must divide the schedule's block_m {sched_block}")
    return sched_block // block_m, range_of(blocks, "blocks")


def expert_segments(expert_offsets: torch.Tensor | None, block_expert: torch.Tensor, num_experts: int,
                    rows: int) -> torch.Tensor:
    """The int32 [E_l + 1] expert_offsets a row-block GEMM's tile order reads (expert_tile_coords): the schedule's
    (checked), or with None derived from block_expert (sorted, -1 past the blocks in use) by device ops, no host
    sync (the same tensor: expert e's rows start at [e], in multiples of the schedule's block_m)."""
    if expert_offsets is None:
        key = torch.where(block_expert < 0, num_experts, block_expert)
        experts = torch.arange(num_experts + 1, dtype=torch.int32, device=block_expert.device)
        return torch.searchsorted(key, experts, out_int32=True) * (rows // block_expert.numel())
    check_offsets_tensor(expert_offsets, num_experts)
    check(expert_offsets.device == block_expert.device,
          f"expert_offsets must be on block_expert's device ({block_expert.device}), got {expert_offsets.device}")
    return expert_offsets


def check_row_src(row_src: torch.Tensor, rows: int) -> None:
    """The schedule's row_src as the kernels read it: a contiguous int32 [rows] tensor."""
    check(isinstance(row_src, torch.Tensor) and row_src.dtype == torch.int32 and tuple(row_src.shape) == (rows,)
          and row_src.is_contiguous(),
          f"row_src must be a contiguous int32 [{rows}] tensor, got "
          f"{getattr(row_src, 'dtype', type(row_src))} {tuple(getattr(row_src, 'shape', ()))}"
          f"{' (not contiguous)' if isinstance(row_src, torch.Tensor) and not row_src.is_contiguous() else ''}")


def check_weight(w: torch.Tensor, x: torch.Tensor, shape: tuple, name: str) -> None:
    check(w.is_contiguous(), f"{name} must be contiguous")
    check(tuple(w.shape) == shape, f"{name} must have shape {shape}, got {tuple(w.shape)}")
    check(w.dtype == x.dtype, f"{name} dtype {w.dtype} must match the activations' {x.dtype}")


def check_matrix(t: torch.Tensor, rows: int | None, cols: int | None, name: str) -> None:
    want = f"[{'R' if rows is None else rows}, {'*' if cols is None else cols}]"
    check(t.dim() == 2 and t.is_contiguous(), f"{name} must be a contiguous {want} tensor, got {tuple(t.shape)}")
    check(rows is None or t.shape[0] == rows, f"{name} must be a contiguous {want} tensor, got {tuple(t.shape)}")
    check(cols is None or t.shape[1] == cols, f"{name} must be a contiguous {want} tensor, got {tuple(t.shape)}")


def check_row_operands(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> None:
    for t, name in zip((a, b), names):
        check(t.dim() == 2 and t.is_contiguous(), f"{name} must be a contiguous [R, *] tensor, got {tuple(t.shape)}")
    check(a.shape[0] == b.shape[0], f"{names[0]} has {a.shape[0]} rows, {names[1]} has {b.shape[0]}")
    check(a.dtype == b.dtype, f"{names[0]} ({a.dtype}) and {names[1]} ({b.dtype}) must have one dtype")


def check_offsets_tensor(expert_offsets, num_experts: int) -> None:
    """The schedule's expert_offsets as the kernels read them: a contiguous int32 [E_l + 1] tensor."""
    check(isinstance(expert_offsets, torch.Tensor) and expert_offsets.dtype == torch.int32
          and tuple(expert_offsets.shape) == (num_experts + 1,) and expert_offsets.is_contiguous(),
          f"expert_offsets must be a contiguous int32 [{num_experts + 1}] tensor, got "
          + (f"{expert_offsets.dtype} {tuple(expert_offsets.shape)}"
             f"{'' if expert_offsets.is_contiguous() else ' (not contiguous)'}"
             if isinstance(expert_offsets, torch.Tensor) else type(expert_offsets).__name__))


def check_expert_offsets(expert_offsets: torch.Tensor, rows: int, num_experts: int, block_k: int) -> None:
    """The weight grads' expert_offsets (check_offsets_tensor) and their row step dividing the rows."""
    check_offsets_tensor(expert_offsets, num_experts)
    check(rows % block_k == 0, f"the row step {block_k} must divide R={rows} (and block_m)")
