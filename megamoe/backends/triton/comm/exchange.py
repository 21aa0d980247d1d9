"""Dispatch and combine over symmetric memory, each in both directions, all giving identical bits.

Row maps come from the Schedule (every rank holds the same global placement):
  receive row r of this rank holds pair src = row_src[r]: rank src // (T*k), pair p = src % (T*k),
  token p // k; pair p = t*k + j of this rank lives in row dest_row[t, j] of rank dest_rank[t, j].
Each exchange starts with a barrier (peers are done with the buffer it overwrites) and, where peers
wrote into this rank, ends with one (everything has landed), so consecutive exchanges and layers can
reuse one workspace. Returned tensors are local (never the reused symmetric buffers), except
collect_pushed(keep=False).

The whole exchanges (dispatch, combine, ...) are built from a few steps: `publish` (barrier, copy into
this rank's buffers, barrier), one row copy per direction (`pull_rows`: the expert owner reads every
published row it receives; `push_tokens`: the token owner writes each (token, slot) row into its expert
owner's receive rows; `push_rows`: the expert owner writes its result rows into the token owners' pairs
buffers; `pull_pairs`: the token owner reads each pair's result row from its expert owner) and
`collect_pushed` (barrier, then this rank's pairs buffer, copied or not). The row steps never
synchronise with peers: every barrier is in publish / collect_pushed (and the exchanges' own).
ep.py runs publish and collect_pushed around its fused kernels, which pull and push themselves
(kernels/ep_fused.py); on its unfused paths (overlap=False, and directions other than pull dispatch
with push combine; benchmarks/ep_probes.py's "comm" probe likewise) it calls publish and pull_rows itself
for a pull dispatch and runs whole exchanges for the rest (push dispatch, either combine: push_rows
inside combine).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megamoe.backends.triton.comm.workspace import ROUTING_HEADER, Workspace, _Buffer
from megamoe.backends.triton.kernels.row_copy import COPY_SHAPE, CopyShape, copy_rows
from megamoe.schedule import Schedule


class ReceiveMaps(NamedTuple):
    """Per receive row r (int32 [R] each): source rank (-1 for padding), source pair p, source token
    p // k, 0 if r is in use else -1, r itself, and zeros (a local tensor's "peer" column)."""

    src_rank: torch.Tensor
    src_pair: torch.Tensor
    src_token: torch.Tensor
    in_use: torch.Tensor
    rows: torch.Tensor
    zeros: torch.Tensor


def receive_maps(schedule: Schedule) -> ReceiveMaps:
    pairs = schedule.num_tokens * schedule.top_k
    src = schedule.row_src
    rows = torch.arange(schedule.num_rows, device=src.device, dtype=torch.int32)
    in_use = torch.where(rows < schedule.expert_offsets[-1], 0, -1).to(torch.int32)
    src_rank = torch.where(src >= 0, src // pairs, -1).to(torch.int32)
    src_pair = torch.where(src >= 0, src % pairs, 0).to(torch.int32)
    return ReceiveMaps(src_rank, src_pair, src_pair // schedule.top_k, in_use, rows, torch.zeros_like(rows))


def _send_maps(schedule: Schedule):
    """Per pair p of this rank: (destination rank, -1 if a capacity dropped it; destination row; p)."""
    dest_row = schedule.dest_row.reshape(-1)
    dest_rank = torch.where(dest_row >= 0, schedule.dest_rank.reshape(-1), -1).to(torch.int32)
    pairs = torch.arange(dest_row.numel(), device=dest_row.device, dtype=torch.int32)
    return dest_rank, dest_row.clamp(min=0).to(torch.int32), pairs


def _size(t: torch.Tensor) -> dict:
    return dict(row_elems=t.shape[1] if t.dim() == 2 else 1, element_size=t.element_size())


def publish(ws: Workspace, items: list[tuple[_Buffer, torch.Tensor]], exchange: str) -> None:
    """Barrier (peers are done reading these buffers), copy each tensor into this rank's copy of its
    buffer, barrier (every rank's copies are in place): peers may pull from them until the next publish.
    exchange: the barriers' name (workspace.BARRIER_CHANNELS)."""
    ws.barrier(exchange)
    for buffer, tensor in items:
        buffer.local.copy_(tensor)
    ws.barrier(exchange)


def pull_rows(buffer: _Buffer, maps: ReceiveMaps, out: torch.Tensor, *, by_token: bool,
              shape: CopyShape = COPY_SHAPE) -> None:
    """out[r] = the source rank's published row (its token row if by_token, else its pair row), zero for
    padding, for every receive row r in use (rows past them are left unwritten)."""
    copy_rows(buffer.peer_ptrs, maps.src_rank, maps.src_token if by_token else maps.src_pair, out, maps.in_use,
              maps.rows, src_is_table=True, dst_is_table=False, shape=shape, **_size(out))


def push_tokens(ws: Workspace, tokens_TH: torch.Tensor, schedule: Schedule, maps: ReceiveMaps,
                shape: CopyShape = COPY_SHAPE) -> None:
    """Push dispatch's copies: this rank's padding receive rows zeroed, and every (token, slot) row
    written into its expert owner's receive rows (Workspace.rows_in). The caller has passed a barrier
    after every peer's last read of its rows_in."""
    size = _size(tokens_TH)
    dest_rank, dest_row, pairs = _send_maps(schedule)
    # Padding rows are zeroed by their owner: written (destination peer 0) from no source (peer -1).
    padding = torch.where((maps.in_use == 0) & (maps.src_rank < 0), 0, -1).to(torch.int32)
    copy_rows(tokens_TH, torch.full_like(padding, -1), maps.rows, ws.rows_in.local, padding, maps.rows,
              src_is_table=False, dst_is_table=False, shape=shape, **size)
    copy_rows(tokens_TH, torch.zeros_like(dest_rank), pairs // schedule.top_k, ws.rows_in.peer_ptrs, dest_rank, dest_row,
              src_is_table=False, dst_is_table=True, shape=shape, **size)


def pull_pairs(ws: Workspace, schedule: Schedule, out: torch.Tensor, shape: CopyShape = COPY_SHAPE) -> None:
    """Pull combine's copy: out[p] = pair p's result row, read from its expert owner's published rows
    (Workspace.rows_out), zero for a pair a capacity dropped."""
    dest_rank, dest_row, pairs = _send_maps(schedule)
    copy_rows(ws.rows_out.peer_ptrs, dest_rank, dest_row, out, torch.zeros_like(dest_rank), pairs,
              src_is_table=True, dst_is_table=False, shape=shape, **_size(out))


def push_rows(buffer: _Buffer, rows: torch.Tensor, maps: ReceiveMaps, shape: CopyShape = COPY_SHAPE) -> None:
    """Write every receive row r in use (rows [R, H], or [R] values) into row p = its pair of its source rank's
    buffer (the pairs buffer [T*k, H], or the weights buffer [T, k] for one value a pair); padding skipped.
    The caller knows that no peer reads those rows meanwhile (for the pairs buffer: a barrier was passed
    after every peer's last read of it, collect_pushed of the previous exchange being followed, on every rank,
    by at least one barrier before this; for a slot of the weights buffer: this rank was its only reader)."""
    copy_rows(rows, maps.zeros, maps.rows, buffer.peer_ptrs, maps.src_rank, maps.src_pair,
              src_is_table=False, dst_is_table=True, shape=shape, **_size(rows))


def collect_pushed(ws: Workspace, *, keep: bool = True) -> torch.Tensor:
    """Barrier (every peer's pushes into this rank have landed), then this rank's pairs rows [T*k, H]:
    a copy if keep (valid past the next exchange: the forward saves it for the backward), else the
    symmetric buffer itself, to be read only by kernels issued before this rank's next barrier (after
    which peers may push into it again)."""
    ws.barrier("combine")
    return ws.pairs.local.clone() if keep else ws.pairs.local


def dispatch(ws: Workspace, tokens_TH: torch.Tensor, schedule: Schedule, direction: str) -> torch.Tensor:
    """Token rows [T, H] -> this rank's receive rows [R, H] (padding rows zero; rows past the last
    segment unspecified). "pull": expert owners read from the token owners' published rows;
    "push": token owners write every (token, slot) row into its expert owner's receive rows."""
    maps = receive_maps(schedule)
    if direction == "pull":
        publish(ws, [(ws.tokens, tokens_TH)], "dispatch")
        out = tokens_TH.new_empty(schedule.num_rows, tokens_TH.shape[1])
        pull_rows(ws.tokens, maps, out, by_token=True)
        return out
    ws.barrier("dispatch")
    push_tokens(ws, tokens_TH, schedule, maps)
    ws.barrier("dispatch")
    return ws.rows_in.local.clone()


def dispatch_pair_weights(ws: Workspace, weights_TK: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """topk_weights [T, k] fp32 of the token owners -> the weight of each receive row [R] (0 for padding)."""
    maps = receive_maps(schedule)
    publish(ws, [(ws.weights, weights_TK)], "dispatch")
    out = weights_TK.new_empty(schedule.num_rows)
    pull_rows(ws.weights, maps, out, by_token=False)
    return out


def combine(ws: Workspace, rows_RH: torch.Tensor, schedule: Schedule, direction: str) -> torch.Tensor:
    """Receive rows [R, H] -> this rank's (token, slot) rows [T*k, H]. "push": expert owners write each
    row into its pair's row on the token owner; "pull": token owners read each pair's row from its
    expert owner (a pair a capacity dropped reads as zeros under "pull" and is unspecified under "push")."""
    ws.barrier("combine")
    if direction == "push":
        push_rows(ws.pairs, rows_RH, receive_maps(schedule))
        return collect_pushed(ws)
    ws.rows_out.local.copy_(rows_RH)
    ws.barrier("combine")
    out = rows_RH.new_empty(schedule.num_tokens * schedule.top_k, rows_RH.shape[1])
    pull_pairs(ws, schedule, out)
    return out


def _shapes_on_device(ws: Workspace, num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """int32 [ROUTING_HEADER]: this call's (T, T*k, R) on like's device, written by fill kernels (a copy from
    the host would synchronise)."""
    out = like.new_empty(ROUTING_HEADER, dtype=torch.int32)
    for i, value in enumerate((ws.sizes.tokens, ws.sizes.pairs, num_rows)):
        out[i].fill_(value)
    return out


def gather_routing(ws: Workspace, ids_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Every rank's routing, [W*T, k] int32 in rank order: publish our (T, T*k, R) (R = num_rows, the
    schedule's receive rows) and ids, then read every rank's. A rank that called with other shapes (ranks
    that each call with shapes the agreement check has seen before, so that none checks again) fails a
    device assert here, on every rank, with no host sync; the ids read from it are then garbage, which
    build_schedule clamps into range (check_gathered_ids)."""
    shapes = _shapes_on_device(ws, num_rows, ids_TK)
    publish(ws, [(ws.ids, torch.cat([shapes, ids_TK.reshape(-1)]))], "routing")
    row_elems = ROUTING_HEADER + ids_TK.numel()
    out = ids_TK.new_empty(ws.world_size, row_elems)
    ranks = torch.arange(ws.world_size, device=ids_TK.device, dtype=torch.int32)
    copy_rows(ws.ids.peer_ptrs, ranks, torch.zeros_like(ranks), out, torch.zeros_like(ranks), ranks,
              row_elems=row_elems, element_size=4, src_is_table=True, dst_is_table=False)
    # NOTE: no host sync; a mismatch fails the device assert at the caller's next synchronisation.
    torch._assert_async(
        (out[:, :ROUTING_HEADER] == shapes).all(),
        "megamoe: the ranks of the expert-parallel group called with different T, k or receive rows; every rank "
        "of the group must pass the same T and k (pad the batch to a common T) and the same MoEConfig",
    )
    return out[:, ROUTING_HEADER:].reshape(-1, ids_TK.shape[1])
