"""Communication inside the persistent kernels of the expert-parallel path (kernels/ep_fused.py; the Gluon
kernels, kernels/gluon_ep.py and kernels/gluon_rows.py with PUSH, follow the same protocol and share its
work buffer, flags and counters).

Pull (dispatch): the fused kernel's first GEMM reads this rank's receive rows (forward: x rows; backward:
the unweighted d_out rows), and the first `programs` programs of its grid are communication programs. They claim groups
of schedule blocks in order (a device counter), copy each group's rows from the token owners' published
buffers (symmetric memory, read over NVLink through the peers' mapped addresses) into the local rows,
and raise the group's ready flag (release, GPU scope); when no group is left they join the GEMM tasks.
Tasks are claimed in order (another counter); a first-GEMM tile acquires its row block's flag before
its K loop, so it starts as soon as its own rows have landed, not when the whole exchange has.

Push (combine): the fused kernel's second GEMM (forward: down_fwd_tile, y; backward:
gate_up_dgrad_tile, d_x) stores each tile row straight into its (token, slot) row of the owner's pairs
buffer (grouped_gemm.store_rows with PUSH, through push_pointers), so the combine leaves as each tile
finishes.

Determinism: every element is still written by one program, with the values and reduction order of the
unfused kernels (copies are bit copies), so results do not depend on the split or the granularity.

No deadlock by construction: a tile only ever waits for a group that a communication program of its
own grid has claimed or will claim (or, in the second GEMM, for first-GEMM tiles claimed before it:
ep_fused.py); communication programs have the lowest program ids (the hardware starts them
first; the interpreter runs programs in id order, so there program 0 pulls every group before any
tile), copy only local or already-published rows and wait for nothing before the pulls run out. The
grid is at most one program per SM. Every wait is bounded by a timeout: past it the kernel traps, which
surfaces as a CUDA error at the next synchronisation instead of a hang.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from megamoe.backends.triton.kernels._common import check

# Bytes each communication program moves per step (rows x columns of one load and one store per
# thread group): 32 KB over the GEMM's 8 warps keeps 8 16-byte vectors per thread in flight.
_PULL_STEP_BYTES = 32768
_PULL_BLOCK_BYTES = 2048


class RowPull(NamedTuple):
    """Receive rows that a fused kernel's communication programs pull while its other programs compute.

    table: int64 [W] base addresses of every rank's published token rows [T, H] (Workspace.tokens).
    src_rank, src_token: int32 [R] per receive row: the token owner (-1: padding, written as a zero
        row) and the token's row there.
    programs: communication programs (MoEConfig.num_comm_sms); the other programs of the grid compute.
    group_blocks: schedule blocks per ready flag (the overlap granularity, MoEConfig.minibatch_tokens).
    timeout_ns: the longest a GEMM program waits for a flag before it traps.
    """

    table: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    programs: int
    group_blocks: int
    timeout_ns: int


class RowPush(NamedTuple):
    """Output rows a fused kernel's second-GEMM epilogue stores into the token owners' pairs buffers.

    table: int64 [W] base addresses of every rank's pairs buffer [T*k, H] (Workspace.pairs).
    dst_rank, dst_pair: int32 [R] per receive row: the token owner (-1: padding, not stored) and the
        (token, slot) row there.
    """

    table: torch.Tensor
    dst_rank: torch.Tensor
    dst_pair: torch.Tensor


def check_pull(pull: RowPull, rows: torch.Tensor) -> None:
    """rows: the local [R, H] buffer the pull fills (the GEMM's A operand)."""
    num_rows = rows.shape[0]
    for name in ("src_rank", "src_token"):
        t = getattr(pull, name)
        check(t.dtype == torch.int32 and t.shape == (num_rows,) and t.is_contiguous(),
              f"RowPull.{name} must be a contiguous int32 [{num_rows}] tensor, got {t.dtype} {tuple(t.shape)}")
    check(pull.table.dtype == torch.int64 and pull.table.dim() == 1, "RowPull.table must be an int64 [W] table of "
          "base addresses")
    check(pull.programs >= 1, f"RowPull.programs must be >= 1, got {pull.programs}")
    check(pull.group_blocks >= 1, f"RowPull.group_blocks must be >= 1, got {pull.group_blocks}")
    check(pull.timeout_ns >= 1, f"RowPull.timeout_ns must be >= 1, got {pull.timeout_ns}")


def check_push(push: RowPush, num_rows: int) -> None:
    for name in ("dst_rank", "dst_pair"):
        t = getattr(push, name)
        check(t.dtype == torch.int32 and t.shape == (num_rows,) and t.is_contiguous(),
              f"RowPush.{name} must be a contiguous int32 [{num_rows}] tensor, got {t.dtype} {tuple(t.shape)}")
    check(push.table.dtype == torch.int64 and push.table.dim() == 1, "RowPush.table must be an int64 [W] table")


# The work buffer of a fused launch (int32, zeroed per launch): [next group to pull, next task to run,
# ready flag of each group of schedule blocks..., tiles done of each kernel row block...].
_NEXT_GROUP, _NEXT_TASK, _FLAGS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def work_buffer(num_groups: int, num_row_blocks: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(zeroed work buffer, offset of the row-block counters); a memset in stream order: capturable."""
    flags = max(1, num_groups)
    return torch.zeros(_FLAGS.value + flags + num_row_blocks, dtype=torch.int32, device=device), _FLAGS.value + flags


def pull_meta(rows: torch.Tensor, block_rows: int) -> dict:
    """Constexprs of the pull role: the rows per step (a power of two dividing the schedule's
    block_rows) and the columns per inner step of the copy, for receive rows [R, H]."""
    hidden, size = rows.shape[1], rows.element_size()
    block = min(triton.next_power_of_2(hidden), _PULL_BLOCK_BYTES // size)
    step_rows = min(block_rows, max(1, _PULL_STEP_BYTES // (block * size)))
    return dict(PULL_ROWS=step_rows, PULL_BLOCK=block)


def aligned_rows(hidden: int, element_size: int, *local: torch.Tensor) -> bool:
    """Every row of every buffer starts 16-byte aligned (symmetric allocations are; local tensors are
    checked), so peer addresses loaded from a table may be hinted as such (16-byte vector copies)."""
    return hidden * element_size % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in local)


@triton.jit
def _row_bases(table_ptr, rank, ELEM: tl.constexpr):
    """Per-row base pointers [ROWS] into each row's rank's buffer (rank < 0: rank 0's, masked by the caller)."""
    return tl.load(table_ptr + tl.maximum(rank, 0)).to(tl.pointer_type(ELEM))


@triton.jit
def pull_then_claim(
    rows_ptr, table_ptr, src_rank_ptr, src_token_ptr, work_ptr, first_block, end_block, pull_programs, H, group_blocks,
    ALIGNED: tl.constexpr, BLOCK_ROWS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """A fused kernel's start: programs below pull_programs claim groups of schedule blocks in order
    (groups [g * group_blocks, (g + 1) * group_blocks) within [first_block, end_block)), copy their rows
    (BLOCK_ROWS per schedule block) and raise each group's flag, until no group is left; then every
    program claims its first task. Claims are atomic
    counters, so the communication programs join the GEMMs as soon as the pulls run out instead of
    leaving their SMs idle."""
    if tl.program_id(0) < pull_programs:
        elem = rows_ptr.dtype.element_ty
        offs_r = tl.arange(0, ROWS)
        offs_c = tl.arange(0, BLOCK)
        first_group = first_block // group_blocks
        end_group = tl.cdiv(end_block, group_blocks)
        group = first_group + pull_claim(work_ptr)
        while group < end_group:
            row_begin = tl.maximum(group * group_blocks, first_block) * BLOCK_ROWS
            row_end = tl.minimum((group + 1) * group_blocks, end_block) * BLOCK_ROWS
            for r0 in range(row_begin, row_end, ROWS):
                rows = r0 + offs_r  # ROWS divides BLOCK_ROWS: every row is in range
                rank = tl.load(src_rank_ptr + rows)
                live = rank >= 0
                token = tl.load(src_token_ptr + rows, mask=live, other=0)
                src = _row_bases(table_ptr, rank, elem) + token.to(tl.int64) * H
                dst = rows_ptr + rows.to(tl.int64) * H
                if ALIGNED:
                    src = tl.multiple_of(src, 16)
                    dst = tl.multiple_of(dst, 16)
                for c0 in range(0, H, BLOCK):
                    cols = c0 + offs_c
                    col_ok = (cols < H)[None, :]
                    value = tl.load(src[:, None] + cols[None, :], mask=live[:, None] & col_ok, other=0.0)
                    tl.store(dst[:, None] + cols[None, :], value, mask=col_ok)
            # Every thread's stores are done (CTA barrier) before one release publishes them GPU-wide.
            tl.debug_barrier()
            tl.atomic_xchg(pull_flag(work_ptr, group), 1, sem="release", scope="gpu")
            group = first_group + pull_claim(work_ptr)
    return claim_task(work_ptr, 1)


@triton.jit
def pull_claim(work_ptr):
    """The next unit of pull work (a group of schedule blocks here, a few rows in kernels/gluon_ep.py), claimed
    in order from a counter."""
    return tl.atomic_add(work_ptr + _NEXT_GROUP, 1, sem="relaxed")


@triton.jit
def pull_flag(work_ptr, group):
    """The ready flag of a group of schedule blocks: 1 once its rows have landed (kernels/gluon_ep.py: the count of
    its units that have)."""
    return work_ptr + _FLAGS + group


@triton.jit
def claim_task(work_ptr, COUNT: tl.constexpr):
    """The first of the next COUNT tasks of a fused kernel (tasks are claimed in order; each tile's math
    does not depend on which program computes it, so the results do not either)."""
    return tl.atomic_add(work_ptr + _NEXT_TASK, COUNT, sem="relaxed")


@triton.jit
def wait_ready(work_ptr, group, timeout_ns):
    """Acquire the ready flag of a group of schedule blocks (its rows have landed)."""
    wait_at_least(pull_flag(work_ptr, group), 1, timeout_ns)


@triton.jit
def signal_done(counter_ptr):
    """Count one finished tile of a row block: every thread's stores are done (CTA barrier) before one
    release makes them visible GPU-wide."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait_at_least(counter_ptr, target, timeout_ns):
    """Acquire (GPU scope) until *counter_ptr >= target; still short after timeout_ns, the kernel traps:
    the launch fails with a CUDA error ("unspecified launch failure") at the next synchronisation
    instead of hanging. (No device_print here: a printf is a function call, and ptxas then serialises
    every wgmma of the kernel.)"""
    value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    if value < target:
        deadline = globaltimer() + timeout_ns
        while value < target:
            value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            if value < target:
                if globaltimer() > deadline:
                    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_all_at_least(counters_ptr, first, end, target, timeout_ns):
    """Acquire (GPU scope) until counters_ptr[i] >= target for every i in [first, end): 64 counters polled
    together by one vector atomic, then a CTA barrier (every thread may read what they publish); bounded
    like wait_at_least."""
    offs = tl.arange(0, 64)
    for c0 in range(first, end, 64):
        index = c0 + offs
        pending = index < end
        values = tl.atomic_add(counters_ptr + index, 0, mask=pending, sem="acquire", scope="gpu")
        pending = pending & (values < target)
        if tl.max(pending.to(tl.int32), axis=0) > 0:
            deadline = globaltimer() + timeout_ns
            while tl.max(pending.to(tl.int32), axis=0) > 0:
                values = tl.atomic_add(counters_ptr + index, 0, mask=pending, sem="acquire", scope="gpu")
                pending = pending & (values < target)
                if tl.max(pending.to(tl.int32), axis=0) > 0:
                    if globaltimer() > deadline:
                        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def push_pointers(table_ptr, dst_rank_ptr, dst_pair_ptr, rows, H, ELEM: tl.constexpr, ALIGNED: tl.constexpr):
    """(row pointers [BLOCK_M] into the token owners' pairs rows, row mask): padding rows are not stored."""
    rank = tl.load(dst_rank_ptr + rows)
    live = rank >= 0
    pair = tl.load(dst_pair_ptr + rows, mask=live, other=0)
    dst = _row_bases(table_ptr, rank, ELEM) + pair.to(tl.int64) * H
    if ALIGNED:
        dst = tl.multiple_of(dst, 16)
    return dst, live
