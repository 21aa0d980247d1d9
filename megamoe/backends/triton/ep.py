"""Expert parallelism over NVLink: symmetric-memory dispatch and combine inside the persistent expert
GEMMs.

Forward: the routing exchange and the schedule (on the device, before this); the token owners publish x
(barrier, copy into symmetric memory, barrier); then the GEMMs with the communication inside them. On the
Gluon core (Hopper, ep_configs): gate_up_fwd's kernel (kernels/gluon_ep.py) pulls its own rows: two warps
of each CTA, beside its GEMM, copy a few receive rows at a time from the token owners and count them on
their group's ready flag; the GEMM's tiles are claimed in order and start as soon as their rows have
landed; then down_fwd's kernel (kernels/gluon_rows.py with PUSH) stores each result row straight into its
(token, slot) row of the token owner's pairs buffer (push combine). Elsewhere one persistent Triton kernel of the
pointer-load core (kernels/ep_fused.py) does both GEMMs with the same pulls, flags and pushes, the down
tiles a stage behind the gate/up tiles. Then a barrier (everything has landed), and the fixed-order fp32
slot sum (+ the shared expert, last).
Backward mirrors it, with the one-GPU backward's math: d_out and the router weights are published; the
d_out rows are pulled unweighted and each receive row's router weight beside them; then the down-projection
data grad with the router epilogue (kernels.down_dgrad_router: d_gate_up, h_w = w * h for d_w_down, and
the router weight's partial sums per row), the gate/up data grad, whose epilogue pushes the d_x rows, and
the two weight grads; each receive row's partials summed in order (row_sums) go into its pair's slot of the
token owner's weights buffer (which the expert owner alone read, for that pair's weight, earlier in the
same stream); a barrier, then the slot sum of d_x, and d_topk_weights read from the weights buffer. So
nothing of the forward's results is kept but x_rows and gate_up (saved), and at EP = 1 every result is the
one-GPU path's, bit for bit. On the Gluon core the d_out pull is still a whole copy before the kernels
(pull_rows), and the weight grads are the one-GPU kernels, run before the final barrier while the peers'
pushes land; the pointer-load core's one persistent kernel (kernels/ep_fused.py) pulls inside and runs the
weight-grad tiles as tasks that wait for every row of their expert.
No host synchronisation: every buffer has its worst-case (or declared-capacity) size and every range is
read on the device, so a forward+backward can be captured in a CUDA graph.

MoEConfig.dispatch / combine: "pull" dispatch with "push" combine (the "auto" choices, docs/perf-notes.md)
runs the fused kernels; any other pair, or overlap=False, runs whole exchanges (comm/exchange.py, with
their own barriers) around the one-GPU GEMMs: the unfused layer, the fused one's bitwise reference. All
give the same bits: every element is written by one program with the same values and reduction order,
whatever num_comm_sms and minibatch_tokens are. (The probes that time the GEMMs without the exchanges and
the exchanges without the GEMMs are benchmarks/ep_probes.py.)

Inference (experts_fwd(..., save_for_backward=False)): saved = (), so x_rows and gate_up are released when
the forward returns (the slot sum reads the symmetric pairs buffer in place, in training too); the forward
kernels still store gate_up (not storing it would be a change to the kernels). Gradients not needed
(experts_bwd's needs_grad) skip only what is local to this rank and outside a fused kernel: reading
d_topk_weights, the shared expert's gradients, the final slot sum of d_x and, except in the pointer-load
core's fused kernel, the weight-grad kernels (h_w is then not stored either). That kernel computes d_x
rows and both weight grads whatever is needed (skipping inside it would need kernel changes), and the
exchanges always run: a peer's d_x, router-weight and weight grads need this rank's rows whatever this
rank needs. Gradients computed but not needed are returned anyway; megamoe.autograd drops them.

The empty batch (T = 0): the ranks of a group agree on T (megamoe.autograd.check_ranks_agree, run on
every call with T = 0: a rank alone with it fails there, a ValueError on every rank where its peers check
this call too, else a RuntimeError after comm_timeout_ms while its peers' barriers time out), so T = 0
here means no rank has a token and R = 0 on every rank. Nothing is exchanged or launched, on every rank
alike (the symmetric workspace is not even looked up: it has no buffers of 0 rows): the routing exchange
returns the empty routing, the forward an empty out, the backward an empty d_x and d_topk_weights and
exact-zero weight gradients.

Why no extra barrier is needed around the pushes: a pairs buffer we push into was last read by its
owner's collect_pushed of the previous exchange, which precedes, on the owner's stream, a barrier that
this exchange passed (the publish barriers, or those of a whole push dispatch); the owner reads it
again only after the final barrier, which each rank reaches after its pushing kernel.
"""

from __future__ import annotations

import math

import torch

from megamoe.backends import ALL_GRADS
from megamoe.backends.swiglu import empty_shared_saved, shared_bwd, shared_fwd
from megamoe.backends.triton import kernels
from megamoe.backends.triton.comm.exchange import (
    ReceiveMaps, collect_pushed, combine, dispatch, dispatch_pair_weights, gather_routing, publish, pull_rows, push_rows,
    receive_maps,
)
from megamoe.backends.triton.comm.workspace import Workspace, _Buffer, get_workspace
from megamoe.backends.triton.configs import KernelConfigs, ep_tma_kernel_configs
from megamoe.backends.triton.experts import all_blocks, configs_for, empty_batch_grads
from megamoe.backends.triton.kernels import tma_gemm
from megamoe.backends.triton.kernels._common import num_sms
from megamoe.schedule import Schedule, receive_rows

# The direction "auto" resolves to, per operation (docs/perf-notes.md has the measurements).
AUTO_DIRECTIONS = {"dispatch": "pull", "combine": "push"}
# MoEConfig.num_comm_sms = None on the pointer-load core (kernels/ep_fused.py): communication programs of
# each fused kernel, one SM each; they join its GEMM tasks when the pulls run out. Swept at EP=2, fwd+bwd
# (docs/perf-notes.md, "EP v7"): qwen3-30b-a3b 16 / 24 / 32 / 48 -> 9.50 / 9.44 / 9.41 / 9.48 ms,
# qwen3-235b-a22b 32.78 / 32.76 / 32.57 / 32.69 ms: flat within 1%, 32 the best of both.
DEFAULT_COMM_SMS = 32


def _direction(config, operation: str) -> str:
    chosen = getattr(config, operation)
    return AUTO_DIRECTIONS[operation] if chosen == "auto" else chosen


def _workspace(x: torch.Tensor, num_tokens: int, top_k: int, num_rows: int, group, config):
    """The workspace of a call with R = num_rows receive rows. It holds receive rows (rows_in, rows_out) only
    for the directions whose whole exchanges use them, push dispatch and pull combine: the "auto" pair (pull
    dispatch, push combine), fused or not, moves rows between the token owners' buffers and local tensors."""
    whole_exchange_rows = _direction(config, "dispatch") == "push" or _direction(config, "combine") == "pull"
    return get_workspace(
        group, device=x.device, num_tokens=num_tokens, hidden_size=x.shape[1], top_k=top_k,
        num_rows=num_rows if whole_exchange_rows else 0, dtype=x.dtype, comm_timeout_ms=config.comm_timeout_ms,
    )


def routing_exchange(x, w_gate_up, group, config):
    """build_schedule's gather_routing: every rank publishes its [T, k] ids in symmetric memory, after its
    (T, T*k, R), and reads all of them (bounded waits, no host sync; a peer with other shapes fails a device
    assert: exchange.gather_routing). Returns a callable ids [T, k] -> [W*T, k]."""

    def gather(ids_TK: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = ids_TK.shape
        if num_tokens == 0:  # T = 0 on every rank (module docstring): no routing anywhere, [W*0, k]
            return ids_TK
        world = torch.distributed.get_world_size(group)
        rows = receive_rows(num_tokens, top_k, w_gate_up.shape[0], world, config.block_m, config.capacity_factor)
        return gather_routing(_workspace(x, num_tokens, top_k, rows, group, config), ids_TK, rows)

    return gather


def _pair_index(schedule: Schedule) -> torch.Tensor:
    """int32 [T, k]: row t*k + j of the pairs buffer holds pair (t, j); -1 where a capacity dropped it."""
    pairs = torch.arange(schedule.num_tokens * schedule.top_k, device=schedule.dest_row.device, dtype=torch.int32)
    return torch.where(schedule.dest_row >= 0, pairs.view_as(schedule.dest_row), -1).to(torch.int32)


def comm_programs(config, device: torch.device, *, gluon: bool = False) -> int:
    """Communication programs of each pulling kernel (MoEConfig.num_comm_sms). The pointer-load core's
    (kernels/ep_fused.py) pull before they compute: DEFAULT_COMM_SMS of them by default, leaving SMs for
    the GEMMs. The Gluon core's (gluon: kernels/gluon_ep.py) pull with two warps beside their GEMM, taking
    no SM from it: every CTA by default, at most one per SM."""
    sms = num_sms(device)
    if config.num_comm_sms is None:
        return sms if gluon else DEFAULT_COMM_SMS
    comm = config.num_comm_sms
    if device.type == "cuda" and (comm > sms if gluon else comm >= sms):
        raise ValueError(f"MoEConfig.num_comm_sms must leave SMs for the expert GEMMs: got {comm}, this GPU has {sms}"
                         if not gluon else f"MoEConfig.num_comm_sms is at most one per SM: got {comm}, this GPU has {sms}")
    return comm


def group_blocks(schedule: Schedule, config) -> int:
    """Schedule blocks per ready flag: the rows of about minibatch_tokens tokens (minibatch_tokens * k
    rows, whole blocks), at most the schedule's blocks (one flag for them all; a count near 2**31 would
    overflow the pull loop's int32 count of flags, kernels/comm_tiles.pull_then_claim); None: one block, the
    finest granularity (a tile waits only for its own rows)."""
    if config.minibatch_tokens is None:
        return 1
    blocks = math.ceil(config.minibatch_tokens * schedule.top_k / schedule.block_m)
    return max(1, min(blocks, schedule.num_rows // schedule.block_m))


def _pull(buffer: _Buffer, maps: ReceiveMaps, schedule: Schedule, config, device: torch.device, *,
          gluon: bool) -> kernels.RowPull:
    return kernels.RowPull(buffer.peer_ptrs, maps.src_rank, maps.src_token, comm_programs(config, device, gluon=gluon),
                           group_blocks(schedule, config), _timeout_ns(config))


def _timeout_ns(config) -> int:
    return config.comm_timeout_ms * 1_000_000


def _push(ws: Workspace, maps: ReceiveMaps) -> kernels.RowPush:
    return kernels.RowPush(ws.pairs.peer_ptrs, maps.src_rank, maps.src_pair)


# ----------------------------------------------------------------------------------------------------
# Forward and backward


def ep_configs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, schedule: Schedule) -> KernelConfigs:
    """The tiles of the expert-parallel path: the Gluon core's where it runs (a Hopper GPU, 16-bit operands TMA can
    address: configs.ep_tma_kernel_configs and 16-byte aligned weights), the pointer-load core's elsewhere. Host
    metadata only: no sync."""
    tma = ep_tma_kernel_configs(x.shape[1], w_gate_up.shape[1] // 2, x.dtype, x.device, schedule.block_m)
    if tma is not None and tma_gemm.tma_addressable(w_gate_up, w_down):
        return tma
    return configs_for(x, w_gate_up, schedule)


def _fused(config, overlap: bool) -> bool:
    """Whether the layer runs the fused kernels: pull dispatch and push combine (the "auto" directions),
    unless overlap=False. Otherwise whole exchanges run around the one-GPU GEMMs (the same bits)."""
    return overlap and _direction(config, "dispatch") == "pull" and _direction(config, "combine") == "push"


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config,
                *, overlap: bool = True, save_for_backward: bool = True):
    """overlap=False: whole exchanges around the one-GPU GEMMs whatever the directions, the unfused layer
    (the fused one's bitwise reference, and its time without overlap in benchmarks/overlap_bench.py)."""
    if schedule.num_tokens == 0:  # T = 0 on every rank (module docstring): nothing to exchange or launch
        saved = empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule, config) if save_for_backward else ()
        return x.new_empty(0, x.shape[1]), saved
    fused = _fused(config, overlap)
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = ep_configs(x, w_gate_up, w_down, schedule)
    x = x.contiguous()
    rows, hidden = schedule.num_rows, x.shape[1]
    pull, push = _direction(config, "dispatch") == "pull", _direction(config, "combine") == "push"
    maps, blocks = receive_maps(schedule), all_blocks(schedule)

    shared_out, shared_saved = shared_fwd(x, shared_gate_up, shared_down)
    if not pull:  # push dispatch: the token owners write the receive rows (a whole exchange)
        x_rows = dispatch(ws, x, schedule, "push")
    else:  # filled by the pull (fused kernel or pull_rows) below
        x_rows = x.new_empty(rows, hidden)
        publish(ws, [(ws.tokens, x)], "dispatch")
    if fused:
        row_pull = _pull(ws.tokens, maps, schedule, config, x.device, gluon=cfg.gate_up_fwd.gluon)
        row_push = _push(ws, maps)
        if cfg.gate_up_fwd.gluon:  # two Gluon kernels: gate_up_fwd pulling its rows, down_fwd pushing its own
            h, gate_up = kernels.gate_up_fwd_pull(x_rows, w_gate_up, schedule.block_expert, blocks, row_pull,
                                                  config=cfg.gate_up_fwd)
            kernels.down_fwd(h, w_down, schedule.block_expert, blocks, config=cfg.down_fwd, push=row_push,
                             expert_offsets=schedule.expert_offsets)
        else:  # one persistent Triton kernel (the pointer-load core)
            h, gate_up = kernels.ep_forward(x_rows, w_gate_up, w_down, schedule.block_expert, blocks, row_pull,
                                            row_push, gate_up_config=cfg.gate_up_fwd, down_config=cfg.down_fwd)
        y_pairs = collect_pushed(ws, keep=False)  # read once, by the slot sum below
    else:
        if pull:
            pull_rows(ws.tokens, maps, x_rows, by_token=True)
        h, gate_up = kernels.gate_up_fwd(x_rows, w_gate_up, schedule.block_expert, blocks, store_gate_up=True,
                                         config=cfg.gate_up_fwd, expert_offsets=schedule.expert_offsets)
        y_rows = kernels.down_fwd(h, w_down, schedule.block_expert, blocks, config=cfg.down_fwd,
                                  expert_offsets=schedule.expert_offsets)
        y_pairs = combine(ws, y_rows, schedule, "push" if push else "pull")
    out = kernels.combine(y_pairs, topk_weights, _pair_index(schedule), shared_out, config=cfg.combine)
    if not save_for_backward:
        return out, ()
    return out, (x_rows, gate_up, *shared_saved)


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule: Schedule, config):
    """Tensors shaped like experts_fwd's `saved`: (x_rows, gate_up, *the shared expert's); config.recompute does not
    change them here."""
    rows, inter, hidden = schedule.num_rows, w_down.shape[2], x.shape[1]
    return (x.new_empty(rows, hidden), x.new_empty(rows, 2 * inter), *empty_shared_saved(x, shared_gate_up))


def _row_index(maps: ReceiveMaps) -> torch.Tensor:
    """int32 [R]: r for a receive row holding a pair, -1 for padding: the index of each row's router weight in the
    pulled weight rows (down_dgrad_router's row_src), and of its partial sums (row_sums)."""
    return torch.where(maps.src_rank >= 0, maps.rows, -1).to(torch.int32)


def experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config,
                saved, *, overlap: bool = True, needs_grad: tuple[bool, ...] = ALL_GRADS):
    """All six gradients (see experts.experts_bwd); needs_grad skips only this rank's local work (module
    docstring): the fused kernel and the exchanges always run, so some gradients not asked for come back anyway.
    overlap=False: whole exchanges around the one-GPU GEMMs, as in experts_fwd."""
    if schedule.num_tokens == 0:  # as in experts_fwd
        return empty_batch_grads(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, needs_grad)
    need_x, need_weights, need_w_gate_up, need_w_down, need_shared_gate_up, need_shared_down = needs_grad
    fused = _fused(config, overlap)
    x_rows, gate_up, *shared_saved = saved
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = ep_configs(x, w_gate_up, w_down, schedule)
    rows, hidden, experts = schedule.num_rows, x.shape[1], w_down.shape[0]
    pull, push = _direction(config, "dispatch") == "pull", _direction(config, "combine") == "push"
    maps, blocks = receive_maps(schedule), all_blocks(schedule)
    row_index = _row_index(maps)
    d_out = d_out.to(x.dtype).contiguous()
    weights = topk_weights.float().contiguous()

    d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(
        d_out, x, shared_gate_up, shared_down, shared_saved,
        need_x=need_x, need_gate_up=need_shared_gate_up, need_down=need_shared_down,
    )
    # The d_out rows (unweighted) and each receive row's router weight, as the one-GPU backward has them.
    if pull:
        publish(ws, [(ws.tokens, d_out), (ws.weights, weights)], "dispatch")
        weight_rows = weights.new_empty(rows)
        pull_rows(ws.weights, maps, weight_rows, by_token=False)
    else:
        weight_rows = dispatch_pair_weights(ws, weights, schedule)
    if fused and not cfg.down_dgrad.gluon:  # one persistent Triton kernel (the pointer-load core)
        d_out_rows = x.new_empty(rows, hidden)
        d_w_gate_up, d_w_down, d_w_part = kernels.ep_backward(
            d_out_rows, x_rows, gate_up, w_gate_up, w_down, schedule.block_expert, blocks, schedule.expert_offsets,
            row_index, weight_rows, _pull(ws.tokens, maps, schedule, config, x.device, gluon=False), _push(ws, maps),
            down_dgrad_config=cfg.down_dgrad, gate_up_dgrad_config=cfg.gate_up_dgrad,
            dw_down_config=cfg.dw_down, dw_gate_up_config=cfg.dw_gate_up)
    else:  # the Gluon core fused (its d_out pull still a whole copy, gate_up_dgrad pushing its rows), or unfused
        if pull:
            d_out_rows = x.new_empty(rows, hidden)
            pull_rows(ws.tokens, maps, d_out_rows, by_token=True)
        else:
            d_out_rows = dispatch(ws, d_out, schedule, "push")
        # The router weight in the epilogue: d_gate_up, h_w = w * h (for d_w_down) and the router weight's partials.
        d_gate_up, h_w, d_w_part = kernels.down_dgrad_router(
            d_out_rows, w_down, gate_up, row_index, weight_rows, schedule.block_expert, blocks,
            store_h_w=need_w_down, config=cfg.down_dgrad, expert_offsets=schedule.expert_offsets)
        d_x_rows = kernels.gate_up_dgrad(d_gate_up, w_gate_up, schedule.block_expert, blocks, config=cfg.gate_up_dgrad,
                                         push=_push(ws, maps) if fused else None,
                                         expert_offsets=schedule.expert_offsets)
        # the weight grads need every row of an expert: kernels of their own here (local: skipped when not needed),
        # before the final barrier, while the peers' pushes land
        d_w_down = d_w_gate_up = None
        if need_w_down:
            d_w_down = kernels.dw_down(d_out_rows, h_w, schedule.expert_offsets, experts, config=cfg.dw_down,
                                       row_src=schedule.row_src)
        if need_w_gate_up:
            d_w_gate_up = kernels.dw_gate_up(d_gate_up, x_rows, schedule.expert_offsets, experts,
                                             config=cfg.dw_gate_up, row_src=schedule.row_src)
    # The router weights' gradient: each receive row's partials summed in order (row_sums, as the one-GPU path
    # sums them), pushed into its pair's slot of the token owner's weights buffer, which only this rank read.
    push_rows(ws.weights, kernels.row_sums(d_w_part, row_index.view(-1, 1), torch.float32).view(-1), maps)
    if fused:
        d_x_pairs = collect_pushed(ws, keep=False)  # read once, by the slot sum below
    else:
        d_x_pairs = combine(ws, d_x_rows, schedule, "push" if push else "pull")
    # After the final barrier every pair's gradient has landed (0 for a pair a capacity dropped, as on one GPU).
    d_topk_weights = None
    if need_weights:
        d_topk_weights = torch.where(schedule.dest_row >= 0, ws.weights.local, 0.0).to(topk_weights.dtype)
    d_x = None
    if need_x:
        d_x = kernels.combine(d_x_pairs, None, _pair_index(schedule), d_x_shared, config=cfg.combine)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
