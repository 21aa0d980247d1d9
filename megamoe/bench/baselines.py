"""What users run instead of megamoe, timed next to it by `python -m megamoe bench` (same inputs, same gate).

- "torchtitan" (always; the headline baseline): TorchTitan's MoE experts and expert parallelism as TorchTitan
  runs them since April 2026 (torchtitan/models/common/moe.py: GroupedExperts, RoutedExperts, MoE.forward;
  token_dispatcher.py: LocalTokenDispatcher, AllToAllTokenDispatcher; ops/scatter_add.py) in plain PyTorch:
  the pairs sorted by expert, x's rows gathered in that order, torch._grouped_mm on the unpadded segments,
  the score applied to the outputs in fp32, the sum over a token's pairs by a deterministic scatter_add (and
  with expert parallelism the two all_to_all_single with the split sizes on the host, the received rows
  reordered rank-major to expert-major and back). Its weights are held as TorchTitan holds them: gate and up
  as two tensors (w1, w3, [E_l, I, H] each; megamoe.bench.problem.torchtitan_weights makes them once, before
  timing), so gate and up are two grouped GEMMs, x's rows read by each and their two gradients summed, and the
  weight gradients come out as two tensors, as TorchTitan's do. One departure: the GEMMs run in the inputs'
  dtype (TorchTitan casts to bf16: the same in a bf16 run, while fp32 CPU runs stay fp32).
- "hf-grouped_mm" (peer, when transformers >= 5 is installed): transformers' own experts implementation
  "grouped_mm" (transformers.integrations.moe), called on our tensors, the router weights in x's dtype as
  transformers' Qwen3-MoE, Qwen2-MoE and gpt-oss routers hand them over (fp32 ones would run its combine, a
  product, gather and sum over [T*k, H] and their backward, in fp32; Mixtral's and DeepSeek-V3's routers do
  hand fp32, so at those workloads the peer runs lighter than those models do).
- "liger" (peer, when liger-kernel is installed; CUDA): Liger-Kernel's fused MoE, LigerFusedMoEFunction.

Each is a function with megamoe.experts' signature (x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH
[E_l, 2I, H] gate rows first, for "torchtitan" the pair (w1, w3) instead, w_down_EHI [E_l, H, I],
shared_gate_up [2I_s, H], shared_down [H, I_s], group; other keywords, e.g. config, ignored); autograd does
the backward. The peers run on one GPU only.
"""

from __future__ import annotations

import importlib.util
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.backends.torch_native import grouped_mm

PEER_PACKAGES = {"hf-grouped_mm": ("transformers", "transformers"), "liger": ("liger_kernel", "liger-kernel")}
PEERS = tuple(PEER_PACKAGES)


def _check_inputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI) -> None:
    """Shapes only: checking that the ids are in range would cost a host sync, which TorchTitan does not pay."""
    _check_tokens(x_TH, topk_ids_TK, topk_weights_TK)
    num_local, two_i, hidden = w_gate_up_E2IH.shape
    if hidden != x_TH.shape[1] or two_i % 2:
        raise ValueError(f"w_gate_up_E2IH must be [E_l, 2I, H={x_TH.shape[1]}], got shape {tuple(w_gate_up_E2IH.shape)}")
    _check_down(w_down_EHI, num_local, hidden, two_i // 2)


def _check_tokens(x_TH, topk_ids_TK, topk_weights_TK) -> None:
    if x_TH.dim() != 2:
        raise ValueError(f"x_TH must be [T, H], got shape {tuple(x_TH.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"topk_ids_TK must be [T={x_TH.shape[0]}, k], got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids_TK must be int32 or int64, got {topk_ids_TK.dtype}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk_weights_TK must have topk_ids_TK's shape {tuple(topk_ids_TK.shape)}, "
                         f"got {tuple(topk_weights_TK.shape)}")


def _check_down(w_down_EHI, num_local: int, hidden: int, intermediate: int) -> None:
    if tuple(w_down_EHI.shape) != (num_local, hidden, intermediate):
        raise ValueError(f"w_down_EHI must be [E_l={num_local}, H={hidden}, I={intermediate}], "
                         f"got shape {tuple(w_down_EHI.shape)}")


def _check_torchtitan_inputs(x_TH, topk_ids_TK, topk_weights_TK, w1_w3_EIH, w_down_EHI) -> None:
    _check_tokens(x_TH, topk_ids_TK, topk_weights_TK)
    if not (isinstance(w1_w3_EIH, tuple) and len(w1_w3_EIH) == 2
            and all(isinstance(t, torch.Tensor) for t in w1_w3_EIH)):
        raise TypeError("w1_w3_EIH must be TorchTitan's gate and up weights as a tuple (w1, w3) of two [E_l, I, H] "
                        f"tensors (megamoe.bench.problem.torchtitan_weights makes them), got {type(w1_w3_EIH).__name__}")
    w1, w3 = w1_w3_EIH
    if w1.dim() != 3 or w1.shape != w3.shape or w1.shape[2] != x_TH.shape[1]:
        raise ValueError(f"w1_w3_EIH must be two [E_l, I, H={x_TH.shape[1]}] tensors of one shape, got shapes "
                         f"{tuple(w1.shape)} and {tuple(w3.shape)}")
    num_local, intermediate, hidden = w1.shape
    _check_down(w_down_EHI, num_local, hidden, intermediate)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' gate on one GEMM's [.., 2I] output (gate columns first), in the rows' dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _shared_expert(x_TH, shared_gate_up, shared_down) -> torch.Tensor:
    """The shared expert as a dense MLP in x's dtype, gate and up two matmuls as TorchTitan's FeedForward (w1, w3)
    and transformers' MLPs (gate_proj, up_proj) run them; the weight's two halves are views of shared_gate_up."""
    gate_IH, up_IH = shared_gate_up.chunk(2)
    return (F.silu(x_TH @ gate_IH.t()) * (x_TH @ up_IH.t())) @ shared_down.t()


class _DeterministicScatterAdd(torch.autograd.Function):
    """out.scatter_add(0, index, src) under torch.use_deterministic_algorithms (a fixed order of the additions, no
    atomics), its backward a gather: TorchTitan's deterministic_scatter_add (torchtitan/ops/scatter_add.py)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        was_on = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=False)
        try:
            return out.scatter_add(0, index, src)
        finally:
            torch.use_deterministic_algorithms(was_on, warn_only=warn_only)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad_out, None, grad_out.gather(0, index)


def _grouped_experts(rows_NH, counts_E, w1_w3_EIH, w_down_EHI) -> torch.Tensor:
    """The expert MLPs of rows_NH, grouped by expert (counts_E rows each, no padding): torch._grouped_mm over the
    segments' ends, gate and up two of them, SwiGLU between (TorchTitan's GroupedExperts)."""
    ends_E = counts_E.cumsum(0).to(torch.int32)
    # grouped_mm is torch._grouped_mm where torch has it for this device and dtype, else a loop over experts.
    w1_EIH, w3_EIH = w1_w3_EIH
    h_NI = (F.silu(grouped_mm(rows_NH, w1_EIH.transpose(-2, -1), ends_E))
            * grouped_mm(rows_NH, w3_EIH.transpose(-2, -1), ends_E))
    return grouped_mm(h_NI, w_down_EHI.transpose(-2, -1), ends_E)


def _expert_parallel(routed_NH, counts_E, w1_w3_EIH, w_down_EHI, group) -> torch.Tensor:
    """TorchTitan's AllToAllTokenDispatcher around _grouped_experts: routed_NH (this rank's pairs sorted by global
    expert, counts_E per global expert) to the experts' owners, reordered from rank-major to expert-major, and
    their outputs back, in routed_NH's order."""
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    world, num_local = dist.get_world_size(group), w_down_EHI.shape[0]
    with torch.no_grad():
        # counts_group[r * E_l + e]: rows rank r sends to this rank's local expert e.
        counts_group = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts_E, None, None, group))
        splits = torch.stack([counts_E.view(world, num_local).sum(1), counts_group.view(world, num_local).sum(1)])
        # NOTE: host sync — all_to_all_single needs the split sizes on the host; TorchTitan's dispatcher copies
        # them the same way, once per forward. The backward reuses them.
        send_splits, recv_splits = splits.tolist()
    # Autograd-aware: the backward is the reverse all-to-all with the same splits.
    received_MH = all_to_all_single_autograd(routed_NH, recv_splits, send_splits, group)
    num_received = sum(recv_splits)
    # Rank-major (r, e) segments to expert-major (e, r): output row p reads input row
    # start_in[seg] + p - start_out[seg] (TorchTitan's _permute; repeat_interleave with output_size: no sync).
    counts_RE = counts_group.view(world, num_local)
    starts_in_RE = (counts_group.cumsum(0) - counts_group).view(world, num_local)
    lengths_G, starts_in_G = counts_RE.t().reshape(-1), starts_in_RE.t().reshape(-1)
    segment_M = torch.repeat_interleave(torch.arange(lengths_G.shape[0], device=routed_NH.device), lengths_G,
                                        output_size=num_received)
    starts_out_G = lengths_G.cumsum(0) - lengths_G
    permuted_M = (starts_in_G[segment_M] + torch.arange(num_received, device=routed_NH.device)
                  - starts_out_G[segment_M])
    rows_out_MH = _grouped_experts(received_MH[permuted_M], counts_RE.sum(0), w1_w3_EIH, w_down_EHI)
    unpermuted_MH = rows_out_MH.new_empty(received_MH.shape)  # TorchTitan's _unpermute
    unpermuted_MH[permuted_M] = rows_out_MH
    return all_to_all_single_autograd(unpermuted_MH, send_splits, recv_splits, group)


def torchtitan_experts(
    x_TH, topk_ids_TK, topk_weights_TK, w1_w3_EIH, w_down_EHI,
    shared_gate_up=None, shared_down=None, group=None, **ignored,
) -> torch.Tensor:
    """TorchTitan's MoE experts (score after the experts), one GPU or expert parallel over group; w1_w3_EIH is
    TorchTitan's gate and up weights (w1, w3), [E_l, I, H] each."""
    _check_torchtitan_inputs(x_TH, topk_ids_TK, topk_weights_TK, w1_w3_EIH, w_down_EHI)
    top_k = topk_ids_TK.shape[1]
    world = 1 if group is None else dist.get_world_size(group)
    num_local = w_down_EHI.shape[0]
    # The (token, slot) pairs sorted by global expert id (which also sorts them by owner rank).
    ids_N = topk_ids_TK.reshape(-1)
    # Counted with histc (sync-free; TorchTitan's router counts with a one-hot sum, also sync-free); torch.bincount
    # would read the ids' maximum back to the host, a synchronisation TorchTitan does not pay.
    num_experts = world * num_local
    counts_E = torch.histc(ids_N.float(), bins=num_experts, min=0, max=num_experts).long()
    order_N = torch.argsort(ids_N, stable=True)
    token_N = order_N // top_k
    scores_N = topk_weights_TK.reshape(-1)[order_N]
    routed_NH = x_TH[token_N]
    if world == 1:
        routed_out_NH = _grouped_experts(routed_NH, counts_E, w1_w3_EIH, w_down_EHI)
    else:
        routed_out_NH = _expert_parallel(routed_NH, counts_E, w1_w3_EIH, w_down_EHI, group)
    # Score after the experts: a product in the router's dtype (fp32), rounded to the rows' dtype.
    routed_out_NH = (routed_out_NH.to(scores_N.dtype) * scores_N.unsqueeze(1)).to(x_TH.dtype)
    out_TH = _DeterministicScatterAdd.apply(
        torch.zeros_like(x_TH), token_N.unsqueeze(1).expand(-1, x_TH.shape[1]), routed_out_NH)
    return out_TH if shared_gate_up is None else out_TH + _shared_expert(x_TH, shared_gate_up, shared_down)


def peer_unavailable_reason(name: str, device: torch.device, group) -> str:
    """Why peer `name` cannot run here ("" if it can, as far as can be told without importing it)."""
    module, package = PEER_PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        return f"{package} not installed"
    if group is not None:
        return "unavailable: one GPU only"
    if name == "liger" and device.type != "cuda":
        return "unavailable: needs a CUDA GPU (Triton kernels)"
    return ""


def _one_gpu_only(name: str, group) -> None:
    if group is not None:
        raise ValueError(f"group: {name} runs on one GPU only (no expert parallelism), got a process group")


def hf_grouped_mm_experts(
    x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI,
    shared_gate_up=None, shared_down=None, group=None, **ignored,
) -> torch.Tensor:
    """transformers' "grouped_mm" experts implementation, as a transformers 5 MoE model runs it."""
    _one_gpu_only("hf-grouped_mm", group)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    _check_inputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI)
    # The attributes that transformers' @use_experts_implementation gives an experts module; our weights
    # are in its default layout (gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I]).
    experts = types.SimpleNamespace(
        num_experts=w_gate_up_E2IH.shape[0], gate_up_proj=w_gate_up_E2IH, down_proj=w_down_EHI, has_gate=True,
        has_bias=False, is_transposed=False, has_post_expert_norm=False, _is_expert_parallel=False,
    )
    experts._apply_gate = _swiglu
    out_TH = ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x_TH, topk_ids_TK, topk_weights_TK.to(x_TH.dtype))
    if shared_gate_up is not None:  # transformers' MoE blocks add the shared expert's dense MLP
        out_TH = out_TH + _shared_expert(x_TH, shared_gate_up, shared_down)
    return out_TH


def liger_experts(
    x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI,
    shared_gate_up=None, shared_down=None, group=None, **ignored,
) -> torch.Tensor:
    """Liger-Kernel's fused MoE (as its LigerExperts module calls it), plus the shared expert's dense MLP."""
    _one_gpu_only("liger", group)
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    _check_inputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI)
    out_TH = LigerFusedMoEFunction.apply(
        x_TH, w_gate_up_E2IH, w_down_EHI, topk_ids_TK.to(torch.int32), topk_weights_TK
    )
    if shared_gate_up is not None:
        out_TH = out_TH + _shared_expert(x_TH, shared_gate_up, shared_down)
    return out_TH


FUNCTIONS = {"torchtitan": torchtitan_experts, "hf-grouped_mm": hf_grouped_mm_experts, "liger": liger_experts}
