"""Expert parallelism over NVLink: symmetric-memory dispatch and combine around the fused kernels.

Forward: dispatch x to this rank's receive rows (pull or push), the fused gate/up (+SwiGLU) and down
GEMMs over the rows, combine the results into (token, slot) rows on the token owners (push or pull),
then the fixed-order fp32 slot sum (+ the shared expert, last). Backward mirrors it: d_out and the
router weights go to the experts, the fused dgrad/wgrad kernels run over the rows, d_x rows come back.
No host synchronisation: routing is exchanged through symmetric memory and the schedule is built on the
device; every buffer has its worst-case (or declared-capacity) size. Both directions of each exchange
move the same bits, so results do not depend on MoEConfig.dispatch/combine.

The rows compute is the one-GPU path's (experts.rows_fwd / rows_bwd): the dispatch already lands rows
expert-contiguous with zero padding rows, which is exactly what those kernels read. The backward scales
the dispatched d_out rows by their pair's router weight once (gather_rows, scale only) to get d_y_rows.
The slot sums read the exchanged pairs buffer [T*k, H] through index[t, j] = t*k + j (-1 where a
capacity dropped the pair).
"""

from __future__ import annotations

import torch

from megamoe.backends.triton import kernels
from megamoe.backends.triton.comm.exchange import combine, dispatch, dispatch_pair_weights, gather_routing
from megamoe.backends.triton.comm.workspace import get_workspace
from megamoe.backends.triton.experts import configs_for, rows_bwd, rows_fwd, rows_in_use, shared_bwd, shared_fwd
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


def _pair_index(schedule: Schedule) -> torch.Tensor:
    """int32 [T, k]: row t*k + j of the pairs buffer holds pair (t, j); -1 where a capacity dropped it."""
    pairs = torch.arange(schedule.num_tokens * schedule.top_k, device=schedule.dest_row.device, dtype=torch.int32)
    return torch.where(schedule.dest_row >= 0, pairs.view_as(schedule.dest_row), -1).to(torch.int32)


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config):
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = configs_for(x, w_gate_up, schedule)
    x = x.contiguous()
    x_rows = dispatch(ws, x, schedule, _direction(config, "dispatch"))
    h, gate_up, y_rows = rows_fwd(x_rows, w_gate_up, w_down, schedule, cfg)
    y_pairs = combine(ws, y_rows, schedule, _direction(config, "combine"))
    shared_out, shared_act = None, x.new_empty(0)
    if shared_gate_up is not None:
        shared_out, shared_act = shared_fwd(x, shared_gate_up, shared_down)
    out = kernels.combine(y_pairs, topk_weights, _pair_index(schedule), shared_out, config=cfg.combine)
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
    cfg = configs_for(x, w_gate_up, schedule)
    pair_index = _pair_index(schedule)
    d_out = d_out.to(x.dtype).contiguous()
    d_topk_weights = kernels.combine_bwd(d_out, y_pairs, pair_index, config=cfg.combine)
    weight_rows = dispatch_pair_weights(ws, topk_weights.float().contiguous(), schedule)
    d_out_rows = dispatch(ws, d_out, schedule, _direction(config, "dispatch"))
    # d_y rows are handed over without a local reference, so rows_bwd frees them after their last GEMM.
    d_x_rows, d_w_gate_up, d_w_down = rows_bwd(
        kernels.gather_rows(d_out_rows, None, weight_rows, rows_in_use(schedule)),
        x_rows, h, gate_up, w_gate_up, w_down, schedule, cfg,
    )
    d_x_pairs = combine(ws, d_x_rows, schedule, _direction(config, "combine"))
    d_x_shared = d_shared_gate_up = d_shared_down = None
    if shared_gate_up is not None:
        d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(d_out, x, shared_gate_up, shared_down, shared_act)
    d_x = kernels.combine(d_x_pairs, None, pair_index, d_x_shared, config=cfg.combine)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
