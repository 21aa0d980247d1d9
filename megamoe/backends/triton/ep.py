"""Expert parallelism over NVLink: symmetric-memory dispatch and combine around the fused kernels.

Forward: dispatch x to this rank's receive rows (pull or push), the fused gate/up (+SwiGLU) and down
GEMMs over the rows, combine the results into (token, slot) rows on the token owners (push or pull),
then the fixed-order fp32 slot sum (+ the shared expert, last). Backward mirrors it: d_out and the
router weights go to the experts, the fused dgrad/wgrad kernels run over the rows, d_x rows come back.
No host synchronisation: routing is exchanged through symmetric memory and the schedule is built on the
device; every buffer has its worst-case (or declared-capacity) size. Both directions of each exchange
move the same bits, so results do not depend on MoEConfig.dispatch/combine.

The kernels are the one-GPU ones: they read A rows at `row_map[r] // top_k`; here the rows are already
expert-contiguous, so row_map is the identity (row r reads row r, -1 for padding) with top_k 1.
"""

from __future__ import annotations

import torch

from megamoe.backends.triton import kernels
from megamoe.backends.triton.comm.exchange import combine, dispatch, dispatch_pair_weights, gather_routing
from megamoe.backends.triton.comm.workspace import get_workspace
from megamoe.backends.triton.configs import kernel_configs
from megamoe.backends.triton.experts import shared_bwd, shared_fwd
from megamoe.schedule import Schedule, receive_rows

# The direction "auto" resolves to, per operation (docs/perf-notes.md has the measurements).
AUTO_DIRECTIONS = {"dispatch": "pull", "combine": "push"}


def _direction(config, operation: str) -> str:
    chosen = getattr(config, operation)
    return AUTO_DIRECTIONS[operation] if chosen == "auto" else chosen


def _workspace(x: torch.Tensor, num_tokens: int, top_k: int, num_rows: int, group, config):
    return get_workspace(
        group, device=x.device, num_tokens=num_tokens, hidden_size=x.shape[1],
        topk=top_k, num_rows=num_rows, dtype=x.dtype, timeout_ms=config.comm_timeout_ms,
    )


def routing_exchange(x, w_gate_up, group, config):
    """build_schedule's gather_routing: every rank publishes its [T, k] ids in symmetric memory and
    reads all of them (bounded waits, no host sync). Returns a callable ids [T, k] -> [W*T, k]."""

    def gather(ids_TK: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = ids_TK.shape
        world = torch.distributed.get_world_size(group)
        rows = receive_rows(num_tokens, top_k, w_gate_up.shape[0], world, config.block_m, config.capacity_factor)
        return gather_routing(_workspace(x, num_tokens, top_k, rows, group, config), ids_TK)

    return gather


def _row_map(schedule: Schedule) -> torch.Tensor:
    rows = torch.arange(schedule.num_rows, device=schedule.row_src.device, dtype=torch.int32)
    return torch.where(schedule.row_src >= 0, rows, -1).to(torch.int32)


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config):
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = kernel_configs(x.shape[1], w_down.shape[2], x.dtype, x.device, schedule.block_m)
    row_map = _row_map(schedule)
    x_rows = dispatch(ws, x, schedule, _direction(config, "dispatch"))
    h, gate_up = kernels.gate_up_fwd(
        x_rows, w_gate_up, row_map, schedule.block_expert, schedule.num_blocks, 1, store_gate_up=True,
        config=cfg.gate_up_fwd,
    )
    y_rows = kernels.down_fwd(h, w_down, row_map, schedule.block_expert, schedule.num_blocks, schedule.num_rows,
                              config=cfg.down_fwd)
    y_pairs = combine(ws, y_rows, schedule, _direction(config, "combine"))
    shared_out, shared_act = None, x.new_empty(0)
    if shared_gate_up is not None:
        shared_out, shared_act = shared_fwd(x, shared_gate_up, shared_down)
    out = kernels.combine(y_pairs, topk_weights, schedule.dest_row, shared_out, config=cfg.combine)
    return out, (x_rows, h, gate_up, y_pairs, shared_act)


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule: Schedule):
    rows, inter, hidden = schedule.num_rows, w_down.shape[2], x.shape[1]
    shared = x.new_empty(x.shape[0], shared_gate_up.shape[0]) if shared_gate_up is not None else x.new_empty(0)
    return (
        x.new_empty(rows, hidden),
        x.new_empty(rows, inter),
        x.new_empty(rows, 2 * inter),
        x.new_empty(schedule.num_tokens * schedule.top_k, hidden),
        shared,
    )


def experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config, saved):
    x_rows, h, gate_up, y_pairs, shared_act = saved
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = kernel_configs(x.shape[1], w_down.shape[2], x.dtype, x.device, schedule.block_m)
    row_map = _row_map(schedule)
    d_out = d_out.to(x.dtype).contiguous()
    d_topk_weights = kernels.combine_bwd(d_out, y_pairs, schedule.dest_row, config=cfg.combine)
    weight_rows = dispatch_pair_weights(ws, topk_weights.float().contiguous(), schedule).view(-1, 1)
    d_out_rows = dispatch(ws, d_out, schedule, _direction(config, "dispatch"))
    d_gate_up = kernels.down_dgrad(
        d_out_rows, weight_rows, w_down, gate_up, row_map, schedule.block_expert, schedule.num_blocks,
        config=cfg.down_dgrad,
    )
    d_x_rows = kernels.gate_up_dgrad(
        d_gate_up, w_gate_up, row_map, schedule.block_expert, schedule.num_blocks, schedule.num_rows,
        config=cfg.gate_up_dgrad,
    )
    num_local = w_gate_up.shape[0]
    d_w_down = kernels.dw_down(d_out_rows, weight_rows, h, row_map, schedule.expert_offsets, num_local, config=cfg.dw_down)
    d_w_gate_up = kernels.dw_gate_up(d_gate_up, x_rows, row_map, schedule.expert_offsets, num_local, 1,
                                     config=cfg.dw_gate_up)
    d_x_pairs = combine(ws, d_x_rows, schedule, _direction(config, "combine"))
    d_x_shared = d_shared_gate_up = d_shared_down = None
    if shared_gate_up is not None:
        d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(d_out, x, shared_gate_up, shared_down, shared_act)
    d_x = kernels.combine(d_x_pairs, None, schedule.dest_row, d_x_shared, config=cfg.combine)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
