"""Pure @triton.jit kernels of the fused expert path and their launchers (validate, allocate, grid)."""

from megamoe.backends.triton.kernels.combine import (
    combine, combine_kernel, row_sums, row_sums_kernel,
)
from megamoe.backends.triton.kernels.comm_tiles import RowPull, RowPush
from megamoe.backends.triton.kernels.ep_fused import ep_backward, ep_bwd_kernel, ep_forward, ep_fwd_kernel
from megamoe.backends.triton.kernels.gluon_ep import gate_up_fwd_pull
from megamoe.backends.triton.kernels.gather import spread_rows, spread_rows_kernel
from megamoe.backends.triton.kernels.grouped_gemm import (
    down_dgrad,
    down_dgrad_kernel,
    down_dgrad_router,
    down_fwd,
    down_fwd_kernel,
    gate_up_dgrad,
    gate_up_dgrad_kernel,
    gate_up_dgrad_spreads_x,
    gate_up_fwd,
    gate_up_fwd_kernel,
)
from megamoe.backends.triton.kernels.weight_grad import dw_down, dw_gate_up, dw_kernel

__all__ = [
    "combine", "combine_kernel", "row_sums", "row_sums_kernel", "spread_rows", "spread_rows_kernel",
    "RowPull", "RowPush", "ep_forward", "ep_fwd_kernel", "ep_backward", "ep_bwd_kernel",
    "gate_up_fwd_pull",
    "down_dgrad", "down_dgrad_kernel", "down_dgrad_router", "down_fwd", "down_fwd_kernel",
    "gate_up_dgrad", "gate_up_dgrad_kernel", "gate_up_dgrad_spreads_x", "gate_up_fwd", "gate_up_fwd_kernel",
    "dw_down", "dw_gate_up", "dw_kernel",
]
