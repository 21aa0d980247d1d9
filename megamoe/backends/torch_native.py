"""The portable MoE path: the schedule, torch ops and (with a group) torch.distributed all_to_all.

It runs on CPU (gloo) and any GPU (NCCL), and is the baseline the benchmarks compare against: what a
user would otherwise write (TorchTitan-like: token gather, `torch._grouped_mm` over expert segments
padded to 16 rows, all_to_all with split sizes known on the host). Forward and backward are written
out by hand so that every reduction has a fixed order: the slot sums run in fp32, j = 0..k-1.

Backend interface (shared with the triton backend):
    block_m_for(hidden, intermediate, dtype) -> int      rows per expert-segment block for build_schedule
    empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule) -> tuple  tensors shaped like `saved`
    experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config)
        -> (out [T, H], saved: tuple of tensors for the backward)
    experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config, saved)
        -> (d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up | None, d_shared_down | None)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megamoe.schedule import Schedule

GROUPED_MM_ALIGN = 16


def block_m_for(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    del hidden, intermediate, dtype
    return GROUPED_MM_ALIGN


def _has_grouped_mm(a: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if a.device.type == "cuda":
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0)
    return a.device.type == "cpu" and a.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _aligned_16_bytes(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm rejects operands whose non-unit strides are not multiples of 16 bytes."""
    return all(s == 1 or s * t.element_size() % 16 == 0 for t in tensors for s in t.stride())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Segmented matmul over rows: segment e = rows [ends[e-1], ends[e]).

    a [R, K] @ b [E, K, N] -> [R, N] (rows past ends[-1] are unspecified), or, for a 2-D b,
    a.T-style weight gradients: a [N, R] (a transposed view) @ b [R, K] -> [E, N, K].
    """
    if _has_grouped_mm(a) and _aligned_16_bytes(a, b):
        return torch._grouped_mm(a, b, offs=ends)
    # NOTE: host sync (offsets to the host); only on devices/dtypes without torch._grouped_mm.
    bounds = [0] + ends.tolist()
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e in range(b.shape[0]):
            out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ b[e]
        return out
    return torch.stack([a[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]] for e in range(len(bounds) - 1)])


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in its accumulation precision: fp32, or fp64 for fp64 inputs."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def swiglu_fwd(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = _acc(gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def swiglu_bwd(gate_up: torch.Tensor, d_h: torch.Tensor) -> torch.Tensor:
    gate, up = _acc(gate_up).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_h = _acc(d_h)
    d_gate = d_h * up * sig * (1 + gate * (1 - sig))
    d_up = d_h * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


@dataclasses.dataclass
class _Exchange:
    """How rows move between token owners and expert owners for one schedule.

    send_order [T*k]: this rank's pairs sorted by (dest rank, dest row) — the order all_to_all sends them.
    recv_rows  [n]:   receive rows sorted by (source rank, row) — the order all_to_all delivers them.
    send_splits / recv_splits: rows per peer rank (host ints; see the NOTE in _exchange).
    """

    send_order: torch.Tensor
    recv_rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


def _exchange(schedule: Schedule) -> _Exchange:
    world, rows = schedule.world_size, schedule.num_rows
    pairs_per_rank = schedule.num_tokens * schedule.top_k
    dest_rank = schedule.dest_rank.reshape(-1).long()
    dest_row = schedule.dest_row.reshape(-1).long()
    send_key = torch.where(dest_row >= 0, dest_rank * rows + dest_row, world * rows)
    send_order = torch.argsort(send_key, stable=True)
    src = schedule.row_src.long()
    src_rank = torch.where(src >= 0, src // pairs_per_rank, world)
    recv_key = src_rank * rows + torch.arange(rows, device=src.device)
    recv_order = torch.argsort(recv_key, stable=True)
    ranks = torch.arange(world, device=src.device)
    # NOTE: host sync — all_to_all needs split sizes on the host (as TorchTitan and DeepEP's default do).
    send_splits = (dest_rank[dest_row >= 0].unsqueeze(1) == ranks).sum(0).tolist()
    recv_splits = (src_rank.unsqueeze(1) == ranks).sum(0).tolist()
    return _Exchange(send_order, recv_order[: sum(recv_splits)], send_splits, recv_splits)


def _all_to_all(rows_N: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = rows_N.new_empty(sum(out_splits), *rows_N.shape[1:])
    dist.all_to_all_single(out, rows_N.contiguous(), out_splits, in_splits, group=group)
    return out


def to_rows(source: torch.Tensor, schedule: Schedule, group, *, per_token: bool) -> torch.Tensor:
    """Token owner's rows -> the expert owner's receive rows [R, ...] (padding rows zero).

    source: [T, ...] one row per token (per_token) or [T*k, ...] one row per (token, slot) pair.
    """
    k = schedule.top_k if per_token else 1
    if group is None or schedule.world_size == 1:
        # One gather: padding rows (-1) read an appended zero row.
        src = schedule.row_src.long()
        padded = torch.cat([source, source.new_zeros(1, *source.shape[1:])])
        return padded[torch.where(src >= 0, src // k, source.shape[0])]
    rows = source.new_zeros(schedule.num_rows, *source.shape[1:])
    ex = _exchange(schedule)
    sent = source[ex.send_order[: sum(ex.send_splits)] // k]
    received = _all_to_all(sent, ex.recv_splits, ex.send_splits, group)
    return rows.index_copy(0, ex.recv_rows, received)


def to_pairs(rows_RH: torch.Tensor, schedule: Schedule, group) -> torch.Tensor:
    """Receive rows [R, H] -> the token owner's (token, slot) rows [T*k, H] (zero if a capacity dropped them)."""
    pairs = schedule.num_tokens * schedule.top_k
    if group is None or schedule.world_size == 1:
        dest = schedule.dest_row.reshape(-1).long()
        return torch.where((dest >= 0).unsqueeze(1), rows_RH[dest.clamp(min=0)], 0).to(rows_RH.dtype)
    ex = _exchange(schedule)
    returned = _all_to_all(rows_RH[ex.recv_rows], ex.send_splits, ex.recv_splits, group)
    out = rows_RH.new_zeros(pairs, rows_RH.shape[1])
    return out.index_copy(0, ex.send_order[: sum(ex.send_splits)], returned)


def slot_sum(pairs_TKH: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    """sum_j w[t, j] * pairs[t, j] in fp32 (fp64 for fp64), j in order 0..k-1."""
    acc_dtype = torch.promote_types(pairs_TKH.dtype, torch.float32)
    acc = torch.zeros(pairs_TKH.shape[0], pairs_TKH.shape[2], dtype=acc_dtype, device=pairs_TKH.device)
    for j in range(pairs_TKH.shape[1]):  # in place, one pass over acc per slot
        if weights_TK is None:
            acc.add_(pairs_TKH[:, j])
        else:
            acc.addcmul_(weights_TK[:, j : j + 1].to(acc_dtype), pairs_TKH[:, j])
    return acc


def rows_fwd(x_rows, w_gate_up, w_down, ends):
    """Expert MLPs over receive rows: returns (gate_up [R, 2I] pre-activation, y_rows [R, H])."""
    gate_up = grouped_mm(x_rows, w_gate_up.transpose(1, 2), ends)
    return gate_up, grouped_mm(swiglu_fwd(gate_up), w_down.transpose(1, 2), ends)


def rows_bwd(d_y_rows, x_rows, gate_up, w_gate_up, w_down, ends):
    """Backward of rows_fwd: returns (d_x_rows [R, H], d_w_gate_up, d_w_down)."""
    d_w_down = grouped_mm(d_y_rows.t(), swiglu_fwd(gate_up), ends)
    d_gate_up = swiglu_bwd(gate_up, grouped_mm(d_y_rows, w_down, ends))
    d_w_gate_up = grouped_mm(d_gate_up.t(), x_rows, ends)
    return grouped_mm(d_gate_up, w_gate_up, ends), d_w_gate_up, d_w_down


def shared_fwd(x, shared_gate_up, shared_down):
    return swiglu_fwd(x @ shared_gate_up.t()) @ shared_down.t()


def shared_bwd(d_out, x, shared_gate_up, shared_down):
    """Returns (d_x, d_shared_gate_up, d_shared_down) of the shared expert, recomputing its activations."""
    pre = x @ shared_gate_up.t()
    d_shared_down = d_out.t() @ swiglu_fwd(pre)
    d_pre = swiglu_bwd(pre, d_out @ shared_down)
    return d_pre @ shared_gate_up, d_pre.t() @ x, d_shared_down


def weighted_rows(d_out_rows: torch.Tensor, weight_rows: torch.Tensor) -> torch.Tensor:
    """d_y of each receive row: its pair's router weight times d_out of its token (fp32 product, cast)."""
    return (_acc(weight_rows).view(-1, 1) * _acc(d_out_rows)).to(d_out_rows.dtype)


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config=None):
    ends = schedule.expert_offsets[1:]
    x_rows = to_rows(x, schedule, group, per_token=True)
    gate_up, y_rows = rows_fwd(x_rows, w_gate_up, w_down, ends)
    y_pairs = to_pairs(y_rows, schedule, group).view(schedule.num_tokens, schedule.top_k, x.shape[1])
    out = slot_sum(y_pairs, topk_weights)
    if shared_gate_up is not None:
        out = out + shared_fwd(x, shared_gate_up, shared_down)
    return out.to(x.dtype), (x_rows, gate_up, y_pairs)


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule: Schedule) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like experts_fwd's `saved` (for torch.compile's fake implementation)."""
    rows, hidden = schedule.num_rows, x.shape[1]
    return (
        x.new_empty(rows, hidden),
        x.new_empty(rows, w_gate_up.shape[1]),
        x.new_empty(schedule.num_tokens, schedule.top_k, hidden),
    )


def pair_weight_grads(d_out: torch.Tensor, y_pairs_TKH: torch.Tensor) -> torch.Tensor:
    """d_topk_weights[t, j] = <d_out[t], y[t, j]> in fp32 (fp64 for fp64)."""
    acc_dtype = torch.promote_types(d_out.dtype, torch.float32)
    return (d_out.to(acc_dtype).unsqueeze(1) * y_pairs_TKH.to(acc_dtype)).sum(-1)


def experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config, saved):
    x_rows, gate_up, y_pairs = saved
    ends = schedule.expert_offsets[1:]
    d_out = d_out.to(x.dtype)
    d_topk_weights = pair_weight_grads(d_out, y_pairs).to(topk_weights.dtype)
    weight_rows = to_rows(topk_weights.reshape(-1), schedule, group, per_token=False)
    d_y_rows = weighted_rows(to_rows(d_out, schedule, group, per_token=True), weight_rows)
    d_x_rows, d_w_gate_up, d_w_down = rows_bwd(d_y_rows, x_rows, gate_up, w_gate_up, w_down, ends)
    d_x = slot_sum(to_pairs(d_x_rows, schedule, group).view(schedule.num_tokens, schedule.top_k, x.shape[1]), None)
    d_shared_gate_up = d_shared_down = None
    if shared_gate_up is not None:
        d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(d_out, x, shared_gate_up, shared_down)
        d_x = d_x + d_x_shared
    return d_x.to(x.dtype), d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
