"""One persistent kernel per direction of the expert-parallel layer, communication inside, on the pointer-load
core: what ep.py runs where the Gluon core does not (not a Hopper GPU, the CPU interpreter). On Hopper the same
pulls, flags and pushes run inside the Gluon kernels (kernels/gluon_ep.py, kernels/gluon_rows.py with PUSH).

Forward (ep_forward): dispatch pulls, the gate/up GEMM (SwiGLU epilogue) and the down GEMM, whose
epilogue pushes each result row to its token owner. Backward (ep_backward): the pulls of the
unweighted d_out rows, the down-projection data grad (the router epilogue, as the one-GPU path's
down_dgrad_router: the router weight, h_w and the router weight's partial sums, then the SwiGLU
backward), the gate/up data grad, whose epilogue pushes each d_x row to its token owner, and both
weight grads. (The schedule and
the final fixed-order sums stay small kernels of their own.)

Tasks. Every program first takes the communication role if it is one of the first `programs`
(comm_tiles.pull_then_claim: pull groups of row blocks, raise their ready flags), then claims tasks in
order from a device counter. The task list interleaves the two GEMMs by stages of `stage_m` row blocks:
    A(0), A(1), B(0), A(2), B(1), ..., A(S-1), B(S-2), B(S-1)
where A(s) are the first GEMM's tiles of stage s (each after its rows' ready flag) and B(s) the second
GEMM's (each after every A tile of its row block is done: a per-row-block counter, release/acquire).
So the second GEMM (and its pushes) starts a stage behind the first instead of after all of it, and no
SM idles between the two. A stage is about two waves of A tiles, so a B tile rarely waits. After the
list, the backward's programs run the weight-grad tiles, which need every row of an expert: every
d_w_down tile, then every d_w_gate_up tile, each after every A tile of its expert's row blocks, claimed
from the same counter once the list is used up, while the last B tiles still run and push.

No deadlock by construction: tasks are claimed in list order and a task only waits for pulls (which
wait for nothing) or for A tasks earlier in the list, already claimed by running programs; the grid is
at most one program per SM. Every wait is bounded (comm_tiles.wait_at_least). Results are bitwise those
of the separate kernels: the same tile functions, one program per output element, fixed K order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.backends.triton.configs import TileConfig
from megamoe.backends.triton.kernels._common import (
    check, check_expert_offsets, check_matrix, check_row_src, check_rows, check_weight, load_range, num_sms, tile_coords,
)
from megamoe.backends.triton.kernels.comm_tiles import (
    RowPull, RowPush, aligned_rows, check_pull, check_push, claim_task, pull_meta, pull_then_claim, signal_done,
    wait_all_at_least, wait_at_least, wait_ready, work_buffer,
)
from megamoe.backends.triton.kernels.grouped_gemm import down_dgrad_tile, down_fwd_tile, gate_up_dgrad_tile, gate_up_fwd_tile
from megamoe.backends.triton.kernels.weight_grad import dw_tile


STAGE_WAVES = 2
# Weight-grad tiles per claim (one atomic round trip each). On 2x H200 against the weight grads as kernels
# of their own (docs/perf-notes.md, "EP v8"): 2 at a time on par with them for balanced routing and ahead
# for skewed; dealing the tiles round-robin with no claim was 4.6% behind on qwen3-235b-a22b skewed.
WEIGHT_GRAD_CLAIM = tl.constexpr(2)


@triton.jit
def _task(task, a_tasks, b_tasks, num_stages):
    """(is a B task, stage, index within the stage's A or B tiles) of task number `task` in the order
    A(0), A(1), B(0), A(2), B(1), ..., A(S-1), B(S-2), B(S-1), with a_tasks / b_tasks per stage."""
    first = task < a_tasks
    q = tl.maximum(task - a_tasks, 0)
    pair = q // (a_tasks + b_tasks)
    r = q - pair * (a_tasks + b_tasks)
    last = pair >= num_stages - 1  # the trailing B(S-1)
    is_b = (task >= a_tasks) & (last | (r >= a_tasks))
    stage = tl.where(first, 0, tl.where(last, num_stages - 1, tl.where(r < a_tasks, pair + 1, pair)))
    index = tl.where(first, task, tl.where(last | (r < a_tasks), r, r - a_tasks))
    return is_b, stage, index


@triton.jit
def _stage_task(task, block_range_ptr, H, I, stage_m, SPLIT: tl.constexpr, A_BLOCK_N: tl.constexpr,
                B_BLOCK_N: tl.constexpr):
    """Where task number `task` lies in the list: (is a B task, index within its stage's A or B tiles,
    first row block of the range, the stage's first row block within it, row blocks in the stage,
    A tiles per row block, B tiles per row block)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    num_m = end_m - first_m
    a_n = tl.cdiv(I, A_BLOCK_N)
    b_n = tl.cdiv(H, B_BLOCK_N)
    is_b, stage, index = _task(task, stage_m * a_n, stage_m * b_n, tl.cdiv(num_m, stage_m))
    m0 = stage * stage_m
    return is_b, index, first_m, m0, tl.minimum(stage_m, num_m - m0), a_n, b_n


@triton.jit
def _num_tasks(block_range_ptr, H, I, stage_m, SPLIT: tl.constexpr, A_BLOCK_N: tl.constexpr, B_BLOCK_N: tl.constexpr):
    """Tasks of the list: stages x (A tiles + B tiles) per stage (partial last stage included)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    return tl.cdiv(end_m - first_m, stage_m) * stage_m * (tl.cdiv(I, A_BLOCK_N) + tl.cdiv(H, B_BLOCK_N))


@triton.jit
def ep_fwd_kernel(
    x_rows_ptr, w_gate_up_ptr, w_down_ptr, block_expert_ptr, block_range_ptr, h_ptr, gate_up_ptr, y_ptr,
    pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr,
    H, I, pull_programs, group_blocks, timeout_ns, stage_m, done_offset,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
    A_EVEN_K: tl.constexpr, A_BLOCK_N: tl.constexpr, A_BLOCK_K: tl.constexpr, A_STAGES: tl.constexpr,
    B_EVEN_K: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr, B_STAGES: tl.constexpr,
    PULL_ALIGNED: tl.constexpr, PULL_ROWS: tl.constexpr, PULL_BLOCK: tl.constexpr, PUSH_ALIGNED: tl.constexpr,
):
    """A = gate_up_fwd tiles (h, gate_up) over the pulled x rows, B = down_fwd tiles (y rows, pushed)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    task = pull_then_claim(
        x_rows_ptr, pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr,
        first_m // SPLIT, end_m // SPLIT, pull_programs, H, group_blocks,
        ALIGNED=PULL_ALIGNED, BLOCK_ROWS=BLOCK_M * SPLIT, ROWS=PULL_ROWS, BLOCK=PULL_BLOCK,
    )
    # Only `task` is carried across iterations: the layout is re-derived from the arguments each time
    # (cheap scalar work), which keeps the tiles' registers free (at 255 otherwise they spill).
    while task < _num_tasks(block_range_ptr, H, I, stage_m, SPLIT, A_BLOCK_N, B_BLOCK_N):
        is_b, index, first_m, m0, stage_rows, a_n, b_n = _stage_task(
            task, block_range_ptr, H, I, stage_m, SPLIT, A_BLOCK_N, B_BLOCK_N)
        if is_b:
            if index < stage_rows * b_n:
                pid_m, pid_n = tile_coords(index, stage_rows, b_n, GROUP_M)
                pid_m += first_m + m0
                wait_at_least(work_ptr + done_offset + pid_m, a_n, timeout_ns)
                down_fwd_tile(pid_m, pid_n, h_ptr, w_down_ptr, block_expert_ptr, y_ptr, push_table_ptr, push_rank_ptr,
                              push_pair_ptr, H, I, B_EVEN_K, SPLIT, BLOCK_M, B_BLOCK_N, B_BLOCK_K, B_STAGES, True, PUSH_ALIGNED)
        else:
            if index < stage_rows * a_n:
                pid_m, pid_n = tile_coords(index, stage_rows, a_n, GROUP_M)
                pid_m += first_m + m0
                wait_ready(work_ptr, pid_m // SPLIT // group_blocks, timeout_ns)
                gate_up_fwd_tile(pid_m, pid_n, x_rows_ptr, w_gate_up_ptr, block_expert_ptr, h_ptr,
                                 gate_up_ptr, H, I, True, A_EVEN_K, SPLIT, BLOCK_M, A_BLOCK_N, A_BLOCK_K, A_STAGES)
                signal_done(work_ptr + done_offset + pid_m)
        task = claim_task(work_ptr, 1)


@triton.jit
def ep_bwd_kernel(
    d_out_rows_ptr, w_gate_up_ptr, w_down_ptr, block_expert_ptr, block_range_ptr, gate_up_ptr, d_gate_up_ptr, d_x_ptr,
    row_index_ptr, weight_rows_ptr, h_w_ptr, d_w_part_ptr,
    pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr, push_table_ptr, push_rank_ptr, push_pair_ptr,
    x_rows_ptr, expert_offsets_ptr, d_w_down_ptr, d_w_gate_up_ptr, num_experts,
    H, I, pull_programs, group_blocks, timeout_ns, stage_m, done_offset,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
    A_EVEN_K: tl.constexpr, A_BLOCK_N: tl.constexpr, A_BLOCK_K: tl.constexpr, A_STAGES: tl.constexpr,
    B_EVEN_K: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr, B_STAGES: tl.constexpr,
    PULL_ALIGNED: tl.constexpr, PULL_ROWS: tl.constexpr, PULL_BLOCK: tl.constexpr, PUSH_ALIGNED: tl.constexpr,
    W_BLOCK_M: tl.constexpr, W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, W_GROUP_M: tl.constexpr,
    W_STAGES: tl.constexpr,
):
    """A = down_dgrad tiles with the router epilogue (d_gate_up, h_w = w * h, the router weight's partials
    d_w_part) over the pulled, unweighted d_out rows (row r's weight: weight_rows[row_index[r]], 0 where
    row_index is -1), B = gate_up_dgrad tiles (d_x rows, pushed); then the weight-grad tiles
    (_weight_grad_tasks)."""
    first_m, end_m = load_range(block_range_ptr, SPLIT)
    task = pull_then_claim(
        d_out_rows_ptr, pull_table_ptr, pull_rank_ptr, pull_token_ptr, work_ptr,
        first_m // SPLIT, end_m // SPLIT, pull_programs, H, group_blocks,
        ALIGNED=PULL_ALIGNED, BLOCK_ROWS=BLOCK_M * SPLIT, ROWS=PULL_ROWS, BLOCK=PULL_BLOCK,
    )
    # Only `task` is carried across iterations: the layout is re-derived from the arguments each time
    # (cheap scalar work), which keeps the tiles' registers free (at 255 otherwise they spill).
    while task < _num_tasks(block_range_ptr, H, I, stage_m, SPLIT, A_BLOCK_N, B_BLOCK_N):
        is_b, index, first_m, m0, stage_rows, a_n, b_n = _stage_task(
            task, block_range_ptr, H, I, stage_m, SPLIT, A_BLOCK_N, B_BLOCK_N)
        if is_b:
            if index < stage_rows * b_n:
                pid_m, pid_n = tile_coords(index, stage_rows, b_n, GROUP_M)
                pid_m += first_m + m0
                wait_at_least(work_ptr + done_offset + pid_m, a_n, timeout_ns)
                gate_up_dgrad_tile(pid_m, pid_n, d_gate_up_ptr, w_gate_up_ptr, block_expert_ptr, d_x_ptr, push_table_ptr,
                                   push_rank_ptr, push_pair_ptr, H, I, B_EVEN_K, SPLIT, BLOCK_M, B_BLOCK_N, B_BLOCK_K,
                                   B_STAGES, True, PUSH_ALIGNED)
        else:
            if index < stage_rows * a_n:
                pid_m, pid_n = tile_coords(index, stage_rows, a_n, GROUP_M)
                pid_m += first_m + m0
                wait_ready(work_ptr, pid_m // SPLIT // group_blocks, timeout_ns)
                down_dgrad_tile(pid_m, pid_n, d_out_rows_ptr, w_down_ptr, gate_up_ptr, block_expert_ptr, d_gate_up_ptr,
                                row_index_ptr, weight_rows_ptr, h_w_ptr, d_w_part_ptr, H, I,
                                A_EVEN_K, SPLIT, BLOCK_M, A_BLOCK_N, A_BLOCK_K, A_STAGES, True, True)
                signal_done(work_ptr + done_offset + pid_m)
        task = claim_task(work_ptr, 1)
    # Tasks are claimed in order: a program gets here with the first task past the A/B list.
    _weight_grad_tasks(
        task, _num_tasks(block_range_ptr, H, I, stage_m, SPLIT, A_BLOCK_N, B_BLOCK_N), work_ptr, done_offset,
        tl.cdiv(I, A_BLOCK_N), timeout_ns,
        d_out_rows_ptr, h_w_ptr, d_gate_up_ptr, x_rows_ptr, expert_offsets_ptr, d_w_down_ptr, d_w_gate_up_ptr, num_experts,
        H, I, BLOCK_M, W_BLOCK_M, W_BLOCK_N, W_BLOCK_K, W_GROUP_M, W_STAGES,
    )


@triton.jit
def _weight_grad_tasks(
    task, first_task, work_ptr, done_offset, a_n, timeout_ns,
    d_out_rows_ptr, h_w_ptr, d_gate_up_ptr, x_rows_ptr, expert_offsets_ptr, d_w_down_ptr, d_w_gate_up_ptr, num_experts, H, I,
    BLOCK_M: tl.constexpr, W_BLOCK_M: tl.constexpr, W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr,
    W_GROUP_M: tl.constexpr, W_STAGES: tl.constexpr,
):
    """The backward's weight-grad tiles, the tasks after the A/B list (task: the first this program
    claimed there; first_task: the first weight-grad task's number): every d_w_down tile, then every
    d_w_gate_up tile, expert-major, claimed WEIGHT_GRAD_CLAIM at a time. Claimed, not dealt round-robin:
    the programs running at once then work on neighbouring tiles of one expert and share its rows in L2,
    which decides the time for experts with many rows (docs/perf-notes.md, "EP v8").
    A tile needs every A tile of its expert's row blocks done (they acquired the ready flags of the
    expert's d_out rows and wrote its d_gate_up and h_w rows). A program keeps how many leading experts it has
    seen done (`ready`) and waits only past them, so it polls each row block's counter at most once."""
    down_tiles = tl.cdiv(H, W_BLOCK_M) * tl.cdiv(I, W_BLOCK_N)
    gate_up_tiles = tl.cdiv(2 * I, W_BLOCK_M) * tl.cdiv(H, W_BLOCK_N)
    index = task - first_task
    claimed_end = index + 1
    ready = 0
    while index < num_experts * (down_tiles + gate_up_tiles):
        is_down = index < num_experts * down_tiles
        tile = tl.where(is_down, index, index - num_experts * down_tiles)
        per_expert = tl.where(is_down, down_tiles, gate_up_tiles)
        expert = tile // per_expert
        if expert >= ready:
            first_m = tl.load(expert_offsets_ptr + ready) // BLOCK_M
            end_m = tl.load(expert_offsets_ptr + expert + 1) // BLOCK_M
            wait_all_at_least(work_ptr + done_offset, first_m, end_m, a_n, timeout_ns)
            ready = expert + 1
        # One dw_tile call site for both weight grads (each inlined copy would hold its own shared memory).
        if is_down:  # d_w_down = d_out_rows^T h_w
            a_ptr, b_ptr, dw_ptr, dw_m, dw_n = d_out_rows_ptr, h_w_ptr, d_w_down_ptr, H, I
        else:  # d_w_gate_up = d_gate_up^T x_rows
            a_ptr, b_ptr, dw_ptr, dw_m, dw_n = d_gate_up_ptr, x_rows_ptr, d_w_gate_up_ptr, 2 * I, H
        dw_tile(expert, tile - expert * per_expert, a_ptr, b_ptr, dw_m, dw_n, expert_offsets_ptr, dw_ptr,
                W_BLOCK_M, W_BLOCK_N, W_BLOCK_K, W_GROUP_M, W_STAGES)
        index += 1
        if index == claimed_end:  # this program's claim is used up
            index = claim_task(work_ptr, WEIGHT_GRAD_CLAIM) - first_task
            claimed_end = index + WEIGHT_GRAD_CLAIM


# ----------------------------------------------------------------------------------------------------
# Launchers


def _launch(rows: torch.Tensor, block_expert: torch.Tensor, blocks: torch.Tensor, a: TileConfig, b: TileConfig,
            a_k: int, b_k: int, a_n: int, pull: RowPull, push: RowPush):
    """(grid, block range, runtime scalars, work buffer, constexprs) of a fused launch over rows [R, H]."""
    check(a.block_m == b.block_m and a.num_warps == b.num_warps,
          f"fused GEMMs need one row tile and warp count, got {a} and {b}")
    num_rows, hidden = rows.shape
    split, block_range = check_rows(num_rows, block_expert, blocks, a.block_m)
    check_pull(pull, rows)
    check_push(push, num_rows)
    num_blocks = block_expert.numel()
    row_blocks = num_rows // a.block_m
    # One program per SM, communication programs included (fewer when there are fewer A tiles).
    grid = max(1, min(num_sms(rows.device), pull.programs + row_blocks * a_n))
    work, done_offset = work_buffer(triton.cdiv(num_blocks, pull.group_blocks), row_blocks, rows.device)
    # A stage is about two waves of A tiles, so B tiles a stage behind rarely wait for their rows.
    # Measured on qwen3-30b-a3b fwd+bwd at EP=2 (docs/perf-notes.md): one wave 9.73 ms, two 9.45, all A
    # tiles before any B tile 9.55; qwen3-235b-a22b 32.86 (one) and 32.88 (all).
    stage_m = max(1, STAGE_WAVES * triton.cdiv(grid, a_n))
    meta = pull_meta(rows, num_rows // num_blocks)
    constexprs = dict(
        SPLIT=split, BLOCK_M=a.block_m, GROUP_M=a.group_m,
        A_EVEN_K=a_k % a.block_k == 0, A_BLOCK_N=a.block_n, A_BLOCK_K=a.block_k, A_STAGES=a.num_stages,
        B_EVEN_K=b_k % b.block_k == 0, B_BLOCK_N=b.block_n, B_BLOCK_K=b.block_k, B_STAGES=b.num_stages,
        PULL_ALIGNED=aligned_rows(hidden, rows.element_size(), rows), PULL_ROWS=meta["PULL_ROWS"],
        PULL_BLOCK=meta["PULL_BLOCK"], PUSH_ALIGNED=aligned_rows(hidden, rows.element_size()),
        num_warps=a.num_warps, num_stages=max(a.num_stages, b.num_stages),
    )
    scalars = [pull.programs, pull.group_blocks, pull.timeout_ns, stage_m, done_offset]
    return (grid,), block_range, scalars, work, constexprs


def ep_forward(
    x_rows: torch.Tensor,
    w_gate_up_E2IH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    pull: RowPull,
    push: RowPush,
    *,
    gate_up_config: TileConfig,
    down_config: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [R, I], gate_up [R, 2I]) over the schedule blocks in `blocks`; x_rows [R, H] is filled by the
    communication programs (pull), and every y row goes to its (token, slot) row of its token owner's
    pairs buffer (push)."""
    check_matrix(x_rows, None, None, "x_rows")
    num_rows, hidden = x_rows.shape
    check(w_gate_up_E2IH.dim() == 3 and w_gate_up_E2IH.shape[1] % 2 == 0, "w_gate_up must be [E_l, 2I, H]")
    inter = w_gate_up_E2IH.shape[1] // 2
    check_weight(w_gate_up_E2IH, x_rows, (w_gate_up_E2IH.shape[0], 2 * inter, hidden), "w_gate_up")
    check_weight(w_down_EHI, x_rows, (w_gate_up_E2IH.shape[0], hidden, inter), "w_down")
    a_n = triton.cdiv(inter, gate_up_config.block_n)
    grid, block_range, scalars, work, constexprs = _launch(
        x_rows, block_expert, blocks, gate_up_config, down_config, hidden, inter, a_n, pull, push)
    h = torch.empty(num_rows, inter, dtype=x_rows.dtype, device=x_rows.device)
    gate_up = torch.empty(num_rows, 2 * inter, dtype=x_rows.dtype, device=x_rows.device)
    ep_fwd_kernel[grid](
        x_rows, w_gate_up_E2IH, w_down_EHI, block_expert, block_range, h, gate_up, x_rows,
        pull.table, pull.src_rank, pull.src_token, work, push.table, push.dst_rank, push.dst_pair,
        hidden, inter, *scalars,
        **constexprs,
    )
    return h, gate_up


def ep_backward(
    d_out_rows: torch.Tensor,
    x_rows: torch.Tensor,
    gate_up_R2I: torch.Tensor,
    w_gate_up_E2IH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    block_expert: torch.Tensor,
    blocks: torch.Tensor,
    expert_offsets: torch.Tensor,
    row_index: torch.Tensor,
    weight_rows: torch.Tensor,
    pull: RowPull,
    push: RowPush,
    *,
    down_dgrad_config: TileConfig,
    gate_up_dgrad_config: TileConfig,
    dw_down_config: TileConfig,
    dw_gate_up_config: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_w_gate_up [E_l, 2I, H], d_w_down [E_l, H, I], d_w_part fp32 [R, cdiv(I, block_n)]) over the schedule
    blocks in `blocks`: grouped_gemm.down_dgrad_router's router epilogue, gate_up_dgrad and both weight grads in
    one kernel. d_out_rows [R, H] (each receive row's d_out row, unweighted) is filled by the communication
    programs (pull); row_index int32 [R] and weight_rows fp32 [R]: row r's router weight is
    weight_rows[row_index[r]] (0 where row_index is -1: padding); x_rows and gate_up are the forward's receive
    rows and pre-activation; every d_x row goes to its token owner's pairs buffer (push); d_w_part: as
    down_dgrad_router's. The two weight grads run one tile (their configs must be equal); expert_offsets int32
    [E_l + 1] bound their row loops."""
    check_matrix(d_out_rows, None, None, "d_out_rows")
    num_rows, hidden = d_out_rows.shape
    check(w_down_EHI.dim() == 3 and w_down_EHI.shape[1] == hidden, "w_down must be [E_l, H, I]")
    num_experts, inter = w_down_EHI.shape[0], w_down_EHI.shape[2]
    check_weight(w_down_EHI, d_out_rows, (num_experts, hidden, inter), "w_down")
    check_weight(w_gate_up_E2IH, d_out_rows, (num_experts, 2 * inter, hidden), "w_gate_up")
    check_matrix(x_rows, num_rows, hidden, "x_rows")
    check_matrix(gate_up_R2I, num_rows, 2 * inter, "gate_up")
    check_row_src(row_index, num_rows)
    check(weight_rows.dtype == torch.float32 and weight_rows.shape == (num_rows,) and weight_rows.is_contiguous(),
          f"weight_rows must be a contiguous fp32 [{num_rows}] tensor, got {weight_rows.dtype} {tuple(weight_rows.shape)}")
    dw_config = dw_down_config
    check(dw_gate_up_config == dw_config and dw_config.num_warps == down_dgrad_config.num_warps,
          f"the fused backward runs one weight-grad tile at the GEMMs' warp count, got dw_down {dw_down_config}, "
          f"dw_gate_up {dw_gate_up_config}, down_dgrad {down_dgrad_config}")
    check_expert_offsets(expert_offsets, num_rows, num_experts, dw_config.block_k)
    a_n = triton.cdiv(inter, down_dgrad_config.block_n)
    grid, block_range, scalars, work, constexprs = _launch(
        d_out_rows, block_expert, blocks, down_dgrad_config, gate_up_dgrad_config, hidden, 2 * inter, a_n, pull, push)
    d_gate_up = d_out_rows.new_empty(num_rows, 2 * inter)
    h_w = d_out_rows.new_empty(num_rows, inter)
    d_w_part = torch.empty(num_rows, a_n, dtype=torch.float32, device=d_out_rows.device)
    d_w_down = torch.empty_like(w_down_EHI)
    d_w_gate_up = torch.empty_like(w_gate_up_E2IH)
    constexprs["num_stages"] = max(constexprs["num_stages"], dw_config.num_stages)
    ep_bwd_kernel[grid](
        d_out_rows, w_gate_up_E2IH, w_down_EHI, block_expert, block_range, gate_up_R2I, d_gate_up, d_out_rows,
        row_index, weight_rows, h_w, d_w_part,
        pull.table, pull.src_rank, pull.src_token, work, push.table, push.dst_rank, push.dst_pair,
        x_rows, expert_offsets, d_w_down, d_w_gate_up, num_experts,
        hidden, inter, *scalars,
        W_BLOCK_M=dw_config.block_m, W_BLOCK_N=dw_config.block_n, W_BLOCK_K=dw_config.block_k,
        W_GROUP_M=dw_config.group_m, W_STAGES=dw_config.num_stages, **constexprs,
    )
    return d_w_gate_up, d_w_down, d_w_part
