"""Helpers shared by the Gluon kernels (gluon_rows.py, gluon_gate_up.py, gluon_down_dgrad.py, gluon_dw.py):
the tile origin of a row-block GEMM (jit) and the shared-memory layouts of their TMA descriptors (host)."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megamoe.backends.triton.kernels._common import tile_coords

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}  # the 16-bit operands wgmma and TMA take


@gluon.jit
def tile_origin(tile, first_m, num_m, num_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column, kernel row block) of a linear tile index over the block range [first_m,
    first_m + num_m), in the order of _common.tile_coords."""
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    m = first_m + pid_m
    return m * BLOCK_M, pid_n * BLOCK_N, m


def nvmma_layout(block: list[int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout (widest swizzle) a TMA descriptor of `block` boxes of 16-bit `dtype` carries."""
    return gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[dtype])
