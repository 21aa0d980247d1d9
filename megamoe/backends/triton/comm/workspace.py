"""The symmetric-memory workspace of an expert-parallel group: one per (group, device, hidden size, dtype),
sized for the largest shapes asked for, reused by every layer and every smaller batch.

Buffers live in PyTorch symmetric memory (`torch.distributed._symmetric_memory`), so every rank can
read and write its peers' copies over NVLink through their mapped addresses. NVLink multicast is never
used. Synchronisation between ranks is the symmetric-memory barrier, a device-side wait on signal pads
with a timeout: a peer that never arrives becomes a device error after `comm_timeout_ms`, not a hang.
Each exchange waits on its own channel (BARRIER_CHANNELS), so the waiting rank's report names it:
torch's barrier kernel prints "[FATAL] CUDASymmetricMemory::barrier: rank R failed to receive signal from
rank P on channel C after N microseconds" (N is comm_timeout_ms: torch prints the milliseconds under that
unit) and traps; the CUDA context is then lost, the launch's error surfaces at the next synchronisation,
and the process can still exit (its other ranks see the same at their own barriers).
"""

from __future__ import annotations

import dataclasses

import torch

from megamoe.config import MAX_COMM_TIMEOUT_MS, check_positive_int, note_group, on_group_recreated
from megamoe.schedule import TRITON_DTYPES

DEFAULT_TIMEOUT_MS = 30_000
# The barrier channel of each exchange (see the module docstring): the routing all-gather, the dispatch of
# token rows (x forward, d_out and the router weights backward) and the combine of result rows (y forward,
# d_x backward). Channel 0 is left to other users of the group's symmetric memory.
BARRIER_CHANNELS = {"routing": 1, "dispatch": 2, "combine": 3}


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """One symmetric buffer: this rank's tensor, the rendezvous handle and the peers' base addresses (an
    empty buffer that no kernel reads: a plain local tensor, no handle, no addresses)."""

    local: torch.Tensor
    handle: object
    peer_ptrs: torch.Tensor  # [W] int64 base addresses of every rank's copy (mapped here)


# The routing buffer starts with each rank's (T, T*k, R), so that a reader checks, on the device, that the
# rank it reads from called with its own shapes (exchange.gather_routing): one workspace serves every T.
ROUTING_HEADER = 3


@dataclasses.dataclass(frozen=True)
class WorkspaceSizes:
    """What a workspace holds: token rows (T), (token, slot) pairs (T * k) and receive rows (R)."""

    tokens: int
    pairs: int
    rows: int

    def covers(self, other: "WorkspaceSizes") -> bool:
        return self.tokens >= other.tokens and self.pairs >= other.pairs and self.rows >= other.rows

    def union(self, other: "WorkspaceSizes") -> "WorkspaceSizes":
        return WorkspaceSizes(max(self.tokens, other.tokens), max(self.pairs, other.pairs), max(self.rows, other.rows))

    def nbytes(self, hidden_size: int, dtype: torch.dtype) -> int:
        """This rank's symmetric memory for these sizes: (T + T*k + 2R) rows of H elements of dtype (tokens,
        pairs, rows_in, rows_out) plus 4 bytes per pair twice and ROUTING_HEADER ints (weights, ids)."""
        row = hidden_size * dtype.itemsize
        return (self.tokens + self.pairs + 2 * self.rows) * row + 4 * (2 * self.pairs + ROUTING_HEADER)


@dataclasses.dataclass(frozen=True)
class Workspace:
    """Buffers of one (group, device, hidden size, dtype) combination; see get_workspace.

    get_workspace hands out views of the cached workspace's leading elements shaped for one call (T, k, R),
    with the same handles and peer tables: a row's address is the same on every rank whatever the call's
    T, so kernels address peers' rows with the same tables.
    tokens [T, H]     token owner's rows (x forward, d_out backward) that expert owners pull
    weights [T, k]    token owner's topk_weights (fp32), pulled by expert owners in the backward; each pair's
                      expert owner then pushes the pair's router-weight gradient into its slot
    ids [ROUTING_HEADER + T*k]  token owner's (T, T*k, R), then its routing (int32), read by every rank to
                      build the global schedule; its handle also carries the group's barrier
    pairs [T*k, H]    token owner's per-(token, slot) rows that expert owners push (y, d_x)
    rows_in [R, H]    expert owner's receive rows that token owners push (push dispatch)
    rows_out [R, H]   expert owner's result rows that token owners pull (pull combine)
    (R = 0, both empty, for the directions that use neither: ep.py's default, pull dispatch and push combine.)
    """

    group_name: str
    rank: int
    world_size: int
    comm_timeout_ms: int
    tokens: _Buffer
    weights: _Buffer
    ids: _Buffer
    pairs: _Buffer
    rows_in: _Buffer
    rows_out: _Buffer

    @property
    def sizes(self) -> WorkspaceSizes:
        return WorkspaceSizes(self.tokens.local.shape[0], self.pairs.local.shape[0], self.rows_in.local.shape[0])

    @property
    def nbytes(self) -> int:
        """This rank's symmetric memory in these buffers (not counted by torch.cuda.max_memory_allocated);
        for a view sized for a call, the part of the workspace that call uses."""
        buffers = (self.tokens, self.weights, self.ids, self.pairs, self.rows_in, self.rows_out)
        return sum(b.local.numel() * b.local.element_size() for b in buffers)

    def barrier(self, exchange: str) -> None:
        """All ranks reach this point of `exchange` (a BARRIER_CHANNELS name; in stream order) before any
        continues; bounded by comm_timeout_ms."""
        self.ids.handle.barrier(channel=BARRIER_CHANNELS[exchange], timeout_ms=self.comm_timeout_ms)

    def sized(self, num_tokens: int, top_k: int, num_rows: int, comm_timeout_ms: int) -> "Workspace":
        """Views of this workspace's leading elements shaped for one call (which `sizes` must cover)."""
        pairs = num_tokens * top_k

        def view(buffer: _Buffer, count: int, *shape: int) -> _Buffer:
            return dataclasses.replace(buffer, local=buffer.local.view(-1)[:count].view(*shape))

        hidden = self.tokens.local.shape[1]
        return dataclasses.replace(
            self, comm_timeout_ms=comm_timeout_ms,
            tokens=view(self.tokens, num_tokens * hidden, num_tokens, hidden),
            weights=view(self.weights, pairs, num_tokens, top_k),
            ids=view(self.ids, ROUTING_HEADER + pairs, ROUTING_HEADER + pairs),
            pairs=view(self.pairs, pairs * hidden, pairs, hidden),
            rows_in=view(self.rows_in, num_rows * hidden, num_rows, hidden),
            rows_out=view(self.rows_out, num_rows * hidden, num_rows, hidden),
        )


# (group name, device, hidden size, dtype) -> the workspace, sized for the largest shapes asked for so far.
_WORKSPACES: dict[tuple, Workspace] = {}


def _forget_group(group_name: str) -> None:
    for key in [key for key in _WORKSPACES if key[0] == group_name]:
        del _WORKSPACES[key]


on_group_recreated(_forget_group)


def _symmetric(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str) -> _Buffer:
    from torch.distributed import _symmetric_memory as symm_mem

    # Normal tensors even when first used under torch.inference_mode(): the cached buffers are written in
    # place (publish's copy_) by later training steps too, which inference tensors would refuse.
    with torch.inference_mode(False):
        local = symm_mem.empty(*shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(local, group_name)
        peer_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    return _Buffer(local, handle, peer_ptrs)


def _allocate(group, device: torch.device, hidden_size: int, dtype: torch.dtype, sizes: WorkspaceSizes) -> Workspace:
    """A workspace of these sizes (a collective: each buffer is a symmetric-memory rendezvous; without
    receive rows, rows_in and rows_out are empty local tensors)."""
    import torch.distributed as dist

    name = group.group_name
    tokens = _symmetric((sizes.tokens, hidden_size), dtype, device, name)

    def receive_rows() -> _Buffer:
        if sizes.rows:
            return _symmetric((sizes.rows, hidden_size), dtype, device, name)
        with torch.inference_mode(False):  # as _symmetric's
            return _Buffer(tokens.local.new_empty(0, hidden_size), None, tokens.peer_ptrs.new_empty(0))

    return Workspace(
        group_name=name,
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        comm_timeout_ms=DEFAULT_TIMEOUT_MS,
        tokens=tokens,
        weights=_symmetric((sizes.pairs,), torch.float32, device, name),
        ids=_symmetric((ROUTING_HEADER + sizes.pairs,), torch.int32, device, name),
        pairs=_symmetric((sizes.pairs, hidden_size), dtype, device, name),
        rows_in=receive_rows(),
        rows_out=receive_rows(),
    )


def get_workspace(
    group,
    *,
    device: torch.device | str,
    num_tokens: int,
    hidden_size: int,
    top_k: int,
    num_rows: int,
    dtype: torch.dtype = torch.bfloat16,
    comm_timeout_ms: int = DEFAULT_TIMEOUT_MS,
) -> Workspace:
    """The workspace of this group, device, hidden size and dtype, as views shaped for num_tokens (T),
    top_k (k) and num_rows (R: the schedule's receive rows where push dispatch or pull combine run, whose
    whole exchanges use rows_in and rows_out; 0 where neither runs) whose barriers wait at most
    comm_timeout_ms.

    One workspace per (group, device, hidden size, dtype), sized for the largest T, T*k and R asked for so
    far (WorkspaceSizes.nbytes: (T + T*k + 2R) * H elements, plus 8 bytes per pair and a
    12-byte routing header): smaller calls reuse it.
    A call that does not fit allocates one sized for it and for everything before it (a collective: every
    rank of the group calls with the same arguments, as megamoe.experts' ranks do, having agreed on the
    shapes) and drops the smaller one, whose memory returns once nothing refers to it (a CUDA graph captured
    on it must be captured again). So a first call with the largest shapes declares the maximum: later
    calls never allocate. Cached until clear_workspaces().
    """
    device = torch.device(device)
    for name, value in (("num_tokens", num_tokens), ("hidden_size", hidden_size), ("top_k", top_k)):
        check_positive_int(f"get_workspace: {name}", value)
    check_positive_int("get_workspace: num_rows", num_rows, allow_zero=True)
    check_positive_int("get_workspace: comm_timeout_ms", comm_timeout_ms)
    if comm_timeout_ms > MAX_COMM_TIMEOUT_MS:
        raise ValueError(f"get_workspace: comm_timeout_ms must be at most {MAX_COMM_TIMEOUT_MS}, got {comm_timeout_ms}")
    if dtype not in TRITON_DTYPES:  # the activations' dtype of the layer it serves
        raise TypeError(f"get_workspace: dtype must be one of {', '.join(map(str, TRITON_DTYPES))}, got {dtype!r}")
    if device.type != "cuda":
        raise ValueError(f"get_workspace: symmetric memory needs a CUDA device, got {device}")
    if not isinstance(getattr(group, "group_name", None), str):  # the cache key and the rendezvous' name
        raise TypeError(f"get_workspace: group must be the expert-parallel torch.distributed ProcessGroup, got "
                        f"{type(group).__name__} {group!r}")
    note_group(group)  # a group created again under a cached workspace's name gets a workspace of its own
    if device.index is None:  # "cuda" is the current device: one key with the layer's x.device ("cuda:N")
        device = torch.device("cuda", torch.cuda.current_device())
    needed = WorkspaceSizes(num_tokens, num_tokens * top_k, num_rows)
    key = (group.group_name, device, hidden_size, dtype)
    held = _WORKSPACES.get(key)
    if held is None or not held.sizes.covers(needed):
        sizes = needed if held is None else held.sizes.union(needed)
        _WORKSPACES[key] = held = _allocate(group, device, hidden_size, dtype, sizes)
    return held.sized(num_tokens, top_k, num_rows, comm_timeout_ms)


def workspace_bytes(group) -> int:
    """This rank's symmetric memory held by the cached workspaces of group (0 for None or none cached)."""
    if group is None:
        return 0
    return sum(ws.nbytes for ws in _WORKSPACES.values() if ws.group_name == group.group_name)


def clear_workspaces() -> None:
    """Drop every cached workspace (their memory returns once no tensor refers to it)."""
    _WORKSPACES.clear()
