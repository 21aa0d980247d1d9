"""Random problems for one rank: expert weights, token inputs, and one forward(+backward) through any experts fn."""

from __future__ import annotations

import dataclasses

import torch

from megamoe.bench.routing import route
from megamoe.bench.workloads import Workload

SHARED_SEED = 0  # expert e's weights use seed e + 1, so they do not depend on the world size


@dataclasses.dataclass
class Weights:
    """One rank's weights, leaves that require grad; the shared expert is replicated on every rank."""

    # [E_l, 2I, H], gate rows first; as TorchTitan holds them (torchtitan_weights), the pair (w1, w3) [E_l, I, H].
    w_gate_up_E2IH: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    w_down_EHI: torch.Tensor  # [E_l, H, I]
    shared_gate_up_2IH: torch.Tensor | None  # [2I_s, H]
    shared_down_HI: torch.Tensor | None  # [H, I_s]


@dataclasses.dataclass
class Tokens:
    """One rank's per-token inputs; x and topk_weights are leaves that require grad."""

    x_TH: torch.Tensor  # [T, H]
    topk_ids_TK: torch.Tensor  # [T, k] int64 global expert ids
    topk_weights_TK: torch.Tensor  # [T, k] fp32
    d_out_TH: torch.Tensor  # [T, H], the gradient fed to the backward


def _swiglu_weights(hidden: int, intermediate: int, dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([2I, H], [H, I]) scaled so that activations stay O(1) for x ~ N(0, 1)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(2 * intermediate, hidden, generator=generator, device=device) * hidden**-0.5
    down = torch.randn(hidden, intermediate, generator=generator, device=device) * intermediate**-0.5
    return gate_up.to(dtype), down.to(dtype)


def expert_weights(
    w: Workload, expert: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) of routed expert `expert` (a global id): the same values on every rank, so
    the bench's gate regenerates the experts of other ranks instead of gathering them."""
    return _swiglu_weights(w.hidden, w.intermediate, dtype, device, seed=expert + 1)


def make_weights(w: Workload, expert_ids: range, dtype: torch.dtype, device: torch.device) -> Weights:
    """Weights of the experts expert_ids (global ids), plus the shared expert if the workload has one."""
    w_gate_up_E2IH = torch.empty(len(expert_ids), 2 * w.intermediate, w.hidden, dtype=dtype, device=device)
    w_down_EHI = torch.empty(len(expert_ids), w.hidden, w.intermediate, dtype=dtype, device=device)
    for i, e in enumerate(expert_ids):  # filled in place: no second copy of the weights
        w_gate_up_E2IH[i], w_down_EHI[i] = expert_weights(w, e, dtype, device)
    shared = (None, None)
    if w.shared_intermediate:
        shared = _swiglu_weights(w.hidden, w.shared_intermediate, dtype, device, seed=SHARED_SEED)
    leaves = [w_gate_up_E2IH, w_down_EHI, *shared]
    return Weights(*(t.requires_grad_() if t is not None else None for t in leaves))


def torchtitan_weights(weights: Weights) -> Weights:
    """weights as TorchTitan holds them, for its baseline (megamoe.bench.baselines.torchtitan_experts): gate and up
    as two leaves (w1, w3) [E_l, I, H], copies of w_gate_up_E2IH's halves (with one expert a half is already
    contiguous, and contiguous() would return a view of it); the other leaves shared."""
    w1_EIH, w3_EIH = (half.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
                      for half in weights.w_gate_up_E2IH.chunk(2, dim=1))
    return dataclasses.replace(weights, w_gate_up_E2IH=(w1_EIH, w3_EIH))


def megamoe_layout(grad: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A gradient in megamoe's layout, for comparisons: d_w_gate_up of TorchTitan's (w1, w3) joined to [E_l, 2I, H]."""
    return torch.cat(grad, dim=1) if isinstance(grad, tuple) else grad


def make_tokens(
    w: Workload, num_tokens: int, num_experts: int, routing: str, dtype: torch.dtype, generator: torch.Generator
) -> Tokens:
    """Random tokens routed to k of num_experts (global) experts; fresh values on every call."""
    device = generator.device
    x_TH = torch.randn(num_tokens, w.hidden, generator=generator, device=device).to(dtype)
    topk_ids_TK, topk_weights_TK = route(routing, num_tokens, num_experts, w.top_k, generator)
    d_out_TH = torch.randn(num_tokens, w.hidden, generator=generator, device=device).to(dtype)
    return Tokens(x_TH.requires_grad_(), topk_ids_TK, topk_weights_TK.requires_grad_(), d_out_TH)


def one_gpu_problem(w: Workload, device: torch.device, routing: str = "balanced",
                    dtype: torch.dtype = torch.bfloat16) -> tuple[Weights, Tokens]:
    """(weights, tokens) of a workload on one GPU, as the benchmark scripts time it: its one-GPU experts (all
    of them unless the workload caps them), its tokens per GPU routed `routing`, the inputs of seed 1."""
    num_experts = w.one_gpu_experts or w.num_experts
    weights = make_weights(w, range(num_experts), dtype, device)
    tokens = make_tokens(w, w.tokens_per_gpu, num_experts, routing, dtype, torch.Generator(device=device).manual_seed(1))
    return weights, tokens


def cast(weights: Weights, tokens: Tokens, dtype: torch.dtype) -> tuple[Weights, Tokens]:
    """New leaves in dtype (topk_weights stay fp32 unless dtype is fp64), for the references."""

    def leaf(t, to=dtype):
        return None if t is None else t.detach().to(to).requires_grad_()

    weights_dtype = Weights(*(leaf(getattr(weights, f.name)) for f in dataclasses.fields(weights)))
    topk_weights_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tokens_dtype = Tokens(
        leaf(tokens.x_TH),
        tokens.topk_ids_TK,
        leaf(tokens.topk_weights_TK, topk_weights_dtype),
        tokens.d_out_TH.to(dtype),
    )
    return weights_dtype, tokens_dtype


def grad_leaves(weights: Weights, tokens: Tokens) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """The differentiable inputs, keyed by the name of their gradient (TorchTitan's (w1, w3) under one name)."""
    named = {
        "d_x": tokens.x_TH,
        "d_topk_weights": tokens.topk_weights_TK,
        "d_w_gate_up": weights.w_gate_up_E2IH,
        "d_w_down": weights.w_down_EHI,
    }
    if weights.shared_gate_up_2IH is not None:
        named.update(d_shared_gate_up=weights.shared_gate_up_2IH, d_shared_down=weights.shared_down_HI)
    return named


def forward_TH(experts_fn, weights: Weights, tokens: Tokens, **kwargs) -> torch.Tensor:
    """experts_fn (megamoe.bench.gate.experts_fn(backend), megamoe.reference.experts) on this problem;
    kwargs: group."""
    return experts_fn(
        tokens.x_TH,
        tokens.topk_ids_TK,
        tokens.topk_weights_TK,
        weights.w_gate_up_E2IH,
        weights.w_down_EHI,
        shared_gate_up=weights.shared_gate_up_2IH,
        shared_down=weights.shared_down_HI,
        **kwargs,
    )


def forward_backward(experts_fn, weights: Weights, tokens: Tokens, **kwargs) -> dict[str, torch.Tensor | tuple]:
    """{"out": [T, H], "d_x": ..., ...}: the output and the gradients of sum(out * d_out) (see grad_leaves; a pair
    of leaves gets a pair of gradients, as its owner's autograd leaves them: megamoe_layout joins them)."""
    out_TH = forward_TH(experts_fn, weights, tokens, **kwargs)
    leaves = grad_leaves(weights, tokens)
    flat = [t for leaf in leaves.values() for t in (leaf if isinstance(leaf, tuple) else (leaf,))]
    # autograd.grad, not backward(): nothing accumulates into .grad between iterations.
    grads = iter(torch.autograd.grad(out_TH, flat, tokens.d_out_TH))
    results = {"out": out_TH.detach()}
    for name, leaf in leaves.items():
        results[name] = tuple(next(grads) for _ in leaf) if isinstance(leaf, tuple) else next(grads)
    return results
