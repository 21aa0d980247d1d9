"""What users run instead of megamoe, timed next to it by `python -m megamoe bench` (same inputs, same gate).

- "torchtitan" (always; the headline baseline): TorchTitan's MoE experts and expert parallelism
  (torchtitan/models/moe/moe.py: TokenReorderer, GroupedExperts, MoE.forward; moe/utils.py: the
  indices_padding_wrapper; distributed/expert_parallel.py: ExpertParallel) in plain PyTorch. Departures:
  the GEMMs run in the inputs' dtype (TorchTitan casts to bf16: the same in a bf16 run, while fp32 CPU runs
  stay fp32); gate and up are one grouped GEMM over w_gate_up; on one GPU x is gathered straight into the
  padded rows (TorchTitan gathers, then permutes: one copy more).
- "hf-grouped_mm" (peer, when transformers >= 5 is installed): transformers' own experts implementation
  "grouped_mm" (transformers.integrations.moe), called on our tensors.
- "liger" (peer, when liger-kernel is installed; CUDA): Liger-Kernel's fused MoE, LigerFusedMoEFunction.

Each is a function with megamoe.experts' signature (x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH
[E_l, 2I, H] gate rows first, w_down_EHI [E_l, H, I], shared_gate_up [2I_s, H], shared_down [H, I_s],
group; other keywords, e.g. config, ignored); autograd does the backward. The peers run on one GPU only.
"""

from __future__ import annotations

import importlib.util
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.backends.torch_native import grouped_mm

ALIGN_SIZE_M = 16  # TorchTitan's TOKEN_GROUP_ALIGN_SIZE_M: rows per expert are padded to a multiple of it
PEER_PACKAGES = {"hf-grouped_mm": ("transformers", "transformers"), "liger": ("liger_kernel", "liger-kernel")}
PEERS = tuple(PEER_PACKAGES)


def _check_inputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI) -> None:
    """Shapes only: checking that the ids are in range would cost a host sync, which TorchTitan does not pay."""
    if x_TH.dim() != 2:
        raise ValueError(f"x_TH must be [T, H], got shape {tuple(x_TH.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"topk_ids_TK must be [T={x_TH.shape[0]}, k], got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids_TK must be int32 or int64, got {topk_ids_TK.dtype}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(f"topk_weights_TK must have topk_ids_TK's shape {tuple(topk_ids_TK.shape)}, "
                         f"got {tuple(topk_weights_TK.shape)}")
    num_local, two_i, hidden = w_gate_up_E2IH.shape
    if hidden != x_TH.shape[1] or two_i % 2:
        raise ValueError(f"w_gate_up_E2IH must be [E_l, 2I, H={x_TH.shape[1]}], got shape {tuple(w_gate_up_E2IH.shape)}")
    if tuple(w_down_EHI.shape) != (num_local, hidden, two_i // 2):
        raise ValueError(f"w_down_EHI must be [E_l={num_local}, H={hidden}, I={two_i // 2}], "
                         f"got shape {tuple(w_down_EHI.shape)}")


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    # In the rows' dtype (bf16 in a bf16 run), as TorchTitan's F.silu(x @ w1.T) * (x @ w3.T).
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _shared_expert(x_TH, shared_gate_up, shared_down) -> torch.Tensor:
    """The shared expert as a dense MLP (TorchTitan's FeedForward), in x's dtype."""
    return _swiglu(x_TH @ shared_gate_up.t()) @ shared_down.t()


def _padded_layout(counts_WE: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of num_rows rows, grouped by (source rank, expert) with counts_WE[r, e] rows per group,
    goes in an expert-major buffer whose expert segments are padded to ALIGN_SIZE_M rows; and the
    segments' ends (int32, the offs of torch._grouped_mm). On the device: no host sync.

    This is TorchTitan's generate_permute_indices (expert by expert, then source rank by source rank),
    except that an expert without rows keeps an empty segment (TorchTitan pads it to ALIGN_SIZE_M rows).
    """
    counts_E = counts_WE.sum(0)
    padded_counts_E = (counts_E + ALIGN_SIZE_M - 1) // ALIGN_SIZE_M * ALIGN_SIZE_M
    ends_E = padded_counts_E.cumsum(0)
    # Group (r, e) starts in expert e's segment after the rows that ranks < r sent to e.
    group_dest_WE = (ends_E - padded_counts_E) + counts_WE.cumsum(0) - counts_WE
    counts_G = counts_WE.flatten()
    group_src_G = counts_G.cumsum(0) - counts_G
    # output_size makes repeat_interleave sync-free.
    group_N = torch.repeat_interleave(counts_G, output_size=num_rows)
    offset_G = group_dest_WE.flatten() - group_src_G
    dest_N = offset_G[group_N] + torch.arange(num_rows, device=counts_WE.device)
    return dest_N, ends_E.to(torch.int32)


def _grouped_experts(src_SH, src_of_row_N, counts_WE, w_gate_up_E2IH, w_down_EHI) -> torch.Tensor:
    """The expert MLPs of rows src_SH[src_of_row_N] (grouped by (source rank, expert), counts_WE rows per
    group), returned in that order [N, H]: permute into padded expert segments, two torch._grouped_mm
    with SwiGLU between, un-permute (TorchTitan's _permute / GroupedExperts / _unpermute)."""
    num_rows, num_local = src_of_row_N.shape[0], w_gate_up_E2IH.shape[0]
    dest_N, ends_E = _padded_layout(counts_WE, num_rows)
    # Worst case: every expert's segment needs ALIGN_SIZE_M - 1 padding rows. Padding rows (and the unused
    # tail) read an appended zero row, as TorchTitan's permuted indices of -1 do.
    row_src_R = torch.full((num_rows + num_local * (ALIGN_SIZE_M - 1),), src_SH.shape[0], device=src_SH.device)
    row_src_R.scatter_(0, dest_N, src_of_row_N)
    x_RH = torch.cat([src_SH, src_SH.new_zeros(1, src_SH.shape[1])])[row_src_R]
    # grouped_mm is torch._grouped_mm where torch has it for this device and dtype, else a loop over experts.
    h_RI = _swiglu(grouped_mm(x_RH, w_gate_up_E2IH.transpose(-2, -1), ends_E))
    y_RH = grouped_mm(h_RI, w_down_EHI.transpose(-2, -1), ends_E)
    return y_RH[dest_N]  # rows past ends_E[-1] are left unwritten by grouped_mm and never read


def _expert_parallel(routed_NH, counts_E, w_gate_up_E2IH, w_down_EHI, group) -> torch.Tensor:
    """TorchTitan's ExpertParallel around _grouped_experts: routed_NH (this rank's pairs sorted by global
    expert, counts_E per global expert) to the experts' owners and their outputs back, in routed_NH's order."""
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    world, num_local = dist.get_world_size(group), w_gate_up_E2IH.shape[0]
    with torch.no_grad():
        # counts_group[r * E_l + e]: rows rank r sends to this rank's local expert e.
        counts_group = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts_E, None, None, group))
        splits = torch.stack([counts_E.view(world, num_local).sum(1), counts_group.view(world, num_local).sum(1)])
        # NOTE: host sync — all_to_all_single needs the split sizes on the host; TorchTitan's
        # ExpertParallel._token_dispatch copies them the same way, once per forward. The backward reuses them.
        send_splits, recv_splits = splits.tolist()
    # Autograd-aware: the backward is the reverse all-to-all with the same splits.
    received_MH = all_to_all_single_autograd(routed_NH, recv_splits, send_splits, group)
    num_received = sum(recv_splits)
    rows_out_MH = _grouped_experts(
        received_MH, torch.arange(num_received, device=routed_NH.device), counts_group.view(world, num_local),
        w_gate_up_E2IH, w_down_EHI,
    )
    return all_to_all_single_autograd(rows_out_MH, send_splits, recv_splits, group)


def torchtitan_experts(
    x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI,
    shared_gate_up=None, shared_down=None, group=None, **ignored,
) -> torch.Tensor:
    """TorchTitan's MoE experts (score after the experts), one GPU or expert parallel over group."""
    _check_inputs(x_TH, topk_ids_TK, topk_weights_TK, w_gate_up_E2IH, w_down_EHI)
    top_k = topk_ids_TK.shape[1]
    world = 1 if group is None else dist.get_world_size(group)
    num_local = w_gate_up_E2IH.shape[0]
    # TokenReorderer: (token, slot) pairs sorted by global expert id, which also sorts them by owner rank.
    ids_N = topk_ids_TK.reshape(-1)
    # Counted as TorchTitan counts them, with histc (sync-free); torch.bincount would read the ids' maximum back to
    # the host, a synchronisation TorchTitan does not pay (and one that keeps the path out of CUDA graphs).
    num_experts = world * num_local
    counts_E = torch.histc(ids_N.float(), bins=num_experts, min=0, max=num_experts).long()
    order_N = torch.argsort(ids_N, stable=True)
    token_N = order_N // top_k
    scores_N = topk_weights_TK.reshape(-1)[order_N]
    if world == 1:
        routed_out_NH = _grouped_experts(x_TH, token_N, counts_E.view(1, -1), w_gate_up_E2IH, w_down_EHI)
    else:
        routed_out_NH = _expert_parallel(x_TH[token_N], counts_E, w_gate_up_E2IH, w_down_EHI, group)
    # Score after the experts: a product in the router's dtype (fp32), rounded to the rows' dtype.
    routed_out_NH = (routed_out_NH.to(scores_N.dtype) * scores_N.unsqueeze(1)).to(x_TH.dtype)
    out_TH = torch.zeros_like(x_TH) if shared_gate_up is None else _shared_expert(x_TH, shared_gate_up, shared_down)
    # Non-deterministic on CUDA (atomics) and accumulated in x's dtype, as TorchTitan's.
    return out_TH.scatter_add(0, token_N.unsqueeze(1).expand(-1, x_TH.shape[1]), routed_out_NH)


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
    out_TH = ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x_TH, topk_ids_TK, topk_weights_TK)
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
