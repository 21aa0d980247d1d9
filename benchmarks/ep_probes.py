"""Measurement probes of the expert-parallel layer (megamoe/backends/triton/ep.py) for overlap_bench.py:
its compute without the communication and its communication without the compute. Their results are
wrong by design (timing only); nothing in the library calls them.

  compute  the one-GPU kernels of the unfused layer (same tiles) on every SM, with no copy and no
           barrier: the GEMMs run on unfilled receive rows and the slot sums read whatever the pairs
           buffer holds. The best the layer could do if communication were free.
  comm     the unfused layer's exchanges alone (barriers, publishes, whole pulls/pushes, the final
           copies, the backward's push of the router weights' gradients), no GEMM, no slot sum, no shared
           expert.

The layer itself, overlapped or not (overlap=False: whole exchanges around the one-GPU GEMMs), is
ep.experts_fwd / ep.experts_bwd. Each probe takes the arguments they take and returns what is
passed on the same way: (out, saved) from a forward, a tuple of tensors from a backward.
"""

from __future__ import annotations

import torch

from megamoe.backends.swiglu import shared_bwd, shared_fwd
from megamoe.backends.triton import ep, kernels
from megamoe.backends.triton.comm import exchange
from megamoe.backends.triton.experts import all_blocks


def _setup(x, w_gate_up, w_down, schedule, group, config):
    """What ep.experts_fwd / _bwd set up on every call (workspace, tiles, receive maps, block range): both
    probes pay it, as the layer does, so that they time the layer less one side."""
    ws = ep._workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    return ws, ep.ep_configs(x, w_gate_up, w_down, schedule), exchange.receive_maps(schedule), all_blocks(schedule)


def compute_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config):
    ws, cfg, _, blocks = _setup(x, w_gate_up, w_down, schedule, group, config)
    shared_out, shared_saved = shared_fwd(x, shared_gate_up, shared_down)
    x_rows = x.new_empty(schedule.num_rows, x.shape[1])
    h, gate_up = kernels.gate_up_fwd(x_rows, w_gate_up, schedule.block_expert, blocks, store_gate_up=True,
                                     config=cfg.gate_up_fwd, expert_offsets=schedule.expert_offsets)
    kernels.down_fwd(h, w_down, schedule.block_expert, blocks, config=cfg.down_fwd,
                     expert_offsets=schedule.expert_offsets)
    y_pairs = ws.pairs.local
    out = kernels.combine(y_pairs, topk_weights, ep._pair_index(schedule), shared_out, config=cfg.combine)
    return out, (x_rows, gate_up, *shared_saved)


def compute_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config,
                saved):
    x_rows, gate_up, *shared_saved = saved
    ws, cfg, maps, blocks = _setup(x, w_gate_up, w_down, schedule, group, config)
    pair_index, experts, row_index = ep._pair_index(schedule), w_down.shape[0], ep._row_index(maps)
    d_out = d_out.to(x.dtype).contiguous()
    d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(d_out, x, shared_gate_up, shared_down, shared_saved)
    d_out_rows = x.new_empty(schedule.num_rows, x.shape[1])
    weight_rows = torch.zeros(schedule.num_rows, dtype=torch.float32, device=x.device)
    d_gate_up, h_w, d_w_part = kernels.down_dgrad_router(
        d_out_rows, w_down, gate_up, row_index, weight_rows, schedule.block_expert, blocks, store_h_w=True,
        config=cfg.down_dgrad, expert_offsets=schedule.expert_offsets)
    kernels.gate_up_dgrad(d_gate_up, w_gate_up, schedule.block_expert, blocks, config=cfg.gate_up_dgrad,
                          expert_offsets=schedule.expert_offsets)
    d_w_down = kernels.dw_down(d_out_rows, h_w, schedule.expert_offsets, experts, config=cfg.dw_down,
                               row_src=schedule.row_src)
    d_w_gate_up = kernels.dw_gate_up(d_gate_up, x_rows, schedule.expert_offsets, experts, config=cfg.dw_gate_up,
                                     row_src=schedule.row_src)
    kernels.row_sums(d_w_part, row_index.view(-1, 1), torch.float32)  # each row's sum, which the layer pushes
    d_topk_weights = torch.where(schedule.dest_row >= 0, ws.weights.local, 0.0)  # read as the layer reads it
    d_x = kernels.combine(ws.pairs.local, None, pair_index, d_x_shared, config=cfg.combine)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down


def comm_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config):
    """Returns (the pairs rows the combine delivered, (the receive rows the dispatch filled,))."""
    ws, _, maps, _ = _setup(x, w_gate_up, w_down, schedule, group, config)
    x = x.contiguous()
    if ep._direction(config, "dispatch") == "pull":
        x_rows = x.new_empty(schedule.num_rows, x.shape[1])
        exchange.publish(ws, [(ws.tokens, x)], "dispatch")
        exchange.pull_rows(ws.tokens, maps, x_rows, by_token=True)
    else:
        x_rows = exchange.dispatch(ws, x, schedule, "push")
    y_rows = x.new_empty(schedule.num_rows, x.shape[1])  # the down GEMM's rows, never computed
    return exchange.combine(ws, y_rows, schedule, ep._direction(config, "combine")), (x_rows,)


def comm_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config,
             saved):
    """Returns (the d_out rows the dispatch filled, the d_x pairs rows the combine delivered)."""
    ws, _, maps, _ = _setup(x, w_gate_up, w_down, schedule, group, config)
    rows, hidden = schedule.num_rows, x.shape[1]
    d_out = d_out.to(x.dtype).contiguous()
    weights = topk_weights.float().contiguous()
    if ep._direction(config, "dispatch") == "pull":
        d_out_rows, weight_rows = x.new_empty(rows, hidden), weights.new_empty(rows)
        exchange.publish(ws, [(ws.tokens, d_out), (ws.weights, weights)], "dispatch")
        exchange.pull_rows(ws.tokens, maps, d_out_rows, by_token=True)
        exchange.pull_rows(ws.weights, maps, weight_rows, by_token=False)
    else:
        weight_rows = exchange.dispatch_pair_weights(ws, weights, schedule)
        d_out_rows = exchange.dispatch(ws, d_out, schedule, "push")
    exchange.push_rows(ws.weights, weight_rows, maps)  # the router weights' gradients (here: the weights themselves)
    d_x_rows = x.new_empty(rows, hidden)  # the gate/up data grad's rows, never computed
    return d_out_rows, exchange.combine(ws, d_x_rows, schedule, ep._direction(config, "combine"))
