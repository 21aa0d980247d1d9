"""Fixed tile table of the Triton backend: per architecture and shape class, no runtime autotuning.

Autotuning picks configs by timing, which would make results depend on the machine's mood (promise 1 in
docs/design.md); so every kernel's tile shape comes from this table, chosen by (arch, dtype, shape class).
Benchmarks (not tests) are where new entries are justified.

Hopper (sm_90) entries are sized for wgmma: 128-row tiles over 8 warps (two warpgroups of 64 rows),
K steps of 64 bf16 elements (128-byte rows, the widest shared-memory swizzle), and 3-5 pipeline stages
within the 227 KB of shared memory.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megamoe.config import TRITON_MIN_BLOCK_M


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One kernel's launch shape. block_m: rows (or output rows of a weight-grad tile); block_n: output
    columns; block_k: reduction step; group_m: row blocks swept together (L2 reuse of weight tiles; the row
    GEMMs' groups stay inside one expert, kernels/_common.expert_tile_coords);
    tma: the kernel of kernels/tma_gemm.py runs (operands and outputs by TMA copies) instead of the
    pointer-load one; flatten (tma only): Triton flattens the persistent tile loop with the K loop, so the
    next tile's first copies are issued during this tile's epilogue; gather (gate_up_fwd on the TMA core):
    the kernel gathers the x rows in its loads (by pointer, the weights still by TMA) instead of reading
    rows a gather pass wrote; gluon (with tma): the warp-specialized Gluon kernel of kernels/gluon_*.py runs
    (a producer warp feeding two consumer warpgroups through an mbarrier ring; num_warps is then its
    default partition's, 4); pingpong (the row-block and weight-grad Gluon kernels, gluon_rows.py and gluon_dw.py):
    their two warpgroups on alternate tiles, else on halves of each tile (gate_up_fwd's Gluon kernels always take
    halves, down_dgrad's always alternate tiles, whatever pingpong says); handoff (gate_up_fwd's Gluon kernel on x rows): its epilogue on warps of its own
    (gluon_gate_up.gate_up_fwd_handoff_kernel, 3 stages)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False
    flatten: bool = False
    gather: bool = False
    gluon: bool = False
    pingpong: bool = False
    handoff: bool = False

    def with_block_m(self, block_m: int) -> "TileConfig":
        return dataclasses.replace(self, block_m=block_m)

    def with_block_k(self, block_k: int) -> "TileConfig":
        return dataclasses.replace(self, block_k=block_k)


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
    """The tile of every kernel of one problem (hidden H, intermediate I, dtype, device)."""

    gate_up_fwd: TileConfig  # two accumulators (gate and up columns): block_n columns of each
    down_fwd: TileConfig
    down_dgrad: TileConfig  # output columns over I, SwiGLU backward in the epilogue
    gate_up_dgrad: TileConfig  # output columns over H, reduction over 2I
    dw_down: TileConfig  # tile [block_m over H, block_n over I], block_k rows per step
    dw_gate_up: TileConfig  # tile [block_m over 2I, block_n over H], block_k rows per step
    combine: TileConfig  # block_m tokens x block_n hidden columns


# Hopper (sm_90), every shape class measured so far (qwen3-30b-a3b and mixtral-8x7b sweeps in
# benchmarks/results/, docs/perf-notes.md v3/v4). The two-accumulator gate/up tile is effectively
# 128 x 256 (2 x 128 fp32 accumulator registers per thread), so it runs 3 stages (3 x 48 KB of shared
# memory). down_fwd: a 256-column tile halves the re-reads of the h rows (qwen3-30b-a3b 0.85 ms vs 1.04
# at 128 x 128 x 4). gate_up_dgrad: 128 x 128 x 4 stages (mixtral 5.85 ms vs 7.30 at 128 x 256 x 3).
# Weight-grad tiles loop over only one expert's rows (~1-2k), so a 128 x 256 tile does twice the work per
# prologue/epilogue (mixtral dw_down 4.26 -> 2.90 ms, dw_gate_up 7.89 -> 6.49 against 128 x 128) and a
# 4th stage helps again (qwen3-30b-a3b dw_gate_up 1.55 -> 1.39 ms).
_SM90 = KernelConfigs(
    gate_up_fwd=TileConfig(128, 128, 64, num_warps=8, num_stages=3),
    down_fwd=TileConfig(128, 256, 64, num_warps=8, num_stages=3),
    # 3 stages: with contiguous d_y rows the loop pipelines fully, and a 4th stage plus the SwiGLU-backward
    # epilogue (g, u and the accumulator live together) spills at the 255-register limit.
    down_dgrad=TileConfig(128, 128, 64, num_warps=8, num_stages=3),
    gate_up_dgrad=TileConfig(128, 128, 64, num_warps=8, num_stages=4),
    dw_down=TileConfig(128, 256, 64, num_warps=8, num_stages=4),
    dw_gate_up=TileConfig(128, 256, 64, num_warps=8, num_stages=4),
    combine=TileConfig(8, 256, 1, num_warps=4, num_stages=1),
)
# The one-GPU path on Hopper: every GEMM on the warp-specialized Gluon kernels (docs/perf-notes.md, "GEMM core
# v2"), with the tiles the Triton TMA kernels (kernels/tma_gemm.py) were measured with ("GEMM core v1"); the
# Triton kernel of an entry's tile (8 warps, at most 3 stages) gives the same bits and is what the GPU tests
# compare with and the CPU interpreter runs. (Flattening the Triton kernels' tile loop, TileConfig.flatten,
# helped some of them; no entry here runs a Triton kernel.)
_SM90_TMA = KernelConfigs(
    # gate_up_fwd: the Gluon kernel (kernels/gluon_gate_up.py), two accumulators per consumer warpgroup (64
    # rows x 128 gate + 128 up columns), bitwise equal to the Triton kernel: h and gate_up at qwen3-235b-a22b
    # 638 TF/s against 616 (3 stages, two staging buffers per consumer); see _GATHER_X_MAX_H for small H.
    # Its epilogue handed off to two warps of the producer's warpgroup (handoff: the consumers round g and u
    # into shared memory and go back to the main loop), bitwise equal: qwen3-235b-a22b h and gate_up 662 TF/s
    # against 609 / 632 (3 stages two buffers / 4 stages one), h alone 651 against 628 / 608
    # (h200-gluon-gate-up-handoff-v1.json); the layer's forward 0.8-2.6% faster at qwen3-235b-a22b,
    # gpt-oss-120b and mixtral-8x7b, even at deepseek-v3 (h200-handoff-layer-ab-v2.json).
    gate_up_fwd=TileConfig(128, 128, 64, num_warps=4, num_stages=3, tma=True, gluon=True, handoff=True),
    # down_fwd and gate_up_dgrad: the Gluon row-block kernel (kernels/gluon_rows.py), the same tiles, bitwise
    # equal, two warpgroups on the halves of each tile: qwen3-30b-a3b 632 / 663 TF/s against the Triton
    # kernel's 614 / 624, qwen3-235b-a22b 668 / 658 against 645 / 643 (benchmarks/gluon_rows_bench.py,
    # h200-gluon-rows-v1.json); ping-pong (128 x 128, alternate tiles) 609-635, below.
    down_fwd=TileConfig(128, 256, 64, num_warps=4, num_stages=3, tma=True, gluon=True),
    # down_dgrad (the router epilogue, h_w stored): the Gluon kernel (kernels/gluon_down_dgrad.py), two consumer
    # warpgroups on alternate tiles, each running the SwiGLU-backward epilogue from its own accumulator beside the
    # other's main loop (the epilogue a loop, so both fit the instruction cache), 5 operand stages. Against the
    # kernel before it (one MMA warpgroup, two epilogue warpgroups through shared memory), 3 alternating rounds, its
    # predecessor (router weights carried across pieces): qwen3-30b-a3b 0.855 ms / 0.891, qwen3-235b-a22b 3.260 /
    # 3.427, gpt-oss-120b 2.460 / 2.411 (h200-down-dgrad-pingpong-loop-v2.json); the layer fwd+bwd, 6 alternating
    # rounds, 7.06 / 7.09, 26.50 / 26.86, 19.21 / 19.32, mixtral-8x7b 27.64 / 27.95 ms (h200-down-dgrad-pingpong-
    # loop-layer-ab-v1.json). This kernel alone, a later run: 0.787 / 3.036 / 2.262 (h200-down-dgrad-pingpong-v3).
    down_dgrad=TileConfig(128, 128, 64, num_warps=4, num_stages=5, tma=True, gluon=True),
    gate_up_dgrad=TileConfig(128, 256, 64, num_warps=4, num_stages=3, tma=True, gluon=True),
    # The Gluon weight-grad kernel (kernels/gluon_dw.py), the same 128 x 256 x 64 tile, bitwise equal:
    # qwen3-30b-a3b dw_down 0.669 ms against 0.689, dw_gate_up 1.342 against 1.385; qwen3-235b-a22b 2.641
    # against 2.826 and 5.239 against 5.478 (benchmarks/gluon_dw_bench.py, h200-gluon-dw-v1.json). Ping-pong
    # 128 x 128 x 4 stages: 1.284 at qwen3-30b-a3b dw_gate_up, slower elsewhere.
    dw_down=TileConfig(128, 256, 64, num_warps=4, num_stages=3, tma=True, gluon=True),
    dw_gate_up=TileConfig(128, 256, 64, num_warps=4, num_stages=3, tma=True, gluon=True),
    # 4 tokens x 512 columns: 1.01-1.02x the 8 x 256 tile, both with the slot loop unrolled, same bits
    # (benchmarks/combine_bench.py, h200-combine-v1.json).
    combine=TileConfig(4, 512, 1, num_warps=4, num_stages=1),
)
# gate_up_fwd gathering x in its loads instead of a gather pass + the GEMM on rows: the Triton kernel
# (benchmarks/gather_ab.py, h200-gather-ab-v1.json) at qwen3-30b-a3b (H 2048) 1.69 ms against 1.80, gpt-oss-120b
# (H 2880) 4.69 against 4.86; qwen3-235b-a22b (H 4096) even; mixtral-8x7b (4096) 7.17 against 6.48, deepseek-v3
# (7168) 7.36 against 6.67: the pointer loads of A cost the long K loops more than the pass they save. The Gluon
# kernel gathers with a producer warpgroup of cp.async copies (4 stages, one staging buffer per consumer):
# qwen3-30b-a3b 1.497 ms against 1.446 + 0.26 (its rows + the pass); qwen3-235b-a22b 6.109 against 5.502 + 0.51
# (h200-gluon-gate-up-v1.json). In the layer (benchmarks/layer_ab.py, h200-gather-layer-ab-v1.json, fwd+bwd):
# qwen3-30b-a3b 7.32 ms gathering against 7.68 on rows, gpt-oss-120b (H 2880) 20.64 against 20.04: gathering
# pays at H 2048 only.
_GATHER_X_MAX_H = 2048
# The other GPUs the Triton backend runs on (compute capability 10 and up: Blackwell until measured) and the CPU
# interpreter: mma.sync-sized tiles that fit 100 KB of shared memory.
_DEFAULT = KernelConfigs(
    gate_up_fwd=TileConfig(128, 64, 32, num_warps=8, num_stages=3),
    down_fwd=TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    down_dgrad=TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    gate_up_dgrad=TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    dw_down=TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    dw_gate_up=TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    combine=TileConfig(8, 256, 1, num_warps=4, num_stages=1),
)
# fp32 inputs (tests, interpreter): K steps of at most 32, half Hopper's 64 (the same shared-memory bytes per stage
# there; _DEFAULT's 32 stays, its stages twice the bytes, 3 x 32 KB at 128 x 128, still within 100 KB).
_FP32_BLOCK_K = 32

_BLOCK_M = 128


def block_m_for(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    """Rows per block the schedule must be built with (build_schedule(..., block_m=...)).

    Every kernel's row tile divides it, so no tile straddles two experts. 128 on every entry of the
    table today (one wgmma tile of two warpgroups); hidden/intermediate/dtype select future entries.
    """
    del hidden, intermediate, dtype
    return _BLOCK_M


def tma_kernel_configs(
    hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, block_m: int
) -> KernelConfigs | None:
    """The tiles of the TMA kernels for this problem, or None where they do not run: not a Hopper GPU
    (Blackwell: not yet measured), not a 16-bit dtype, or rows TMA cannot address (H or I not a multiple
    of 8 elements: 16-byte strides), or a schedule block_m the 128-row tiles do not divide."""
    arch = _arch(torch.device(device))
    if arch is None or arch[0] != 9 or dtype not in (torch.bfloat16, torch.float16):
        return None
    if hidden % 8 or intermediate % 8 or block_m % _SM90_TMA.gate_up_fwd.block_m:
        return None
    table = _SM90_TMA
    if hidden <= _GATHER_X_MAX_H:
        gathering = dataclasses.replace(table.gate_up_fwd, gather=True, handoff=False, num_stages=4)
        table = dataclasses.replace(table, gate_up_fwd=gathering)
    return table


def ep_tma_kernel_configs(
    hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, block_m: int
) -> KernelConfigs | None:
    """The expert-parallel path's tiles on the Gluon core, or None where tma_kernel_configs has none: the one-GPU
    table with gate_up_fwd on x rows by TMA through 3 stages, the kernels the pulls run in (kernels/gluon_ep.py):
    where one GPU hands the epilogue off (its x rows by a pass), the hand-off kernel; where one GPU gathers x, the
    epilogue on the consumers beside two staging buffers (gate_up is always stored)."""
    table = tma_kernel_configs(hidden, intermediate, dtype, device, block_m)
    if table is None:
        return None
    rows = dataclasses.replace(table.gate_up_fwd, gather=False, num_stages=3)
    return dataclasses.replace(table, gate_up_fwd=rows)


def triton_tile(cfg: TileConfig) -> TileConfig:
    """The Triton TMA kernel's version of a tile-table entry that runs a Gluon kernel (TileConfig.gluon): the same
    tile and K step, hence the same bits (the Gluon kernels' reference in the GPU tests and the benchmarks), with
    the 8 warps the Triton kernels run and at most 3 stages (the two-accumulator gate_up_fwd tile fits no more in
    shared memory). Any other entry as it is."""
    if not cfg.gluon:
        return cfg
    return dataclasses.replace(cfg, gluon=False, pingpong=False, handoff=False, num_warps=8,
                               num_stages=min(cfg.num_stages, 3))


def _arch(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def kernel_configs(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, block_m: int) -> KernelConfigs:
    """The table entry for a problem, with every row tile clipped to the schedule's block_m.

    block_m: the schedule's rows per block (a power of two >= 16, the smallest tl.dot tile); row tiles
    larger than it are shrunk to it so that tiles never straddle experts.
    """
    if block_m < TRITON_MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(
            f"the triton backend needs a schedule block_m that is a power of two >= {TRITON_MIN_BLOCK_M}, got {block_m}")
    return _kernel_configs(hidden, intermediate, dtype, _arch(torch.device(device)), block_m)


@functools.lru_cache(maxsize=None)
def _kernel_configs(hidden: int, intermediate: int, dtype: torch.dtype, arch, block_m: int) -> KernelConfigs:
    if arch is not None and arch[0] == 9:
        table = _SM90
    else:
        table = _DEFAULT
    fields = {}
    for field in dataclasses.fields(table):
        cfg = getattr(table, field.name)
        if field.name != "combine":
            if dtype == torch.float32:
                cfg = cfg.with_block_k(min(cfg.block_k, _FP32_BLOCK_K))
            if field.name.startswith("dw_"):
                # Weight-grad tiles step over rows: the step must divide block_m so each expert's
                # (block_m-padded) segment is whole steps and the row loop needs no mask.
                cfg = cfg.with_block_k(min(cfg.block_k, block_m))
            else:
                cfg = cfg.with_block_m(min(cfg.block_m, block_m))
        fields[field.name] = cfg
    return KernelConfigs(**fields)
