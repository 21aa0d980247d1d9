"""Forward/backward drivers of the single-GPU fused Triton path (no expert-parallel group), and the
helpers the expert-parallel path (ep.py) shares (tile configs, device ranges, shared expert).

Every GEMM reads and writes contiguous receive rows [R, *] (expert-major, padded per expert to the
schedule's block_m, padding rows zero); the token-sourced operands are materialised once by a gather:
Forward:  gather x_rows = x[row_src // k] -> rows_fwd: gate_up_fwd (gate/up GEMM, SwiGLU epilogue) ->
          down_fwd (y_rows) -> combine (out[t] = sum_j w * y_rows[dest_row[t, j]] in fp32, j in order,
          + shared last).
Backward: combine_bwd (d_topk_weights = <d_out, y_rows[dest_row]>) -> gather d_y_rows = w * d_out[tok]
          -> rows_bwd: down_dgrad (SwiGLU backward fused) -> gate_up_dgrad (d_x_rows) and the two
          weight-grad kernels (one program per output tile, looping over its expert's rows) ->
          combine without weights (d_x = sum_j d_x_rows[dest_row[t, j]], + shared).
The shared expert is a dense MLP and runs on cuBLAS through torch.

saved = (h [R, I], gate_up [R, 2I], y_rows [R, H], shared_gate_up_act [T, 2I_s]); x_rows is re-gathered
from x in the backward (0.26 ms at qwen3-30b-a3b) rather than kept (R*H*2 bytes: 0.6 GB there). In
recompute mode (save_gate_up=False) h and gate_up are empty and the backward reruns gate_up_fwd on
x_rows; without a shared expert the last entry is empty. Entries are always tensors so the tuple can
cross torch.library custom ops.

Inference (experts_fwd(..., save_for_backward=False), what megamoe.experts passes under torch.no_grad() /
torch.inference_mode() or when no input requires grad): saved = (); gate_up is never stored (gate_up_fwd
without store_gate_up, the recompute mode's kernel: same h, same bits), x_rows is released after the
gate/up GEMM, h after the down GEMM and y_rows after the combine, so only out outlives the call.
Gradients not needed (experts_bwd's needs_grad): d_topk_weights skips combine_bwd; d_w_down skips
dw_down; d_w_gate_up skips dw_gate_up (and the re-gather of x_rows); d_x skips gate_up_dgrad and the
final combine; down_dgrad (SwiGLU backward fused) runs only for d_x or d_w_gate_up; with none of d_x,
d_w_gate_up, d_w_down the whole rows backward (and the d_y gather) is skipped; the shared expert's
gradients are skipped one by one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import KernelConfigs, kernel_configs, tma_kernel_configs
from megamoe.backends.triton.kernels import tma_gemm
from megamoe.backends.triton.kernels._common import range_of
from megamoe.schedule import Schedule

# Save the gate/up pre-activation (2 bytes * R * 2I) in the forward rather than recompute its GEMM
# (a third of the forward FLOPs) in the backward: memory is the cheaper resource on H100/H200.
SAVE_GATE_UP = True
# needs_grad with every gradient asked for: (x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down).
ALL_GRADS = (True,) * 6


def configs_for(x: torch.Tensor, w_gate_up: torch.Tensor, schedule: Schedule) -> KernelConfigs:
    """The tile table entry of this problem (H, I, dtype, device, the schedule's block_m)."""
    return kernel_configs(x.shape[1], w_gate_up.shape[1] // 2, x.dtype, x.device, schedule.block_m)


def one_gpu_configs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, schedule: Schedule) -> KernelConfigs:
    """The tiles of the one-GPU path: the TMA core's where it runs (a Hopper GPU, 16-bit operands TMA can
    address: configs.tma_kernel_configs and 16-byte aligned weights), the pointer-load core's elsewhere.
    Host metadata only: no sync."""
    tma = tma_kernel_configs(x.shape[1], w_gate_up.shape[1] // 2, x.dtype, x.device, schedule.block_m)
    if tma is not None and tma_gemm.tma_addressable(w_gate_up, w_down):
        return tma
    return configs_for(x, w_gate_up, schedule)


def rows_in_use(schedule: Schedule) -> torch.Tensor:
    """int32 [2] on the device: the receive rows in use, (0, expert_offsets[E_l]); no host sync."""
    return range_of(schedule.expert_offsets[-1:], "rows_in_use")


def all_blocks(schedule: Schedule) -> torch.Tensor:
    """int32 [2] on the device: the schedule blocks (0, num_blocks), the GEMMs' range over every row in use."""
    return range_of(schedule.num_blocks, "num_blocks")


def _check_group(group, schedule: Schedule, w_gate_up: torch.Tensor) -> None:
    if schedule.world_size != 1:
        raise ValueError("megamoe.backends.triton.experts is the one-GPU path; expert parallelism is in ep.py")
    if schedule.num_local_experts != w_gate_up.shape[0]:
        raise ValueError(
            f"schedule has {schedule.num_local_experts} local experts, w_gate_up has {w_gate_up.shape[0]}"
        )


def shared_fwd(x, shared_gate_up, shared_down):
    gate_up = x @ shared_gate_up.t()
    g, u = gate_up.float().chunk(2, dim=-1)
    h = (torch.nn.functional.silu(g) * u).to(x.dtype)
    return h @ shared_down.t(), gate_up


def shared_bwd(d_out, x, shared_gate_up, shared_down, gate_up, *, need_x: bool = True,
               need_gate_up: bool = True, need_down: bool = True):
    """(d_x, d_shared_gate_up, d_shared_down) of the shared expert, None for each one not needed."""
    g, u = gate_up.float().chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    silu = g * sig
    d_shared_down = d_out.t() @ (silu * u).to(x.dtype) if need_down else None
    if not (need_x or need_gate_up):
        return None, None, d_shared_down
    d_h = (d_out @ shared_down).float()
    d_gate_up = torch.cat([d_h * u * sig * (1.0 + g * (1.0 - sig)), d_h * silu], dim=-1).to(x.dtype)
    return d_gate_up @ shared_gate_up if need_x else None, d_gate_up.t() @ x if need_gate_up else None, d_shared_down


# ----------------------------------------------------------------------------------------------------
# The rows compute: everything indexed by receive row r, expert e = the row's block.


def rows_fwd(
    x_rows: torch.Tensor | Callable[[], torch.Tensor],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    schedule: Schedule,
    cfg: KernelConfigs,
    *,
    save_gate_up: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [R, I], gate_up [R, 2I], y_rows [R, H]) from x_rows [R, H] (padding rows zero; rows past
    expert_offsets[E_l] are neither read nor written). Without save_gate_up, gate_up is [0, 2I].
    x_rows: the rows, or a function producing them: then they are released right after the gate/up GEMM,
    before the down GEMM allocates y_rows.
    """
    # NOTE: the block range stays on the device; every buffer and grid is sized from shapes alone,
    # so nothing here waits for the GPU.
    blocks = all_blocks(schedule)
    h, gate_up = kernels.gate_up_fwd(
        x_rows() if callable(x_rows) else x_rows, w_gate_up, schedule.block_expert, blocks,
        store_gate_up=save_gate_up, config=cfg.gate_up_fwd,
    )
    y_rows = kernels.down_fwd(h, w_down, schedule.block_expert, blocks, config=cfg.down_fwd)
    if gate_up is None:
        gate_up = h.new_empty(0, 2 * h.shape[1])
    return h, gate_up, y_rows


def rows_bwd(
    d_y_rows: torch.Tensor,
    x_rows: torch.Tensor | Callable[[], torch.Tensor],
    h: torch.Tensor,
    gate_up: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    schedule: Schedule,
    cfg: KernelConfigs,
    *,
    need_x: bool = True,
    need_w_gate_up: bool = True,
    need_w_down: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d_x_rows [R, H], d_w_gate_up [E_l, 2I, H], d_w_down [E_l, H, I]), None for each one not needed
    (need_*: its kernel is not launched; down_dgrad runs only for d_x_rows or d_w_gate_up).

    d_y_rows [R, H]: the router-weighted upstream gradient of each row (zero for padding), released as
    soon as its last GEMM is done; x_rows: the rows, or a function producing them, called only when
    needed (so the one-GPU path re-gathers them instead of keeping them from the forward); h, gate_up
    as rows_fwd returned them (both empty: recomputed here, same kernel, same bits).
    """
    rows = x_rows if callable(x_rows) else (lambda: x_rows)
    blocks = all_blocks(schedule)
    need_d_gate_up = need_x or need_w_gate_up
    if gate_up.shape[0] == 0 and (need_d_gate_up or need_w_down):
        h, gate_up = kernels.gate_up_fwd(
            rows(), w_gate_up, schedule.block_expert, blocks, store_gate_up=need_d_gate_up, config=cfg.gate_up_fwd,
        )
    num_experts = w_gate_up.shape[0]
    d_gate_up = d_x_rows = d_w_gate_up = d_w_down = None
    if need_d_gate_up:
        d_gate_up = kernels.down_dgrad(d_y_rows, w_down, gate_up, schedule.block_expert, blocks, config=cfg.down_dgrad)
    if need_w_down:
        d_w_down = kernels.dw_down(d_y_rows, h, schedule.expert_offsets, num_experts, config=cfg.dw_down)
    del d_y_rows  # lowers the backward's peak memory (the caller holds no reference)
    if need_x:
        d_x_rows = kernels.gate_up_dgrad(d_gate_up, w_gate_up, schedule.block_expert, blocks, config=cfg.gate_up_dgrad)
    if need_w_gate_up:
        d_w_gate_up = kernels.dw_gate_up(d_gate_up, rows(), schedule.expert_offsets, num_experts, config=cfg.dw_gate_up)
    return d_x_rows, d_w_gate_up, d_w_down


# ----------------------------------------------------------------------------------------------------
# The one-GPU backend interface.


def experts_fwd(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    schedule: Schedule,
    group=None,
    config=None,
    *,
    save_gate_up: bool = SAVE_GATE_UP,
    save_for_backward: bool = True,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """out [T, H] (x's dtype) and the tensors the backward needs (see the module docstring); without
    save_for_backward (inference), () and gate_up never stored.

    x [T, H]; topk_weights [T, k] fp32; w_gate_up [E_l, 2I, H]; w_down [E_l, H, I]; shared_gate_up
    [2I_s, H] and shared_down [H, I_s] or None; schedule built with block_m_for(H, I, x.dtype) (or any
    power of two >= 16). Sync-free: every size here comes from shapes, counts are read on the device.
    """
    _check_group(group, schedule, w_gate_up)
    cfg = one_gpu_configs(x, w_gate_up, w_down, schedule)
    x = x.contiguous()
    save_gate_up = save_gate_up and save_for_backward
    # x_rows is not kept: gathered for the gate/up GEMM and released before the down GEMM allocates y_rows;
    # the backward re-gathers it from x (saved anyway) just before dw_gate_up.
    h, gate_up, y_rows = rows_fwd(
        lambda: kernels.gather_rows(x, schedule.row_src, None, rows_in_use(schedule), div=schedule.top_k),
        w_gate_up, w_down, schedule, cfg, save_gate_up=save_gate_up,
    )
    if not save_gate_up:
        h = x.new_empty(0, h.shape[1])  # recompute mode (the backward reruns gate_up_fwd), or inference
    shared_out, shared_act = None, x.new_empty(0)
    if shared_gate_up is not None:
        shared_out, shared_act = shared_fwd(x, shared_gate_up, shared_down)
    out = kernels.combine(y_rows, topk_weights, schedule.dest_row, shared_out, config=cfg.combine)
    if not save_for_backward:
        return out, ()
    return out, (h, gate_up, y_rows, shared_act)


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule: Schedule) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like experts_fwd's `saved` (default save mode), for torch.compile's fake impl."""
    rows, inter, hidden = schedule.num_rows, w_down.shape[2], x.shape[1]
    shared = x.new_empty(x.shape[0], shared_gate_up.shape[0]) if shared_gate_up is not None else x.new_empty(0)
    return (x.new_empty(rows, inter), x.new_empty(rows, 2 * inter), x.new_empty(rows, hidden), shared)


def experts_bwd(
    d_out: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    schedule: Schedule,
    group,
    config,
    saved: tuple[torch.Tensor, ...],
    *,
    needs_grad: tuple[bool, ...] = ALL_GRADS,
) -> tuple[torch.Tensor | None, ...]:
    """(d_x, d_topk_weights [T, k] fp32, d_w_gate_up, d_w_down, d_shared_gate_up or None, d_shared_down or None);
    needs_grad: one bool per gradient in that order; None (and its kernels skipped) for each one not needed."""
    _check_group(group, schedule, w_gate_up)
    need_x, need_weights, need_w_gate_up, need_w_down, need_shared_gate_up, need_shared_down = needs_grad
    h, gate_up, y_rows, shared_act = saved
    cfg = one_gpu_configs(x, w_gate_up, w_down, schedule)
    d_out = d_out.to(x.dtype).contiguous()
    d_x = d_topk_weights = d_x_rows = d_w_gate_up = d_w_down = None
    if need_weights:
        d_topk_weights = kernels.combine_bwd(d_out, y_rows, schedule.dest_row, config=cfg.combine)
    if need_x or need_w_gate_up or need_w_down:
        in_use = rows_in_use(schedule)
        d_x_rows, d_w_gate_up, d_w_down = rows_bwd(
            # The router weight of each row's pair, applied once here (fp32 product rounded to the dtype,
            # as autograd of the reference rounds w * d_out), so no GEMM scales its operand in registers.
            kernels.gather_rows(d_out, schedule.row_src, topk_weights.contiguous().view(-1), in_use, div=schedule.top_k),
            lambda: kernels.gather_rows(x.contiguous(), schedule.row_src, None, in_use, div=schedule.top_k),
            h, gate_up, w_gate_up, w_down, schedule, cfg,
            need_x=need_x, need_w_gate_up=need_w_gate_up, need_w_down=need_w_down,
        )
    d_x_shared = d_shared_gate_up = d_shared_down = None
    if shared_gate_up is not None:
        d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(
            d_out, x, shared_gate_up, shared_down, shared_act,
            need_x=need_x, need_gate_up=need_shared_gate_up, need_down=need_shared_down,
        )
    if need_x:
        d_x = kernels.combine(d_x_rows, None, schedule.dest_row, d_x_shared, config=cfg.combine)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
