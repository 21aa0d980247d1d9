"""The math of one MoE layer in plain PyTorch (docs/design.md), readable and importable without Triton or a GPU.

No schedule and no expert-parallel tricks: a loop over experts. Matmuls run in the inputs' dtype (so the
reference in bf16 is "PyTorch's own bf16 error" for error budgets, and in fp64 the ground truth); the sum
over slots and the shared expert are accumulated in fp32 (fp64 for fp64 inputs), slot by slot in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.config import MoEConfig
from megamoe.schedule import AUTOCAST_DEVICE_TYPES, check_topk_ids, validate


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) @ w_down.T for x [N, H], w_gate_up [2I, H] (gate rows first), w_down [H, I]."""
    gate, up = (x @ w_gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down.t()


def experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    config=None,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t,j] * expert_{topk_ids[t,j]}(x[t]) (+ shared_expert(x[t]), added last).

    x [T, H]; topk_ids [T, k] expert ids in [0, E); topk_weights [T, k]; w_gate_up [E, 2I, H];
    w_down [E, H, I]; shared_gate_up [2I_s, H]; shared_down [H, I_s]. Returns [T, H] in x's dtype.
    Differentiable (autograd) with respect to every floating-point input (T = 0 included: zero gradients).
    Arguments are checked as megamoe.experts checks them (ValueError/TypeError naming the argument; an id
    outside [0, E) too; inputs on the meta device too, which hold no routing to gather by; a TypeError for topk_ids
    batched by torch.vmap, whose values pick the tokens: vmap over the other inputs only). `config` is accepted
    for signature parity with megamoe.experts and ignored. Under torch.autocast, as megamoe.experts: the
    float32/float16/bfloat16 inputs (but topk_weights) cast to the autocast dtype, float64 ones not.
    """
    del config
    if (isinstance(x, torch.Tensor) and x.device.type in AUTOCAST_DEVICE_TYPES
            and torch.is_autocast_enabled(x.device.type)):
        # megamoe.experts casts the inputs as a matmul's would be and calls back here with autocast off (autocast's
        # own casts would give the expert outputs another dtype than the sum that collects them).
        from megamoe.autograd import experts as experts_api

        return experts_api(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up=shared_gate_up,
                           shared_down=shared_down, config=MoEConfig(backend="reference"))
    validate(x, topk_ids, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, world_size=1)
    if x.device.type == "meta":
        # The loop below picks each expert's tokens by the routing's values (nonzero), which meta tensors lack:
        # torch would fail inside nonzero with advice about its own fake-tensor configuration.
        raise ValueError(
            "megamoe.reference.experts (MoEConfig.backend='reference') needs the routing's values to pick each "
            "expert's tokens, and x and the other inputs are on the meta device, which holds none; run it on "
            "the CPU or a GPU, or use MoEConfig(backend='torch') (or 'auto'), which runs on meta (shapes only)"
        )
    if not torch.compiler.is_compiling() and torch._C._functorch.is_batchedtensor(topk_ids):
        # The range check and the loop below read the ids' values (nonzero): torch.vmap fails on either with
        # "data-dependent control flow ... please file an issue".
        raise TypeError(
            "megamoe.reference.experts: topk_ids is batched by torch.vmap, which cannot batch the routing (each "
            "expert's tokens are picked by the ids' values); vmap over x, topk_weights or the weights only, or loop "
            "over the routings"
        )
    check_topk_ids(topk_ids, w_gate_up.shape[0])
    num_tokens, top_k = topk_ids.shape
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    # y[t, j]: each slot's expert output. Gathering the routed tokens synchronises the host (nonzero);
    # the reference is the readable math, not a sync-free path. An expert without tokens still runs (on
    # zero rows): every input stays in the graph, so with T = 0 the output requires grad and the gradients
    # are zeros, as from the other backends.
    y = x.new_zeros(num_tokens, top_k, x.shape[1])
    for e in range(w_gate_up.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        y = y.index_put((token, slot), swiglu_mlp(x[token], w_gate_up[e], w_down[e]))
    out = torch.zeros(num_tokens, x.shape[1], dtype=acc_dtype, device=x.device)
    for j in range(top_k):
        out = out + topk_weights[:, j : j + 1].to(acc_dtype) * y[:, j].to(acc_dtype)
    if shared_gate_up is not None:
        out = out + swiglu_mlp(x, shared_gate_up, shared_down).to(acc_dtype)
    return out.to(x.dtype)
