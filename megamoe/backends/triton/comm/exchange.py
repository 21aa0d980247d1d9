"""Dispatch and combine over symmetric memory, each in both directions, all giving identical bits.

Row maps come from the Schedule (every rank holds the same global placement):
  receive row r of this rank holds pair src = row_src[r]: rank src // (T*k), pair p = src % (T*k),
  token p // k; pair p = t*k + j of this rank lives in row dest_row[t, j] of rank dest_rank[t, j].
Each exchange starts with a barrier (peers are done with the buffer it overwrites) and, where peers
wrote into this rank, ends with one (everything has landed), so consecutive exchanges and layers can
reuse one workspace. Returned tensors are local (never the reused symmetric buffers).
"""

from __future__ import annotations

import torch

from megamoe.backends.triton.comm.workspace import Workspace
from megamoe.backends.triton.kernels.row_copy import copy_rows
from megamoe.schedule import Schedule


def _receive_maps(schedule: Schedule):
    """Per receive row r: (source rank, -1 for padding; source pair p; 0 if r is in use else -1; r)."""
    pairs = schedule.num_tokens * schedule.top_k
    src = schedule.row_src
    rows = torch.arange(schedule.num_rows, device=src.device, dtype=torch.int32)
    in_use = torch.where(rows < schedule.expert_offsets[-1], 0, -1).to(torch.int32)
    src_rank = torch.where(src >= 0, src // pairs, -1).to(torch.int32)
    src_pair = torch.where(src >= 0, src % pairs, 0).to(torch.int32)
    return src_rank, src_pair, in_use, rows


def _send_maps(schedule: Schedule):
    """Per pair p of this rank: (destination rank, -1 if a capacity dropped it; destination row; p)."""
    dest_row = schedule.dest_row.reshape(-1)
    dest_rank = torch.where(dest_row >= 0, schedule.dest_rank.reshape(-1), -1).to(torch.int32)
    pairs = torch.arange(dest_row.numel(), device=dest_row.device, dtype=torch.int32)
    return dest_rank, dest_row.clamp(min=0).to(torch.int32), pairs


def dispatch(ws: Workspace, tokens_TH: torch.Tensor, schedule: Schedule, direction: str) -> torch.Tensor:
    """Token rows [T, H] -> this rank's receive rows [R, H] (padding rows zero; rows past the last
    segment unspecified). "pull": expert owners read from the token owners' published rows;
    "push": token owners write every (token, slot) row into its expert owner's receive rows."""
    src_rank, src_pair, in_use, rows = _receive_maps(schedule)
    size = dict(row_elems=tokens_TH.shape[1], element_size=tokens_TH.element_size())
    ws.barrier()
    if direction == "pull":
        ws.tokens.local.copy_(tokens_TH)
        ws.barrier()
        out = tokens_TH.new_empty(schedule.num_rows, tokens_TH.shape[1])
        copy_rows(ws.tokens.peer_ptrs, src_rank, src_pair // schedule.top_k, out, in_use, rows,
                  src_is_table=True, dst_is_table=False, **size)
        return out
    dest_rank, dest_row, pairs = _send_maps(schedule)
    # Padding rows are zeroed by their owner: written (destination peer 0) from no source (peer -1).
    padding = torch.where((in_use == 0) & (src_rank < 0), 0, -1).to(torch.int32)
    copy_rows(tokens_TH, torch.full_like(padding, -1), rows, ws.rows_in.local, padding, rows,
              src_is_table=False, dst_is_table=False, **size)
    copy_rows(tokens_TH, torch.zeros_like(dest_rank), pairs // schedule.top_k, ws.rows_in.peer_ptrs, dest_rank, dest_row,
              src_is_table=False, dst_is_table=True, **size)
    ws.barrier()
    return ws.rows_in.local.clone()


def dispatch_pair_weights(ws: Workspace, weights_TK: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """topk_weights [T, k] fp32 of the token owners -> the weight of each receive row [R] (0 for padding)."""
    src_rank, src_pair, in_use, rows = _receive_maps(schedule)
    ws.barrier()
    ws.weights.local.copy_(weights_TK)
    ws.barrier()
    out = weights_TK.new_empty(schedule.num_rows)
    copy_rows(ws.weights.peer_ptrs, src_rank, src_pair, out, in_use, rows,
              row_elems=1, element_size=weights_TK.element_size(), src_is_table=True, dst_is_table=False)
    return out


def combine(ws: Workspace, rows_RH: torch.Tensor, schedule: Schedule, direction: str) -> torch.Tensor:
    """Receive rows [R, H] -> this rank's (token, slot) rows [T*k, H]. "push": expert owners write each
    row into its pair's row on the token owner; "pull": token owners read each pair's row from its
    expert owner (a pair a capacity dropped reads as zeros under "pull" and is unspecified under "push")."""
    size = dict(row_elems=rows_RH.shape[1], element_size=rows_RH.element_size())
    ws.barrier()
    if direction == "push":
        src_rank, src_pair, _, rows = _receive_maps(schedule)
        copy_rows(rows_RH, torch.zeros_like(src_rank), rows, ws.pairs.peer_ptrs, src_rank, src_pair,
                  src_is_table=False, dst_is_table=True, **size)
        ws.barrier()
        return ws.pairs.local.clone()
    dest_rank, dest_row, pairs = _send_maps(schedule)
    ws.rows_out.local.copy_(rows_RH)
    ws.barrier()
    out = rows_RH.new_empty(pairs.numel(), rows_RH.shape[1])
    copy_rows(ws.rows_out.peer_ptrs, dest_rank, dest_row, out, torch.zeros_like(dest_rank), pairs,
              src_is_table=True, dst_is_table=False, **size)
    return out


def gather_routing(ws: Workspace, ids_TK: torch.Tensor) -> torch.Tensor:
    """Every rank's routing, [W*T, k] int32 in rank order: publish ours, then read every rank's copy."""
    ws.barrier()
    ws.ids.local.copy_(ids_TK)
    ws.barrier()
    out = ids_TK.new_empty(ws.world_size, ids_TK.numel())
    ranks = torch.arange(ws.world_size, device=ids_TK.device, dtype=torch.int32)
    copy_rows(ws.ids.peer_ptrs, ranks, torch.zeros_like(ranks), out, torch.zeros_like(ranks), ranks,
              row_elems=ids_TK.numel(), element_size=4, src_is_table=True, dst_is_table=False)
    return out.view(-1, ids_TK.shape[1])
