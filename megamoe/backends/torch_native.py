"""The portable MoE path: the schedule, torch ops and (with a group) torch.distributed all_to_all.

It runs on CPU (gloo) and any GPU (NCCL): token gather, `torch._grouped_mm` over expert segments padded
to 16 rows, all_to_all with split sizes known on the host. (The benchmarks' baseline, what TorchTitan users
run, is megamoe.bench.baselines; this path is timed beside it as "portable".) Forward and backward are
written out by hand, in eager ops chosen for the bytes they move, so that every reduction has a fixed order.

Precision (bf16/fp16 inputs; fp32 and fp64 run the same ops in their own dtype):
- GEMMs run in the input dtype (fp32 accumulation inside); SwiGLU and its backward run in the input dtype
  with fp32 math inside each op, one rounding per op: exactly the ops of PyTorch's own F.silu(g) * u and
  its autograd (the error-budget reference), never an fp32 copy of [R, 2I] (backends/swiglu.py, which
  also holds the shared expert that every backend runs).
- Forward slot sum: out[t] = sum_j w[t, j] * y[t, j] + shared[t], products and sums in fp32 (fp64 for
  fp64), j = 0..k-1 in order, one chain of in-place fp32 ops (the documented math).
- Backward: d_y = w * d_out in fp32, rounded once; d_x[t] = sum_j d_x_pairs[t, j] by one torch.sum with
  fp32 accumulation, whose order is fixed by the shapes and the device, not j = 0..k-1 for every k (CUDA's
  reduction kernel pairs slots j and j+4 for k > 4; the CPU's regroups the slots by H and its vector width:
  torch 2.13 on an AVX-512 CPU from k = 5 at H = 1000, from k = 18 at H = 4096); d_topk_weights[t, j] =
  <d_out[t], y[t, j]> summed in fp32 over products rounded once to the input dtype (fp16: fp32 products, past
  fp16's range).
Deterministic: no atomics, no index_add_/scatter_add_; every scatter (index_copy_) has unique targets.
No host sync on the one-process path where torch._grouped_mm runs (bf16 on NVIDIA GPUs of compute capability
9.x and 10.x; fp32 / bf16 / fp16 on the CPU); elsewhere the loop of GEMMs reads the segment ends on the host. With a group, the split sizes go to the host once per forward
(see the NOTE in _exchange); the backward reuses that exchange (saved with the activations). Before it,
megamoe.autograd.check_ranks_agree reads the ranks' agreement check on the host (one tiny collective per
forward).

Backend interface (shared with the triton backend):
    block_m_for(hidden, intermediate, dtype) -> int      rows per expert-segment block for build_schedule
    empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule, config) -> tuple  tensors shaped like `saved`
    experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config,
                *, save_for_backward=True)
        -> (out [T, H], saved: tuple of tensors for the backward; () without save_for_backward)
    experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config, saved,
                *, needs_grad=ALL_GRADS)
        -> (d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up | None, d_shared_down | None)
    needs_grad: one bool per gradient, in that order; a backend may return None for a gradient not needed
    (and skip its work), and may compute it anyway.

saved = (x_rows [R, H], gate_up [R, 2I], h [R, I], y_pairs [T, k, H]), then with a group of W > 1 ranks
the exchange (send_order [T*k] int64, recv_order [R] int64, splits [2, W] int64 on the CPU), then the
shared expert's saved tensors (swiglu.shared_fwd's; none without a shared expert).

Inference (save_for_backward=False, what megamoe.experts passes under torch.no_grad() /
torch.inference_mode() or when no input requires grad): nothing is saved (saved = ()), and each
intermediate is released as soon as its last reader is done (x_rows after the gate/up GEMM, gate_up after
SwiGLU, h after the down GEMM), with or without a group.
Gradients not needed (needs_grad): skipped with their work. On one process: d_topk_weights (the
<d_out, y> reduction), d_w_down and d_w_gate_up (their grouped GEMMs, each on its own), d_x (the
d_gate_up @ w_gate_up GEMM, the return of rows to pairs, the slot sum), the SwiGLU backward and the
down-projection data grad when neither d_x nor d_w_gate_up needs them, the whole expert part (and the
d_y gather) when none of d_x, d_w_gate_up, d_w_down is needed, and each shared-expert gradient. With a
group, only what is local to this rank is skipped (d_topk_weights, the weight-grad GEMMs, the shared
expert, the final slot sum of d_x): the d_y rows, d_x rows and both all_to_alls always run, because a
peer's d_x and weight grads need them whatever this rank needs.
"""

from __future__ import annotations

import dataclasses

import torch

from megamoe.backends import ALL_GRADS
from megamoe.backends.swiglu import empty_shared_saved, shared_bwd, shared_fwd, swiglu_bwd, swiglu_fwd
from megamoe.schedule import Schedule, receive_rows

GROUPED_MM_ALIGN = 16


def block_m_for(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    del hidden, intermediate, dtype
    return GROUPED_MM_ALIGN


def _has_grouped_mm(a: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if a.device.type == "cuda":
        # torch's own kernel runs bf16 on NVIDIA GPUs of compute capability 9.x and 10.x; on other GPUs (and ROCm
        # builds by default) its fallback reads the offsets on the host, as the loop of GEMMs does.
        return (a.dtype == torch.bfloat16 and torch.version.hip is None
                and torch.cuda.get_device_capability(a.device)[0] in (9, 10))
    return a.device.type == "cpu" and a.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _aligned_16_bytes(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm's operand layouts: one of the last two dimensions contiguous (stride 1), every other
    stride a multiple of 16 bytes. A size-1 dimension does not count as the contiguous one twice: [R, 1] has
    strides (1, 1), and its row stride of one element is rejected."""
    for t in tensors:
        strides = list(t.stride())
        inner = -1 if strides[-1] == 1 else -2
        if strides[inner] != 1:
            return False
        del strides[inner]
        if any(s * t.element_size() % 16 for s in strides):
            return False
    return True


def _aligned_base(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it (same strides) where its base is not 16-byte aligned (a view at an odd offset of a larger
    buffer, e.g. weights sliced from one): torch._grouped_mm requires aligned bases off the CPU, and in torch 2.10 on
    the CPU too."""
    return t.clone() if t.data_ptr() % 16 else t


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Segmented matmul over rows: segment e = rows [ends[e-1], ends[e]).

    a [R, K] @ b [E, K, N] -> [R, N] (rows past ends[-1] are unspecified), or, for a 2-D b,
    a.T-style weight gradients: a [N, R] (a transposed view) @ b [R, K] -> [E, N, K].
    torch._grouped_mm runs where the operands and the output's rows suit it: autograd's backward of it (the
    TorchTitan-style baseline relies on it) takes the output's gradient as an operand.
    """
    out_row_bytes = b.shape[-1] * a.element_size()
    if _has_grouped_mm(a) and _aligned_16_bytes(a, b) and out_row_bytes % 16 == 0:
        return torch._grouped_mm(_aligned_base(a), _aligned_base(b), offs=ends)
    # NOTE: host sync (offsets to the host); only on devices/dtypes without torch._grouped_mm.
    bounds = [0] + ends.tolist()
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e in range(b.shape[0]):
            out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ b[e]
        return out
    return torch.stack([a[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]] for e in range(len(bounds) - 1)])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation precision of dtype: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


@dataclasses.dataclass
class _Exchange:
    """How rows move between token owners and expert owners for one schedule (built once per forward,
    saved for the backward).

    send_order [T*k]: this rank's pairs sorted by (dest rank, dest row) — the order all_to_all sends them;
                      pairs that did not fit a capacity come last (not sent).
    recv_order [R]:   receive rows sorted by (source rank, row) — the order all_to_all delivers them — then
                      the rows nobody sends (padding, unused).
    splits [2, W]:    int64 on the CPU: rows sent to / received from each peer rank.
    """

    send_order: torch.Tensor
    recv_order: torch.Tensor
    splits: torch.Tensor

    def __post_init__(self) -> None:
        self.send_splits, self.recv_splits = self.splits.tolist()  # a CPU tensor: no device sync here
        self.num_sent, self.num_received = sum(self.send_splits), sum(self.recv_splits)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.send_order, self.recv_order, self.splits

    def live_rows(self, schedule: Schedule) -> int:
        """A bound on the receive rows in use (expert_offsets[-1]) from the host's split sizes: each local
        expert pads its received rows by at most block_m - 1. The buffer is sized for the worst case (all
        W*T*k pairs of the group here): elementwise work on rows past this bound would be wasted (about
        (W - 1) / W of it with balanced routing)."""
        return min(schedule.num_rows, self.num_received + schedule.num_local_experts * (schedule.block_m - 1))


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
    # Counted with masks, not boolean indexing (which would sync the host on its own).
    send_counts = ((dest_rank.unsqueeze(1) == ranks) & (dest_row >= 0).unsqueeze(1)).sum(0)
    recv_counts = (src_rank.unsqueeze(1) == ranks).sum(0)
    # NOTE: host sync — all_to_all needs split sizes on the host (as TorchTitan and DeepEP's default do).
    # Once per forward, both directions in one copy; the backward reuses them (saved, on the CPU).
    splits = torch.stack([send_counts, recv_counts]).cpu()
    return _Exchange(send_order, recv_order, splits)


def _all_to_all(rows_N: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = rows_N.new_empty(sum(out_splits), *rows_N.shape[1:])
    dist.all_to_all_single(out, rows_N.contiguous(), out_splits, in_splits, group=group)
    return out


def _is_local(schedule: Schedule, group) -> bool:
    return group is None or schedule.world_size == 1


def _dropless(schedule: Schedule) -> bool:
    """Whether every pair has a receive row, known from the shapes alone (no host sync): the receive buffer
    is the worst case (MoEConfig.capacity_factor None, or a capacity at least that large)."""
    worst = receive_rows(
        schedule.num_tokens, schedule.top_k, schedule.num_local_experts, schedule.world_size, schedule.block_m, None
    )
    return schedule.num_rows >= worst


def to_rows(
    source: torch.Tensor, schedule: Schedule, group, ex: _Exchange | None = None, *,
    pair_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token owner's rows -> the expert owner's receive rows [R, ...] (padding rows zero; with a group, rows
    past ex.live_rows, which nothing reads, are left unwritten).

    source: [T, ...] one row per token.
    pair_scale: optional [T, k]: each row is multiplied by its pair's value (fp32 math, one rounding to
        source's dtype; padding rows stay zero) — the router-weighted d_out of the backward.
    ex: the forward's exchange (with a group).
    """
    k = schedule.top_k
    if _is_local(schedule, group):
        # One gather: padding rows (-1) read an appended zero row (the copy of source costs T rows, the
        # gather R; zeroing the padding rows after the gather would cost another pass over R rows).
        src = schedule.row_src.long()
        padded = torch.cat([source, source.new_zeros(1, *source.shape[1:])])
        rows = padded.index_select(0, torch.where(src >= 0, src // k, source.shape[0]))
        if pair_scale is not None:
            scale = pair_scale.reshape(-1)
            pair = torch.where(src >= 0, src, scale.numel())
            scale_rows = torch.cat([scale, scale.new_zeros(1)]).index_select(0, pair)
            rows.mul_(scale_rows.unsqueeze(1))  # in place: one pass over [R, H], no fp32 [R, H] temporaries
        return rows
    send = ex.send_order[: ex.num_sent]
    sent = source.index_select(0, send // k)
    if pair_scale is not None:  # scaled on the sending side: the same products, no separate exchange of weights
        sent.mul_(pair_scale.reshape(-1).index_select(0, send).unsqueeze(1))
    received = _all_to_all(sent, ex.recv_splits, ex.send_splits, group)
    # The received rows copied and the padding rows zeroed, each written once (no zero-fill of all R rows
    # first). Rows past live_rows are never read and stay unwritten: recv_order lists the
    # rows nobody sends by ascending row, so the first live - num_received of them are the ones below live.
    rows = received.new_empty(schedule.num_rows, *source.shape[1:])
    rows.index_copy_(0, ex.recv_order[: ex.num_received], received)
    live = ex.live_rows(schedule)
    if ex.num_received < live:
        rows.index_fill_(0, ex.recv_order[ex.num_received : live], 0)
    return rows


def to_pairs(rows_RH: torch.Tensor, schedule: Schedule, group, ex: _Exchange | None = None) -> torch.Tensor:
    """Receive rows [R, H] -> the token owner's (token, slot) rows [T*k, H] (zero if a capacity dropped them)."""
    pairs = schedule.num_tokens * schedule.top_k
    if _is_local(schedule, group):
        dest = schedule.dest_row.reshape(-1).long()
        if _dropless(schedule):  # every pair has a row: one gather, no masking
            return rows_RH.index_select(0, dest)
        out = rows_RH.index_select(0, dest.clamp(min=0))
        return out.masked_fill_((dest < 0).unsqueeze(1), 0)
    sent = rows_RH.index_select(0, ex.recv_order[: ex.num_received])
    returned = _all_to_all(sent, ex.send_splits, ex.recv_splits, group)
    if ex.num_sent == pairs:  # every pair came back: no zero-fill
        out = rows_RH.new_empty(pairs, rows_RH.shape[1])
    else:
        out = rows_RH.new_zeros(pairs, rows_RH.shape[1])
    return out.index_copy_(0, ex.send_order[: ex.num_sent], returned)


def weighted_slot_sum(
    y_TKH: torch.Tensor, weights_TK: torch.Tensor, extra_TH: torch.Tensor | None
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[t, j] (+ extra[t]) in fp32 (fp64 for fp64), j = 0..k-1 in order, then cast
    to y's dtype: the documented math.

    An explicit chain of in-place fp32 ops rather than one batched reduction: in eager torch a batched one
    needs the products w * y first, rounded to bf16 (or bf16 weights in a bmm), which the documented math
    does not round, and its order is not j = 0..k-1 on CUDA. The chain reads and writes the fp32
    accumulator once per slot; it starts from the first product (no zero-fill) and writes the last op's
    result straight in y's dtype (no separate cast pass): (10k - 6) B per [T, H] element in bf16, 10k + 4
    with a shared expert.
    """
    acc_dtype = _acc_dtype(y_TKH.dtype)
    num_tokens, top_k, hidden = y_TKH.shape
    w = weights_TK.to(acc_dtype)
    final = y_TKH.new_empty(num_tokens, hidden) if y_TKH.dtype != acc_dtype else None
    last = top_k - 1 if extra_TH is None and final is not None else top_k  # the op that writes `final`
    acc = torch.mul(y_TKH[:, 0], w[:, 0:1], out=final if last == 0 else None)
    for j in range(1, top_k):
        if j == last:
            acc = torch.addcmul(acc, w[:, j : j + 1], y_TKH[:, j], out=final)
        else:
            acc.addcmul_(w[:, j : j + 1], y_TKH[:, j])
    if extra_TH is not None:
        return torch.add(acc, extra_TH, out=final) if final is not None else acc.add_(extra_TH)
    return acc


def slot_sum(pairs_TKH: torch.Tensor, extra_TH: torch.Tensor | None) -> torch.Tensor:
    """sum_j pairs[t, j] (+ extra[t]) accumulated in fp32 (fp64 for fp64), in pairs' dtype.

    One torch.sum over the k dim (reads the pairs once, not k passes over an fp32 [T, H] accumulator at
    10 B per element per slot): the reduction kernel accumulates in fp32 and rounds once, in an order fixed
    by the shapes (see the module docstring), so it is deterministic. With extra, the fp32 sum is kept and
    extra added before the one rounding.
    """
    if extra_TH is None:
        return pairs_TKH.sum(dim=1)  # low precision: fp32 accumulation inside, one rounding at the end
    acc = pairs_TKH.sum(dim=1, dtype=_acc_dtype(pairs_TKH.dtype))
    return torch.add(acc, extra_TH, out=torch.empty_like(extra_TH))


def pair_weight_grads(d_out: torch.Tensor, y_pairs_TKH: torch.Tensor) -> torch.Tensor:
    """d_topk_weights[t, j] = <d_out[t], y[t, j]> summed in fp32 (fp64 for fp64).

    The products are rounded once to the inputs' dtype (one pass over [T, k, H] in bf16, then one read by
    the reduction: 6 B/element; an fp32 copy of y_pairs and an fp32 product would be ~18 B/element), except
    in fp16: there they are fp32 (y read in fp16, the product written and read in fp32: 10 B/element).
    """
    acc_dtype = _acc_dtype(d_out.dtype)
    if d_out.dtype == torch.float16:
        # fp16's range ends at 65504, bf16's is fp32's: with a loss-scaled d_out (GradScaler) the products of fp16
        # training pass it where their fp32 sum does not, and inf - inf would give a NaN weight gradient that the
        # reference and the fused path (both multiply in fp32) do not give.
        d_out = d_out.to(acc_dtype)
    return (y_pairs_TKH * d_out.unsqueeze(1)).sum(-1, dtype=acc_dtype)


def rows_fwd(x_rows, w_gate_up, w_down, ends, live: int | None = None):
    """Expert MLPs over receive rows: returns (gate_up [R, 2I] pre-activation, h [R, I], y_rows [R, H]).
    live: a bound on the rows in use (ends[-1] <= live); SwiGLU skips the rows past it."""
    gate_up = grouped_mm(x_rows, w_gate_up.transpose(1, 2), ends)
    h = swiglu_fwd(gate_up, live)
    return gate_up, h, grouped_mm(h, w_down.transpose(1, 2), ends)


def rows_infer(x_rows: list, w_gate_up, w_down, ends, live: int | None = None) -> torch.Tensor:
    """rows_fwd's y_rows [R, H] (the same ops, the same bits) keeping nothing else: x_rows comes as a
    one-element list that is emptied, so x_rows is released after the gate/up GEMM, gate_up after SwiGLU
    and h after the down GEMM (the inference forward's peak: the rows of two of them, not all four)."""
    gate_up = grouped_mm(x_rows.pop(), w_gate_up.transpose(1, 2), ends)
    h = swiglu_fwd(gate_up, live)
    del gate_up
    return grouped_mm(h, w_down.transpose(1, 2), ends)


def rows_bwd(d_y_rows, x_rows, gate_up, h, w_gate_up, w_down, ends, live: int | None = None,
             *, need_x: bool = True, need_w_gate_up: bool = True, need_w_down: bool = True):
    """Backward of rows_fwd: returns (d_x_rows [R, H], d_w_gate_up, d_w_down), None for each one not needed
    (its GEMM skipped; the SwiGLU backward and the down-projection data grad run only for d_x or
    d_w_gate_up). h comes saved from the forward (2 B per [R, I] element held, rather than recomputed here
    by an extra SwiGLU forward of 38 B per element)."""
    d_w_down = grouped_mm(d_y_rows.t(), h, ends) if need_w_down else None
    if not (need_x or need_w_gate_up):
        return None, None, d_w_down
    d_gate_up = swiglu_bwd(gate_up, grouped_mm(d_y_rows, w_down, ends), live)
    d_w_gate_up = grouped_mm(d_gate_up.t(), x_rows, ends) if need_w_gate_up else None
    d_x_rows = grouped_mm(d_gate_up, w_gate_up, ends) if need_x else None
    return d_x_rows, d_w_gate_up, d_w_down


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config=None,
                *, save_for_backward: bool = True):
    ex = None if _is_local(schedule, group) else _exchange(schedule)
    ends = schedule.expert_offsets[1:]
    live = None if ex is None else ex.live_rows(schedule)
    x_rows = to_rows(x, schedule, group, ex)
    if save_for_backward:
        gate_up, h, y_rows = rows_fwd(x_rows, w_gate_up, w_down, ends, live)
    else:
        hold = [x_rows]
        del x_rows
        y_rows = rows_infer(hold, w_gate_up, w_down, ends, live)
    y_pairs = to_pairs(y_rows, schedule, group, ex).view(schedule.num_tokens, schedule.top_k, x.shape[1])
    del y_rows
    shared_out, shared_saved = shared_fwd(x, shared_gate_up, shared_down)
    out = weighted_slot_sum(y_pairs, topk_weights, shared_out)
    if not save_for_backward:
        return out.to(x.dtype), ()
    exchange_saved = () if ex is None else ex.tensors()
    return out.to(x.dtype), (x_rows, gate_up, h, y_pairs, *exchange_saved, *shared_saved)


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule: Schedule, config) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like experts_fwd's `saved` (for torch.compile's fake implementation); config does not change
    them here."""
    rows, hidden, two_i = schedule.num_rows, x.shape[1], w_gate_up.shape[1]
    saved = [
        x.new_empty(rows, hidden),
        x.new_empty(rows, two_i),
        x.new_empty(rows, two_i // 2),
        x.new_empty(schedule.num_tokens, schedule.top_k, hidden),
    ]
    if schedule.world_size > 1:
        saved += [
            torch.empty(schedule.num_tokens * schedule.top_k, dtype=torch.int64, device=x.device),
            torch.empty(rows, dtype=torch.int64, device=x.device),
            torch.empty(2, schedule.world_size, dtype=torch.int64, device="cpu"),
        ]
    return (*saved, *empty_shared_saved(x, shared_gate_up))


def experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config,
                saved, *, needs_grad=ALL_GRADS):
    """The gradients (see the module docstring), None for those needs_grad does not ask for (their work
    skipped: on one process all of it, with a group what is local to this rank)."""
    need_x, need_weights, need_w_gate_up, need_w_down, need_shared_gate_up, need_shared_down = needs_grad
    x_rows, gate_up, h, y_pairs, *rest = saved
    local = _is_local(schedule, group)
    num_exchange = 0 if local else len(dataclasses.fields(_Exchange))
    ex = None if local else _Exchange(*rest[:num_exchange])  # the forward's: no second exchange, no host sync
    shared_saved = rest[num_exchange:]
    ends = schedule.expert_offsets[1:]
    d_out = d_out.to(x.dtype)
    d_topk_weights = pair_weight_grads(d_out, y_pairs).to(topk_weights.dtype) if need_weights else None
    # With a group, the rows this rank computes are its peers' d_x and the weight grads need every rank's
    # d_y rows: both exchanges (collectives) and the d_x rows run whatever this rank needs.
    need_x_rows = need_x or not local
    d_x = d_w_gate_up = d_w_down = None
    if need_x_rows or need_w_gate_up or need_w_down:
        d_y_rows = to_rows(d_out, schedule, group, ex, pair_scale=topk_weights)
        live = None if ex is None else ex.live_rows(schedule)
        d_x_rows, d_w_gate_up, d_w_down = rows_bwd(
            d_y_rows, x_rows, gate_up, h, w_gate_up, w_down, ends, live,
            need_x=need_x_rows, need_w_gate_up=need_w_gate_up, need_w_down=need_w_down,
        )
        del d_y_rows
        if need_x_rows:
            d_x_pairs = to_pairs(d_x_rows, schedule, group, ex).view(schedule.num_tokens, schedule.top_k, x.shape[1])
            del d_x_rows
    d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(
        d_out, x, shared_gate_up, shared_down, shared_saved,
        need_x=need_x, need_gate_up=need_shared_gate_up, need_down=need_shared_down,
    )
    if need_x:
        d_x = slot_sum(d_x_pairs, d_x_shared).to(x.dtype)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
