"""The differentiable entry point: validates inputs, builds the schedule, picks a backend, runs its fwd/bwd."""

from __future__ import annotations

import functools
import importlib

import torch

from megamoe import reference
from megamoe.config import DEFAULT_CONFIG, MoEConfig
from megamoe.schedule import Schedule, build_schedule, check_topk_ids

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CapacityOverflowError(RuntimeError):
    """Routing sent more (token, slot) pairs to a rank than MoEConfig.capacity_factor allows."""


@functools.cache
def _triton_available() -> bool:
    try:
        importlib.import_module("megamoe.backends.triton")
    except ImportError:
        return False
    return True


def resolve_backend(config: MoEConfig, x: torch.Tensor, group) -> str:
    """The backend that runs: "auto" means triton on CUDA GPUs of compute capability >= 9.0, torch elsewhere."""
    if config.backend != "auto":
        return config.backend
    if (
        x.device.type == "cuda"
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.dtype in (torch.bfloat16, torch.float16)
        and group is None
        and _triton_available()
    ):
        return "triton"
    return "torch"


def _backend_module(name: str):
    return importlib.import_module({"torch": "megamoe.backends.torch_native", "triton": "megamoe.backends.triton"}[name])


def _check_tensor(name: str, value, dim: int) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(value.shape)}")


def validate(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, world_size: int) -> None:
    """Clear errors for bad arguments (shapes, dtypes, devices). Never asserts, never modifies inputs."""
    _check_tensor("x", x, 2)
    _check_tensor("topk_weights", topk_weights, 2)
    _check_tensor("w_gate_up", w_gate_up, 3)
    _check_tensor("w_down", w_down, 3)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    num_tokens, hidden = x.shape
    num_local, two_i, w_hidden = w_gate_up.shape
    if two_i % 2 != 0 or two_i == 0:
        raise ValueError(f"w_gate_up must be [E_local, 2*I, H] with an even middle size, got {tuple(w_gate_up.shape)}")
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
    check_topk_ids(topk_ids, num_local * world_size)


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


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, backend):
        out, saved = backend.experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group)
        ctx.save_for_backward(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, *saved)
        ctx.schedule, ctx.group, ctx.backend = schedule, group, backend
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, *saved = ctx.saved_tensors
        grads = ctx.backend.experts_bwd(
            d_out.contiguous(), x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down,
            ctx.schedule, ctx.group, tuple(saved),
        )
        return (*grads, None, None, None)


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
    """The routed experts (+ optional shared expert) of one MoE layer; see megamoe.experts."""
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
    world_size = 1
    if group is not None:
        import torch.distributed as dist

        world_size = dist.get_world_size(group)
    _check_tensor("topk_ids", topk_ids, 2)
    validate(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, world_size)
    backend_name = resolve_backend(config, x, group)
    if backend_name == "reference":
        if world_size > 1:
            raise ValueError("MoEConfig.backend='reference' computes all experts in one process; it takes no group")
        return reference.experts(
            x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up=shared_gate_up, shared_down=shared_down
        )
    backend = _backend_module(backend_name)
    hidden, intermediate = x.shape[1], w_down.shape[2]
    schedule = build_schedule(
        topk_ids,
        w_gate_up.shape[0] * world_size,
        group=group,
        config=config,
        block_m=config.block_m or backend.block_m_for(hidden, intermediate, x.dtype),
    )
    if config.capacity_factor is not None:
        _raise_on_overflow(schedule)
    contiguous = [t.contiguous() if t is not None else None for t in (x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down)]
    return _Experts.apply(*contiguous, schedule, group, backend)
