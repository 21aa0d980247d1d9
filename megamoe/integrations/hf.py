"""Run Hugging Face transformers MoE blocks through megamoe.experts, keeping each model's own router.

    model = AutoModelForCausalLM.from_config(cfg)        # or from_pretrained(...)
    patch_model(model)                                   # experts (and shared experts) -> megamoe.experts
    ...train...
    unpatch_model(model); model.save_pretrained(path)    # a plain transformers checkpoint

How transformers (v5) lays these families out, and what patching does with each. In every family the
routed experts are one `<Family>Experts` module holding two fused 3-D parameters, exactly megamoe's layout:

    gate_up_proj [E, 2I, H]  (gate rows first, then up rows)   = megamoe w_gate_up [E_local, 2I, H]
    down_proj    [E, H, I]                                      = megamoe w_down    [E_local, H, I]

so the parameters are passed to megamoe.experts as they are: no copy, no repack, the model's own
parameters are the ones trained and saved. The router (`block.gate`) is never touched: its forward,
its parameters and buffers (DeepSeek-V3's sigmoid scores, `e_score_correction_bias`, grouped top-k and
`routed_scaling_factor`; the softmax top-k, `norm_topk_prob` of the others) and its output
`router_logits`, which transformers records with a hook on the router module for the auxiliary
load-balancing loss, all stay exactly as the model defines them.

    family       block (router -> experts)           shared expert              what patching replaces
    qwen3_moe    Qwen3MoeSparseMoeBlock              none                       experts.forward
    mixtral      MixtralSparseMoeBlock (+ jitter)    none                       experts.forward
    olmoe        OlmoeSparseMoeBlock                 none                       experts.forward
    qwen2_moe    Qwen2MoeSparseMoeBlock              sigmoid(shared_expert_gate(x)) * shared_expert(x)
                                                                                experts.forward; the gated
                                                                                shared expert is kept as the
                                                                                model computes it (megamoe's
                                                                                shared expert has no gate)
    deepseek_v3  DeepseekV3MoE                       shared_experts(x), ungated block.forward: router, then
                                                                                one megamoe.experts call for
                                                                                routed + shared experts

Only the routed experts' forward is swapped where that is enough, so everything else in the block (e.g.
Mixtral's training-time jitter noise) stays the model's own code. DeepSeek-V3 needs its block's forward
swapped too, to hand the shared expert to the same megamoe.experts call; that forward is the block's own
three lines (router on the flattened tokens, experts, + shared) with the last two fused.

The one repack: DeepSeek-V3's shared expert is an MLP of three nn.Linear (gate_proj [I_s, H],
up_proj [I_s, H], down_proj [H, I_s]). megamoe wants gate and up as one [2I_s, H] matrix, so every
forward concatenates the two weights (torch.cat: one copy of 2*I_s*H elements per layer, differentiable).
The model keeps its own nn.Linear parameters, which are the ones the optimizer updates and
save_pretrained writes; there is no second copy to keep in sync.

Expert parallelism: with `group`, rank r keeps only global experts [r*E_l, (r+1)*E_l) (E_l = E / W):
patching replaces `gate_up_proj`/`down_proj` by new parameters holding that slice (a copy, so the full
tensors can be freed). Build the optimizer after patching, exclude these parameters from data-parallel
gradient averaging (they are not replicas; see examples/train_moe.py), and call unpatch_model (a
collective: it all-gathers the full expert weights) before saving. The router and the shared experts
stay replicated.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import megamoe
from megamoe.config import MoEConfig

__all__ = ["BLOCK_SPECS", "MoEBlockSpec", "is_patched", "patch_model", "unpatch_model"]

_PATCH_ATTR = "_megamoe_patch"


@dataclasses.dataclass(frozen=True)
class MoEBlockSpec:
    """How one transformers family lays out its MoE block (attribute names inside the block).

    router: the routing module; called as `router(x [T, H]) -> (router_logits, topk_weights [T, k],
        topk_ids [T, k])`, never modified.
    experts: the fused experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]); its forward is
        swapped for megamoe.experts.
    shared: an ungated SwiGLU shared expert (gate_proj / up_proj / down_proj nn.Linear) added after the
        routed experts; given, the block's forward is swapped so it runs in the same megamoe.experts
        call. None when there is no shared expert, or when it is gated (kept as the model computes it).
    """

    family: str
    router: str = "gate"
    experts: str = "experts"
    shared: str | None = None


# Block class name -> layout. One entry per family; the code below is shared by all of them.
BLOCK_SPECS: dict[str, MoEBlockSpec] = {
    "Qwen3MoeSparseMoeBlock": MoEBlockSpec("qwen3_moe"),
    # Its shared expert is scaled per token by sigmoid(shared_expert_gate(x)); left to the model.
    "Qwen2MoeSparseMoeBlock": MoEBlockSpec("qwen2_moe"),
    "MixtralSparseMoeBlock": MoEBlockSpec("mixtral"),
    "OlmoeSparseMoeBlock": MoEBlockSpec("olmoe"),
    "DeepseekV3MoE": MoEBlockSpec("deepseek_v3", shared="shared_experts"),
}


@dataclasses.dataclass(frozen=True)
class _Patch:
    spec: MoEBlockSpec
    group: object
    config: MoEConfig | None
    local_slice: tuple[int, int] | None  # (first global expert, number of local experts) when sharded


def _is_silu(act) -> bool:
    probe = torch.linspace(-4.0, 4.0, 17)
    return torch.equal(act(probe), F.silu(probe))


def _check_experts(name: str, experts: nn.Module) -> None:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)) or gate_up.dim() != 3:
        raise ValueError(
            f"{name}: expected fused 3-D parameters gate_up_proj [E, 2I, H] and down_proj [E, H, I], the layout of "
            "transformers >= 5 (older versions keep a ModuleList of per-expert MLPs, which is not supported)"
        )
    num_experts, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    # transformers' experts decorator describes the layout; megamoe supports the plain one only.
    layout = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True}
    for flag, wanted in layout.items():
        if getattr(experts, flag, wanted) != wanted:
            raise ValueError(f"{name}: megamoe needs {flag}={wanted}, the model's experts have {flag}={not wanted}")
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{name}: experts with a post-expert norm are not supported")
    if not _is_silu(experts.act_fn):
        raise ValueError(f"{name}: megamoe computes silu(gate) * up; the experts use {experts.act_fn!r}")


def _check_shared(name: str, shared: nn.Module) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(shared, proj, None)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise ValueError(f"{name}.{proj}: expected an nn.Linear without bias, got {linear!r}")
    if not _is_silu(shared.act_fn):
        raise ValueError(f"{name}: megamoe's shared expert computes silu(gate) * up; it uses {shared.act_fn!r}")


def _routed_experts(experts: nn.Module, x_TH, topk_ids_TK, topk_weights_TK, shared: nn.Module | None):
    patch: _Patch = getattr(experts, _PATCH_ATTR)
    shared_kwargs = {}
    if shared is not None:
        shared_kwargs = {
            # The one repack (module docstring): gate and up rows side by side, recomputed every forward so
            # the model's own nn.Linear weights stay the trained and saved parameters.
            "shared_gate_up": torch.cat([shared.gate_proj.weight, shared.up_proj.weight], dim=0),
            "shared_down": shared.down_proj.weight,
        }
    # Under autocast megamoe.experts casts x and the weights to the autocast dtype, as the model's own
    # F.linear would; the result goes back to the residual stream's dtype, as the model's experts return it.
    # Routers return weights in the model dtype (Qwen, OLMoE) or fp32 (Mixtral, DeepSeek-V3); megamoe
    # combines in fp32 either way.
    return megamoe.experts(
        x_TH, topk_ids_TK, topk_weights_TK.float(), experts.gate_up_proj, experts.down_proj,
        group=patch.group, config=patch.config, **shared_kwargs,
    ).to(x_TH.dtype)


def _experts_forward(experts: nn.Module, hidden_states, top_k_index, top_k_weights):
    """Replaces `<Family>Experts.forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`."""
    return _routed_experts(experts, hidden_states, top_k_index, top_k_weights, shared=None)


def _block_forward_with_shared(block: nn.Module, hidden_states):
    """Replaces the block forward `gate -> experts + shared(x)` of blocks with an ungated shared expert."""
    spec: MoEBlockSpec = getattr(block, _PATCH_ATTR).spec
    shape = hidden_states.shape
    x_TH = hidden_states.reshape(-1, shape[-1])
    _, topk_weights_TK, topk_ids_TK = getattr(block, spec.router)(x_TH)
    out_TH = _routed_experts(
        getattr(block, spec.experts), x_TH, topk_ids_TK, topk_weights_TK, shared=getattr(block, spec.shared)
    )
    return out_TH.reshape(shape)


def _bind(module: nn.Module, function) -> None:
    # An instance attribute shadows the class's forward for this module only; deleting it restores it.
    module.forward = function.__get__(module, type(module))


def _moe_blocks(model: nn.Module):
    return [(name, module, BLOCK_SPECS[type(module).__name__])
            for name, module in model.named_modules() if type(module).__name__ in BLOCK_SPECS]


def _shard(experts: nn.Module, group) -> tuple[int, int]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    num_experts = experts.gate_up_proj.shape[0]
    if num_experts % world != 0:
        raise ValueError(f"expert parallelism needs E divisible by the group size; E={num_experts}, group size={world}")
    num_local = num_experts // world
    first = rank * num_local
    for param_name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, param_name)
        local = full.detach()[first : first + num_local].clone()
        setattr(experts, param_name, nn.Parameter(local, requires_grad=full.requires_grad))
    return first, num_local


def _unshard(experts: nn.Module, group) -> None:
    import torch.distributed as dist

    for param_name in ("gate_up_proj", "down_proj"):
        local = getattr(experts, param_name)
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.detach().contiguous(), group=group)
        setattr(experts, param_name, nn.Parameter(torch.cat(pieces), requires_grad=local.requires_grad))


def patch_model(model: nn.Module, *, group=None, config: MoEConfig | None = None) -> nn.Module:
    """Route every supported MoE block of `model` through megamoe.experts (in place; returns `model`).

    model: a transformers model (any head) of a family in BLOCK_SPECS: Qwen3-MoE, Qwen2-MoE, Mixtral,
        OLMoE, DeepSeek-V3. Routers are kept exactly; routed experts (and DeepSeek-V3's shared experts)
        run in megamoe.experts on the model's own parameters (see the module docstring for the layout
        of each family, and the one repack of DeepSeek-V3's shared expert).
    group: expert-parallel process group, or None. Given, each rank keeps only its slice of every
        experts module's parameters (rank r: global experts [r*E_l, (r+1)*E_l)); build the optimizer
        after patching.
    config: the megamoe.MoEConfig passed to every megamoe.experts call (None: the default).
    Raises ValueError if the model has no supported block, is already patched, or a block's experts do
    not have megamoe's layout (bias, transposed or interleaved weights, an activation other than silu).
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError(
            f"no supported MoE block in {type(model).__name__}; supported block classes: {sorted(BLOCK_SPECS)}"
        )
    if is_patched(model):
        raise ValueError(f"{type(model).__name__} is already patched by megamoe; call unpatch_model first")
    # Check every block before changing any, so a failure leaves the model untouched.
    for name, block, spec in blocks:
        _check_experts(f"{name}.{spec.experts} ({spec.family})", getattr(block, spec.experts))
        if spec.shared is not None:
            _check_shared(f"{name}.{spec.shared} ({spec.family})", getattr(block, spec.shared))
    for _, block, spec in blocks:
        experts = getattr(block, spec.experts)
        local_slice = _shard(experts, group) if group is not None else None
        patch = _Patch(spec=spec, group=group, config=config, local_slice=local_slice)
        setattr(experts, _PATCH_ATTR, patch)
        _bind(experts, _experts_forward)
        if spec.shared is not None:
            setattr(block, _PATCH_ATTR, patch)
            _bind(block, _block_forward_with_shared)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo patch_model (in place; returns `model`): the original forwards, and with expert parallelism
    the full expert weights (a collective over the group: every rank must call it). Afterwards
    save_pretrained writes a checkpoint that plain transformers loads."""
    for _, block, spec in _moe_blocks(model):
        experts = getattr(block, spec.experts)
        patch: _Patch | None = getattr(experts, _PATCH_ATTR, None)
        if patch is None:
            continue
        if patch.local_slice is not None:
            _unshard(experts, patch.group)
        del experts.forward
        delattr(experts, _PATCH_ATTR)
        if hasattr(block, _PATCH_ATTR):
            del block.forward
            delattr(block, _PATCH_ATTR)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any MoE block of `model` currently runs through megamoe."""
    return any(hasattr(getattr(block, spec.experts), _PATCH_ATTR) for _, block, spec in _moe_blocks(model))
