"""Forward/backward drivers of the single-GPU fused Triton path (no expert-parallel group), and the
helpers the expert-parallel path (ep.py) shares (tile configs, device ranges, the empty batch's gradients).

Every GEMM reads and writes contiguous receive rows [R, *] (expert-major, padded per expert to the
schedule's block_m, padding rows zero).
Forward:  spread_rows x_rows = x[row_src // k] (token-major, kernels/gather.py) -> gate_up_fwd (gate/up
          GEMM, SwiGLU epilogue: h, and gate_up when kept) -> down_fwd (y_rows) -> combine (out[t] = sum_j w * y_rows[dest_row[t, j]] in fp32,
          j in order, + shared last). x_rows, h and y_rows are released inside the forward. Where the tile
          table says so (small H, configs._GATHER_X_MAX_H) gate_up_fwd gathers the x rows in its loads and
          there is no x_rows.
Backward: spread_rows d_out_rows = d_out[row_src // k] (unweighted) -> down_dgrad_router (d_out_rows @ w_down,
          the router weight and the SwiGLU backward in the epilogue: d_gate_up; h_w = w * h recomputed
          from gate_up; the router-weight gradient's partial sums) -> dw_down (d_out_rows^T h_w) ->
          d_topk_weights (the partial sums, in order) -> gate_up_dgrad (d_x_rows; where its Gluon kernel has
          room, one of its warps spreads x_rows beside the GEMM) -> combine without weights (d_x = sum_j
          d_x_rows[dest_row[t, j]], + shared) -> x_rows by a spread_rows pass unless spread beside
          gate_up_dgrad -> dw_gate_up (d_gate_up^T x_rows; with MoEConfig.recompute on the Gluon kernel, x gathered in its loads
          instead). The weight-grad kernels own one output tile per program and loop over its expert's rows.
The shared expert is a dense MLP on cuBLAS through torch: backends/swiglu.py's, the one every backend runs.

saved = (gate_up [R, 2I], shared pre [T, 2I_s], shared h [T, I_s]): 4I bytes per routed row in bf16, all the
backward needs besides x and the schedule: h is recomputed from gate_up in down_dgrad's epilogue
(gate_up_fwd computes it from the rounded gate_up, so the bits match) and the router-weight gradient
<d_out[t], y_rows[r]> is computed as <d_out[t] @ w_down[e], h[r]> there, so y_rows is not kept either.
With MoEConfig.recompute (memory first) gate_up is empty [0, 2I] and the backward reruns gate_up_fwd as the
forward ran it (on x_rows, or gathering x in its loads at small H; same kernel, same bits); where
dw_gate_up runs the Gluon kernel (Hopper) it also gathers x in its loads, so the backward's peak (inside dw_gate_up) holds no x_rows: a quarter less at qwen3-30b-a3b, for
1.5-5% more time than the gather pass (docs/perf-notes.md, "GEMM core v3"). Without a shared expert the shared entries are absent. Entries are always tensors so the
tuple can cross torch.library custom ops. gate_up's memory is released once down_dgrad_router has read it
(autograd would hold it to the end of the backward; a second backward through the same forward recomputes
it), so the backward's order keeps at most four [R, *] tensors live (gate_up, d_out_rows, d_gate_up and
h_w during down_dgrad_router; then d_gate_up and d_x_rows, then d_gate_up and x_rows; with x_rows spread
beside gate_up_dgrad all three of those at once, only where that stays below dw_gate_up's moment).
Gathering x inside the Triton dw_gate_up's pointer loads was measured and lost (323-349 TF/s against 589 on
the copy, docs/perf-notes.md); the Gluon kernel gathers with a producer warpgroup of cp.async copies.

Inference (experts_fwd(..., save_for_backward=False), what megamoe.experts passes under torch.no_grad() /
torch.inference_mode() or when no input requires grad): saved = (); gate_up is never stored, so only out
outlives the call.
Gradients not needed (experts_bwd's needs_grad): down_dgrad_router runs for any of d_x, d_topk_weights,
d_w_gate_up, d_w_down (it is where each starts) and stores h_w only for d_w_down; dw_down, gate_up_dgrad
(and its combine) and dw_gate_up run only for their own gradient; the shared expert's gradients are
skipped one by one.
"""

from __future__ import annotations

import torch

from megamoe.backends import ALL_GRADS
from megamoe.backends.swiglu import empty_shared_saved, shared_bwd, shared_fwd
from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import KernelConfigs, kernel_configs, tma_kernel_configs
from megamoe.backends.triton.kernels import tma_gemm
from megamoe.backends.triton.kernels._common import range_of
from megamoe.config import DEFAULT_CONFIG, MoEConfig
from megamoe.schedule import Schedule


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


def tma_ready_x(x: torch.Tensor, cfg: KernelConfigs) -> torch.Tensor:
    """x contiguous and, where the TMA core runs (its kernels gather x in their loads and take a descriptor of it:
    gate_up_fwd where the tile says gather, dw_gate_up with MoEConfig.recompute), 16-byte aligned: a contiguous x
    at an odd offset of a larger buffer (H a multiple of 8, its base not) is copied once instead of being refused
    by the launchers' TMA check (as is a one-token x whose size-1 dimension has an odd stride, e.g. a column's
    transpose). one_gpu_configs checks only the weights' alignment; x's is settled here."""
    x = x.contiguous()
    if cfg.gate_up_fwd.tma and not tma_gemm.tma_addressable(x):
        # the caching allocator's blocks are 512-byte aligned; the contiguous format's strides (clone's default keeps
        # x's, odd ones included)
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def rows_in_use(schedule: Schedule) -> torch.Tensor:
    """int32 [2] on the device: the receive rows in use, (0, expert_offsets[E_l]); no host sync."""
    return range_of(schedule.expert_offsets[-1:], "rows_in_use")


def all_blocks(schedule: Schedule) -> torch.Tensor:
    """int32 [2] on the device: the schedule blocks (0, num_blocks), the GEMMs' range over every row in use."""
    return range_of(schedule.num_blocks, "num_blocks")


def _check_schedule(schedule: Schedule, w_gate_up: torch.Tensor) -> None:
    if schedule.world_size != 1:
        raise ValueError("megamoe.backends.triton.experts is the one-GPU path; expert parallelism is in ep.py")
    if schedule.num_local_experts != w_gate_up.shape[0]:
        raise ValueError(
            f"schedule has {schedule.num_local_experts} local experts, w_gate_up has {w_gate_up.shape[0]}"
        )


# ----------------------------------------------------------------------------------------------------
# The one-GPU backend interface.


def _gate_up(x, w_gate_up, schedule: Schedule, blocks: torch.Tensor, cfg: KernelConfigs, *, store_gate_up: bool):
    """(h [R, I], gate_up [R, 2I] or None) of the rows of x: gathered in the kernel's loads where the tile
    says so (gather), else by a gather pass whose rows are released on return. blocks: all_blocks(schedule)."""
    if cfg.gate_up_fwd.gather:
        a, gather = x, (schedule.row_src, schedule.top_k)
    else:
        a, gather = kernels.spread_rows(x, schedule.dest_row, schedule.row_src, rows_in_use(schedule)), None
    return kernels.gate_up_fwd(a, w_gate_up, schedule.block_expert, blocks,
                               store_gate_up=store_gate_up, config=cfg.gate_up_fwd, gather=gather,
                               expert_offsets=schedule.expert_offsets)


def experts_fwd(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    schedule: Schedule,
    group=None,
    config: MoEConfig | None = None,
    *,
    save_for_backward: bool = True,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """out [T, H] (x's dtype) and the tensors the backward needs (see the module docstring); without
    save_for_backward (inference), () and gate_up never stored.

    x [T, H]; topk_weights [T, k] fp32 or x's dtype (widened to fp32 in the combine); w_gate_up [E_l, 2I, H];
    w_down [E_l, H, I]; shared_gate_up [2I_s, H] and shared_down [H, I_s] or None; schedule built with
    block_m_for(H, I, x.dtype) (or any power of two >= 16); config: its recompute field is read (None: the
    defaults). Sync-free: every size here comes from shapes, counts are read on the device.
    """
    _check_schedule(schedule, w_gate_up)
    config = DEFAULT_CONFIG if config is None else config
    cfg = one_gpu_configs(x, w_gate_up, w_down, schedule)
    x = tma_ready_x(x, cfg)
    # NOTE: the block range stays on the device; every buffer and grid is sized from shapes alone.
    store_gate_up = save_for_backward and not config.recompute
    if schedule.num_rows == 0:  # T = 0: no rows, nothing to launch (a TMA descriptor cannot describe 0 rows)
        gate_up, y_rows = x.new_empty(0, w_gate_up.shape[1]), x.new_empty(0, x.shape[1])
    else:
        blocks = all_blocks(schedule)
        h, gate_up = _gate_up(x, w_gate_up, schedule, blocks, cfg, store_gate_up=store_gate_up)
        y_rows = kernels.down_fwd(h, w_down, schedule.block_expert, blocks, config=cfg.down_fwd,
                                  expert_offsets=schedule.expert_offsets)
        del h  # lowers the peak: the combine allocates out
    shared_out, shared_saved = shared_fwd(x, shared_gate_up, shared_down)
    out = kernels.combine(y_rows, topk_weights, schedule.dest_row, shared_out, config=cfg.combine)
    if not save_for_backward:
        return out, ()
    return out, (gate_up if gate_up is not None else x.new_empty(0, w_gate_up.shape[1]), *shared_saved)


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule: Schedule, config: MoEConfig) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like experts_fwd's `saved`, for torch.compile's fake impl: gate_up [R, 2I], or [0, 2I] with
    config.recompute."""
    rows = 0 if config.recompute else schedule.num_rows
    return (x.new_empty(rows, w_gate_up.shape[1]), *empty_shared_saved(x, shared_gate_up))


def empty_batch_grads(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down,
                      needs_grad: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """experts_bwd's gradients for a batch without tokens (T = 0), computed without a launch: d_x [0, H] and
    d_topk_weights [0, k] empty, every weight's gradient exact zeros (no token contributes); None for each
    one needs_grad does not ask for, and for the shared weights without a shared expert."""
    inputs = (x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down)
    return tuple(torch.zeros_like(t) if need and t is not None else None for t, need in zip(inputs, needs_grad))


def _release(saved: torch.Tensor) -> None:
    """Free a saved tensor's memory now, although autograd holds the tensor until the backward returns: its
    storage is resized to 0 (stream-ordered, as any free: kernels already queued still read it). A second
    backward through the same forward (retain_graph=True) finds it empty and recomputes it, bit for bit."""
    saved.untyped_storage().resize_(0)


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
    """(d_x, d_topk_weights [T, k] in topk_weights' dtype, d_w_gate_up, d_w_down, d_shared_gate_up or None,
    d_shared_down or None); needs_grad: one bool per gradient in that order; None (and its kernels skipped)
    for each one not needed. The order of the steps is the module docstring's (it decides the peak memory).
    config: its recompute field is read (None: the defaults)."""
    _check_schedule(schedule, w_gate_up)
    config = DEFAULT_CONFIG if config is None else config
    if schedule.num_rows == 0:  # T = 0: no token contributes, nothing to launch
        return empty_batch_grads(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, needs_grad)
    need_x, need_weights, need_w_gate_up, need_w_down, need_shared_gate_up, need_shared_down = needs_grad
    gate_up, *shared_saved = saved
    cfg = one_gpu_configs(x, w_gate_up, w_down, schedule)
    x = tma_ready_x(x, cfg)
    d_out = d_out.to(x.dtype).contiguous()
    d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(
        d_out, x, shared_gate_up, shared_down, shared_saved,
        need_x=need_x, need_gate_up=need_shared_gate_up, need_down=need_shared_down,
    )
    d_x = d_topk_weights = d_w_gate_up = d_w_down = None
    if need_x or need_weights or need_w_gate_up or need_w_down:
        blocks, in_use, num_experts = all_blocks(schedule), rows_in_use(schedule), w_gate_up.shape[0]
        kept = gate_up.shape[0] > 0 and gate_up.untyped_storage().nbytes() > 0
        if not kept:  # MoEConfig.recompute, or a second backward through this forward (see _release)
            gate_up = _gate_up(x, w_gate_up, schedule, blocks, cfg, store_gate_up=True)[1]
        d_out_rows = kernels.spread_rows(d_out, schedule.dest_row, schedule.row_src, in_use)
        d_gate_up, h_w, d_w_part = kernels.down_dgrad_router(
            d_out_rows, w_down, gate_up, schedule.row_src, topk_weights.contiguous(), schedule.block_expert, blocks,
            store_h_w=need_w_down, config=cfg.down_dgrad, expert_offsets=schedule.expert_offsets,
        )
        if kept:
            _release(gate_up)
        del gate_up
        if need_w_down:
            d_w_down = kernels.dw_down(d_out_rows, h_w, schedule.expert_offsets, num_experts, config=cfg.dw_down,
                                       row_src=schedule.row_src)
        del d_out_rows, h_w
        if need_weights:
            # row dest_row[t, j]'s partials summed in a fixed order (deterministic), 0 for a pair cut by a capacity
            d_topk_weights = kernels.row_sums(d_w_part, schedule.dest_row, topk_weights.dtype)
        # dw_gate_up's x: gathered in its loads (recompute: memory first), else x_rows, spread beside
        # gate_up_dgrad's GEMM where its kernel has room (its padding rows zeroed first), else by a pass of its own.
        # Beside the GEMM, x_rows [R, H] lives with d_x_rows [R, H]; while R <= 2 E I that moment stays below
        # dw_gate_up's, where d_w_gate_up [E, 2I, H] takes d_x_rows' place, so the backward's peak does not rise.
        gather_x = config.recompute and cfg.dw_gate_up.gluon
        x_rows = None
        if need_x:
            spread_x = None
            if (need_w_gate_up and not gather_x and schedule.num_rows <= num_experts * w_gate_up.shape[1]
                    and kernels.gate_up_dgrad_spreads_x(cfg.gate_up_dgrad, x)):
                x_rows = kernels.spread_rows(x, schedule.dest_row, schedule.row_src, in_use, padding_only=True)
                spread_x = (x, schedule.dest_row, x_rows)
            d_x_rows = kernels.gate_up_dgrad(d_gate_up, w_gate_up, schedule.block_expert, blocks,
                                             config=cfg.gate_up_dgrad, spread_x=spread_x,
                                             expert_offsets=schedule.expert_offsets)
            d_x = kernels.combine(d_x_rows, None, schedule.dest_row, d_x_shared, config=cfg.combine)
            del d_x_rows
        if need_w_gate_up:
            if gather_x:
                x_rows, gather = x, (schedule.row_src, schedule.top_k)
            else:
                if x_rows is None:  # into d_x_rows' freed memory
                    x_rows = kernels.spread_rows(x, schedule.dest_row, schedule.row_src, in_use)
                gather = None
            d_w_gate_up = kernels.dw_gate_up(d_gate_up, x_rows, schedule.expert_offsets, num_experts,
                                             config=cfg.dw_gate_up, gather=gather, row_src=schedule.row_src)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
