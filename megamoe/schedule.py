"""build_schedule: routing -> fixed-size device tensors, without host synchronisation.

The schedule is the contract between routing and every kernel (docs/design.md). All ranks of an
expert-parallel group derive the same *global* placement from the all-gathered routing, so each rank
knows both its receive rows (as expert owner) and where its own (token, slot) pairs go (as token owner).
Every shape here is a function of (W, T, k, E, block_m, capacity) only: nothing depends on the routing
values, so the whole computation runs on `device="meta"` and inside CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from megamoe.config import DEFAULT_CONFIG, MoEConfig, check_block_m, check_group, check_positive_int

DEFAULT_BLOCK_M = 128
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what x may be
TRITON_DTYPES = FLOAT_DTYPES[:3]  # the fused kernels accumulate in fp32: no float64 path
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps")  # where torch.is_autocast_enabled(device_type) may be asked
INT32_MAX = torch.iinfo(torch.int32).max  # the schedule's indices and counts are int32


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where every (token, slot) pair of the expert-parallel group goes, for one rank.

    Sizes: W ranks, T tokens per rank, k slots per token, E global experts, E_l = E / W local
    experts, B = block_m, R = num_rows (receive capacity of this rank, a multiple of B).
    A pair's *flat source index* is src = (s * T + t) * k + j for token t, slot j of rank s.

    Receive side (this rank as expert owner). Rows are expert-major; the rows of local expert e are
    ordered by (source rank, token, slot) ascending and padded to a multiple of B:
      expert_counts   [E]      int32  pairs routed to each *global* expert, over all ranks (dropped ones too)
      expert_offsets  [E_l+1]  int32  first row of each local expert's segment; expert_offsets[E_l] is the
                                      number of rows in use. Clamped to R when a capacity cuts segments.
      row_src         [R]      int32  flat source index of each row; -1 marks padding and unused rows
      block_expert    [R // B] int32  local expert of each block of B rows; -1 for blocks past the end
      num_blocks      [1]      int32  number of leading blocks in use (= expert_offsets[E_l] // B)
    Send side (this rank as token owner):
      dest_rank       [T, k]   int32  rank owning expert topk_ids[t, j]
      dest_row        [T, k]   int32  row of pair (t, j) in dest_rank's receive rows; -1 if it did not fit
      overflow        []       int32  pairs of the whole group that did not fit a declared capacity (0 when
                                      dropless); identical on every rank
    """

    num_experts: int
    num_local_experts: int
    world_size: int
    rank: int
    num_tokens: int
    top_k: int
    block_m: int
    num_rows: int
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    row_src: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    dest_rank: torch.Tensor
    dest_row: torch.Tensor
    overflow: torch.Tensor


# The Schedule's tensor fields, in declaration order (what crosses torch.library op boundaries).
SCHEDULE_TENSORS = (
    "expert_counts", "expert_offsets", "row_src", "block_expert", "num_blocks", "dest_rank", "dest_row", "overflow",
)


def schedule_tensors(schedule: Schedule) -> list[torch.Tensor]:
    return [getattr(schedule, name) for name in SCHEDULE_TENSORS]


def schedule_from_tensors(tensors, *, num_experts: int, world_size: int, rank: int, block_m: int) -> Schedule:
    """Rebuild a Schedule from schedule_tensors() (the integer fields follow from the shapes)."""
    fields = dict(zip(SCHEDULE_TENSORS, tensors))
    num_tokens, top_k = fields["dest_row"].shape
    return Schedule(
        num_experts=num_experts, num_local_experts=num_experts // world_size, world_size=world_size, rank=rank,
        num_tokens=num_tokens, top_k=top_k, block_m=block_m, num_rows=fields["row_src"].numel(), **fields,
    )


def receive_rows(
    num_tokens: int,
    top_k: int,
    num_local_experts: int,
    world_size: int,
    block_m: int,
    capacity_factor: float | None,
) -> int:
    """R, the receive rows of one rank: the worst case, or the declared capacity if smaller.

    Worst case: all W*T*k pairs of the group land on this rank, each non-empty expert padded to B.
    Capacity c: ceil(c*T*k) rows (c times the balanced load) rounded up to whole blocks of B, plus one block of
    padding per local expert (at most one per pair), never more than the worst case.
    block_m: the B the schedule is built with (MoEConfig.block_m, or where that is None the backend's: 128 on
    the triton path, 16 on the torch path); capacity_factor: MoEConfig.capacity_factor (None: dropless).
    """
    for name, value, allow_zero in (("num_tokens", num_tokens, True), ("top_k", top_k, False),
                                    ("num_local_experts", num_local_experts, False), ("world_size", world_size, False)):
        if not isinstance(value, torch.SymInt):  # a symbolic size under torch.compile's dynamic shapes
            check_positive_int(f"receive_rows: {name}", value, allow_zero=allow_zero)
    check_block_m("receive_rows: block_m", block_m)
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
        or not (0 < capacity_factor < math.inf)  # not math.isfinite: an int beyond the floats is an OverflowError there
    ):
        raise ValueError(
            f"receive_rows: capacity_factor must be None or a finite number > 0, got {capacity_factor!r}"
        )
    pairs = world_size * num_tokens * top_k
    # sym_min, not min: under torch.compile's dynamic shapes min would guard on W*T*k < E_local (a recompile when T crosses
    # that bound; a T marked dynamic specialised to a constant, an error).
    nonempty = torch.sym_min(num_local_experts, pairs)
    worst_blocks = (pairs + nonempty * (block_m - 1)) // block_m
    wanted = None if capacity_factor is None else capacity_factor * num_tokens * top_k
    # A capacity at least the worst case is the worst case (this also keeps a huge finite factor, whose
    # product overflows to inf, away from math.ceil).
    if wanted is None or wanted >= worst_blocks * block_m:
        return worst_blocks * block_m
    capped_blocks = math.ceil(math.ceil(wanted) / block_m) + nonempty
    return min(worst_blocks, capped_blocks) * block_m


def _group_info(group) -> tuple[int, int]:
    check_group("group", group)
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def not_dense(name: str, value: torch.Tensor) -> TypeError | None:
    """The TypeError for a tensor that is not dense, or None. Sparse layouts (COO/CSR): .contiguous() and the
    kernels' ops fail on them. Nested tensors (also those of layout torch.strided): their shape is ragged, and
    torch fails on it with its own internal errors ("NestedTensorImpl doesn't support sizes")."""
    if value.is_nested:
        return TypeError(
            f"{name} must be a dense (torch.strided) tensor, got a nested tensor of layout {value.layout}; pass the "
            "tokens of a ragged batch as one dense tensor (a jagged nested tensor's values())"
        )
    if value.layout != torch.strided:
        return TypeError(f"{name} must be a dense (torch.strided) tensor, got layout {value.layout}")
    return None


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int, *, check_range: bool = True) -> None:
    """Validate routing: type and shape, then (check_range) the ids' range — on the CPU directly, on
    accelerators with a device assert (no host sync)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if (error := not_dense("topk_ids", topk_ids)) is not None:
        raise error
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have k >= 1 columns, got shape {tuple(topk_ids.shape)}")
    if not isinstance(num_experts, torch.SymInt):  # a symbolic size under torch.compile's dynamic shapes
        check_positive_int("num_experts", num_experts)
    if not check_range or topk_ids.device.type == "meta" or topk_ids.numel() == 0:
        return
    in_range = ((topk_ids >= 0) & (topk_ids < num_experts)).all()
    if topk_ids.device.type == "cpu":
        if not bool(in_range):
            bad = topk_ids[(topk_ids < 0) | (topk_ids >= num_experts)][0].item()
            raise ValueError(f"topk_ids must hold expert ids in [0, {num_experts}), found {bad}")
    else:
        # NOTE: no host sync; a bad id fails the device assert at the caller's next synchronisation.
        torch._assert_async(in_range, f"megamoe: topk_ids must hold expert ids in [0, {num_experts})")


def _check_tensor(name: str, value, dim: int) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if (error := not_dense(name, value)) is not None:
        raise error
    if value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(value.shape)}")


# The argument checks of megamoe.experts live here, beside check_topk_ids, rather than in megamoe.autograd:
# megamoe.reference (which megamoe.autograd imports) runs the same ones.
def validate(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, world_size: int) -> None:
    """Clear errors for bad arguments (shapes, dtypes, devices). Never asserts, never modifies inputs.
    The ids' range is not checked here (build_schedule checks it; megamoe.reference calls check_topk_ids)."""
    _check_tensor("topk_ids", topk_ids, 2)  # first: the checks below read its shape
    _check_tensor("x", x, 2)
    _check_tensor("topk_weights", topk_weights, 2)
    _check_tensor("w_gate_up", w_gate_up, 3)
    _check_tensor("w_down", w_down, 3)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    num_tokens, hidden = x.shape
    if hidden < 1:
        raise ValueError(f"x must be [T, H] with hidden size H >= 1, got shape {tuple(x.shape)}")
    num_local, two_i, w_hidden = w_gate_up.shape
    if num_local < 1:
        raise ValueError(
            f"w_gate_up must be [E_local, 2*I, H] with E_local >= 1 experts, got shape {tuple(w_gate_up.shape)}"
        )
    if two_i % 2 != 0 or two_i == 0:
        raise ValueError(
            "w_gate_up must be [E_local, 2*I, H] with an even middle size 2*I >= 2 (I >= 1), "
            f"got shape {tuple(w_gate_up.shape)}"
        )
    if w_hidden != hidden:
        raise ValueError(f"w_gate_up must be [E_local, 2*I, H={hidden}] to match x [T, H], got {tuple(w_gate_up.shape)}")
    expected_down = (num_local, hidden, two_i // 2)
    if tuple(w_down.shape) != expected_down:
        raise ValueError(f"w_down must be [E_local, H, I] = {expected_down}, got {tuple(w_down.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T={num_tokens}, k], "
            f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    if topk_weights.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"topk_weights must be float32 (or x's dtype {x.dtype}), got {topk_weights.dtype}")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up and shared_down must be given together (or both None)")
    if shared_gate_up is not None:
        _check_tensor("shared_gate_up", shared_gate_up, 2)
        _check_tensor("shared_down", shared_down, 2)
        two_i_s = shared_gate_up.shape[0]
        if two_i_s % 2 != 0 or shared_gate_up.shape[1] != hidden:
            raise ValueError(f"shared_gate_up must be [2*I_s, H={hidden}], got {tuple(shared_gate_up.shape)}")
        if tuple(shared_down.shape) != (hidden, two_i_s // 2):
            raise ValueError(f"shared_down must be [H, I_s] = {(hidden, two_i_s // 2)}, got {tuple(shared_down.shape)}")
        for name, w in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down)):
            if w.dtype != x.dtype:
                raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    named = [("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_gate_up", w_gate_up), ("w_down", w_down)]
    if shared_gate_up is not None:
        named += [("shared_gate_up", shared_gate_up), ("shared_down", shared_down)]
    for name, t in named:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all inputs must share one device")
    check_topk_ids(topk_ids, num_local * world_size, check_range=False)  # the range: in build_schedule


def check_gathered_ids(ids: torch.Tensor, num_experts: int, *, num_tokens: int, rank: int) -> torch.Tensor:
    """Range-check the routing gathered from every rank of a group ([W*T, k], rank s's at rows [s*T, (s+1)*T)),
    which build_schedule's placement indexes tensors of E experts with.

    On the CPU a bad id is a ValueError at once, on every rank (each holds the same gathered routing),
    naming the rank that passed it. On accelerators (no host sync): a device assert that fails at the
    caller's next synchronisation, and the ids are clamped into [0, E) so that nothing reads out of bounds
    before it does (the schedule of a failed assert is never used). Returns the ids to place.
    """
    if ids.numel() == 0:
        return ids
    bad = (ids < 0) | (ids >= num_experts)
    if ids.device.type == "cpu":
        if bool(bad.any()):
            first = int(bad.reshape(-1).to(torch.uint8).argmax())
            top_k = ids.shape[1]
            row, slot = divmod(first, top_k)
            source, token = divmod(row, max(num_tokens, 1))
            value = int(ids.reshape(-1)[first])
            if source == rank:
                raise ValueError(
                    f"topk_ids must hold expert ids in [0, {num_experts}), found {value} (token {token}, slot {slot})"
                )
            raise ValueError(
                f"rank {source} of the expert-parallel group passed topk_ids with expert id {value} (its token "
                f"{token}, slot {slot}), outside [0, {num_experts}): every rank of the group raises here"
            )
        return ids
    # NOTE: no host sync; a bad id of any rank fails the device assert at the caller's next synchronisation.
    torch._assert_async(
        ~bad.any(), f"megamoe: the topk_ids of a rank of the expert-parallel group hold an expert id outside [0, {num_experts})"
    )
    return ids.clamp(0, num_experts - 1)


def build_schedule(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    group=None,
    config: MoEConfig | None = None,
    block_m: int | None = None,
    gather_routing=None,
    place_routing=None,
) -> Schedule:
    """Turn routing into a Schedule (see its docstring), with device ops only.

    topk_ids: [T, k] int32/int64 global expert ids of this rank's tokens.
    num_experts: E, the global number of experts (divisible by the group size).
    group: expert-parallel process group (None: one process owns all experts). With a group, every
        rank must pass the same T and k (not checked here: megamoe.experts checks it, see
        autograd.check_ranks_agree); routing is all-gathered and each rank derives the same schedule. The
        ids' range is checked on the gathered routing (check_gathered_ids), so a bad id of any rank fails
        every rank.
    block_m: overrides config.block_m (megamoe.experts passes a config with block_m resolved; benchmarks and
        tests pass it here); default 128. Like MoEConfig.block_m: None or a power of two in [1, 1024].
    gather_routing: with a group, how to all-gather routing: a callable taking this rank's int32
        [T, k] ids and returning every rank's, [W*T, k] in rank order (default: the process group's
        all_gather_into_tensor; the fused EP path passes its symmetric-memory exchange).
    place_routing: how to place the pairs (default place_routing_torch; the triton backend passes its
        fused kernels, which give identical tensors in a handful of launches). A placement other than the
        default checks the ids' range itself (a device assert), so build_schedule leaves that check to it.
    Raises ValueError when the group's W*T*k pairs or the receive rows before any capacity (the worst case, which
    the placement sums) exceed 2**31 - 1 (the int32 indices).
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
    check_block_m("build_schedule: block_m", block_m, allow_none=True)
    world_size, rank = _group_info(group)
    # With a group the range is checked on the gathered routing (every rank's ids, below): a bad id of one
    # rank then fails every rank at the same point, instead of one rank raising while its peers block in
    # the gather.
    # A backend's placement checks the ids' range itself; the default, passed or not, does not.
    checks_range = place_routing is None or place_routing is place_routing_torch
    check_topk_ids(topk_ids, num_experts, check_range=world_size == 1 and checks_range)
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel group size ({world_size})"
        )
    block_m = block_m or config.block_m or DEFAULT_BLOCK_M
    num_tokens, top_k = topk_ids.shape
    num_local = num_experts // world_size
    device = topk_ids.device
    rows = receive_rows(num_tokens, top_k, num_local, world_size, block_m, config.capacity_factor)
    # The placement kernels sum the padded segments before cutting them at a capacity: the uncapped worst case must
    # fit int32 too.
    uncapped_rows = receive_rows(num_tokens, top_k, num_local, world_size, block_m, None)
    pairs = world_size * num_tokens * top_k
    # Beyond int32, flat source indices, counts and rows would wrap, and pairs be placed wrong or dropped unseen.
    # NOTE: shapes only, no host sync. Under torch.compile's dynamic shapes (the ops' fake impls) the sizes are
    # symbols, which a comparison would guard on: statically_known_true decides without a guard, and the op's
    # real implementation checks the concrete sizes at run time.
    if statically_known_true(pairs > INT32_MAX) or statically_known_true(uncapped_rows > INT32_MAX):
        raise ValueError(
            f"topk_ids [T={num_tokens}, k={top_k}] over W={world_size} ranks gives W*T*k = {pairs} (token, slot) "
            f"pairs and {uncapped_rows} receive rows before any capacity (block_m={block_m}); the schedule's int32 "
            f"indices take at most 2**31 - 1 = {INT32_MAX} of each"
        )

    ids = topk_ids
    if world_size > 1:  # int32 on the wire
        if ids.dtype == torch.int64:
            # Saturated, not wrapped: an int64 id beyond int32's range (say 2**32 + 1, which .to(int32) turns
            # into 1) stays outside [0, E), so the range check of the gathered routing below still rejects it.
            int32 = torch.iinfo(torch.int32)
            ids = ids.clamp(int32.min, int32.max)
        ids = ids.to(torch.int32).contiguous()
    if world_size > 1 and device.type == "meta":
        ids = ids.new_empty(world_size * num_tokens, top_k)  # shapes only: nothing to exchange
    elif world_size > 1 and gather_routing is not None:
        ids = gather_routing(ids)
    elif world_size > 1:
        import torch.distributed as dist

        gathered = torch.empty(world_size * num_tokens, top_k, dtype=torch.int32, device=device)
        # all_gather_single is the newer name (torch >= 2.13) of all_gather_into_tensor.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, ids, group=group)
        ids = gathered
    if world_size > 1 and device.type != "meta" and checks_range:
        ids = check_gathered_ids(ids, num_experts, num_tokens=num_tokens, rank=rank)
    placed = (place_routing or place_routing_torch)(
        ids.reshape(-1), num_experts=num_experts, world_size=world_size, rank=rank, block_m=block_m, num_rows=rows
    )

    local = slice(rank * num_tokens * top_k, (rank + 1) * num_tokens * top_k)
    return Schedule(
        num_experts=num_experts,
        num_local_experts=num_local,
        world_size=world_size,
        rank=rank,
        num_tokens=num_tokens,
        top_k=top_k,
        block_m=block_m,
        num_rows=rows,
        expert_counts=placed.expert_counts,
        expert_offsets=placed.expert_offsets,
        row_src=placed.row_src,
        block_expert=placed.block_expert,
        num_blocks=placed.num_blocks,
        dest_rank=placed.dest_rank.view(num_tokens, top_k),
        dest_row=placed.dest_row[local].view(num_tokens, top_k),
        overflow=placed.overflow,
    )


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every pair of the group goes (all int32): the Schedule's fields, with dest_row for all W*T*k
    pairs ([N], flat source order) rather than this rank's [T, k], and dest_rank for this rank's pairs
    ([N / W], flat source order)."""

    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    row_src: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    dest_row: torch.Tensor
    overflow: torch.Tensor
    dest_rank: torch.Tensor


def place_routing_torch(
    flat_ids: torch.Tensor, *, num_experts: int, world_size: int, rank: int, block_m: int, num_rows: int
) -> Placement:
    """The placement of every pair, with torch ops (any device, meta included).

    flat_ids: [N = W*T*k] int32 or int64 global expert ids in [0, E), in flat source order. Backends may
    supply a faster placement with this signature (build_schedule's place_routing); it must give identical
    tensors.
    """
    flat_ids = flat_ids.to(torch.int64)
    device, num_pairs, rows = flat_ids.device, flat_ids.numel(), num_rows
    local_pairs = num_pairs // world_size
    num_local = num_experts // world_size
    # Stable sort by expert keeps (source rank, token, slot) order inside each expert.
    sorted_ids, perm = torch.sort(flat_ids, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=device, dtype=torch.int64))
    counts = bounds[1:] - bounds[:-1]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.zeros(world_size, num_local + 1, dtype=torch.int64, device=device)
    starts[:, 1:] = torch.cumsum(padded.view(world_size, num_local), dim=1)  # per owner rank

    position = torch.arange(num_pairs, device=device, dtype=torch.int64) - bounds[sorted_ids]
    owner = sorted_ids // num_local
    row_sorted = starts[owner, sorted_ids % num_local] + position
    fits = row_sorted < rows
    dest_row_all = torch.empty(num_pairs, dtype=torch.int64, device=device)
    dest_row_all[perm] = torch.where(fits, row_sorted, -1)

    # Receive side of this rank: scatter flat source indices into their rows (unique targets; pairs
    # owned by other ranks or cut by the capacity go to a dummy row R that is sliced off).
    mine = fits & (owner == rank)
    row_src = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
    row_src[torch.where(mine, row_sorted, rows)] = torch.where(mine, perm, -1)

    offsets = starts[rank].clamp(max=rows)  # [E_l + 1]
    block_starts = torch.arange(0, rows, block_m, device=device, dtype=torch.int64)
    block_expert = torch.searchsorted(offsets[1:].contiguous(), block_starts, right=True)
    block_expert = torch.where(block_starts < offsets[-1], block_expert, -1)
    return Placement(
        expert_counts=counts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
        row_src=row_src[:rows].to(torch.int32),
        block_expert=block_expert.to(torch.int32),
        num_blocks=(offsets[-1:] // block_m).to(torch.int32),
        dest_row=dest_row_all.to(torch.int32),
        overflow=(~fits).sum().to(torch.int32),
        dest_rank=(flat_ids[rank * local_pairs:(rank + 1) * local_pairs] // num_local).to(torch.int32),
    )
