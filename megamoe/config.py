"""MoEConfig: the one place where megamoe's knobs (and its environment variables) live."""

from __future__ import annotations

import dataclasses
import os

BACKENDS = ("auto", "reference", "torch", "triton")
COMM_DIRECTIONS = ("auto", "pull", "push")
ENV_PREFIX = "MEGAMOE_"


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Knobs of the MoE layer. Every field is validated; defaults give the dropless, deterministic path.

    backend: "auto" picks "triton" on CUDA GPUs of compute capability >= 9.0 (in bf16/fp16; with an
        expert-parallel group, when the group fits on this host: symmetric memory over NVLink) and
        "torch" elsewhere; "reference" runs the plain-PyTorch math (no schedule, no EP); "torch" the
        portable path.
    capacity_factor: None (default) sizes every buffer for the worst case, so no token can ever be
        dropped. A float c > 0 sizes each rank's receive rows for c times the balanced load
        (c * T * k rows, plus per-expert padding); routing that overflows it is detected on the device
        and raised as an error (on CPU at once; on CUDA through a device-side assert that surfaces at
        the next host synchronisation, e.g. `loss.item()`).
    block_m: rows per GEMM tile; every expert's rows are padded to a multiple of it. None lets the
        backend choose (torch: 16, the alignment torch._grouped_mm wants; triton: its tile table).
    num_comm_sms / minibatch_tokens / dispatch / combine: expert-parallel overlap knobs used by the
        fused EP path (triton backend). They never change results (bitwise), only speed.
        num_comm_sms: communication programs (one SM each) inside each fused expert-parallel kernel
            (the forward's, and the backward's data grads'): they pull the receive rows from the token
            owners, then join the GEMM programs, which start on the other SMs. None: 32
            (ep.DEFAULT_COMM_SMS). Must be smaller than the GPU's SM count.
        minibatch_tokens: the overlap granularity: the rows of about minibatch_tokens tokens
            (minibatch_tokens * k rows, whole blocks of block_m) share one ready flag, raised when
            they have all landed; a GEMM tile starts when its rows' flag is up. None: one flag per
            block, the finest granularity.
        dispatch / combine: the direction of each communication operation, "pull", "push" or
            "auto" (pull dispatch, push combine: the directions that run inside the fused kernels;
            other choices run whole exchanges around the GEMMs).
    comm_timeout_ms: how long a GPU waits for a peer of the expert-parallel group at a synchronisation
        point before failing with an error (a peer that never arrives must not hang the job).
    """

    backend: str = "auto"
    capacity_factor: float | None = None
    block_m: int | None = None
    num_comm_sms: int | None = None
    minibatch_tokens: int | None = None
    dispatch: str = "auto"
    combine: str = "auto"
    comm_timeout_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"MoEConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.capacity_factor is not None:
            if isinstance(self.capacity_factor, bool) or not isinstance(self.capacity_factor, (int, float)):
                raise TypeError(
                    f"MoEConfig.capacity_factor must be None or a number > 0, got {type(self.capacity_factor).__name__}"
                )
            if not self.capacity_factor > 0:
                raise ValueError(f"MoEConfig.capacity_factor must be None or > 0, got {self.capacity_factor}")
        if self.block_m is not None and (
            isinstance(self.block_m, bool) or not isinstance(self.block_m, int) or not _is_power_of_two(self.block_m)
            or self.block_m > 1024
        ):
            raise ValueError(f"MoEConfig.block_m must be None or a power of two in [1, 1024], got {self.block_m!r}")
        if isinstance(self.comm_timeout_ms, bool) or not isinstance(self.comm_timeout_ms, int) or self.comm_timeout_ms <= 0:
            raise ValueError(f"MoEConfig.comm_timeout_ms must be a positive int, got {self.comm_timeout_ms!r}")
        for name in ("num_comm_sms", "minibatch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"MoEConfig.{name} must be None or a positive int, got {value!r}")
        for name in ("dispatch", "combine"):
            value = getattr(self, name)
            if value not in COMM_DIRECTIONS:
                raise ValueError(f"MoEConfig.{name} must be one of {COMM_DIRECTIONS}, got {value!r}")

    @classmethod
    def from_env(cls, **overrides) -> "MoEConfig":
        """A config whose defaults come from MEGAMOE_* environment variables (read here, and only here).

        MEGAMOE_BACKEND, MEGAMOE_CAPACITY_FACTOR, MEGAMOE_BLOCK_M; keyword overrides win.
        """
        env: dict = {}
        for field, parse in (("backend", str), ("capacity_factor", float), ("block_m", int)):
            name = ENV_PREFIX + field.upper()
            if name in os.environ:
                try:
                    env[field] = parse(os.environ[name])
                except ValueError:
                    raise ValueError(
                        f"{name} (MoEConfig.{field}) must be {parse.__name__}-valued, got {os.environ[name]!r}"
                    ) from None
        env.update(overrides)
        return cls(**env)


DEFAULT_CONFIG = MoEConfig()
