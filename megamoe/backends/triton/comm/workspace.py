"""The symmetric-memory workspace of an expert-parallel group, allocated once and reused by every layer.

Buffers live in PyTorch symmetric memory (`torch.distributed._symmetric_memory`), so every rank can
read and write its peers' copies over NVLink through their mapped addresses. NVLink multicast is never
used. Synchronisation between ranks is the symmetric-memory barrier, a device-side wait on signal pads
with a timeout: a peer that never arrives becomes a device error after `comm_timeout_ms`, not a hang.
"""

from __future__ import annotations

import dataclasses

import torch

from megamoe.config import check_positive_int

DEFAULT_TIMEOUT_MS = 30_000


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """One symmetric buffer: this rank's tensor, the rendezvous handle and the peers' base addresses."""

    local: torch.Tensor
    handle: object
    peer_ptrs: torch.Tensor  # [W] int64 base addresses of every rank's copy (mapped here)


@dataclasses.dataclass(frozen=True)
class Workspace:
    """Buffers of one (group, device, shape) combination; see get_workspace.

    tokens [T, H]     token owner's rows (x forward, d_out backward) that expert owners pull
    weights [T, k]    token owner's topk_weights (fp32), pulled by expert owners in the backward
    ids [T, k]        token owner's routing (int32), read by every rank to build the global schedule;
                      its handle also carries the group's barrier
    pairs [T*k, H]    token owner's per-(token, slot) rows that expert owners push (y, d_x)
    rows_in [R, H]    expert owner's receive rows that token owners push (push dispatch)
    rows_out [R, H]   expert owner's result rows that token owners pull (pull combine)
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
    def nbytes(self) -> int:
        """This rank's symmetric memory in these buffers (not counted by torch.cuda.max_memory_allocated)."""
        buffers = (self.tokens, self.weights, self.ids, self.pairs, self.rows_in, self.rows_out)
        return sum(b.local.numel() * b.local.element_size() for b in buffers)

    def barrier(self) -> None:
        """All ranks reach this point (in stream order) before any continues; bounded by comm_timeout_ms."""
        self.ids.handle.barrier(channel=0, timeout_ms=self.comm_timeout_ms)


_WORKSPACES: dict[tuple, Workspace] = {}


def _symmetric(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str) -> _Buffer:
    from torch.distributed import _symmetric_memory as symm_mem

    # Normal tensors even when first used under torch.inference_mode(): the cached buffers are written in
    # place (publish's copy_) by later training steps too, which inference tensors would refuse.
    with torch.inference_mode(False):
        local = symm_mem.empty(*shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(local, group_name)
        peer_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    return _Buffer(local, handle, peer_ptrs)


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
    """The workspace for this group and shape, allocated on first use (a collective: every rank of the
    group must call it with the same arguments) and cached until clear_workspaces()."""
    import torch.distributed as dist

    device = torch.device(device)
    for name, value in (("num_tokens", num_tokens), ("hidden_size", hidden_size), ("top_k", top_k), ("num_rows", num_rows)):
        check_positive_int(f"get_workspace: {name}", value)
    if device.type != "cuda":
        raise ValueError(f"get_workspace: symmetric memory needs a CUDA device, got {device}")
    key = (group.group_name, device, num_tokens, hidden_size, top_k, num_rows, dtype, comm_timeout_ms)
    if key not in _WORKSPACES:
        name = group.group_name
        _WORKSPACES[key] = Workspace(
            group_name=name,
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            comm_timeout_ms=comm_timeout_ms,
            tokens=_symmetric((num_tokens, hidden_size), dtype, device, name),
            weights=_symmetric((num_tokens, top_k), torch.float32, device, name),
            ids=_symmetric((num_tokens, top_k), torch.int32, device, name),
            pairs=_symmetric((num_tokens * top_k, hidden_size), dtype, device, name),
            rows_in=_symmetric((num_rows, hidden_size), dtype, device, name),
            rows_out=_symmetric((num_rows, hidden_size), dtype, device, name),
        )
    return _WORKSPACES[key]


def workspace_bytes(group) -> int:
    """This rank's symmetric memory held by the cached workspaces of group (0 for None or none cached)."""
    if group is None:
        return 0
    return sum(ws.nbytes for ws in _WORKSPACES.values() if ws.group_name == group.group_name)


def clear_workspaces() -> None:
    """Drop every cached workspace (their memory returns once no tensor refers to it)."""
    _WORKSPACES.clear()
