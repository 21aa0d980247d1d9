"""Run Hugging Face transformers MoE models' routed experts through megamoe.experts, keeping each model's
own router, shared experts, parameters and checkpoint format.

Two ways in, one adapter underneath (`check_experts` decides whether a module's math is megamoe's, one
function calls megamoe.experts on the module's own parameters):

1. transformers' experts interface (transformers >= 5). Importing this module registers
   `experts_implementation="megamoe"` in `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`, beside
   "eager", "grouped_mm" and "batched_mm" (and in the interface of transformers' FP8-quantized experts, which
   megamoe refuses); `register()` does it explicitly (idempotent):

       import megamoe.integrations.hf                  # or: from megamoe.integrations import hf; hf.register()
       model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="megamoe")
       model = AutoModelForCausalLM.from_config(cfg, experts_implementation="megamoe")
       model.set_experts_implementation("megamoe")      # switch a loaded model ("grouped_mm"/"eager" switch back)
       ...train...; model.save_pretrained(path)         # nothing to undo: a plain transformers checkpoint

   Every family whose experts class carries transformers' `@use_experts_implementation` goes through it:
   transformers calls the registered function as `fn(experts, hidden_states [T, H], top_k_index [T, k],
   top_k_weights [T, k])` in place of the experts module's forward, and only there, so the router, any
   shared expert (DeepSeek-V3, Qwen2-MoE, GLM-4-MoE, ...), auxiliary losses and everything else stay the
   model's own code. The function runs megamoe.experts on the module's parameters as they are (no copy).
   transformers gives no hook when an implementation is *set* (it checks only that the name is registered),
   so each experts module is validated on its first forward through megamoe; `check_model(model)` does
   the same for a whole model up front. The check of the standard layout is attribute lookups only, so
   torch.compile(fullgraph=True) traces a first call; a custom activation or gate function is checked on a
   probe tensor, which fullgraph cannot trace: call check_model before compiling such a model.

2. `patch_model(model, group=...)` for the five families of BLOCK_SPECS (below): the same adapter, bound
   as the experts' forward, plus megamoe's own expert parallelism (each rank keeps its slice of the expert
   weights) and DeepSeek-V3's shared expert fused into the same megamoe.experts call.

What megamoe computes, and what it refuses. megamoe.experts computes, per token and selected expert e,
down_e(silu(gate_e x) * up_e x) with gate_up_proj [E, 2I, H] (gate rows first, then up rows) and
down_proj [E, H, I]: transformers 5's default experts layout, read in place. An experts module whose
decorator flags or functions say otherwise raises `UnsupportedExpertsError` (a ValueError and a
NotImplementedError) naming the experts class, its model_type and every such feature; a different
result is never returned (benchmarks/hf_families_table.py lists every family of the installed transformers,
tests/test_hf_families.py checks each against "eager"):

    flag / function                     refused because
    has_bias=True                       megamoe's projections have no bias
    has_gate=False                      ungated experts (up_proj -> act -> down_proj)
    is_concatenated=False               gate/up rows interleaved, not [gate; up]
    is_transposed=True                  weights [E, H, 2I] / [E, I, H]; a transposed view would be made
                                        contiguous (copied, and its gradient copied back) on every forward:
                                        refused rather than silently paying a full weight copy per step
    has_post_expert_norm=True           a norm after each expert's output
    _apply_gate not silu(gate) * up     a custom gate (gpt-oss's clamped SwiGLU, swiglu_limit clamps,
                                        softcaps): checked on a probe with large magnitudes
    act_fn not SiLU                     e.g. hidden_act="gelu_pytorch_tanh" (Gemma 4)
    float8 / int8 weights               quantized experts (transformers' FP8Experts, e.g. of an FP8
                                        checkpoint): megamoe computes with float weights, without scales
    DTensor parameters                  outside transformers' parallel styles, which hand the experts
                                        their local shards, and FSDP2's fully_shard, which hands them
                                        the unsharded tensors

transformers' own parallelism (DistributedConfig; tests/test_hf_ep.py, 2 gloo ranks):
- experts_implementation="megamoe" runs under its expert-parallel styles "all_to_all" and "all_reduce"
  (the experts get local expert ids, with a sentinel id for routes to other ranks, weight 0: those run on
  expert 0 with weight 0, no contribution and no gradient, as transformers' batched_mm does) and under its
  tensor-parallel experts (each rank's gate/up and down shards; transformers sums the partial outputs);
- ep_implementation="megamoe", registered in transformers.distributed.expert_parallel's
  EPImplementationInterface where it exists: each rank's tokens, with global expert ids, go to one
  megamoe.experts call over the EP group, which exchanges them itself (tp_size=1, same number of tokens
  on every rank).

patch_model: how transformers (v5) lays out the five families of BLOCK_SPECS, and what patching does:

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

The router (`block.gate`) is never touched: its forward, its parameters and buffers (DeepSeek-V3's
sigmoid scores, `e_score_correction_bias`, grouped top-k and `routed_scaling_factor`; the softmax top-k,
`norm_topk_prob` of the others) and its output `router_logits`, which transformers records with a hook on
the router module for the auxiliary load-balancing loss, all stay exactly as the model defines them.
DeepSeek-V3's block forward is swapped to hand the shared expert to the same megamoe.experts call; that
forward is the block's own three lines (router on the flattened tokens, experts, + shared) with the last
two fused. The one repack: DeepSeek-V3's shared expert is an MLP of three nn.Linear (gate_proj [I_s, H],
up_proj [I_s, H], down_proj [H, I_s]); megamoe wants gate and up as one [2I_s, H] matrix, so every forward
concatenates the two weights (torch.cat: one copy of 2*I_s*H elements per layer, differentiable). The
model keeps its own nn.Linear parameters, the ones the optimizer updates and save_pretrained writes.

Expert parallelism with patch_model(group=...): rank r keeps only global experts [r*E_l, (r+1)*E_l)
(E_l = E / W): patching replaces `gate_up_proj`/`down_proj` by new parameters holding that slice (a copy,
so the full tensors can be freed). Build the optimizer after patching and exclude these parameters from
data-parallel gradient averaging (they are not replicas; see examples/train_moe.py). The router and the
shared experts stay replicated. Saving:
- model.state_dict() holds each experts weight as a DTensor of all E experts, sharded over the group
  (megamoe.expert_state), so torch.distributed.checkpoint saves every rank's experts and loads them back,
  also into another group size;
- model.save_pretrained(path) writes the checkpoint that the same model in one process writes, loadable by
  plain transformers. Call it on every rank: it is a collective (it all-gathers the expert weights, so each
  rank holds them whole for the call, and called on rank 0 alone it waits for the others); transformers writes
  on global rank 0. safetensors takes no DTensors, so patch_model binds a save_pretrained that gathers them
  first (as transformers gathers its own tensor-parallel DTensors); a state_dict passed to it must hold the
  experts as model.state_dict() gives them, or whole (ValueError otherwise, before anything is written);
- unpatch_model (a collective) gathers the experts back into the model for good, e.g. to go on in one process.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import megamoe
from megamoe.config import MoEConfig, check_group
from megamoe.expert_state import expert_state_names, load_expert_shards, shard_expert_state
from megamoe.schedule import FLOAT_DTYPES
from megamoe.integrations._patch_attr import PATCH_ATTR as _PATCH_ATTR  # read by megamoe.parallel too
from megamoe.parallel import _check_module

__all__ = [
    "BLOCK_SPECS",
    "EXPERTS_IMPLEMENTATION",
    "MoEBlockSpec",
    "UnsupportedExpertsError",
    "check_experts",
    "check_model",
    "experts_modules",
    "is_patched",
    "is_registered",
    "megamoe_experts_forward",
    "patch_model",
    "register",
    "unpatch_model",
    "unsupported_reason",
    "unsupported_reasons",
]

EXPERTS_IMPLEMENTATION = "megamoe"  # the name registered in transformers' experts interface
_CHECKED_ATTR = "_megamoe_checked"  # set on an experts module once check_experts accepted it
_interface_config: MoEConfig | None = None  # the MoEConfig of calls through transformers' interface


class UnsupportedExpertsError(ValueError, NotImplementedError):
    """An experts module whose math megamoe.experts does not compute (refused, never approximated)."""


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


# Block class name -> layout, for patch_model. One entry per family; the code below is shared by all of them.
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

    def __deepcopy__(self, memo):
        # Immutable, and its process group can be neither copied nor pickled: a copied model shares the record.
        return self


# --------------------------------------------------------------------------------------------- validation

# Probe values for activations and gate functions: small, medium and large magnitudes of both signs, so
# clamps (gpt-oss's limit 7, swiglu_limit), softcaps and scaled sigmoids all show.
_PROBE_VALUES = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 4.5, 6.0, 7.5, 9.0, 12.0, 20.0, 50.0, 200.0, 1000.0)


def _probe(device) -> torch.Tensor:
    values = torch.tensor(_PROBE_VALUES, dtype=torch.float32)
    values = torch.cat([values, -values[1:]])
    return values.to("cpu" if torch.device(device).type == "meta" else device)


def _silu_types() -> tuple[type, ...]:
    types: tuple[type, ...] = (nn.SiLU,)
    try:
        from transformers.activations import SiLUActivation

        types += (SiLUActivation,)
    except ImportError:
        pass
    return types


def _is_silu(act, device="cpu") -> bool:
    """act computes silu: F.silu itself, an exact nn.SiLU / transformers SiLUActivation (no subclass, which
    could override forward), or anything equal to F.silu on the probe values."""
    if act is F.silu or type(act) in _silu_types():
        return True
    if not callable(act):
        return False
    x = _probe(device)
    try:
        with torch.no_grad():
            return torch.equal(act(x), F.silu(x))
    except Exception:  # a probe it cannot take (device, dtype): not provably silu
        return False


def _default_apply_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate as default
    except ImportError:
        return None
    return default


def _has_default_gate(experts: nn.Module) -> bool:
    """No _apply_gate (not a transformers-decorated module), or transformers' default act_fn(gate) * up.
    Plain attribute lookups (no tensor work), so torch.compile traces it on a first call."""
    override = vars(experts).get("_apply_gate")
    if override is not None:
        function = getattr(override, "__func__", override)
    else:
        function = getattr(type(experts), "_apply_gate", None)
    if function is None:
        return True
    default = _default_apply_gate()
    return default is not None and function is default


def _is_silu_gate(experts: nn.Module, device) -> bool:
    """A custom experts._apply_gate(gate_up [S, 2I]) computes silu(gate) * up (gate = the first I columns)
    on the probe values, e.g. one that computes it in fp32."""
    gate = _probe(device)
    up = torch.flip(gate, dims=[0]) + 0.5
    gate, up = gate.repeat(2).unsqueeze(0), up.repeat(2).unsqueeze(0)  # [1, I] each, I = 2 * len(probe)
    try:
        with torch.no_grad():
            out = experts._apply_gate(torch.cat([gate, up], dim=-1))
            return out.shape == gate.shape and torch.allclose(out.float(), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    except Exception:  # a probe it cannot take: not provably silu(gate) * up
        return False


def _activation_setting(experts: nn.Module) -> str:
    config = getattr(experts, "config", None)
    for key in ("hidden_act", "hidden_activation", "mlp_hidden_act"):
        value = getattr(config, key, None)
        if isinstance(value, str):
            return f" (config.{key}={value!r})"
    return ""


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def unsupported_reasons(experts: nn.Module, *, allow_dtensor: bool = False) -> list[str]:
    """Every reason megamoe.experts cannot compute this experts module's forward (empty: it can), each
    "<feature>: <why>" (see the module docstring). Reads flags and shapes; may run the module's activation
    or custom gate function on a 29-value probe. allow_dtensor: accept DTensor weights (transformers'
    parallel styles hand the forward its local shards)."""
    if not isinstance(experts, nn.Module):
        raise TypeError(f"experts must be a torch.nn.Module (an experts module of a transformers model), "
                        f"got {type(experts).__name__}")
    reasons = []
    if getattr(experts, "has_post_expert_norm", False):
        reasons.append("a norm after each expert (has_post_expert_norm=True) is not supported: megamoe's experts end "
                       "at down_proj")
    if getattr(experts, "has_bias", False):
        reasons.append("biased projections (has_bias=True) are not supported: megamoe's projections have no bias")
    if not getattr(experts, "has_gate", True):
        reasons.append("ungated experts (has_gate=False, up_proj -> act -> down_proj) are not supported: megamoe "
                       "computes silu(gate) * up")
    if not getattr(experts, "is_concatenated", True):
        reasons.append("interleaved gate/up rows (is_concatenated=False) are not supported: megamoe needs "
                       "gate_up_proj [E, 2I, H] with all gate rows first, then all up rows")
    if getattr(experts, "is_transposed", False):
        reasons.append(
            "transposed weights (is_transposed=True, gate_up_proj [E, H, 2I] and down_proj [E, I, H]) are not "
            "supported: megamoe reads [E, 2I, H] and [E, H, I] in place, and a transposed view would be copied "
            "(and its gradient copied back) on every forward"
        )
    if reasons:
        layout_ok = False
    else:
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        layout_ok = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
        if not layout_ok:
            reasons.append(
                "no fused 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]: that is the layout of transformers "
                ">= 5 (older versions keep a ModuleList of per-expert MLPs, which is not supported)"
            )
        elif not allow_dtensor and (_is_dtensor(gate_up) or _is_dtensor(down)):
            reasons.append("DTensor expert weights are not supported: call it where transformers' parallel styles "
                           "hand the experts their local shards")
        elif (gate_up.dtype not in FLOAT_DTYPES or down.dtype not in FLOAT_DTYPES
              or any(hasattr(experts, f"{weight}_scale_inv") for weight in _EXPERT_WEIGHTS)):
            reasons.append(f"quantized expert weights (gate_up_proj {gate_up.dtype}, down_proj {down.dtype}, or with "
                           "*_scale_inv scales) are not supported: megamoe computes with float16, bfloat16, float32 or "
                           "float64 weights and no scales (dequantize them, e.g. FineGrainedFP8Config(dequantize=True))")
        elif gate_up.shape[1] % 2 or tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
            reasons.append(f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                           "[E, 2I, H] and [E, H, I]: shapes")
    gate_up = getattr(experts, "gate_up_proj", None)
    # The gate function matters only for gated experts, and has nothing to say about a module without gate_up_proj
    # (e.g. a ModuleList of per-expert MLPs, each with an activation of its own).
    if getattr(experts, "has_gate", True) and isinstance(gate_up, torch.Tensor):
        device = gate_up.device
        if _has_default_gate(experts):  # act_fn(gate) * up, or (not a transformers-decorated module) its own act_fn
            act = getattr(experts, "act_fn", None)
            if not _is_silu(act, device):
                reasons.append(f"activation {act!r}{_activation_setting(experts)} is not silu: megamoe computes "
                               "silu(gate) * up")
        elif not _is_silu_gate(experts, device):
            reasons.append(f"custom gate function {type(experts).__name__}._apply_gate is not silu(gate) * up: e.g. a "
                           "clamped, scaled or softcapped SwiGLU (checked on a probe up to |x| = 1000)")
    return reasons


def unsupported_reason(experts: nn.Module, *, allow_dtensor: bool = False) -> str | None:
    """unsupported_reasons joined with "; ", or None if megamoe.experts can compute this experts module."""
    return "; ".join(unsupported_reasons(experts, allow_dtensor=allow_dtensor)) or None


@functools.cache
def _decorated_forward_code():
    """The code object of the forward that @use_experts_implementation installs (probed on a dummy class)."""
    from transformers.integrations.moe import use_experts_implementation

    class _Probe(nn.Module):
        def __init__(self, config):
            super().__init__()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    return use_experts_implementation(_Probe).forward.__code__


def is_experts_class(cls) -> bool:
    """Whether cls is a class whose own forward is the one @use_experts_implementation installs."""
    forward = inspect.isclass(cls) and cls.__dict__.get("forward")
    return bool(forward) and getattr(forward, "__code__", None) is _decorated_forward_code()


def _describe(experts: nn.Module) -> str:
    """The module's class; the decorated class it subclasses, where that is another (e.g. a subclass whose
    forward wraps the dispatched one in a per-route norm); the model_type."""
    cls = type(experts)
    try:
        dispatched = next((base for base in cls.__mro__ if is_experts_class(base)), cls)
    except ImportError:  # no transformers: nothing was decorated
        dispatched = cls
    notes = [f"subclass of {dispatched.__name__}"] if dispatched is not cls else []
    model_type = getattr(getattr(experts, "config", None), "model_type", None)
    notes += [f"model_type={model_type!r}"] if model_type else []
    return cls.__name__ + (f" ({', '.join(notes)})" if notes else "")


def check_experts(experts: nn.Module, name: str | None = None, *, allow_dtensor: bool = False) -> None:
    """Raise UnsupportedExpertsError (a ValueError and NotImplementedError) naming the model family and
    the feature if megamoe.experts cannot compute this experts module; return None if it can."""
    reason = unsupported_reason(experts, allow_dtensor=allow_dtensor)
    if reason is not None:
        where = f"{name}: " if name else ""
        raise UnsupportedExpertsError(
            f"{where}megamoe cannot run {_describe(experts)}: {reason}. Use experts_implementation='grouped_mm' "
            "or 'eager' for this model."
        )


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module under `model` that transformers' experts interface
    dispatches (the modules `@use_experts_implementation` decorated)."""
    _check_module("model", model)
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def check_model(model: nn.Module) -> nn.Module:
    """Validate every experts module of `model` for experts_implementation="megamoe" now rather than at
    its first forward (e.g. before torch.compile(fullgraph=True)); returns `model`. Raises
    UnsupportedExpertsError on the first module megamoe cannot run, ValueError if there is none (TypeError if
    model is not an nn.Module)."""
    found = experts_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no experts module of transformers' experts interface "
            "(@use_experts_implementation)"
        )
    under_fsdp2 = _under_fsdp2(model)
    for name, experts in found:
        # FSDP2 (fully_shard) keeps the weights as sharded DTensors between forwards and hands the forward
        # plain unsharded tensors, transformers' parallel styles hand it the local shards: what the first
        # forward's own check sees.
        local_in_forward = id(experts) in under_fsdp2 or _distributed_by_transformers(experts)
        check_experts(experts, name, allow_dtensor=local_in_forward)
        setattr(experts, _CHECKED_ATTR, True)
    return model


def _distributed_by_transformers(experts: nn.Module) -> bool:
    """Whether transformers' DistributedConfig put a tensor- or expert-parallel style on `experts` ("moe_tp_experts",
    "ep_dispatch_experts"): it marks the module `_is_hooked` and sets a forward on the instance that runs the
    experts on the local shards of their DTensor weights."""
    return getattr(experts, "_is_hooked", False) and "forward" in vars(experts)


def _under_fsdp2(model: nn.Module) -> set[int]:
    """id() of every module of `model` inside a module that fully_shard wrapped (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return set()
    return {id(m) for wrapped in model.modules() if isinstance(wrapped, FSDPModule) for m in wrapped.modules()}


def _shared_problem(name: str, shared: nn.Module) -> str | None:
    """Why megamoe cannot fuse this shared expert (None: it can): three bias-free nn.Linear and silu."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(shared, proj, None)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            return f"{name}.{proj}: expected an nn.Linear without bias, got {linear!r}"
    act = getattr(shared, "act_fn", None)
    if not _is_silu(act):
        return f"{name}: megamoe's shared expert computes silu(gate) * up; it uses {act!r}"
    return None


def _check_shared(name: str, shared: nn.Module) -> None:
    problem = _shared_problem(name, shared)
    if problem is not None:
        raise ValueError(problem)


# --------------------------------------------------------------------------------------------- the adapter


def _run_experts(experts: nn.Module, x_TH, topk_ids_TK, topk_weights_TK, *, group, config,
                 shared: nn.Module | None = None, sentinels: bool = False):
    """megamoe.experts on the experts module's own parameters (and optionally an ungated shared expert).

    sentinels: topk_ids are local expert ids from transformers' expert parallelism, where an id outside
    [0, E_local) marks a route to another rank (its weight already 0): run on expert 0 with weight 0."""
    shape = x_TH.shape
    if x_TH.dim() != 2:  # transformers flattens tokens before its experts; accept [..., H] all the same
        x_TH, topk_ids_TK = x_TH.reshape(-1, shape[-1]), topk_ids_TK.reshape(-1, topk_ids_TK.shape[-1])
        topk_weights_TK = topk_weights_TK.reshape(topk_ids_TK.shape)
    if sentinels:
        off_rank = (topk_ids_TK < 0) | (topk_ids_TK >= experts.gate_up_proj.shape[0])
        topk_ids_TK = topk_ids_TK.masked_fill(off_rank, 0)
        topk_weights_TK = topk_weights_TK.masked_fill(off_rank, 0.0)
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
    # combines in fp32 either way, except for a float64 model, where float64 weights stay float64 (megamoe
    # accumulates float64 in float64; rounding them to fp32 would cost the model its precision).
    if not (topk_weights_TK.dtype == torch.float64 and x_TH.dtype == torch.float64):
        topk_weights_TK = topk_weights_TK.float()
    out_TH = megamoe.experts(
        x_TH, topk_ids_TK, topk_weights_TK, experts.gate_up_proj, experts.down_proj,
        group=group, config=config, **shared_kwargs,
    ).to(x_TH.dtype)
    # No view of the result when nothing was reshaped (FSDP2 warns about modules returning views).
    return out_TH if out_TH.shape == shape else out_TH.reshape(shape)


def megamoe_experts_forward(self: nn.Module, hidden_states, top_k_index, top_k_weights):
    """The function registered as experts_implementation="megamoe": transformers calls it in place of an
    experts module's forward, `fn(experts, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]`, the sum over the k selected experts of weight * expert(x). The first call on a module
    validates it (check_experts) and raises UnsupportedExpertsError if megamoe cannot compute it. A module
    patched by patch_model uses its patch's group and config; otherwise the config given to register()."""
    if not getattr(self, _CHECKED_ATTR, False):
        check_experts(self)
        setattr(self, _CHECKED_ATTR, True)
    patch: _Patch | None = getattr(self, _PATCH_ATTR, None)
    if patch is not None:
        return _run_experts(self, hidden_states, top_k_index, top_k_weights, group=patch.group, config=patch.config)
    # transformers' own expert parallelism (ep_implementation "all_to_all" / "all_reduce") hands over local
    # ids with sentinels for other ranks' experts; it marks the modules whose experts it split.
    return _run_experts(self, hidden_states, top_k_index, top_k_weights, group=None, config=_interface_config,
                        sentinels=getattr(self, "_is_expert_parallel", False))


# --------------------------------------------------------------------------------------------- registration


def register(config: MoEConfig | None = None) -> None:
    """Register experts_implementation="megamoe" in transformers' experts interface (idempotent; importing
    this module already did, with config=None), so that from_pretrained / from_config(...,
    experts_implementation="megamoe") and model.set_experts_implementation("megamoe") accept it.

    config: the megamoe.MoEConfig of every call through the interface (None: megamoe's default,
        backend "auto"); each call of register() sets it. Raises ImportError without transformers >= 5.
    """
    global _interface_config
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:
        raise ImportError(
            "experts_implementation='megamoe' needs transformers >= 5 "
            "(transformers.integrations.moe.ExpertsInterface), as does patch_model (the fused 3-D expert weights it runs "
            "are transformers 5's layout)"
        ) from error
    _interface_config = config
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, megamoe_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # a transformers without FP8-quantized experts
        pass
    else:  # FP8-quantized experts dispatch through an interface of their own: there megamoe refuses them by name
        FP8ExpertsInterface.register(EXPERTS_IMPLEMENTATION, megamoe_experts_forward)
    _register_ep_implementation()


_ep_implementation_class = None


def _register_ep_implementation() -> None:
    """ep_implementation="megamoe" in transformers' EPImplementationInterface, where this version has one."""
    global _ep_implementation_class
    try:
        from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
    except ImportError:  # transformers without its native expert parallelism (or torch without distributed)
        return
    if _ep_implementation_class is None:

        class MegaMoEEP(EPImplementation):
            """ep_implementation="megamoe" (DistributedConfig(ep_size=N, ep_implementation="megamoe")): each rank
            hands its own tokens, with *global* expert ids, to one megamoe.experts call over the EP group, which
            exchanges them, runs this rank's experts (the module's local expert weights, in place) and brings
            the results back (on Hopper GPUs of one host: the fused Triton path, the exchange inside its
            kernels; elsewhere the portable path with torch.distributed). Needs ranks holding different batches
            (tp_size == 1) of the same number of tokens on every rank of the EP group, as megamoe.experts does
            with a group; the experts are validated like experts_implementation="megamoe"'s, whatever
            experts_implementation says."""

            def __init__(self, experts, ep_mesh, tp_mesh):
                super().__init__(experts, ep_mesh, tp_mesh)
                if self.shares_batch or tp_mesh.size() > 1:
                    raise ValueError(
                        'ep_implementation="megamoe" needs every rank of the expert-parallel group to hold its own '
                        "batch (tp_size=1); with tensor parallelism use ep_implementation='all_to_all' or "
                        "'all_reduce' with experts_implementation='megamoe'"
                    )
                check_experts(experts, allow_dtensor=True)  # its weights are DTensors until the forward
                self.experts = experts
                self.group = ep_mesh.get_group()

            def __call__(self, hidden_states, top_k_index, top_k_weights):
                # Runs inside transformers' local-parameters context: gate_up_proj / down_proj are this rank's
                # [E_local, 2I, H] / [E_local, H, I] shards (rank r: global experts [r*E_local, (r+1)*E_local)).
                return _run_experts(self.experts, hidden_states, top_k_index, top_k_weights, group=self.group,
                                    config=_interface_config)

        _ep_implementation_class = MegaMoEEP
    EPImplementationInterface.register(EXPERTS_IMPLEMENTATION, _ep_implementation_class)


def is_registered() -> bool:
    """Whether transformers' experts interface maps "megamoe" to this module's function."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return ALL_EXPERTS_FUNCTIONS.get(EXPERTS_IMPLEMENTATION) is megamoe_experts_forward


# --------------------------------------------------------------------------------------------- patch_model


def _has_hooks(module: nn.Module) -> bool:
    """Whether a forward or backward hook (full or legacy, pre or post) is registered on module: each fires only
    when the module is called."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _is_bound(module: nn.Module, function) -> bool:
    """Whether module's instance forward is `function` as _bind bound it (not replaced on the instance since)."""
    forward = vars(module).get("forward")
    return isinstance(forward, functools.partial) and forward.func is function


def _instance_forward(module: nn.Module) -> str:
    """The name of the function set as module.forward on the instance (accelerate's hooks set a partial of theirs)."""
    function = getattr(vars(module)["forward"], "func", vars(module)["forward"])
    return getattr(function, "__qualname__", type(function).__name__)


def _can_fuse(block: nn.Module, patch: _Patch) -> bool:
    """Whether the fused forward computes what the block's own forward would: the experts module is still the
    one patched (not replaced or wrapped, e.g. by PEFT's ParamWrapper), the shared expert is still three plain
    nn.Linear and silu (not LoRA layers or other subclasses, whose forward the fused path would skip), and no
    forward or backward hook waits on any of them or on the activation module, nor a forward set on the instance
    (accelerate's hooks replace module.forward): the fused path calls none of these modules. Attribute lookups only."""
    experts, shared = getattr(block, patch.spec.experts), getattr(block, patch.spec.shared)
    if getattr(experts, _PATCH_ATTR, None) is not patch or _shared_problem("", shared) is not None:
        return False
    projections = [getattr(shared, proj) for proj in ("gate_proj", "up_proj", "down_proj")]
    if any(type(linear) is not nn.Linear for linear in projections):
        return False
    skipped = [shared, *projections] + ([shared.act_fn] if isinstance(shared.act_fn, nn.Module) else [])
    if not _is_bound(experts, megamoe_experts_forward) or any("forward" in vars(m) for m in skipped):
        return False
    return not any(_has_hooks(module) for module in (experts, *skipped))


def _block_forward_with_shared(block: nn.Module, hidden_states):
    """Replaces the block forward `gate -> experts + shared(x)` of blocks with an ungated shared expert."""
    patch: _Patch = getattr(block, _PATCH_ATTR)
    if not _can_fuse(block, patch):
        # Something was wrapped around or hooked onto the experts or the shared expert after patching: the
        # block's own forward (transformers' class), which calls both modules; the experts still run through
        # megamoe when they are the patched module (or wrap it).
        return type(block).forward(block, hidden_states)
    spec = patch.spec
    shape = hidden_states.shape
    x_TH = hidden_states.reshape(-1, shape[-1])
    _, topk_weights_TK, topk_ids_TK = getattr(block, spec.router)(x_TH)
    out_TH = _run_experts(
        getattr(block, spec.experts), x_TH, topk_ids_TK, topk_weights_TK, group=patch.group, config=patch.config,
        shared=getattr(block, spec.shared),
    )
    return out_TH.reshape(shape)


def _bind(module: nn.Module, method: str, function) -> None:
    # An instance attribute shadows the class's method (forward, save_pretrained) for this module only; deleting
    # it restores it. A functools.partial of a module-level function, not a bound method: pickle (torch.save(model))
    # saves a bound method as getattr(module, function name), which fails on load; a partial pickles the function
    # by reference and the module with the rest of the model (copy.deepcopy binds it to the copy likewise).
    setattr(module, method, functools.partial(function, module))


def _moe_blocks(model: nn.Module):
    _check_module("model", model)
    return [(name, module, BLOCK_SPECS[type(module).__name__])
            for name, module in model.named_modules() if type(module).__name__ in BLOCK_SPECS]


def _shard(experts: nn.Module, group) -> tuple[int, int]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    num_local = experts.gate_up_proj.shape[0] // world  # divisible: patch_model checked
    first = rank * num_local
    for param_name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, param_name)
        local = full.detach()[first : first + num_local].clone()
        setattr(experts, param_name, nn.Parameter(local, requires_grad=full.requires_grad))
    return first, num_local


_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_STATE_HOOKS_ATTR = "_megamoe_state_hooks"  # set on an experts module once the two hooks below are registered


def _sharded(experts: nn.Module) -> _Patch | None:
    patch = getattr(experts, _PATCH_ATTR, None)
    return patch if patch is not None and patch.local_slice is not None else None


def _save_sharded_experts(experts: nn.Module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of an experts module patched with a group (a no-op once unpatched): its weights as
    DTensor shards of the global experts (megamoe.expert_state), as MoELayer(group=...) gives them."""
    patch = _sharded(experts)
    if patch is not None:
        names = expert_state_names(experts, _EXPERT_WEIGHTS, patch.local_slice[1])
        shard_expert_state(state_dict, prefix, names, patch.group)


def _load_sharded_experts(experts: nn.Module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: the inverse of _save_sharded_experts (also takes all experts, or the local ones)."""
    patch = _sharded(experts)
    if patch is not None:
        names = expert_state_names(experts, _EXPERT_WEIGHTS, patch.local_slice[1])
        load_expert_shards(state_dict, prefix, names, patch.group, patch.local_slice[1])


def _full_expert_state(model: nn.Module, state_dict: dict) -> dict:
    """A copy of state_dict (model's own, or one handed to save_pretrained) in which the expert weights of every
    experts module patched with a group (parametrized after patching: their originals of one entry per local
    expert, as the state_dict hook shards them) are whole, [E, ...]: a DTensor (what model.state_dict() holds)
    gathered with full_tensor(), a collective over the module's group; a plain tensor of that shape kept as it is.
    The other entries are the same objects. Raises ValueError, before any collective, naming the first expert entry
    of another shape (e.g. this rank's slice, from state_dict(keep_vars=True))."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    keys = []
    for name, experts in model.named_modules():
        patch = _sharded(experts)
        if patch is None:
            continue
        world = dist.get_world_size(patch.group)
        for weight in expert_state_names(experts, _EXPERT_WEIGHTS, patch.local_slice[1]):
            key = f"{name}.{weight}"
            value = state_dict.get(key)
            if value is None:
                continue
            local_shape = tuple(experts.get_parameter(weight).shape)
            full_shape = (local_shape[0] * world, *local_shape[1:])
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != full_shape:
                given = type(value).__name__
                if isinstance(value, torch.Tensor):
                    given += f" of shape {tuple(value.shape)}"
                raise ValueError(
                    f"save_pretrained: state_dict[{key!r}] must hold all {full_shape[0]} experts, shape {full_shape} "
                    f"(a DTensor, as model.state_dict() gives it, or a plain tensor); got a {given}. This rank holds "
                    f"experts {patch.local_slice[0]}..{patch.local_slice[0] + patch.local_slice[1] - 1} only "
                    f"({local_shape}, what state_dict(keep_vars=True) gives): pass model.state_dict() or no state_dict"
                )
            keys.append(key)
    full = dict(state_dict)
    for key in keys:
        if isinstance(full[key], DTensor):
            full[key] = full[key].full_tensor()
    return full


def _save_pretrained_full(model: nn.Module, save_directory, is_main_process: bool = True, state_dict=None, *args,
                          **kwargs):
    """save_pretrained of a model patched with a group (patch_model binds it in place of transformers' method):
    transformers' own save_pretrained, given a state dict in which every experts weight is whole, [E, ...], so it
    writes the checkpoint a one-process model of the same weights writes (safetensors takes no DTensors, and
    transformers gathers only the DTensors of its own DistributedConfig). A collective over the expert-parallel
    group: every rank calls it, as with transformers' tensor parallelism; transformers writes on global rank 0
    when is_main_process. state_dict: None (model.state_dict()) or a state dict whose expert entries are
    DTensors or full tensors (ValueError otherwise, before anything is written)."""
    state_dict = _full_expert_state(model, model.state_dict() if state_dict is None else state_dict)
    return type(model).save_pretrained(model, save_directory, is_main_process, state_dict, *args, **kwargs)


def _unshard(experts: nn.Module, patch: _Patch) -> None:
    """Every rank's experts gathered into the parameters holding this rank's: the expert weights or, parametrized
    after patching, their originals of one entry per local expert (those the state dict shards)."""
    import torch.distributed as dist

    for name in expert_state_names(experts, _EXPERT_WEIGHTS, patch.local_slice[1]):
        owner, _, param_name = name.rpartition(".")  # parametrized: the parametrization's module holds the original
        module = experts.get_submodule(owner)
        local = getattr(module, param_name)
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(patch.group))]
        dist.all_gather(pieces, local.detach().contiguous(), group=patch.group)
        setattr(module, param_name, nn.Parameter(torch.cat(pieces), requires_grad=local.requires_grad))


def _check_patch_group(group) -> int:
    """The size of patch_model's expert-parallel group (1 without one); raises if it is not a process group
    of which this rank is a member (a non-member would keep an empty slice of every experts module)."""
    if group is None:
        return 1
    import torch.distributed as dist

    # dist.new_group hands ranks outside the new group GroupMember.NON_GROUP_MEMBER (an int in torch 2.x).
    not_member = dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER
    if not not_member:
        check_group("group", group)
        not_member = dist.get_rank(group) < 0
    if not_member:
        raise ValueError(
            f"group must be an expert-parallel process group that this rank (global rank {dist.get_rank()}) "
            f"belongs to, or None; got {group!r}, which does not include it (dist.new_group returns such a value "
            "to the ranks it leaves out: call patch_model on the group's members only)"
        )
    return dist.get_world_size(group)


def patch_model(model: nn.Module, *, group=None, config: MoEConfig | None = None) -> nn.Module:
    """Route every supported MoE block of `model` through megamoe.experts (in place; returns `model`).

    Without `group`, `experts_implementation="megamoe"` (module docstring) does the same for every
    family of transformers' experts interface and needs no unpatching; patch_model adds megamoe's own
    expert parallelism and DeepSeek-V3's fused shared expert, for the families of BLOCK_SPECS.

    model: a transformers model (any head) of a family in BLOCK_SPECS: Qwen3-MoE, Qwen2-MoE, Mixtral,
        OLMoE, DeepSeek-V3. Routers are kept exactly; routed experts (and DeepSeek-V3's shared experts)
        run in megamoe.experts on the model's own parameters (see the module docstring for the layout
        of each family, and the one repack of DeepSeek-V3's shared expert).
    group: expert-parallel process group, or None. Given, each rank keeps only its slice of every
        experts module's parameters (rank r: global experts [r*E_l, (r+1)*E_l)); build the optimizer
        after patching. Every rank then runs each forward with the same number of tokens (megamoe.experts over
        a group). model.save_pretrained then gathers the experts (every rank calls it) and writes a
        plain transformers checkpoint of all of them; model.state_dict() holds them as DTensors for DCP.
    config: the megamoe.MoEConfig passed to every megamoe.experts call (None: the default).
    Raises TypeError if model is not an nn.Module or group not a ProcessGroup (or None), ValueError if this rank
    is not in group, if a block's number of experts is not divisible by the group size or (with a group) its expert
    weights are parametrized (torch.nn.utils.parametrize: parametrize after patching), if the model has no
    supported block, is already patched or has its experts wrapped already (PEFT: patch first) or their forward
    (DeepSeek-V3: the block's) set on the instance (accelerate's hooks), and UnsupportedExpertsError (a
    ValueError) if a block's experts do not have megamoe's layout (bias, transposed or interleaved weights, an
    activation other than silu). On any of these errors the model is left unchanged.

    DeepSeek-V3: a module wrapped around or hooked onto `experts` or `shared_experts` (or its projections)
    after patching is honoured: the block then runs its own forward, the two modules called one after the
    other, instead of the fused call. A wrapper around `experts` (PEFT's LoRA on the expert weights) is seen
    through by is_patched and unpatch_model; merge such adapters (merge_and_unload) before unpatch_model, since
    with a group they were made for this rank's slice of the experts.
    The patched experts ignore transformers' own experts_implementation setting (set_experts_implementation)
    until unpatch_model.
    """
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
    world = _check_patch_group(group)
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError(
            f"no supported MoE block in {type(model).__name__}; supported block classes: {sorted(BLOCK_SPECS)}"
        )
    if is_patched(model):
        raise ValueError(f"{type(model).__name__} is already patched by megamoe; call unpatch_model first")
    # Check every block before changing any, so a failure leaves the model untouched.
    for name, block, spec in blocks:
        experts = getattr(block, spec.experts)
        wrapped = None if unsupported_reason(experts) is None else next(
            (m for m in experts.modules() if m is not experts and unsupported_reason(m) is None), None)
        if wrapped is not None:
            raise ValueError(
                f"{name}.{spec.experts} ({spec.family}): the experts ({type(wrapped).__name__}) are wrapped by "
                f"{type(experts).__name__} (e.g. PEFT's LoRA on the expert weights), which patch_model cannot run "
                "around: call patch_model before wrapping them, or use experts_implementation='megamoe', which "
                "runs inside such wrappers"
            )
        check_experts(experts, f"{name}.{spec.experts} ({spec.family})")
        for module_name, module in [(f"{name}.{spec.experts}", experts)] + ([(name, block)] if spec.shared else []):
            if "forward" in vars(module):
                raise ValueError(
                    f"{module_name} ({spec.family}): its forward was replaced on the instance, by "
                    f"{_instance_forward(module)} (accelerate's hooks, e.g. of device_map offloading, do that), which "
                    "patch_model would discard: remove it before patch_model (accelerate: remove_hook_from_module), "
                    "or use experts_implementation='megamoe', which runs inside it"
                )
        if spec.shared is not None:
            _check_shared(f"{name}.{spec.shared} ({spec.family})", getattr(block, spec.shared))
        parametrized = [w for w in _EXPERT_WEIGHTS if parametrize.is_parametrized(experts, w)]
        if group is not None and parametrized:
            raise ValueError(
                f"{name}.{spec.experts} ({spec.family}): with a group, patch_model keeps this rank's experts of each "
                f"weight, which it cannot do for parametrized ones ({', '.join(parametrized)}: torch.nn.utils."
                "parametrize, e.g. PEFT's LoRA on target_parameters): call patch_model before parametrizing them"
            )
        num_experts = experts.gate_up_proj.shape[0]
        if num_experts % world != 0:
            raise ValueError(
                f"{name}.{spec.experts} ({spec.family}): expert parallelism needs num_experts divisible by the "
                f"size of group; num_experts={num_experts}, group size={world}"
            )
    for _, block, spec in blocks:
        experts = getattr(block, spec.experts)
        local_slice = _shard(experts, group) if group is not None else None
        patch = _Patch(spec=spec, group=group, config=config, local_slice=local_slice)
        setattr(experts, _PATCH_ATTR, patch)
        if group is not None and not getattr(experts, _STATE_HOOKS_ATTR, False):
            # Registered once per module (they act only while it is patched with a group), so that patching
            # again after unpatch_model does not stack them; module-level functions, which copy.deepcopy carries
            # (and torch.save(model) once unpatched).
            experts.register_state_dict_post_hook(_save_sharded_experts)
            experts.register_load_state_dict_pre_hook(_load_sharded_experts)
            setattr(experts, _STATE_HOOKS_ATTR, True)
        setattr(experts, _CHECKED_ATTR, True)
        _bind(experts, "forward", megamoe_experts_forward)
        if spec.shared is not None:
            setattr(block, _PATCH_ATTR, patch)
            _bind(block, "forward", _block_forward_with_shared)
    if group is not None and callable(getattr(type(model), "save_pretrained", None)):
        # Its state_dict holds the experts as DTensors, for DCP; safetensors takes none: save_pretrained gathers them.
        _bind(model, "save_pretrained", _save_pretrained_full)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo patch_model (in place; returns `model`): the original forwards and save_pretrained, and with
    expert parallelism the full expert weights (a collective over the group: every rank must call it).
    Raises ValueError, before changing anything, if a forward that patch_model bound was replaced on the
    instance since (e.g. by accelerate's hooks, around megamoe's): deleting it would drop that too."""
    # DeepSeek-V3's block keeps its patched forward also when its experts module was replaced since.
    patched = [(name, block, _patched_experts(block, spec)) for name, block, spec in _moe_blocks(model)]
    for name, block, experts in patched:
        forwards = [] if experts is None else [(experts, megamoe_experts_forward)]
        if hasattr(block, _PATCH_ATTR):
            forwards.append((block, _block_forward_with_shared))
        for module, function in forwards:
            if "forward" in vars(module) and not _is_bound(module, function):
                module_name = next(n for n, m in block.named_modules(prefix=name) if m is module)
                raise ValueError(
                    f"{module_name}: its forward was replaced on the instance after patch_model, by "
                    f"{_instance_forward(module)} (accelerate's hooks do that), which unpatch_model would drop with "
                    "megamoe's: remove it first (accelerate: remove_hook_from_module), then call unpatch_model"
                )
    for _, block, experts in patched:
        if experts is not None:
            patch: _Patch = getattr(experts, _PATCH_ATTR)
            if patch.local_slice is not None:
                _unshard(experts, patch)
            del experts.forward
            delattr(experts, _PATCH_ATTR)
        if hasattr(block, _PATCH_ATTR):
            del block.forward
            delattr(block, _PATCH_ATTR)
    bound = vars(model).get("save_pretrained")
    if isinstance(bound, functools.partial) and bound.func is _save_pretrained_full:
        del model.save_pretrained
    return model


def _patched_experts(block: nn.Module, spec) -> nn.Module | None:
    """The experts module of block that patch_model patched, or None: block's experts attribute itself, or the
    module inside what was wrapped around it since (PEFT's ParamWrapper holds it as its base layer)."""
    return next((m for m in getattr(block, spec.experts).modules() if hasattr(m, _PATCH_ATTR)), None)


def is_patched(model: nn.Module) -> bool:
    """Whether any MoE block of `model` currently runs through patch_model (its experts wrapped since or not, or
    DeepSeek-V3's block with its experts module replaced since)."""
    return any(_patched_experts(block, spec) is not None or hasattr(block, _PATCH_ATTR)
               for _, block, spec in _moe_blocks(model))


try:  # experts_implementation="megamoe" as soon as this module is imported, where transformers >= 5 is
    register()
except ImportError:  # no transformers (or < 5): this module still imports; register() says what is missing
    pass
except Exception as error:  # noqa: BLE001 - a broken transformers must not break `import megamoe.integrations.hf`
    warnings.warn(f"megamoe.integrations.hf: experts_implementation='megamoe' not registered: {error!r}", stacklevel=2)
