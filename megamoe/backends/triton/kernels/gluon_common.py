"""Helpers shared by the Gluon kernels (gluon_rows.py, gluon_gate_up.py, gluon_down_dgrad.py, gluon_dw.py):
the TMA copies under the name of the installed Triton, the tile origin of a row-block GEMM (jit), the tile of
the two-consumer kernels (gluon_rows.py, gluon_dw.py) and the shared-memory layouts of their TMA descriptors
(host)."""

from __future__ import annotations

import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import expert_tile_coords, tile_coords

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}  # the 16-bit operands wgmma and TMA take
SMEM_PER_CTA = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)

# The asynchronous copies: TMA (global -> shared, completing an mbarrier; shared -> global) and cp.async
# (per-thread, global -> shared). Triton 3.8 renamed them (async_copy_global_to_shared -> async_load,
# async_copy_shared_to_global -> async_store) and 3.9 removed the old names; the kernels call them through
# these, so they compile on either side of the rename.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
cp_async_load = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
# smem_reinterpret(buffer, dtype, shape, layout): the same shared memory seen with another dtype, shape and
# layout (a method, renamed from _reinterpret to reinterpret in Triton 3.8).
smem_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret
# thread_barrier(): a bar.sync of the partition's threads (gl.thread_barrier, gl.barrier from Triton 3.8).
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def tile_origin(tile, first_m, num_m, num_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column, kernel row block) of a linear tile index over the block range [first_m,
    first_m + num_m), in the order of _common.tile_coords (groups across expert boundaries: the expert-parallel
    pull kernel's order, gluon_ep.py; the one-GPU row GEMMs take expert_tile_origin's)."""
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    m = first_m + pid_m
    return m * BLOCK_M, pid_n * BLOCK_N, m


@gluon.jit
def expert_tile_origin(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column, expert) of a linear tile index of a one-GPU row-block GEMM, in the order of
    _common.expert_tile_coords (groups inside one expert's row blocks)."""
    m, pid_n, expert = expert_tile_coords(tile, first_m, num_m, num_n, block_expert_ptr, expert_offsets_ptr, SPLIT,
                                          BLOCK_M, GROUP_M)
    return m * BLOCK_M, pid_n * BLOCK_N, expert


def nvmma_layout(block: list[int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout (widest swizzle) a TMA descriptor of `block` boxes of 16-bit `dtype` carries."""
    return gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[dtype])


NUM_CONSUMERS = 2  # consumer warpgroups of a two-consumer kernel's CTA (gluon_rows.py, gluon_dw.py)


@dataclasses.dataclass(frozen=True)
class ConsumerTile:
    """The launch shape of a kernel with a producer warp and two consumer warpgroups (gluon_rows.py, gluon_dw.py):
    the output tile block_m x block_n of one tile index ("coop": both warpgroups on its row halves;
    "pingpong": one warpgroup's whole tile, the two alternating), block_k per K step (the Triton kernel's
    BLOCK_K: the K steps must match for equal bits), a ring of `stages` slots, group_m row blocks swept per
    column block (gluon_rows: expert_tile_coords, inside one expert; gluon_dw: tile_coords over an expert's weight
    tile grid), the register split (setmaxnreg) between the producer's warpgroup and the
    consumers."""

    block_m: int
    block_n: int
    stages: int
    pingpong: bool
    block_k: int = 64
    group_m: int = 8
    producer_regs: int = 40
    consumer_regs: int = 232

    @classmethod
    def of(cls, config: TileConfig) -> "ConsumerTile":
        """The tile of a tile-table entry that runs a Gluon kernel (TileConfig.gluon)."""
        return cls(config.block_m, config.block_n, stages=config.num_stages, pingpong=config.pingpong,
                   block_k=config.block_k, group_m=config.group_m)

    @property
    def store_m(self) -> int:
        """Rows of one consumer's output tile (its TMA store box)."""
        return self.block_m if self.pingpong else self.block_m // NUM_CONSUMERS

    @property
    def num_warps(self) -> int:
        """Warps the kernel runs with: the consumers' warpgroups + the producer's (rounded up to a warpgroup)."""
        return 4 * NUM_CONSUMERS + 4

    def smem_bytes(self, elem: int = 2) -> int:
        """Operand ring + the consumers' epilogue buffers (without the barriers)."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * elem
        return ring + NUM_CONSUMERS * self.store_m * self.block_n * elem
