"""MoELayer: router (linear -> scores -> top-k -> optional renormalisation) + routed experts + shared expert."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.autograd import AUTOCAST_CASTS, AUTOCAST_DEVICE_TYPES, announce_rejection, experts
from megamoe.config import MoEConfig, _type_name, check_group, check_positive_int
from megamoe.expert_state import expert_state_names, load_expert_shards, shard_expert_state
from megamoe.schedule import FLOAT_DTYPES, not_dense

SCORE_FUNCS = ("softmax", "sigmoid")


def _zero_counts(layer: MoELayer, incompatible_keys) -> None:
    """After load_state_dict: tokens_per_expert as a layer that has not run a forward has it, zeros on the weights'
    device. Non-persistent, the buffer is otherwise left as it was: on meta after torch's fast-load recipe (meta
    init, then load_state_dict(assign=True)), where the layer's .to() then fails ("Cannot copy out of meta
    tensor"), and uninitialised after to_empty + load_state_dict. A post-hook, not _load_from_state_dict: that runs
    before the submodules load, among them a parametrized w_gate_up's original."""
    layer.tokens_per_expert = torch.zeros(layer.num_experts, dtype=torch.int32, device=layer.w_gate_up.device)


def _shard_experts(layer: MoELayer, state_dict, prefix: str, local_metadata) -> None:
    """After state_dict: this rank's experts as its shards of DTensors over the group (megamoe.expert_state). A
    post-hook, not _save_to_state_dict: a parametrized expert weight's originals are saved by its parametrization's
    module, after the layer's own entries."""
    if layer.group is not None:
        shard_expert_state(state_dict, prefix, layer._expert_state_names(), layer.group)


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer with SwiGLU experts, expert-parallel over `group`.

    Args:
        hidden_size: H. intermediate_size: I of each routed expert. num_experts: E (global).
        top_k: k experts per token. shared_intermediate_size: I_s of an always-on shared expert (0: none).
        score_func: "softmax" or "sigmoid" router scores. norm_topk_prob: renormalise the k weights to sum 1.
        group: expert-parallel process group (None: all experts here); rank r holds experts
            [r*E/W, (r+1)*E/W). The router and shared expert are replicated.
        config: megamoe.MoEConfig (backend, capacity, ...).

    Parameters: router.weight [E, H]; w_gate_up [E_local, 2I, H] (gate rows first); w_down [E_local, H, I];
    shared_gate_up [2I_s, H] and shared_down [H, I_s] when a shared expert is present.
    With a group, state_dict() holds w_gate_up and w_down as DTensors [E, ...] over the group, sharded on dim 0
    (so that torch.distributed.checkpoint saves every rank's experts; parametrized, their originals of one entry per
    local expert), and load_state_dict also takes a one-process state dict of all E experts (each rank loads its
    own): megamoe.expert_state.

    x: [..., H] in the layer's dtype (under autocast: float32, float16 or bfloat16). Also accepted: x in the float16 or
    bfloat16 of the router and shared expert when only the experts are float32, as under FSDP2's MixedPrecisionPolicy
    with the experts in ignored_params; the experts are then cast to x's dtype for the call.

    After each forward (no host synchronisation): `tokens_per_expert` [E] int32 — this rank's (token, slot)
    pairs routed to each global expert (zeros before the first forward, and again after load_state_dict);
    `aux_loss` — the Switch-Transformer load-balancing loss E * sum_e f_e * P_e over this rank's tokens (f_e:
    fraction of pairs sent to e; P_e: mean router probability of e), differentiable with respect to the router;
    add `coef * layer.aux_loss` to your loss. Under reentrant activation checkpointing (use_reentrant=True) the
    forward runs without grad and aux_loss has no gradient: checkpoint non-reentrantly (checkpoint_wrapper's
    default).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        shared_intermediate_size: int = 0,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        group=None,
        config: MoEConfig | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            check_positive_int(name, value)
        check_positive_int("shared_intermediate_size", shared_intermediate_size, allow_zero=True)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not isinstance(norm_topk_prob, bool):  # a string such as "false" would be truthy
            raise TypeError(f"norm_topk_prob must be a bool, got {_type_name(norm_topk_prob)} {norm_topk_prob!r}")
        if dtype is not None and dtype not in FLOAT_DTYPES:  # what forward's x may be
            raise TypeError(f"dtype must be torch.float16, bfloat16, float32, float64 or None, got {dtype!r}")
        if config is not None and not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a megamoe.MoEConfig or None, got {type(config).__name__}")
        check_group("group", group)
        world_size = 1
        if group is not None:
            import torch.distributed as dist

            world_size = dist.get_world_size(group)
        if num_experts % world_size != 0:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the group size ({world_size})")
        if config is not None and config.backend == "reference" and world_size > 1:  # refused here, not at forward
            raise ValueError("MoEConfig.backend='reference' computes all experts in one process; it takes no group "
                             f"(group of size {world_size} given)")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shared_intermediate_size = shared_intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // world_size
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.group, self.config = group, config
        factory = {"device": device, "dtype": dtype}
        # Built on meta, then allocated where the experts are, uninitialised: reset_parameters (below) initialises
        # it, so nn.Linear's own init would only consume random numbers, and a layer built on meta and then reset
        # (to_empty + reset_parameters) would get other values than one built directly with the same seed.
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device="meta", dtype=dtype)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, **factory))
        # A new Parameter rather than to_empty, which swaps the tensors and cannot under FakeTensorMode (a layer built
        # there for tracing or memory estimation: "Couldn't swap Linear.weight").
        self.router.weight = nn.Parameter(torch.empty_like(self.router.weight, device=self.w_gate_up.device))
        self.w_down = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size, **factory))
        if shared_intermediate_size > 0:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * shared_intermediate_size, hidden_size, **factory))
            self.shared_down = nn.Parameter(torch.empty(hidden_size, shared_intermediate_size, **factory))
        else:
            self.register_parameter("shared_gate_up", None)
            self.register_parameter("shared_down", None)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int32, device=device), persistent=False
        )
        self.aux_loss: torch.Tensor | None = None
        self.register_load_state_dict_post_hook(_zero_counts)
        self.register_state_dict_post_hook(_shard_experts)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform init with bound 1/sqrt(fan_in) for every projection (nn.Linear's scale)."""
        self.router.reset_parameters()
        for w, fan_in in ((self.w_gate_up, self.hidden_size), (self.w_down, self.intermediate_size)):
            self._init_experts(w, 1 / math.sqrt(fan_in))
        if self.shared_gate_up is not None:
            nn.init.uniform_(self.shared_gate_up, -1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
            bound = 1 / math.sqrt(self.shared_down.shape[1])
            nn.init.uniform_(self.shared_down, -bound, bound)
        # Garbage after to_empty (meta-device init). Replaced, as forward replaces it, not zeroed in place: after a
        # forward under torch.inference_mode it is an inference tensor, which cannot change in place outside it.
        self.tokens_per_expert = torch.zeros_like(self.tokens_per_expert)

    @torch.no_grad()
    def _init_experts(self, w: torch.Tensor, bound: float) -> None:
        """uniform_(-bound, bound) on w [E_local, ...]. Expert-parallel: the global experts are drawn one after
        another and this rank keeps its own, so ranks seeded alike (as the replicated router needs) hold
        different experts, not E/E_local copies of the same E_local; on the CPU generator the values are the
        single-process layer's slice (one draw of [E, ...] consumes the stream as E draws of [...] do)."""
        if self.num_local_experts == self.num_experts:
            nn.init.uniform_(w, -bound, bound)
            return
        import torch.distributed as dist

        first = dist.get_rank(self.group) * self.num_local_experts
        slab = torch.empty_like(w[0])
        for expert in range(self.num_experts):
            slab.uniform_(-bound, bound)
            if first <= expert < first + self.num_local_experts:
                w[expert - first].copy_(slab)

    _EXPERT_WEIGHTS = ("w_gate_up", "w_down")

    def _expert_state_names(self) -> tuple[str, ...]:
        return expert_state_names(self, self._EXPERT_WEIGHTS, self.num_local_experts)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # state_dict is load_state_dict's own copy of the caller's; the submodules (a parametrization's originals)
        # load after this.
        if self.group is not None:
            load_expert_shards(state_dict, prefix, self._expert_state_names(), self.group, self.num_local_experts)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __deepcopy__(self, memo):
        # A process group cannot be copied (nor pickled): a copy of an expert-parallel layer runs over the same group.
        if self.group is not None:
            memo.setdefault(id(self.group), self.group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        # MoELayer's __getstate__, not the instance's: torch.nn.utils.parametrize gives the class it makes for a
        # parametrized layer one that raises, to forbid pickling, and leaves deepcopy to __deepcopy__.
        copied.__setstate__(copy.deepcopy(MoELayer.__getstate__(self), memo))
        return copied

    def __getstate__(self):
        # aux_loss is a non-leaf tensor of the last forward's autograd graph, which copy.deepcopy rejects
        # ("Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol"): a copy
        # (or a pickled layer) starts without one, as a layer that has not run a forward yet.
        state = super().__getstate__()
        state["aux_loss"] = None
        return state

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router: returns (topk_ids [T, k] int64, topk_weights [T, k] fp32, probs [T, E] fp32; fp64 for an x and
        router in float64). The router runs in its own dtype (e.g. kept in fp32 with `layer.router.float()` in a
        bf16 layer): x is cast to it. A router without a floating-point weight tensor is forward's TypeError, one that
        scores another number of experts than E its ValueError."""
        router_weight = getattr(self.router, "weight", None)
        if (error := self._router_error(router_weight)) is not None:
            raise error
        return self._route(x_TH, router_weight.dtype)

    def _route(self, x_TH: torch.Tensor, router_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """route, given the router weight's dtype (forward has read the weight). The router is called, rather than
        F.linear on that weight, so that its hooks and wrappers (e.g. an adapter in its place) run: it reads its
        weight once more."""
        logits = self.router(x_TH.to(router_dtype))
        if logits.shape[-1:] != (self.num_experts,):  # an id past E would index the counts out of bounds
            raise ValueError(
                f"router must give [T, E={self.num_experts}] logits, got shape {tuple(logits.shape)} from "
                f"{type(self.router).__module__}.{type(self.router).__name__}"
            )
        # Scores in fp32, but not below a float64 layer's precision: rounded to fp32, its weights and aux loss would
        # lose it (and torch.autograd.gradcheck of the layer would fail). megamoe.experts takes float64 topk_weights
        # beside a float64 x.
        logits = logits.to(torch.float64 if x_TH.dtype == logits.dtype == torch.float64 else torch.float32)
        softmax = self.score_func == "softmax"
        scores = torch.softmax(logits, dim=-1) if softmax else torch.sigmoid(logits)
        # The top k of the logits: the experts of the top k scores (both score functions increase), but scores
        # saturate where logits do not (fp32 sigmoid is exactly 1.0 above a logit of about 17 and 0.0 below about
        # -104), and top-k among such ties picked arbitrary experts (those of the smallest logits, on the CPU).
        topk_logits, topk_ids = torch.topk(logits, self.top_k, dim=-1)
        topk_weights = scores.gather(-1, topk_ids)
        if self.norm_topk_prob and softmax:  # the k largest softmax scores sum to at least 1/E: no 0/0
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        elif self.norm_topk_prob:
            # sigmoid(l_j) / sum_i sigmoid(l_i), from log-sigmoids: the quotient of underflowed sigmoids is 0/0.
            topk_weights = torch.softmax(F.logsigmoid(topk_logits), dim=-1)
        probs = scores if softmax else torch.softmax(F.logsigmoid(logits), dim=-1)
        return topk_ids, topk_weights, probs

    def _weights(self) -> dict[str, torch.Tensor | None]:
        """The layer's weights by name (the shared expert's None without one), each read once: forward reads them
        here and passes them on, since a parametrized weight (torch.nn.utils.parametrize) is computed at every
        read."""
        return {
            # getattr: a router without a weight (e.g. an nn.Sequential in its place) is _input_error's TypeError,
            # announced to EP peers, not an AttributeError here that leaves them waiting.
            "router.weight": getattr(self.router, "weight", None), "w_gate_up": self.w_gate_up, "w_down": self.w_down,
            "shared_gate_up": self.shared_gate_up, "shared_down": self.shared_down,
        }

    def _router_error(self, router_weight) -> TypeError | None:
        """The TypeError of a router (the module in the layer's router place) without a floating-point weight tensor
        (its dtype is the routing's), or None; router_weight: its weight attribute, None where it has none."""
        if isinstance(router_weight, torch.Tensor) and router_weight.is_floating_point():
            return None
        # e.g. torch.ao.quantization.quantize_dynamic's Linear, whose weight is a method returning int8 values
        return TypeError(
            f"router must be a module with a floating-point weight tensor (an nn.Linear, parametrized or not), "
            f"got {type(self.router).__module__}.{type(self.router).__name__} "
            + ("without a weight" if router_weight is None else f"whose weight is {type(router_weight).__name__}")
        )

    def _input_error(self, x, weights: dict[str, torch.Tensor | None]) -> Exception | None:
        """What is wrong with forward's x, or None: a tensor [..., H] on the parameters' device, in their dtype
        (under autocast, which casts float32/float16/bfloat16 but not float64: any of those three, for a layer
        in one of them; or the dtype of every parameter but the experts, _experts_follow). Also the router put in
        the layer's place, which must have a floating-point weight tensor (its dtype is the routing's)."""
        if (error := self._router_error(weights["router.weight"])) is not None:
            return error
        if not isinstance(x, torch.Tensor):
            return TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if (error := not_dense("x", x)) is not None:
            return error
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            return ValueError(f"x must be [..., H={self.hidden_size}], got shape {tuple(x.shape)}")
        weight = weights["w_gate_up"]
        if x.device != weight.device:
            return ValueError(f"x must be on the layer's device {weight.device}, got {x.device}")
        if x.dtype == weight.dtype or self._experts_follow(x, weights):
            return None
        # Under autocast another floating dtype is cast for the matmuls, but only float32/float16/bfloat16:
        # autocast leaves float64 as it is, so float64 on one side only would reach the router's matmul mismatched.
        # torch.is_autocast_enabled raises for device types without autocast (e.g. meta), as in megamoe.experts.
        castable = x.dtype in AUTOCAST_CASTS and weight.dtype in AUTOCAST_CASTS
        if x.device.type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(x.device.type):
            if castable:
                return None
            return TypeError(
                f"x must have the layer's dtype {weight.dtype}, or under autocast any of "
                f"{', '.join(str(d) for d in AUTOCAST_CASTS)} with a layer in one of them too (autocast does not "
                f"cast float64), got {x.dtype}"
            )
        # Autocast as the remedy only where it would take x: not for float64 (or an integer x) on either side.
        hint = " (or run under autocast)" if castable and x.device.type in AUTOCAST_DEVICE_TYPES else ""
        return TypeError(f"x must have the layer's dtype {weight.dtype}{hint}, got {x.dtype}")

    def _experts_follow(self, x: torch.Tensor, weights: dict[str, torch.Tensor | None]) -> bool:
        """Whether the experts are cast to x's dtype for this call, outside autocast: x and every other parameter of
        the layer (router, shared expert) are in one of float16/bfloat16, the experts in float32. That is FSDP2's
        MixedPrecisionPolicy(param_dtype=...) with the experts in fully_shard's ignored_params (megamoe.parallel's
        recipe for expert parallelism): FSDP2 casts x and the parameters it manages for the forward, not the ones
        it ignores. Only that way round: a float32 x beside a router kept in float32 (layer.router.float()) in a
        bfloat16 layer without a shared expert is a mistake (the TypeError), not a call to run the experts in
        float32. The cast is differentiable: the experts' gradients arrive in their own dtype, as FSDP2's managed
        parameters' do."""
        experts_dtype = weights["w_gate_up"].dtype
        others = [w for name, w in weights.items() if name not in self._EXPERT_WEIGHTS and w is not None]
        autocast = x.device.type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(x.device.type)
        return (
            not autocast and x.dtype in (torch.float16, torch.bfloat16) and experts_dtype == torch.float32
            and weights["w_down"].dtype == experts_dtype and all(p.dtype == x.dtype for p in others)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self._weights()
        error = self._input_error(x, weights)
        if error is not None:
            if self.group is not None:  # the peers are on their way to megamoe.experts' agreement exchange
                announce_rejection(self.group, error, (weights["w_gate_up"],), self.config)
            raise error
        x_TH = x.reshape(-1, self.hidden_size)
        try:
            topk_ids, topk_weights, probs = self._route(x_TH, weights["router.weight"].dtype)
        except ValueError as error:  # a router scoring another number of experts than E: the peers are told too
            if self.group is not None:
                announce_rejection(self.group, error, (weights["w_gate_up"],), self.config)
            raise
        # Integer scatter-add: exact and order-independent, no host sync.
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, topk_ids.reshape(-1), torch.ones_like(topk_ids.reshape(-1), dtype=torch.int32))
        fraction = counts.to(probs.dtype) / max(topk_ids.numel(), 1)
        # sum / max(T, 1) rather than mean: an empty batch gives 0 (0 * 0), not 0 * NaN.
        mean_probs = probs.sum(dim=0) / max(x_TH.shape[0], 1)
        aux_loss = self.num_experts * (fraction * mean_probs).sum()
        w_gate_up, w_down = weights["w_gate_up"], weights["w_down"]
        if self._experts_follow(x, weights):
            w_gate_up, w_down = w_gate_up.to(x.dtype), w_down.to(x.dtype)
        out = experts(
            x_TH, topk_ids, topk_weights, w_gate_up, w_down,
            shared_gate_up=weights["shared_gate_up"], shared_down=weights["shared_down"],
            group=self.group, config=self.config,
        )
        # Set only once the call went through: a rejected call (e.g. a capacity overflow) changes nothing.
        if torch.compiler.is_exporting():
            # torch.export carries a buffer's in-place update into the exported module, not a new tensor in its place.
            self.tokens_per_expert.copy_(counts)
        else:
            self.tokens_per_expert = counts
        self.aux_loss = aux_loss
        return out.view_as(x)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func!r}, "
            f"norm_topk_prob={self.norm_topk_prob}, shared_intermediate_size={self.shared_intermediate_size}, "
            f"num_local_experts={self.num_local_experts}"
        ) + (f", config={self.config!r}" if self.config is not None else "")
