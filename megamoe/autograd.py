"""The differentiable entry point: validates inputs, builds the schedule, picks a backend, runs its fwd/bwd."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import struct

import torch

from megamoe import reference
from megamoe.config import BACKENDS as BACKEND_NAMES
from megamoe.config import (
    COMM_DIRECTIONS, DEFAULT_CONFIG, TRITON_MIN_BLOCK_M, MoEConfig, check_group, note_group, on_group_recreated,
)
from megamoe.schedule import (
    AUTOCAST_DEVICE_TYPES,
    FLOAT_DTYPES,
    SCHEDULE_TENSORS,
    TRITON_DTYPES,
    Schedule,
    build_schedule,
    schedule_from_tensors,
    schedule_tensors,
    validate,
)

AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts for a matmul; not float64


class CapacityOverflowError(RuntimeError):
    """Routing sent more (token, slot) pairs to a rank than MoEConfig.capacity_factor allows."""


def _load_backends() -> tuple[dict, str]:
    """(the backends importable here: torch always, triton when a recent enough Triton is installed; why
    triton is not, "" when it is)."""
    from megamoe.backends import torch_native

    backends = {"torch": torch_native}
    try:
        from megamoe.backends import triton as triton_backend
    except ImportError as error:
        return backends, str(error)
    backends["triton"] = triton_backend
    return backends, ""


# Imported once, here, so that backend selection is plain dict lookups that torch.compile can trace.
BACKENDS, TRITON_UNAVAILABLE = _load_backends()


def triton_runs_on(device: torch.device) -> bool:
    """Whether the fused Triton backend can run on device: Triton installed, an NVIDIA GPU of sm_90 or newer (not
    a ROCm build's AMD GPU, also a "cuda" device, whose capability is its gfx version: 9.4 on an MI300)."""
    return ("triton" in BACKENDS and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))


def resolve_backend(config: MoEConfig, x: torch.Tensor, group) -> str:
    """The backend that runs: "auto" means triton for bf16/fp16 on NVIDIA GPUs of compute capability >= 9.0
    (with a group, one whose ranks all run on this host: symmetric memory maps peers over NVLink; with block_m None
    or at least TRITON_MIN_BLOCK_M), torch elsewhere."""
    # Asked on every rank whatever its config says: the group's first call gathers the ranks' hosts, a
    # collective, so a rank with another backend or dtype (check_ranks_agree reports it) must not skip it.
    one_host = _on_one_host(None if group is None else group.group_name, x.device)
    if config.backend != "auto":
        if config.backend not in BACKENDS and config.backend != "reference":
            raise ValueError(f"MoEConfig.backend={config.backend!r} is not available here ({TRITON_UNAVAILABLE})")
        if config.backend == "triton" and not triton_runs_on(x.device):
            # A host-side device query (as "auto" makes), no sync: fail here, not in Triton's driver lookup.
            where = str(x.device)
            if x.device.type == "cuda" and torch.version.hip is not None:
                where += " (an AMD GPU: a ROCm build of torch)"
            elif x.device.type == "cuda":
                where += " (compute capability {}.{})".format(*torch.cuda.get_device_capability(x.device))
            raise ValueError(
                f"MoEConfig.backend='triton' needs an NVIDIA GPU of compute capability >= 9.0, but the tensors are on "
                f"{where}; use backend='auto' or 'torch'"
            )
        if config.backend == "triton" and x.dtype not in TRITON_DTYPES:
            raise TypeError(
                f"MoEConfig.backend='triton' runs float16, bfloat16 and float32, got x of dtype {x.dtype}; use "
                "backend='torch' or 'reference' (or 'auto', which picks the torch path for it)"
            )
        if config.backend == "triton" and config.block_m is not None and config.block_m < TRITON_MIN_BLOCK_M:
            raise ValueError(
                f"MoEConfig.backend='triton' needs MoEConfig.block_m None or a power of two >= {TRITON_MIN_BLOCK_M}, got "
                f"{config.block_m}; use backend='torch' (or 'auto', which picks it for such a block_m)"
            )
        if config.backend == "triton" and not one_host:
            hosts = group_hosts(group.group_name, x.device)
            raise ValueError(
                f"MoEConfig.backend='triton' runs expert parallelism through symmetric memory over NVLink, which needs "
                f"every rank of the group on one host, but this group spans {len(set(hosts))} hosts "
                f"({_by_value(list(hosts), lambda host: f'host {host!r}')}); use backend='torch' (or 'auto', which "
                "picks it for a group spanning hosts)"
            )
        return config.backend
    triton_block_m = config.block_m is None or config.block_m >= TRITON_MIN_BLOCK_M
    if triton_runs_on(x.device) and x.dtype in (torch.bfloat16, torch.float16) and one_host and triton_block_m:
        return "triton"
    return "torch"


@torch.compiler.assume_constant_result
def _on_one_host(group_name: str | None, device: torch.device) -> bool:
    """No group, or one whose ranks all run on this host (group_hosts); a group spread over hosts needs the
    portable path (no NVLink between them). Takes the group's name: torch.compile runs this eagerly at
    trace time, where the group itself is an opaque stand-in that a collective cannot use."""
    return group_name is None or len(set(group_hosts(group_name, device))) == 1


def _host_id() -> str:
    """This process's host as NCCL tells hosts apart: the hostname and the kernel's boot id (two machines
    that share a hostname differ; the boot id is absent where /proc is)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()[:8]}"
    except OSError:
        return socket.gethostname()


_GROUP_HOSTS: dict[str, tuple[str, ...]] = {}  # group name -> each rank's _host_id, in group rank order


def group_hosts(group_name: str, device: torch.device) -> tuple[str, ...]:
    """Each rank's host (_host_id) in group rank order, gathered at the group's first use, then cached by
    group name (as the symmetric-memory workspaces are). device: where the gather runs with NCCL (x's)."""
    group = _group(group_name)  # first: a group created again under this name forgets the cached hosts
    if group_name not in _GROUP_HOSTS:
        hosts = [None] * torch.distributed.get_world_size(group)
        # NOTE: host sync — a collective whose result the host reads, once per group and process. Acceptable:
        # it runs at the group's first call, as the symmetric-memory workspace's rendezvous does (that call
        # is the warm-up; under torch.compile it runs at trace time), and never again for that group.
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            torch.distributed.all_gather_object(hosts, _host_id(), group=group)
        _GROUP_HOSTS[group_name] = tuple(hosts)
    return _GROUP_HOSTS[group_name]


def _backend_module(name: str):
    return BACKENDS[name]


def _raise_on_overflow(schedule: Schedule) -> None:
    message = (
        "megamoe: routing overflowed the capacity set by MoEConfig.capacity_factor; "
        "raise capacity_factor or use None (dropless)"
    )
    if schedule.overflow.device.type == "cpu":
        if int(schedule.overflow) > 0:
            raise CapacityOverflowError(f"{message} ({int(schedule.overflow)} (token, slot) pairs did not fit)")
    elif schedule.overflow.device.type != "meta":
        # NOTE: no host sync; the device assert fails at the caller's next synchronisation (e.g. loss.item()).
        torch._assert_async(schedule.overflow == 0, message)


def _group(group_name: str | None):
    """The process group named group_name (None for None), noted (config.note_group): a group created again under
    a name drops the state this module keeps for the name (_forget_group)."""
    if group_name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    note_group(group)
    return group


def _forget_group(group_name: str) -> None:
    _GROUP_HOSTS.pop(group_name, None)
    _MET_GROUPS.discard(group_name)
    _OUT_OF_STEP.discard(group_name)
    _AGREED.difference_update({key for key in _AGREED if key[0] == group_name})


# ----------------------------------------------------------------------------------------------------
# Ranks of an expert-parallel group must agree on every size the collectives depend on. Unchecked,
# disagreeing ranks abort (gloo: size mismatch), hang until the process-group timeout (one rank with T=0) or
# index out of range with routing gathered from a peer; a bad expert id on one rank leaves its peers blocked
# in the routing gather. check_ranks_agree turns all of these into a ValueError on every rank; a rank that
# rejects its own arguments joins its exchange anyway (announce_rejection), so its peers raise at once.

_SAME_TK = "every rank of the group must pass the same T and k (pad the batch to a common T)"
_SAME_CALL = "every rank of the group must call megamoe.experts with the same shapes, dtype and MoEConfig"


def _float_bits(value: float | None) -> int:
    return -1 if value is None else struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _from_float_bits(bits: int) -> str:
    return "None" if bits == -1 else repr(struct.unpack("<d", struct.pack("<q", bits))[0])


def _direction_name(code: int) -> str:
    return "unused" if code == -1 else repr(COMM_DIRECTIONS[code])


# The fields of a rank's signature, in payload order: (label, hint on a mismatch, int -> what the user wrote).
AGREE_FIELDS = (
    ("T (tokens per rank)", _SAME_TK, str),
    ("k (experts per token)", _SAME_TK, str),
    ("E_local (experts per rank, w_gate_up.shape[0])", "every rank must hold num_experts / group size experts", str),
    ("H (hidden size)", _SAME_CALL, str),
    ("I (expert intermediate size)", _SAME_CALL, str),
    ("dtype", _SAME_CALL, lambda code: str(FLOAT_DTYPES[code]).removeprefix("torch.")),
    ("block_m (as resolved)", _SAME_CALL, str),
    ("MoEConfig.capacity_factor", _SAME_CALL, _from_float_bits),
    ("backend (as resolved: 'auto' picks per rank)", _SAME_CALL, lambda code: repr(BACKEND_NAMES[code])),
    ("MoEConfig.dispatch (as resolved)", _SAME_CALL, _direction_name),
    ("MoEConfig.combine (as resolved)", _SAME_CALL, _direction_name),
)
# After the signature, a rank's status: (code, value, index). Its ids in range: (0, 0, 0); _ID_OUT_OF_RANGE:
# (1, the first id outside [0, E), its flat index); _REJECTED: the rank rejected its own arguments before
# the exchange, (2, the index of its error's type in REJECTION_TYPES, 0), and its signature is all -1.
_STATUS_LEN = 3
_ID_OUT_OF_RANGE, _REJECTED = 1, 2
REJECTION_TYPES = (ValueError, TypeError)
# The fused path's checked (group name, signature) pairs (see check_ranks_agree).
_AGREED: set[tuple] = set()
# The groups whose ranks have met in an agreement exchange once (any path): later exchanges on them wait at
# most MoEConfig.comm_timeout_ms, the first one the process-group timeout (the warm-up).
_MET_GROUPS: set[str] = set()
# The groups whose agreement exchange timed out on this rank: that gather stays pending, so the next collective
# on the group would pair with it (a late peer's check with this rank's stale gather, its routing gather with
# this rank's next check); every later exchange on them raises at once instead (_exchange_status).
_OUT_OF_STEP: set[str] = set()
on_group_recreated(_forget_group)


def rank_signature(x, topk_ids, w_gate_up, w_down, config: MoEConfig) -> tuple[int, ...]:
    """This rank's (T, k, E_local, H, I, dtype, block_m, capacity_factor, backend, dispatch, combine), as
    ints (AGREE_FIELDS); config has backend and block_m resolved."""
    directions = (-1, -1)  # only the fused path's exchanges depend on them
    if config.backend == "triton":
        ep = BACKENDS["triton"].ep
        directions = tuple(COMM_DIRECTIONS.index(ep._direction(config, op)) for op in ("dispatch", "combine"))
    return (
        x.shape[0], topk_ids.shape[1], w_gate_up.shape[0], x.shape[1], w_down.shape[2], FLOAT_DTYPES.index(x.dtype),
        config.block_m, _float_bits(config.capacity_factor), BACKEND_NAMES.index(config.backend), *directions,
    )


def _ids_status(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [3] on topk_ids' device, device ops only: (1 if an id is outside [0, E) else 0, the first such
    id, its flat index)."""
    if topk_ids.numel() == 0:
        return torch.zeros(_STATUS_LEN, dtype=torch.int64, device=topk_ids.device)
    flat = topk_ids.reshape(-1)
    bad = (flat < 0) | (flat >= num_experts)
    first = bad.to(torch.int32).argmax().view(1)  # the first bad one (argmax returns the first maximum)
    value = flat.index_select(0, first)  # not flat[first]: no host round trip for the index
    return torch.cat([bad.any().view(1).to(torch.int64), value.to(torch.int64), first.to(torch.int64)])


def _by_value(values: list[int], describe) -> str:
    """'rank 0 has 5, rank 1 has 0' (ranks with one value grouped: 'ranks 0, 1, 2 have 5')."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return ", ".join(
        f"rank {ranks[0]} has {describe(value)}" if len(ranks) == 1
        else f"ranks {', '.join(map(str, ranks))} have {describe(value)}"
        for value, ranks in groups.items()
    )


def _ranks(rs: list[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def _raise_on_disagreement(rows: list[list[int]], rank: int, num_experts: int, top_k: int) -> None:
    """ValueError (the same verdict on every rank) if a rank rejected its arguments, the gathered signatures
    differ or a rank's ids are bad. Not called on a rank that rejected its arguments (it raises its own error)."""
    num_fields = len(AGREE_FIELDS)
    rejected = {r: REJECTION_TYPES[row[num_fields + 1]].__name__ for r, row in enumerate(rows)
                if row[num_fields] == _REJECTED}
    if rejected:
        one = len(rejected) == 1
        errors = ", ".join(f"rank {r} a {name}" for r, name in rejected.items())
        raise ValueError(
            f"megamoe.experts: {_ranks(list(rejected))} of the expert-parallel group "
            f"rejected {'its' if one else 'their'} arguments before the exchange ({errors}; "
            f"{'that' if one else 'each'} rank's own error names the argument and what is allowed): every rank of "
            f"the group raises here instead of waiting for {'it' if one else 'them'}"
        )
    problems = []
    for field, (label, hint, describe) in enumerate(AGREE_FIELDS):
        values = [row[field] for row in rows]
        if len(set(values)) > 1:
            problems.append((f"ranks disagree on {label}: {_by_value(values, describe)}", hint))
    if problems:
        hints = list(dict.fromkeys(hint for _, hint in problems))
        found = "; ".join(problem for problem, _ in problems)
        raise ValueError(f"megamoe.experts with an expert-parallel group: {found}; {'; '.join(hints)}")
    failed = [(r, row[num_fields + 1], row[num_fields + 2]) for r, row in enumerate(rows)
              if row[num_fields] == _ID_OUT_OF_RANGE]
    if not failed:
        return
    mine = [f for f in failed if f[0] == rank]
    source, value, index = mine[0] if mine else failed[0]
    token, slot = divmod(index, top_k)
    others = [r for r, _, _ in failed if r != source]
    if mine:
        also = f"; {_ranks(others)} of the group passed out-of-range ids too" if others else ""
        raise ValueError(
            f"topk_ids must hold expert ids in [0, {num_experts}), found {value} (token {token}, slot {slot}); "
            f"every rank of the expert-parallel group raises{also}"
        )
    also = f" ({_ranks(others)} too)" if others else ""
    raise ValueError(
        f"rank {source} of the expert-parallel group passed topk_ids with expert id {value} (its token {token}, "
        f"slot {slot}), outside [0, {num_experts}){also}: every rank of the group raises here instead of entering "
        "the exchange"
    )


def check_ranks_agree(group, x, topk_ids, w_gate_up, w_down, config: MoEConfig) -> None:
    """Fail fast, with the same ValueError on every rank, when the ranks of an expert-parallel group disagree
    on (T, k, E_local, H, I, dtype, block_m, capacity_factor, backend, dispatch, combine) (AGREE_FIELDS), a
    rank's topk_ids hold an expert id outside [0, E), or a rank rejected its own arguments
    (announce_rejection): every rank all-gathers its signature and status (a small int64 tensor on x's
    device: the CPU with gloo, the GPU with NCCL) and compares.

    When it runs (config has backend and block_m resolved):
    - The torch path: on every call, before the routing gather, so that a rank that changes its T alone
      (say T=0 on a last, short batch) or passes a bad id fails with the others instead of the collectives
      going out of step (one tiny collective per call; the path already syncs the host every forward).
    - The fused (triton) path: once per (group, signature). Later calls of a checked signature pay nothing,
      no collective and no host sync, so a captured CUDA graph never runs it: the first call of a shape is
      the warm-up, which also allocates the symmetric-memory workspace. Bad ids on later calls fail a device
      assert (build_schedule's check of the gathered routing). Except T = 0, checked on every call: an empty
      batch exchanges nothing (ep.py), so a rank alone with it would return while its peers wait at their
      routing exchange; checking, it fails too, after comm_timeout_ms at the latest (its peers, on a checked
      shape, do not join), and its peers' barriers time out (a device error naming the routing exchange).
    How long it waits for the peers: the group's first exchange (on either path) waits for the process-group
    timeout (ranks may be far apart while warming up); every later one at most MoEConfig.comm_timeout_ms,
    then raises a RuntimeError. So a peer that stopped before the call (failed outside megamoe, or is late
    by more than comm_timeout_ms) fails the others after comm_timeout_ms, as the fused exchange's bounded
    waits do, and so does a rank whose fused-path signature is new while its peers' are checked (they skip
    the check).
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return
    signature = rank_signature(x, topk_ids, w_gate_up, w_down, config)
    every_call = config.backend != "triton"
    group_name = group.group_name
    if not every_call and x.shape[0] > 0 and (group_name, signature) in _AGREED:
        return
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "megamoe.experts with an expert-parallel group checks that the ranks agree on the shapes (a collective "
            "and a host sync) on every call of the torch path and on the first call of each shape of the fused "
            "path, which cannot run during CUDA-graph capture: run the fused path once with these shapes before "
            "capturing (the warm-up); the torch path with a group cannot be captured"
        )
    num_experts = w_gate_up.shape[0] * world
    mine = torch.tensor(signature, dtype=torch.int64, device=x.device)
    try:
        gathered = _exchange_status(group, torch.cat([mine, _ids_status(topk_ids, num_experts)]), config.comm_timeout_ms)
    except TimeoutError as e:
        shown = ", ".join(
            f"{label.split(' (')[0]}={describe(value)}" for (label, _, describe), value in zip(AGREE_FIELDS, signature)
        )
        fused = (
            "; or this rank calls with shapes it has not used before while its peers, skipping the check (the "
            f"fused path checks each shape once), use shapes they have: the ranks disagree ({_SAME_CALL})"
        )
        raise RuntimeError(
            f"megamoe.experts: the peers of the expert-parallel group did not join the check of this call's shapes "
            f"({shown}) within MoEConfig.comm_timeout_ms={config.comm_timeout_ms}: a peer stopped or failed before "
            f"this call, or is late by more than comm_timeout_ms{'' if every_call else fused} ({e.__cause__}); the "
            "exchange stays pending, so the group is now out of step: later megamoe calls on it raise at once "
            "(recreate the process group)"
        ) from e
    # NOTE: host sync — the verdict is needed on the host before the routing gather, whose size it checks.
    # Acceptable: on the fused path once per (group, shapes), like the workspace allocation (the warm-up);
    # on the torch path once per call, next to the split sizes it already copies to the host.
    rows = gathered.view(world, -1).tolist()
    _raise_on_disagreement(rows, dist.get_rank(group), num_experts, topk_ids.shape[1])
    if not every_call:
        _AGREED.add((group_name, signature))


def _exchange_status(group, payload: torch.Tensor, comm_timeout_ms: int) -> torch.Tensor:
    """All-gather each rank's [len(AGREE_FIELDS) + _STATUS_LEN] int64 payload, [W * that] in rank order. The
    group's first exchange waits for the process-group timeout, later ones at most comm_timeout_ms (then a
    TimeoutError whose __cause__ is the process group's error; the gather stays pending, and the group is out of
    step for this rank: every later exchange on it raises a RuntimeError at once, _OUT_OF_STEP)."""
    import torch.distributed as dist

    if group.group_name in _OUT_OF_STEP:
        raise RuntimeError(
            f"megamoe.experts: the expert-parallel group {group.group_name!r} is out of step: an earlier call's "
            "agreement exchange on it timed out (MoEConfig.comm_timeout_ms) and is still pending, so a new collective "
            "on the group would pair with that one and mix up the ranks' data; destroy and recreate the process "
            "group (or restart the job)"
        )
    gathered = payload.new_empty(dist.get_world_size(group) * payload.numel())
    # all_gather_single is the newer name (torch >= 2.13) of all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(gathered, payload, group=group, async_op=True)
    if group.group_name not in _MET_GROUPS:
        work.wait()  # bounded by the process-group timeout
    else:
        # NOTE: host sync — a wait with a timeout blocks the host until the gather completes (NCCL too).
        # Acceptable: check_ranks_agree reads the result on the host right after (its NOTE), and
        # announce_rejection runs only on a rank that is raising.
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=comm_timeout_ms))
        except RuntimeError as e:
            _OUT_OF_STEP.add(group.group_name)
            raise TimeoutError(f"no agreement exchange within {comm_timeout_ms} ms") from e
    _MET_GROUPS.add(group.group_name)
    return gathered


def announce_rejection(group, error: Exception, tensors, config) -> None:
    """A rank of an expert-parallel group (of more than one rank) whose own arguments were rejected (error, a
    REJECTION_TYPES instance) joins the agreement exchange anyway, saying so, so that its peers raise at once
    (check_ranks_agree names this rank) instead of waiting for it. The caller raises error afterwards,
    whatever happens here.

    The exchange runs where the peers run theirs: after the group's host gather (group_hosts, at each
    group's first call, which resolve_backend runs on every rank), on the device of the first tensor among
    `tensors` (callers put the weights first: they stay on the rank's device whatever else is wrong). Not
    under torch.compile (the checks run at trace time, where a collective cannot), nor when no argument is
    a tensor; then the peers give up as for a rank that never arrives (check_ranks_agree). Waits as long as
    check_ranks_agree does (config's comm_timeout_ms, the default config's when config is the rejected
    argument): peers on the fused path whose signature is checked never join it.
    """
    import torch.distributed as dist

    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    if torch.compiler.is_compiling() or device is None or dist.get_world_size(group) == 1:
        return
    group_hosts(group.group_name, device)
    kind = next(i for i, error_type in enumerate(REJECTION_TYPES) if isinstance(error, error_type))
    payload = torch.tensor([-1] * len(AGREE_FIELDS) + [_REJECTED, kind, 0], dtype=torch.int64, device=device)
    timeout_ms = (config if isinstance(config, MoEConfig) else DEFAULT_CONFIG).comm_timeout_ms
    # The peers that never join (or a process-group timeout on the group's first exchange) change nothing:
    # this rank's own error is the one to raise.
    with contextlib.suppress(TimeoutError, RuntimeError):
        _exchange_status(group, payload, timeout_ms)


# MoEConfig crosses the custom-op boundary as its fields, in declaration order (ops take scalars).
CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(MoEConfig))


def _config(*values) -> MoEConfig:
    """The MoEConfig of an op's static arguments (CONFIG_FIELDS' values). Under torch.compile(dynamic=True) an int or
    float field can arrive as a symbol (a module's or an argument's number attributes are traced so): specialised
    here, in the ops' fake impls (int() and float() of a symbol install the guard that recompiles for another
    value), since a config picks kernels and buffer sizes."""
    concrete = (int(v) if isinstance(v, torch.SymInt) else float(v) if isinstance(v, torch.SymFloat) else v
                for v in values)
    return _cached_config(*concrete)


@functools.lru_cache(maxsize=64)
def _cached_config(*values) -> MoEConfig:
    return MoEConfig(*values)


def _schedule(topk_ids, x, w_gate_up, config: MoEConfig, group) -> Schedule:
    world_size = 1 if group is None else torch.distributed.get_world_size(group)
    backend = _backend_module(config.backend)
    gather_routing = None
    if world_size > 1 and hasattr(backend, "routing_exchange"):
        gather_routing = backend.routing_exchange(x, w_gate_up, group, config)
    place_routing = getattr(backend, "place_routing", None) if topk_ids.is_cuda else None
    schedule = build_schedule(
        topk_ids, w_gate_up.shape[0] * world_size, group=group, config=config,
        gather_routing=gather_routing, place_routing=place_routing,
    )
    if config.capacity_factor is not None:
        _raise_on_overflow(schedule)
    return schedule


# The layer as two custom ops (opaque to torch.compile, with fake implementations), so that
# torch.compile(fullgraph=True) traces models that use it. The forward op returns, after the output,
# the backend's saved tensors and then the schedule's tensors, which the backward op reuses (no
# second routing exchange). The config crosses the boundary field by field, backend and block_m resolved.
# save_for_backward=False (chosen by `experts`: grad mode off, or no input requiring grad) is inference:
# the backend keeps nothing for a backward and the op returns [out] alone.
# The backward op gets a bitmask of the gradients autograd needs (ctx.needs_input_grad; bit i = GRAD_NAMES[i])
# and returns only those, in GRAD_NAMES order; the backends skip the work of the others where they can.
GRAD_NAMES = ("x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down")
ALL_GRADS_MASK = (1 << len(GRAD_NAMES)) - 1  # the backward op's mask asking for every gradient


def needs_from_mask(mask: int) -> tuple[bool, ...]:
    """The bitmask of the backward op -> the backends' needs_grad tuple (one bool per GRAD_NAMES entry)."""
    return tuple(bool(mask >> i & 1) for i in range(len(GRAD_NAMES)))


def mask_from_needs(needs) -> int:
    return sum(1 << i for i, need in enumerate(needs) if need)


@torch.library.custom_op("megamoe::experts_fwd", mutates_args=())
def _experts_fwd(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    backend: str,
    capacity_factor: float | None,
    block_m: int,
    num_comm_sms: int | None,
    minibatch_tokens: int | None,
    dispatch: str,
    combine: str,
    comm_timeout_ms: int,
    recompute: bool,
    group_name: str | None,
    save_for_backward: bool,
) -> list[torch.Tensor]:
    """Returns [out, *saved, *schedule tensors] (see the comment above); [out] without save_for_backward."""
    config = _config(
        backend, capacity_factor, block_m, num_comm_sms, minibatch_tokens, dispatch, combine, comm_timeout_ms, recompute
    )
    group = _group(group_name)
    if group is not None:
        # Here, in the op, rather than in `experts`: the op runs eagerly under torch.compile (its fake
        # implementation is what is traced), so the check runs in compiled models too.
        check_ranks_agree(group, x, topk_ids, w_gate_up, w_down, config)
    schedule = _schedule(topk_ids, x, w_gate_up, config, group)
    out, saved = _backend_module(config.backend).experts_fwd(
        x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config,
        save_for_backward=save_for_backward,
    )
    if not save_for_backward:
        return [out]
    return [out, *saved, *schedule_tensors(schedule)]


@_experts_fwd.register_fake
def _experts_fwd_fake(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, *static):
    *config_values, group_name, save_for_backward = static
    config = _config(*config_values)
    schedule = _schedule(topk_ids.to("meta"), x, w_gate_up, config, _group(group_name))
    # new_empty, not empty_like: the real out is a fresh contiguous tensor whatever x's strides.
    if not save_for_backward:
        return [x.new_empty(x.shape)]
    saved = _backend_module(config.backend).empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule, config)
    return [x.new_empty(x.shape), *saved, *(torch.empty_like(t, device=x.device) for t in schedule_tensors(schedule))]


@torch.library.custom_op("megamoe::experts_bwd", mutates_args=())
def _experts_bwd(
    d_out: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    saved: list[torch.Tensor],
    schedule_parts: list[torch.Tensor],
    backend: str,
    capacity_factor: float | None,
    block_m: int,
    num_comm_sms: int | None,
    minibatch_tokens: int | None,
    dispatch: str,
    combine: str,
    comm_timeout_ms: int,
    recompute: bool,
    group_name: str | None,
    needs_grad: int,
) -> list[torch.Tensor]:
    """Returns the gradients that needs_grad asks for (bit i: GRAD_NAMES[i]), in GRAD_NAMES order, e.g.
    [d_x, d_topk_weights, d_w_gate_up, d_w_down(, d_shared_gate_up, d_shared_down)] with every bit set."""
    config = _config(
        backend, capacity_factor, block_m, num_comm_sms, minibatch_tokens, dispatch, combine, comm_timeout_ms, recompute
    )
    group = _group(group_name)
    world_size, rank = (1, 0) if group is None else (torch.distributed.get_world_size(group), torch.distributed.get_rank(group))
    schedule = schedule_from_tensors(
        schedule_parts, num_experts=w_gate_up.shape[0] * world_size, world_size=world_size, rank=rank, block_m=block_m
    )
    needs = _needs(needs_grad, shared_gate_up)
    grads = _backend_module(config.backend).experts_bwd(
        d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config, tuple(saved),
        needs_grad=needs,
    )
    # A backend may compute more than was asked (the EP kernels compute every gradient): only the asked-for go out.
    return [g for g, need in zip(grads, needs) if need]


def _needs(needs_grad: int, shared_gate_up) -> tuple[bool, ...]:
    needs = needs_from_mask(needs_grad)
    if shared_gate_up is None:  # no shared expert: no shared gradients, whatever the mask says
        needs = needs[:4] + (False, False)
    return needs


@_experts_bwd.register_fake
def _experts_bwd_fake(d_out, x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, saved, schedule_parts, *static):
    like = (x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down)
    return [t.new_empty(t.shape) for t, need in zip(like, _needs(static[-1], shared_gate_up)) if need]


_STATIC_ARGS = (*CONFIG_FIELDS, "group_name")
# The forward op's inputs: 7 tensors, the static arguments, save_for_backward.
_NUM_FWD_INPUTS = 7 + len(_STATIC_ARGS) + 1
# Input index of each GRAD_NAMES entry in the forward op (topk_ids, index 1, has no gradient).
_GRAD_INPUTS = (0, 2, 3, 4, 5, 6)


def _setup_context(ctx, inputs, output) -> None:
    x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, *static, save_for_backward = inputs
    # Without save_for_backward (inference) the op returned [out] alone and no backward can run.
    ctx.save_for_backward(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, *output[1:])
    ctx.static = static
    ctx.saved_for_backward = save_for_backward
    # Only out is differentiable; the saved and schedule outputs get no gradient, and none is made up as
    # zeros (by default autograd would allocate a zero gradient for each, e.g. [R, 2I] for gate_up).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    if not ctx.saved_for_backward:
        raise RuntimeError(
            "megamoe: backward through a forward that ran without saving for it (grad mode off or no input "
            "requiring grad when megamoe.experts was called)"
        )
    # torch's legacy vmap, whose fallback cannot batch an op with tensor-list arguments (torch.vmap can:
    # _experts_bwd_vmap): a clear error instead of "Batching rule not implemented for megamoe::experts_bwd". Not
    # asked under torch.compile (compiled autograd), which cannot trace the query and never runs the legacy vmap.
    if (grads[0] is not None and not torch.compiler.is_compiling()
            and torch._C._functorch.is_legacy_batchedtensor(grads[0])):
        raise TypeError(
            "megamoe.experts: torch.autograd.grad(..., is_grads_batched=True) and "
            "torch.autograd.functional.jacobian(..., vectorize=True) batch the backward with torch's legacy "
            "vmap, which cannot run it; use torch.vmap over torch.autograd.grad, vectorize=False, or "
            "MoEConfig(backend='reference') (plain PyTorch ops)"
        )
    x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, *rest = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[i] for i in _GRAD_INPUTS)
    mask = mask_from_needs(needs)
    d_all = [None] * len(GRAD_NAMES)
    if mask:
        split = len(rest) - len(SCHEDULE_TENSORS)
        # The output's gradient is undefined where nothing downstream depends on it (e.g. a custom Function
        # returning None for it): zero gradients, computed rather than skipped, so that an expert-parallel
        # backward still runs its exchanges with its peers.
        d_out = torch.zeros_like(x) if grads[0] is None else grads[0].contiguous()
        d_inputs = iter(_experts_bwd(
            d_out, x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down,
            rest[:split], rest[split:], *ctx.static, mask,
        ))
        d_all = [next(d_inputs) if need else None for need in _needs(mask, shared_gate_up)]
    d_x, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down = d_all
    return (d_x, None, d_topk_weights, d_w_gate_up, d_w_down, d_shared_gate_up, d_shared_down) + (None,) * (
        _NUM_FWD_INPUTS - 7
    )


_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, grads):
    raise RuntimeError(
        "megamoe.experts has no second derivative: its backward (megamoe::experts_bwd) cannot itself be "
        "differentiated (torch.autograd.grad(..., create_graph=True) followed by another backward, e.g. a gradient "
        "penalty); MoEConfig(backend='reference') computes the layer in differentiable PyTorch ops"
    )


# A backward built with create_graph=True records experts_bwd; differentiating that raises the error above instead
# of torch's advice to the op's author ("no autograd formula was registered").
_experts_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.register_vmap("megamoe::experts_bwd")
def _experts_bwd_vmap(info, in_dims, d_out, *args):
    """A batch of output gradients (torch.vmap over torch.autograd.grad): the backward is linear in d_out, so it
    runs once per slice and each gradient is stacked (dim 0). Only d_out is batched: the other inputs are the
    forward's, which ran outside the vmap (megamoe.experts rejects inputs a torch.func transform wraps)."""
    def batched(dim) -> bool:  # a list argument's in_dims is a list
        return any(batched(d) for d in dim) if isinstance(dim, (list, tuple)) else dim is not None

    if any(batched(dim) for dim in in_dims[1:]):
        raise TypeError("megamoe.experts: torch.vmap can batch only the output gradient of its backward, not the "
                        "forward's inputs or saved tensors; run the forward outside the vmap")
    slices = [_experts_bwd(d_out_b, *args) for d_out_b in d_out.unbind(in_dims[0])]
    grads = [torch.stack(grad) for grad in zip(*slices)]
    return grads, [0] * len(grads)


def _check_no_function_transforms(compiling: bool, **tensors) -> None:
    """TypeError naming the first input that a torch.func transform (grad, vmap, jvp, ...) wraps or that carries a
    forward-mode tangent (torch.autograd.forward_ad). The fast paths are custom ops with a backward formula only:
    under forward-mode AD their output silently gets a zero (torch.func.jvp) or no (forward_ad) tangent, and
    torch.func.grad / vmap fail inside torch with messages about an autograd.Function or a batching rule.
    compiling (under torch.compile): only the forward-mode check, which Dynamo traces (it marks the functorch
    wrapper queries as skipped); it still catches torch.func.jvp traced by torch.compile, whose tangent would
    otherwise be silently zero. grad and vmap fail loudly there (torch's errors)."""
    from torch._C._functorch import is_batchedtensor, is_gradtrackingtensor
    from torch.autograd import forward_ad

    for name, t in tensors.items():
        if t is None:
            continue
        # Not is_functorch_wrapped_tensor: torch.func.functionalize's wrappers are fine (the op is functional).
        if not compiling and (is_batchedtensor(t) or is_gradtrackingtensor(t)):
            what = "a tensor wrapped by a torch.func transform (grad, vmap, jvp, jacrev, ...)"
        elif forward_ad.unpack_dual(t).tangent is not None:
            what = "a forward-mode dual tensor (torch.autograd.forward_ad)"
        else:
            continue
        raise TypeError(
            f"megamoe.experts: {name} is {what}; the fused and torch backends support reverse-mode autograd only "
            "(loss.backward() / torch.autograd.grad), not torch.func transforms or forward-mode AD. Call it outside "
            "the transform, or use MoEConfig(backend='reference') (plain PyTorch ops: every transform, though vmap "
            "cannot batch topk_ids)"
        )


def experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    group=None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """The routed experts (+ optional shared expert) of one MoE layer, differentiable.

    out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) + shared_expert(x[t]), where
    expert_e(v) = (silu(v @ gate_e.T) * (v @ up_e.T)) @ w_down[e].T and the sum over j runs in fp32 in order.

    x: [T, H] float16/bfloat16/float32/float64. topk_ids: [T, k] int32/int64 *global* expert ids.
    topk_weights: [T, k] float32 (or x's dtype). w_gate_up: [E_local, 2I, H], gate rows first.
    w_down: [E_local, H, I]. shared_gate_up: [2I_s, H], shared_down: [H, I_s] (both or neither).
    group: expert-parallel process group; rank r owns global experts [r*E_local, (r+1)*E_local) and every
        rank passes the same T and k. None: this process owns all experts.
    config: MoEConfig (backend, capacity, ...). Under torch.autocast the float32/float16/bfloat16 inputs
        (but topk_weights) are cast to the autocast dtype, as a matmul's would be; float64 ones are not. A
        topk_weights in x's float16/bfloat16 is widened to float32 when x is cast to the other.
    Returns out [T, H] in x's dtype (the autocast dtype under autocast, unless x is float64).

    Inference: under torch.no_grad() / torch.inference_mode(), or when no input requires grad, nothing is
    kept for a backward (the same out, bit for bit). The backward computes only the gradients autograd
    needs (frozen weights: no weight-grad GEMMs; x not requiring grad: no d_x), where the backend can
    skip them (the EP paths skip only each rank's local work; see the backends' docstrings).
    """
    # A literal set of device types rather than torch.amp.is_autocast_available, which torch.compile
    # (torch 2.11) cannot trace.
    autocast = (
        isinstance(x, torch.Tensor)
        and x.device.type in AUTOCAST_DEVICE_TYPES
        and torch.is_autocast_enabled(x.device.type)
    )
    if autocast:
        dtype = torch.get_autocast_dtype(x.device.type)
        x_dtype = x.dtype
        # Only the dtypes autocast itself casts for a matmul: float64 stays float64 (as a matmul's would). Beside an x
        # that is not cast (float64), nothing is: a float32 weight there is a mismatch, reported in the dtype given.
        if x_dtype in AUTOCAST_CASTS:
            x, w_gate_up, w_down, shared_gate_up, shared_down = (
                t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in AUTOCAST_CASTS else t
                for t in (x, w_gate_up, w_down, shared_gate_up, shared_down)
            )
        # topk_weights is not cast, but one in x's float16/bfloat16 (allowed beside x) would no longer match x
        # cast to the other: it is widened to float32 (exact, and always allowed).
        if isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == x_dtype != x.dtype:
            topk_weights = topk_weights.float()
        with torch.autocast(x.device.type, enabled=False):
            return experts(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, group=group, config=config)
    check_group("group", group)
    world_size = 1
    if group is not None:
        import torch.distributed as dist

        world_size = dist.get_world_size(group)
    try:
        config = DEFAULT_CONFIG if config is None else config
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
        validate(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, world_size)
        if group is not None:  # a DDP forward that did not leave the experts alone (megamoe.parallel) stops here
            from megamoe.parallel import check_active_ddp_leaves_experts_alone

            check_active_ddp_leaves_experts_alone()
        backend_name = resolve_backend(config, x, group)
        if backend_name == "reference" and world_size > 1:
            raise ValueError("MoEConfig.backend='reference' computes all experts in one process; it takes no group")
        if backend_name != "reference":
            _check_no_function_transforms(
                torch.compiler.is_compiling(), x=x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate_up=w_gate_up,
                w_down=w_down, shared_gate_up=shared_gate_up, shared_down=shared_down,
            )
    except REJECTION_TYPES as error:
        if group is not None:  # the peers are on their way to the agreement exchange: tell them, then raise
            announce_rejection(group, error, (w_gate_up, w_down, x, topk_ids, topk_weights), config)
        raise
    if backend_name == "reference":  # it checks the ids' range itself
        return reference.experts(
            x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up=shared_gate_up, shared_down=shared_down
        )
    hidden, intermediate = x.shape[1], w_down.shape[2]
    block_m = config.block_m or _backend_module(backend_name).block_m_for(hidden, intermediate, x.dtype)
    contiguous = [t.contiguous() if t is not None else None for t in (x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down)]
    # The ops' static arguments: config's fields with the resolved backend and block_m, not a new MoEConfig (whose
    # validation cannot trace the symbols torch.compile(dynamic=True) may make of its numbers; the ops specialise
    # them, _config).
    static = [backend_name if name == "backend" else block_m if name == "block_m" else getattr(config, name)
              for name in CONFIG_FIELDS]
    group_name = None if group is None else group.group_name
    # Inference (grad mode off, e.g. torch.no_grad() / torch.inference_mode(), or no input requiring grad):
    # nothing is kept for a backward that cannot happen.
    save_for_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down)
    )
    return _experts_fwd(*contiguous, *static, group_name, save_for_backward)[0]
