"""MoEConfig: the one place where megamoe's knobs (and its environment variables) live.

Also the argument checks shared by every layer above (schedule, autograd, layer): this module is the lowest
layer, importable from all of them. Each raises naming the argument, what was given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

BACKENDS = ("auto", "reference", "torch", "triton")
COMM_DIRECTIONS = ("auto", "pull", "push")
ENV_PREFIX = "MEGAMOE_"
MAX_BLOCK_M = 1024
# The smallest block_m the fused Triton kernels take (the smallest tl.dot row tile); MoEConfig accepts any power
# of two from 1, which the torch path runs ("auto" picks it below this).
TRITON_MIN_BLOCK_M = 16
# The longest comm_timeout_ms (about 24.8 days, an int32 of milliseconds): every wait it bounds can take it (the
# agreement exchange's datetime.timedelta, the GPU's int64 nanoseconds); a longer one, e.g. 10**17 ms, would
# fail with an OverflowError at an expert-parallel group's second call.
MAX_COMM_TIMEOUT_MS = 2**31 - 1
# The largest minibatch_tokens: no rank holds more tokens (the schedule's rows are int32), so a larger one means no
# more than this (one ready flag for the whole batch); a far larger one, e.g. 10**23, would fail with an
# OverflowError in the launch of the fused expert-parallel kernels (their blocks-per-flag argument).
MAX_MINIBATCH_TOKENS = 2**31 - 1
# The largest num_comm_sms: far more than any GPU's SMs, which the fused path checks it against. A larger one, e.g.
# 2**63, would fail every call of every backend (the torch path ignores it) as an argument the custom ops' int64
# cannot hold ("Expected a value of type 'Optional[int]'").
MAX_COMM_SMS = 2**31 - 1


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _type_name(value) -> str:
    """value's type, with its module unless a builtin: NumPy's bool and int64 print as "bool" and "int64" alone."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _shown(value) -> str:
    """value's repr, or for what is not an int (nor None), its type and repr and that it is not one: NumPy's
    np.int64(32) is no int to these checks, and "must be a power of two in [1, 1024], got np.int64(32)" would not
    say why it was refused."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return repr(value)
    return f"{_type_name(value)} {value!r}, not an int"


def check_positive_int(name: str, value, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    """ValueError naming `name` unless value is an int >= 1 (>= 0 with allow_zero; or None with allow_none).
    bool is not accepted as an int, nor are floats with integral values."""
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        allowed = "an int >= 0" if allow_zero else "a positive int"
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}{allowed}, got {_shown(value)}")


def check_block_m(name: str, value, *, allow_none: bool = False) -> None:
    """ValueError naming `name` unless value is a power of two in [1, MAX_BLOCK_M] (or None with allow_none; rows
    per GEMM block: every expert's rows are padded to a multiple of it, and every kernel's row tile must divide it)."""
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not _is_power_of_two(value) or value > MAX_BLOCK_M:
        allowed = f"a power of two in [1, {MAX_BLOCK_M}]"
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}{allowed}, got {_shown(value)}")


def check_group(name: str, group) -> None:
    """TypeError naming `name` unless group is None or a torch.distributed ProcessGroup (a host-side type
    check; nothing is communicated); ValueError for the value dist.new_group returns to the ranks it leaves out."""
    if group is None:
        return
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return
    # An int in torch 2.x: compared only as one, since == on an arbitrary object may do anything.
    if dist.is_available() and type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name} must be a process group that this rank belongs to, or None; got {group!r}, "
            "dist.GroupMember.NON_GROUP_MEMBER, which dist.new_group returns to the ranks it leaves out: pass each "
            "rank the group it is a member of"
        )
    hint = " (for a DeviceMesh, pass mesh.get_group())" if hasattr(group, "get_group") else ""
    raise TypeError(
        f"{name} must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD) or None, "
        f"got {type(group).__name__} {group!r}{hint}"
    )


# State kept per expert-parallel group (megamoe.autograd's agreement exchanges and host gather, the symmetric-memory
# workspaces) is keyed by the group's name, which is what the custom ops carry. A group destroyed and created again
# can come back under the same name (dist.destroy_process_group, then init_process_group: the default group is "0"
# again) and must start afresh: note_group forgets a name's state when the name comes back with another group.
_GROUP_OF_NAME: dict[str, object] = {}
_FORGET_GROUP: list = []


def on_group_recreated(forget) -> None:
    """Register forget(group_name), which drops a module's state for group_name (note_group calls it)."""
    _FORGET_GROUP.append(forget)


def note_group(group) -> None:
    """Record that group (a process group, or anything with a group_name) is the one its name now stands for;
    if that name stood for another group object before, every registered forget(name) runs first."""
    name = group.group_name
    known = _GROUP_OF_NAME.get(name)
    if known is not None and known is not group:
        for forget in _FORGET_GROUP:
            forget(name)
    _GROUP_OF_NAME[name] = group


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Knobs of the MoE layer. Every field is validated; defaults give the dropless, deterministic path.

    backend: "auto" picks "triton" on NVIDIA GPUs of compute capability >= 9.0 (in bf16/fp16; with an
        expert-parallel group, when every rank of the group runs on this host: symmetric memory over NVLink; with
        block_m None or at least 16) and "torch" elsewhere; "reference" runs the plain-PyTorch math (no schedule,
        no EP); "torch" the portable path.
    capacity_factor: None (default) sizes every buffer for the worst case, so no token can ever be
        dropped. A finite float c > 0 sizes each rank's receive rows for c times the balanced load
        (c * T * k rows, plus per-expert padding); routing that overflows it is detected on the device
        and raised as an error (on CPU at once; on CUDA through a device-side assert that surfaces at
        the next host synchronisation, e.g. `loss.item()`). Not with backend="reference" (a ValueError),
        which computes every pair: no buffer to size, no overflow to raise.
    block_m: rows per GEMM tile; every expert's rows are padded to a multiple of it. None lets the
        backend choose (torch: 16, the alignment torch._grouped_mm wants; triton: its tile table).
    num_comm_sms / minibatch_tokens / dispatch / combine: expert-parallel overlap knobs used by the
        fused EP path (triton backend). They never change results (bitwise), only speed.
        num_comm_sms: communication programs inside each pulling expert-parallel kernel: the CTAs that
            pull the receive rows from the token owners. On Hopper (the Gluon kernels: the forward's
            first GEMM) two warps of each of those CTAs pull beside its GEMM work; None: every CTA, at
            most one per SM. Elsewhere (the pointer-load core's fused kernels, forward and backward)
            each takes an SM, pulls, then joins the GEMM programs, which start on the other SMs; None:
            32 (ep.DEFAULT_COMM_SMS); must be smaller than the GPU's SM count (and at most MAX_COMM_SMS, 2**31 - 1).
        minibatch_tokens: the overlap granularity: the rows of about minibatch_tokens tokens
            (minibatch_tokens * k rows, whole blocks of block_m) share one ready flag, raised when
            they have all landed; a GEMM tile starts when its rows' flag is up. None: one flag per
            block, the finest granularity. At most MAX_MINIBATCH_TOKENS (2**31 - 1; no rank holds more tokens).
        dispatch / combine: the direction of each communication operation, "pull", "push" or
            "auto" (pull dispatch, push combine: the directions that run inside the fused kernels;
            other choices run whole exchanges around the GEMMs).
    comm_timeout_ms: how long a rank waits for a peer of the expert-parallel group before failing with an
        error (a peer that never arrives must not hang the job): a GPU at each synchronisation point of the
        fused path, and the host in the ranks' agreement check (megamoe.autograd.check_ranks_agree, on
        every call of the torch path, on a new shape of the fused path) after the group's first one.
        At most MAX_COMM_TIMEOUT_MS (2**31 - 1 ms, about 24.8 days).
    recompute (read by the fused one-GPU path only; the torch and expert-parallel paths ignore it):
        False (default) keeps the gate/up pre-activation of every routed row for the backward
        (2 * 2I bytes per row in bf16); True (memory first) keeps nothing per routed row and the backward
        reruns the gate/up GEMM from x (a third of the forward's FLOPs) instead, and on Hopper its x
        weight-gradient GEMM gathers x in its loads rather than from a copy of the routed rows (a quarter
        lower backward peak). Results are the same, bit for bit.
    """

    backend: str = "auto"
    capacity_factor: float | None = None
    block_m: int | None = None
    num_comm_sms: int | None = None
    minibatch_tokens: int | None = None
    dispatch: str = "auto"
    combine: str = "auto"
    comm_timeout_ms: int = 30_000
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"MoEConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.capacity_factor is not None:
            # Any real number (NumPy's scalars too), but not a bool (an int to Python, a flag to a reader).
            if isinstance(self.capacity_factor, bool) or not isinstance(self.capacity_factor, numbers.Real):
                raise TypeError(
                    f"MoEConfig.capacity_factor must be None or a real number > 0 (an int or a float), "
                    f"got {_type_name(self.capacity_factor)} {self.capacity_factor!r}"
                )
            try:
                value = float(self.capacity_factor)
            except OverflowError:  # an int beyond the floats: as unusable as inf
                value = math.inf
            # NaN fails both comparisons; inf would size buffers with math.ceil(inf) (an OverflowError much later).
            # Comparisons, not math.isfinite, which torch.compile cannot trace on a float it made a symbol of.
            if not (0 < value < math.inf):
                raise ValueError(
                    f"MoEConfig.capacity_factor must be None or a finite number > 0, got {self.capacity_factor}"
                )
            # Stored as a Python float: one type for the sizing arithmetic, equality and hashing.
            object.__setattr__(self, "capacity_factor", value)
            if self.backend == "reference":
                raise ValueError(
                    f"MoEConfig.capacity_factor must be None with backend='reference' (which computes every pair: "
                    f"no receive buffer to size, no overflow to raise), got {self.capacity_factor}"
                )
        check_block_m("MoEConfig.block_m", self.block_m, allow_none=True)
        check_positive_int("MoEConfig.comm_timeout_ms", self.comm_timeout_ms)
        if self.comm_timeout_ms > MAX_COMM_TIMEOUT_MS:
            raise ValueError(
                f"MoEConfig.comm_timeout_ms must be at most {MAX_COMM_TIMEOUT_MS} (about 24.8 days), "
                f"got {self.comm_timeout_ms}"
            )
        for name, most in (("num_comm_sms", MAX_COMM_SMS), ("minibatch_tokens", MAX_MINIBATCH_TOKENS)):
            value = getattr(self, name)
            check_positive_int(f"MoEConfig.{name}", value, allow_none=True)
            if value is not None and value > most:
                raise ValueError(f"MoEConfig.{name} must be None or at most {most}, got {value}")
        for name in ("dispatch", "combine"):
            value = getattr(self, name)
            if value not in COMM_DIRECTIONS:
                raise ValueError(f"MoEConfig.{name} must be one of {COMM_DIRECTIONS}, got {value!r}")
        if not isinstance(self.recompute, bool):
            # Named with its module: NumPy's bool is called "bool" too, and "must be a bool, got bool" says nothing.
            raise TypeError(f"MoEConfig.recompute must be a bool (True or False), got {_type_name(self.recompute)} "
                            f"{self.recompute!r}")

    @classmethod
    def from_env(cls, **overrides) -> "MoEConfig":
        """A config whose defaults come from MEGAMOE_* environment variables (read here, and only here).

        MEGAMOE_BACKEND, MEGAMOE_CAPACITY_FACTOR, MEGAMOE_BLOCK_M; keyword overrides win. An invalid value
        raises naming its variable and value.
        """
        env: dict = {}
        for field, parse in (("backend", str), ("capacity_factor", float), ("block_m", int)):
            name = ENV_PREFIX + field.upper()
            if name in os.environ and field not in overrides:  # an override wins: the variable is not read
                try:
                    env[field] = parse(os.environ[name])
                except ValueError:
                    raise ValueError(
                        f"{name} (MoEConfig.{field}) must be {parse.__name__}-valued, got {os.environ[name]!r}"
                    ) from None
                # Checked alone (the other fields at their valid defaults), so that an error names the
                # variable the user set, not only the field it feeds.
                try:
                    cls(**{field: env[field]})
                except (TypeError, ValueError) as error:
                    raise type(error)(f"{name}={os.environ[name]!r}: {error}") from None
        cls(**overrides)  # an invalid override raises as it would without the environment
        try:
            return cls(**env, **overrides)
        except (TypeError, ValueError) as error:  # each valid alone, the variables clash with each other or an override
            read = ", ".join(f"{ENV_PREFIX}{field.upper()}={os.environ[ENV_PREFIX + field.upper()]!r}" for field in env)
            raise type(error)(f"{error} (from the environment: {read})") from None


DEFAULT_CONFIG = MoEConfig()
