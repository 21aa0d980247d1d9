"""Expert parallelism over NVLink: symmetric-memory dispatch and combine around the fused kernels,
overlapped with the expert compute chunk by chunk.

Forward: dispatch x to this rank's receive rows (pull or push), the fused gate/up (+SwiGLU) and down
GEMMs over the rows, combine the results into (token, slot) rows on the token owners (push or pull),
then the fixed-order fp32 slot sum (+ the shared expert, last). Backward mirrors it: d_out and the
router weights go to the experts, the fused dgrad/wgrad kernels run over the rows, d_x rows come back.
No host synchronisation: routing is exchanged through symmetric memory and the schedule is built on the
device; every buffer has its worst-case (or declared-capacity) size. Both directions of each exchange
move the same bits, so results do not depend on MoEConfig.dispatch/combine.

The rows compute is the one-GPU path's (experts.rows_fwd and the pieces of rows_bwd): the dispatch
already lands rows expert-contiguous with zero padding rows, which is exactly what those kernels read.
The backward scales the dispatched d_out rows by their pair's router weight once (gather_rows, scale
only) to get d_y_rows. The slot sums read the exchanged pairs buffer [T*k, H] through
index[t, j] = t*k + j (-1 where a capacity dropped the pair).

Overlap (OverlapPlan). The E_l local experts are cut into chunks of consecutive experts [e0, e1)
(static); a chunk's receive rows are [expert_offsets[e0], expert_offsets[e1]) and its GEMM blocks those
divided by block_m, both device values that the kernels read (never the host). With pull dispatch:
barrier, publish, barrier on the current ("compute") stream; then a communication stream forked from
it pulls chunk 0, 1, ... (an event per chunk) while the compute stream runs each chunk's GEMMs as soon
as its event fires. With push combine, the communication stream, after its pulls, pushes each chunk's
result rows to the token owners as soon as that chunk's compute event fires. Then the streams join,
and one barrier (everything has landed) precedes the local slot sum. The backward does the same with
d_out and the router weights published together, d_y rows gathered per chunk, the data grads per chunk
(whose d_x rows are pushed as soon as they are ready) and each chunk's experts' weight grads written
into their slices of one output. Push dispatch and pull combine stay whole exchanges (with their own
barriers) before and after the chunked compute.

Why the ordering is safe (no barrier ever runs while the communication stream copies):
- Every barrier runs on the compute stream outside a fork/join bracket: the publish barriers before
  the fork, the final one after the join. The communication stream only copies and waits on local
  events, never on a peer, so it cannot deadlock, and no kernel in the bracket spins (GEMMs and copies
  need no co-residency; at worst they run one after the other).
- A buffer a peer pulls from (tokens, weights) is rewritten only by the next publish, whose first
  barrier needs every peer to arrive, which each does only after joining its pulls.
- A pairs buffer we push into was last read by its owner's collect_pushed of the previous exchange,
  which precedes, on the owner's stream, a barrier that this exchange passed before forking (the
  publish barriers, or those of a whole push dispatch), so the pushes need no barrier of their own.
  The owner reads it again only after the final barrier, which each rank reaches after its join.
Results are bitwise identical for any chunking and any num_comm_sms: every output element is still
written by one program with a fixed reduction order (GEMM tiles, weight-grad tiles per expert, rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from megamoe.backends.triton import kernels
from megamoe.backends.triton.comm.exchange import (
    collect_pushed, combine, dispatch, dispatch_pair_weights, gather_routing, publish, pull_rows, push_rows, receive_maps,
)
from megamoe.backends.triton.comm.workspace import get_workspace
from megamoe.backends.triton.experts import configs_for, rows_dgrad, rows_fwd, rows_wgrad, shared_bwd, shared_fwd
from megamoe.backends.triton.kernels._common import num_sms
from megamoe.schedule import Schedule, receive_rows

# The direction "auto" resolves to, per operation (docs/perf-notes.md has the measurements).
AUTO_DIRECTIONS = {"dispatch": "pull", "combine": "push"}
# MoEConfig.minibatch_tokens = None: this many chunks of experts (fewer if E_l is smaller). Four
# pipeline stages expose a quarter of the first dispatch and of the last combine; more chunks
# expose less but pay a wave-quantisation tail per GEMM launch (docs/perf-notes.md, "EP overlap").
DEFAULT_CHUNKS = 4
# MoEConfig.num_comm_sms = None: programs of each chunked communication kernel, one SM each; the
# persistent GEMMs beside them take the other SMs (116 of an H200's 132).
DEFAULT_COMM_SMS = 16
# Benchmark-only probes (benchmarks/overlap_bench.py): "full" is the layer; "compute" skips every
# copy and barrier (results wrong, timing only); "comm" runs only the exchanges (results wrong);
# "serial" is the layer without overlap (one chunk, one stream, every SM for each kernel).
PROBES = ("full", "compute", "comm", "serial")


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


# ----------------------------------------------------------------------------------------------------
# The overlap plan, its device ranges and its two streams


@dataclasses.dataclass(frozen=True)
class OverlapPlan:
    """How one EP forward/backward overlaps communication with compute; static (shapes and config).

    experts_per_chunk: chunk c holds local experts [c * n, min((c + 1) * n, E_l)).
    comm_programs: grid of each chunked communication kernel (None: copy_rows' default grid).
    compute_sms: SMs of every persistent kernel between fork and join (None: all).
    streams: communication on a side stream (CUDA); otherwise everything inline, in program order.
    """

    num_local_experts: int
    experts_per_chunk: int
    comm_programs: int | None
    compute_sms: int | None
    streams: bool

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.num_local_experts / self.experts_per_chunk)

    def experts(self, chunk: int) -> tuple[int, int]:
        first = chunk * self.experts_per_chunk
        return first, min(first + self.experts_per_chunk, self.num_local_experts)


def overlap_plan(schedule: Schedule, config, device: torch.device, probe: str = "full") -> OverlapPlan:
    """The plan for this schedule and config (see MoEConfig.minibatch_tokens / num_comm_sms).

    Experts per chunk = ceil(E_l * minibatch_tokens / T): under balanced routing a rank receives T*k
    rows (T tokens' worth) over its E_l experts, so a chunk holds about minibatch_tokens tokens' rows,
    i.e. T / minibatch_tokens chunks. None: DEFAULT_CHUNKS chunks.
    """
    experts = schedule.num_local_experts
    if probe == "serial":
        return OverlapPlan(experts, experts, None, None, False)
    if config.minibatch_tokens is None:
        per_chunk = math.ceil(experts / min(DEFAULT_CHUNKS, experts))
    else:
        per_chunk = min(experts, max(1, math.ceil(experts * config.minibatch_tokens / schedule.num_tokens)))
    comm = DEFAULT_COMM_SMS if config.num_comm_sms is None else config.num_comm_sms
    sms = num_sms(device)
    if device.type == "cuda" and comm >= sms:
        raise ValueError(f"MoEConfig.num_comm_sms must leave SMs for the expert GEMMs: got {comm}, this GPU has {sms}")
    return OverlapPlan(experts, per_chunk, comm, max(1, sms - comm), device.type == "cuda")


class _ChunkRanges:
    """Device int32 ranges of each chunk: receive rows (first, end) and schedule blocks (first, end).
    Built from expert_offsets with device ops only (no host sync, capturable)."""

    def __init__(self, schedule: Schedule, plan: OverlapPlan):
        offsets = schedule.expert_offsets
        bounds = torch.arange(plan.num_chunks + 1, device=offsets.device, dtype=torch.int64) * plan.experts_per_chunk
        self.row_bounds = offsets.index_select(0, bounds.clamp_(max=plan.num_local_experts))
        self.block_bounds = self.row_bounds // schedule.block_m  # segments are whole blocks

    def rows(self, chunk: int) -> torch.Tensor:
        return self.row_bounds[chunk : chunk + 2]

    def blocks(self, chunk: int) -> torch.Tensor:
        return self.block_bounds[chunk : chunk + 2]


_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        # High priority: when both streams have blocks waiting for an SM, the few communication
        # programs are placed first, so they run beside the GEMMs rather than after them.
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _COMM_STREAMS[index]


class _Lanes:
    """The current (compute) stream and the communication stream, from a fork to a join. Without
    streams (CPU and the interpreter tests, the "serial" probe) every step runs inline, in order.

    The fork makes the communication stream wait for everything issued so far (the publish barrier);
    the join makes the compute stream wait for all communication. Both are events, so the bracket can
    be captured in a CUDA graph; every tensor the communication stream touches is allocated before the
    fork on the compute stream and referenced until after the join (the caching allocator reuses a
    block only in stream order after its last use)."""

    def __init__(self, device: torch.device, streams: bool):
        self.streams = streams
        if streams:
            self.compute = torch.cuda.current_stream(device)
            self.comm = _comm_stream(device)
            self.comm.wait_stream(self.compute)

    def comm_side(self):
        return torch.cuda.stream(self.comm) if self.streams else contextlib.nullcontext()

    def mark(self):
        """An event at this point of the current stream (None inline)."""
        if not self.streams:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def join(self) -> None:
        if self.streams:
            self.compute.wait_stream(self.comm)


def _check_probe(probe: str) -> tuple[bool, bool]:
    """(run the communication, run the compute)."""
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    return probe != "compute", probe != "comm"


# ----------------------------------------------------------------------------------------------------
# Forward and backward


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config,
                *, probe: str = "full"):
    comm, compute = _check_probe(probe)
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = configs_for(x, w_gate_up, schedule)
    plan = overlap_plan(schedule, config, x.device, probe)
    x = x.contiguous()
    rows, hidden, inter = schedule.num_rows, x.shape[1], w_down.shape[2]
    pull, push = _direction(config, "dispatch") == "pull", _direction(config, "combine") == "push"
    maps, chunks = receive_maps(schedule), _ChunkRanges(schedule, plan)
    like = dict(dtype=x.dtype, device=x.device)

    if pull or not comm:
        x_rows = torch.empty(rows, hidden, **like)
        if comm:
            publish(ws, [(ws.tokens, x)])
    else:
        x_rows = dispatch(ws, x, schedule, "push")
    lanes = _Lanes(x.device, plan.streams)
    landed = [None] * plan.num_chunks
    if pull and comm:
        with lanes.comm_side():
            for c in range(plan.num_chunks):
                pull_rows(ws.tokens, maps, x_rows, by_token=True, row_range=chunks.rows(c), num_programs=plan.comm_programs)
                landed[c] = lanes.mark()
    shared_out, shared_act = None, x.new_empty(0)
    if shared_gate_up is not None and compute:  # independent of the dispatch: beside the first pull
        shared_out, shared_act = shared_fwd(x, shared_gate_up, shared_down)
    h, gate_up, y_rows = torch.empty(rows, inter, **like), torch.empty(rows, 2 * inter, **like), torch.empty(rows, hidden, **like)
    computed = [None] * plan.num_chunks
    for c in range(plan.num_chunks):
        lanes.wait(landed[c])
        if compute:
            rows_fwd(x_rows, w_gate_up, w_down, schedule, cfg, blocks=chunks.blocks(c), out=(h, gate_up, y_rows),
                     sms=plan.compute_sms)
        computed[c] = lanes.mark() if push and comm else None
    if push and comm:
        with lanes.comm_side():
            for c in range(plan.num_chunks):
                lanes.wait(computed[c])
                push_rows(ws, y_rows, maps, row_range=chunks.rows(c), num_programs=plan.comm_programs)
    lanes.join()

    if not comm:
        y_pairs = ws.pairs.local  # probe "compute": whatever is there (timing only)
    elif push:
        y_pairs = collect_pushed(ws)
    else:
        y_pairs = combine(ws, y_rows, schedule, "pull")
    if compute:
        out = kernels.combine(y_pairs, topk_weights, _pair_index(schedule), shared_out, config=cfg.combine)
    else:
        out = torch.empty_like(x)
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


def experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule: Schedule, group, config,
                saved, *, probe: str = "full"):
    comm, compute = _check_probe(probe)
    x_rows, h, gate_up, y_pairs, shared_act = saved
    ws = _workspace(x, schedule.num_tokens, schedule.top_k, schedule.num_rows, group, config)
    cfg = configs_for(x, w_gate_up, schedule)
    plan = overlap_plan(schedule, config, x.device, probe)
    rows, hidden, inter, experts = schedule.num_rows, x.shape[1], w_down.shape[2], w_down.shape[0]
    pull, push = _direction(config, "dispatch") == "pull", _direction(config, "combine") == "push"
    maps, chunks = receive_maps(schedule), _ChunkRanges(schedule, plan)
    pair_index = _pair_index(schedule)
    d_out = d_out.to(x.dtype).contiguous()
    weights = topk_weights.float().contiguous()
    like = dict(dtype=x.dtype, device=x.device)

    if pull or not comm:
        d_out_rows = torch.empty(rows, hidden, **like)
        weight_rows = torch.empty(rows, dtype=torch.float32, device=x.device)
        if comm:
            publish(ws, [(ws.tokens, d_out), (ws.weights, weights)])
    else:
        weight_rows = dispatch_pair_weights(ws, weights, schedule)
        d_out_rows = dispatch(ws, d_out, schedule, "push")
    lanes = _Lanes(x.device, plan.streams)
    landed = [None] * plan.num_chunks
    if pull and comm:
        with lanes.comm_side():
            for c in range(plan.num_chunks):
                pull_rows(ws.tokens, maps, d_out_rows, by_token=True, row_range=chunks.rows(c), num_programs=plan.comm_programs)
                pull_rows(ws.weights, maps, weight_rows, by_token=False, row_range=chunks.rows(c), num_programs=plan.comm_programs)
                landed[c] = lanes.mark()
    # Independent of the dispatch: on the compute stream beside the first pull.
    d_x_shared = d_shared_gate_up = d_shared_down = None
    if compute:
        d_topk_weights = kernels.combine_bwd(d_out, y_pairs, pair_index, config=cfg.combine)
        if shared_gate_up is not None:
            d_x_shared, d_shared_gate_up, d_shared_down = shared_bwd(d_out, x, shared_gate_up, shared_down, shared_act)
    else:
        d_topk_weights = torch.empty_like(weights)
    d_y_rows, d_x_rows = torch.empty(rows, hidden, **like), torch.empty(rows, hidden, **like)
    d_gate_up = torch.empty(rows, 2 * inter, **like)
    d_w_gate_up = torch.empty(experts, 2 * inter, hidden, **like)
    d_w_down = torch.empty(experts, hidden, inter, **like)
    computed = [None] * plan.num_chunks
    for c in range(plan.num_chunks):
        lanes.wait(landed[c])
        if compute:
            # The router weight of each row's pair, applied once (fp32 product rounded to the dtype).
            kernels.gather_rows(d_out_rows, None, weight_rows, chunks.rows(c), out=d_y_rows, sms=plan.compute_sms)
            rows_dgrad(d_y_rows, gate_up, w_gate_up, w_down, schedule, cfg, blocks=chunks.blocks(c),
                       d_gate_up=d_gate_up, d_x_rows=d_x_rows, sms=plan.compute_sms)
        # This chunk's d_x rows can leave while its weight grads run.
        computed[c] = lanes.mark() if push and comm else None
        if compute:
            rows_wgrad(d_y_rows, d_gate_up, x_rows, h, schedule, cfg, experts=plan.experts(c),
                       d_w_gate_up=d_w_gate_up, d_w_down=d_w_down, sms=plan.compute_sms)
    if push and comm:
        with lanes.comm_side():
            for c in range(plan.num_chunks):
                lanes.wait(computed[c])
                push_rows(ws, d_x_rows, maps, row_range=chunks.rows(c), num_programs=plan.comm_programs)
    lanes.join()

    if not comm:
        d_x_pairs = ws.pairs.local
    elif push:
        d_x_pairs = collect_pushed(ws)
    else:
        d_x_pairs = combine(ws, d_x_rows, schedule, "pull")
    d_x = kernels.combine(d_x_pairs, None, pair_index, d_x_shared, config=cfg.combine) if compute else torch.empty_like(x)
    return d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down
