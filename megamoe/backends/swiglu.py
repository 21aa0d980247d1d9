"""SwiGLU in eager torch ops, and the shared expert built on it: one implementation for every backend.

Precision: the input dtype with fp32 math inside each op and one rounding per op, exactly the ops of
PyTorch's own F.silu(g) * u and its autograd (the error-budget reference), never an fp32 copy of [N, 2I].
The torch path runs its routed rows through swiglu_fwd / swiglu_bwd; the Triton kernels run their own
SwiGLU epilogues (kernels/_common.py). The shared expert (a dense SwiGLU MLP over every token, its GEMMs
on cuBLAS through torch) is shared_fwd / shared_bwd on every backend, so its output and gradients are
the same bits on the torch path, the one-GPU Triton path and the expert-parallel one.

The shared expert's saved tensors (shared_fwd's, for shared_bwd): (pre [T, 2I_s], h [T, I_s]), its
gate/up pre-activation and SwiGLU output; () without a shared expert.
"""

from __future__ import annotations

import torch


def swiglu_fwd(gate_up: torch.Tensor, live: int | None = None) -> torch.Tensor:
    """h = silu(gate) * up in gate_up's dtype (fp32 math inside each op, one rounding per op, as PyTorch's
    F.silu(g) * u): two passes over [R, I], 10 B per element in bf16 (an fp32 copy of [R, 2I] and fp32
    temporaries would be 38 B). Only the first `live` rows are computed (the rest of h is left unwritten)."""
    gate, up = gate_up[:live].chunk(2, dim=-1)
    h = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.aten.silu.out(gate, out=h[:live]).mul_(up)
    return h


def swiglu_bwd(gate_up: torch.Tensor, d_h: torch.Tensor, live: int | None = None) -> torch.Tensor:
    """d_gate_up [R, 2I] of swiglu_fwd, written in place into one buffer (no fp32 copies, no cat): the ops
    of PyTorch's autograd of F.silu(g) * u, 22 B per element of [R, I] in bf16. d_h is consumed
    (overwritten). Only the first `live` rows are computed (the rest of d_gate_up is left unwritten)."""
    gate, up = gate_up[:live].chunk(2, dim=-1)
    d_gate_up = torch.empty_like(gate_up)
    d_gate, d_up = d_gate_up[:live].chunk(2, dim=-1)
    d_h = d_h[:live]
    torch.ops.aten.silu.out(gate, out=d_up)  # s = silu(gate), recomputed straight into d_up's half
    d_up.mul_(d_h)  # d_up = d_h * s
    torch.ops.aten.silu_backward.grad_input(d_h.mul_(up), gate, grad_input=d_gate)  # silu'(gate) * (d_h * up)
    return d_gate_up


def shared_fwd(
    x: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """(out [T, H], saved) of the shared expert, saved = (pre, h) for shared_bwd (the module docstring);
    (None, ()) without a shared expert (shared_gate_up None)."""
    if shared_gate_up is None:
        return None, ()
    pre = x @ shared_gate_up.t()
    h = swiglu_fwd(pre)
    return h @ shared_down.t(), (pre, h)


def empty_shared_saved(x: torch.Tensor, shared_gate_up: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like shared_fwd's saved (for the backends' empty_saved, torch.compile's fake impl)."""
    if shared_gate_up is None:
        return ()
    two_i_s = shared_gate_up.shape[0]
    return x.new_empty(x.shape[0], two_i_s), x.new_empty(x.shape[0], two_i_s // 2)


def shared_bwd(
    d_out: torch.Tensor,
    x: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    saved: tuple[torch.Tensor, ...],
    *,
    need_x: bool = True,
    need_gate_up: bool = True,
    need_down: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d_x, d_shared_gate_up, d_shared_down) of the shared expert from shared_fwd's saved (no recompute of
    x @ shared_gate_up.T, nor of SwiGLU); None for each one not needed, and all three without a shared
    expert. d_out in x's dtype."""
    if shared_gate_up is None:
        return None, None, None
    pre, h = saved
    d_shared_down = d_out.t() @ h if need_down else None
    if not (need_x or need_gate_up):
        return None, None, d_shared_down
    d_pre = swiglu_bwd(pre, d_out @ shared_down)
    return d_pre @ shared_gate_up if need_x else None, d_pre.t() @ x if need_gate_up else None, d_shared_down
