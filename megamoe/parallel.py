"""Data parallelism (DDP, FSDP2) around expert-parallel MoE layers: which parameters are experts, and their grads.

An expert-parallel layer (MoELayer(group=ep_group), or a Hugging Face model patched with
megamoe.integrations.hf.patch_model(model, group=ep_group)) holds two kinds of parameters:

- non-expert (router, shared expert, and everything else in the model): replicas, data-parallel over
  all ranks. DDP or FSDP2 averages their gradients over the ranks, as usual.
- expert (w_gate_up / w_down, or the patched experts' gate_up_proj / down_proj): rank e of the EP group
  holds its own slice of experts. They are not replicas, so the data-parallel wrapper must leave them
  alone: DDP would broadcast rank 0's experts over every other rank's at construction and then average
  different experts' gradients; FSDP2 would shard and all-gather them as one replicated tensor, mixing
  the ranks' experts.

Convention: every parameter receives the gradient of the mean over all N ranks of each rank's loss,
L = (1/N) sum_r L_r. DDP and FSDP2 give non-expert parameters exactly that (they average). megamoe's
backward gives a local expert the sum over the tokens of every rank of its EP group,
sum_{r in EP group} dL_r/dw; reduce_expert_grads completes it to (1/N) sum_r dL_r/dw by summing over the
data-parallel group that holds replicas of the same experts (2-D layout only) and dividing by
N = EP size x DP size. (examples/train_moe.py, 1-D, divides by W for the same reason.)

1-D layout (DP group == EP group == the world; every rank holds E/W experts):

    layer = megamoe.MoELayer(..., group=dist.group.WORLD)
    experts = megamoe.parallel.expert_parameters(model)              # {name: parameter}
    # DDP
    megamoe.parallel.ddp_ignore_experts(model)
    model = DistributedDataParallel(model)
    # or FSDP2: pass the set to every fully_shard call whose module holds experts
    fully_shard(model, mesh=init_device_mesh("cuda", (world,)), ignored_params=set(experts.values()))
    # built on the meta device: to_empty gives the (ignored) experts new parameter objects, FSDP2's own keep theirs;
    # after model.to_empty(...) take experts = megamoe.parallel.expert_parameters(model) again for the optimizer
    optimizer = torch.optim.AdamW([{"params": list(experts.values())},   # two groups: needed under FSDP2
                                   {"params": list(megamoe.parallel.non_expert_parameters(model).values())}])
    ...
    loss.backward()
    megamoe.parallel.reduce_expert_grads(model)                       # divides by the EP size
    optimizer.step()

2-D layout (recommended at scale): a DeviceMesh ("dp", "ep") of N = dp x ep ranks. Experts are sharded
over "ep" and replicated over "dp"; non-expert parameters are data-parallel over all N ranks.

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    layer = megamoe.MoELayer(..., group=mesh["ep"].get_group())
    # DDP over the default (world) group, or fully_shard over a 1-D mesh of all N ranks, ignoring experts
    # exactly as above; then after backward:
    megamoe.parallel.reduce_expert_grads(model, dp_group=mesh["dp"].get_group())

Gradient clipping: torch.nn.utils.clip_grad_norm_ would see only this rank's experts, so the norm (and the factor
every gradient is scaled by) would differ between ranks, and the replicas (router, shared expert) would drift
apart. clip_grad_norm_(model, max_norm) takes the norm of the whole model's gradient, every expert once, the same
on every rank; call it after reduce_expert_grads:

    megamoe.parallel.reduce_expert_grads(model)
    megamoe.parallel.clip_grad_norm_(model, max_norm=1.0)
    optimizer.step()

Checkpoints: model.state_dict() holds each expert-parallel weight as a DTensor over its EP group, sharded on dim 0
(global shape [E, ...]), so torch.distributed.checkpoint (DCP) saves every rank's experts and reshards them on
load (megamoe.expert_state):

    dcp.save(model.state_dict(), checkpoint_id=path)
    state = model.state_dict(); dcp.load(state, checkpoint_id=path); model.load_state_dict(state)

The optimizer's state of the expert parameters (e.g. AdamW's moments) is per rank as the parameters are; after
shard_optimizer_state(model, optimizer), optimizer.state_dict() holds it as DTensors too, and torch's
get_optimizer_state_dict / set_optimizer_state_dict (which fill a fresh optimizer's state first) carry it through DCP:

    parallel.shard_optimizer_state(model, optimizer)                 # once, after building the optimizer
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)

Tested on CPU with gloo (tests/test_distributed_wrappers.py) against a one-process run of the global batch.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from megamoe.config import check_group
from megamoe.expert_state import load_expert_shards, shard_expert_state
# The mark patch_model leaves on the modules it patched: from a module of its own, not from integrations.hf,
# so that `import megamoe` (which imports this module) never loads the Hugging Face adapter or transformers.
from megamoe.integrations._patch_attr import PATCH_ATTR as _HF_PATCH_ATTR
from megamoe.layer import MoELayer

__all__ = ["clip_grad_norm_", "ddp_ignore_experts", "expert_parameters", "non_expert_parameters",
           "reduce_expert_grads", "shard_optimizer_state"]


def _check_module(name: str, module) -> None:
    """TypeError naming `name` unless module is a torch.nn.Module (e.g. not model.parameters(), nor an optimizer)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module (the model holding the experts), "
                        f"got {type(module).__name__}")


def _expert_weights(module: nn.Module, names: tuple[str, str]) -> list[nn.Parameter]:
    """The parameters holding module's expert weights `names`: each weight itself or, parametrized
    (torch.nn.utils.parametrize, e.g. weight_norm), its originals, which hold this rank's experts as the weight does
    (reading the weight computes a new tensor, not a parameter)."""
    from torch.nn.utils import parametrize

    params = []
    for name in names:
        if parametrize.is_parametrized(module, name):
            params += module.parametrizations[name].parameters(recurse=False)
        else:
            params.append(getattr(module, name))
    return params


def _expert_groups(module: nn.Module) -> dict[int, tuple[nn.Parameter, object]]:
    """id(parameter) -> (parameter, EP group) for every expert-parallel parameter under module."""
    found = {}
    for sub in module.modules():
        if isinstance(sub, MoELayer):
            group, names = sub.group, ("w_gate_up", "w_down")
        else:
            patch = getattr(sub, _HF_PATCH_ATTR, None)
            # The patch record sits on the experts module and, for DeepSeek-V3, on its block too; only the
            # experts module owns the sharded parameters.
            if patch is None or patch.local_slice is None or not hasattr(sub, "gate_up_proj"):
                continue
            group, names = patch.group, ("gate_up_proj", "down_proj")
        if group is None:
            continue  # all experts on every rank: ordinary replicas, averaged by the wrapper like the rest
        for p in _expert_weights(sub, names):
            found[id(p)] = (p, group)
    return found


def expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The expert-parallel parameters of `module`, by their names in module.named_parameters().

    These are the w_gate_up / w_down of every MoELayer built with a group, and the gate_up_proj / down_proj
    of every Hugging Face experts module patched with a group (of a parametrized one, torch.nn.utils.parametrize's
    originals: parametrizations.w_gate_up.original, ...). Expert weights of layers without a group are
    replicas like any other parameter and are not returned. Pass the values to fully_shard's `ignored_params`;
    for DDP call ddp_ignore_experts(model) rather than passing these names to DDP's own
    `_set_params_and_buffers_to_ignore_for_model`, whose gradient reducer misses them for a MoELayer wrapped directly
    (ddp_ignore_experts says why; the forward then raises check_ddp_leaves_experts_alone's ValueError).
    """
    _check_module("module", module)
    found = _expert_groups(module)
    return {name: p for name, p in module.named_parameters() if id(p) in found}


def non_expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter of `module` but expert_parameters(module), by name: what DDP / FSDP2 manage.

    Under FSDP2 these become DTensors while the experts stay plain tensors, and a foreach optimizer (the
    default on CUDA) cannot mix the two in one parameter group ("got mixed torch.Tensor and DTensor"):
    give the optimizer one group of each.
    """
    _check_module("module", module)
    found = _expert_groups(module)
    return {name: p for name, p in module.named_parameters() if id(p) not in found}


def ddp_ignore_experts(model: nn.Module) -> list[str]:
    """Make DistributedDataParallel(model) leave the expert-parallel state of `model` alone; call before wrapping.

    Ignored: expert_parameters(model) (no broadcast from rank 0 at construction, no gradient averaging) and
    the `tokens_per_expert` buffer of every expert-parallel MoELayer (per-rank counts, which DDP would
    otherwise broadcast from rank 0 before every forward). Adds to names already set by
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, and returns the full list.

    Why not call that DDP method directly: in torch 2.13 its construction-time broadcast matches names as
    named_parameters() spells them ("w_gate_up") but its gradient reducer as f"{module_name}.{name}", which
    is ".w_gate_up" for a parameter of the wrapped module itself; a MoELayer wrapped directly would have its
    experts' gradients averaged. Both spellings are given here.
    """
    from torch.nn.parallel import DistributedDataParallel

    _check_module("model", model)
    found = _expert_groups(model)
    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, p in module.named_parameters(recurse=False):
            if id(p) in found:
                names += [prefix + name, f"{module_name}.{name}"]  # identical below the root
        if isinstance(module, MoELayer) and module.group is not None:
            names.append(prefix + "tokens_per_expert")
    names = list(dict.fromkeys(names))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def _check_not_data_parallel(module: nn.Module, found: dict) -> None:
    """ValueError naming the first expert-parallel parameter of module that is a DTensor: FSDP2's fully_shard took it
    for a replica (it was not in ignored_params), so each rank keeps a shard of its own experts and all-gathers the
    others' shards of theirs: the ranks' experts are mixed from construction on, and reduce_expert_grads /
    clip_grad_norm_ would go on silently (or fail inside a collective)."""
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        if id(p) in found and isinstance(p, DTensor):
            raise ValueError(
                f"expert-parallel parameter {name!r} is a DTensor {tuple(p.placements)} over ranks "
                f"{p.device_mesh.mesh.flatten().tolist()}: a data-parallel wrapper (FSDP2's fully_shard) manages it as "
                "a replica, but every rank of its expert-parallel group holds other experts, which it shards and "
                "all-gathers together; pass set(megamoe.parallel.expert_parameters(model).values()) as ignored_params "
                "to every fully_shard call whose module holds experts (megamoe.parallel's docstring)"
            )


def check_ddp_leaves_experts_alone(module: nn.Module) -> None:
    """ValueError naming the first expert-parallel parameter that a DistributedDataParallel at or under `module`
    manages (neither of the names ddp_ignore_experts gives it is in the wrapper's ignore list): at construction DDP
    broadcast rank 0's copy of it over every other rank's, so those ranks' own experts are gone, and its backward
    averages different experts' gradients. A wrapper found in order is checked once (remembered on it)."""
    from torch.nn.parallel import DistributedDataParallel

    for ddp in module.modules():
        if not isinstance(ddp, DistributedDataParallel) or getattr(ddp, "_megamoe_experts_left_alone", False):
            continue
        found = _expert_groups(ddp.module)
        ignored = ddp.parameters_to_ignore
        for module_name, sub in ddp.module.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, p in sub.named_parameters(recurse=False):
                # The construction-time broadcast reads the first spelling, the gradient reducer the second.
                if id(p) in found and not {prefix + name, f"{module_name}.{name}"} <= ignored:
                    raise ValueError(
                        f"expert-parallel parameter {prefix + name!r} is managed by DistributedDataParallel as a "
                        "replica, but every rank of its expert-parallel group holds other experts: at construction "
                        "DDP copied rank 0's experts over every other rank's, and its backward would average "
                        "different experts' gradients. Call megamoe.parallel.ddp_ignore_experts(model) before "
                        "wrapping, on a model built (or loaded) again"
                    )
        ddp._megamoe_experts_left_alone = True


def check_active_ddp_leaves_experts_alone() -> None:
    """check_ddp_leaves_experts_alone for the DistributedDataParallel whose forward is running, if any (torch sets
    it for the duration of DDP's forward; not while compiling, where reduce_expert_grads checks instead)."""
    if torch.compiler.is_compiling():
        return
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    # Checked once per wrapper: every later forward costs these two lookups, not a walk over the model.
    if ddp is not None and not getattr(ddp, "_megamoe_experts_left_alone", False):
        check_ddp_leaves_experts_alone(ddp)


def _check_dp_group(dp_group, ep_groups) -> None:
    """ValueError unless dp_group and every EP group have no rank in common but this one: the ranks of dp_group
    must hold replicas of this rank's experts, and every other rank of an EP group holds other experts."""
    me = dist.get_rank()
    dp_ranks = dist.get_process_group_ranks(dp_group)
    for ep_group in ep_groups:
        ep_ranks = dist.get_process_group_ranks(ep_group)
        common = sorted(set(dp_ranks) & set(ep_ranks) - {me})
        if common:
            raise ValueError(
                f"dp_group must be the group of ranks holding the same experts as this one (mesh['dp'].get_group() "
                f"in the 2-D layout; None in the 1-D layout, where the EP group is the data-parallel group), "
                f"disjoint from the expert-parallel group but for this rank (global rank {me}); got ranks {dp_ranks}, "
                f"which share ranks {common} with the expert-parallel group (ranks {ep_ranks}): their experts' "
                "gradients would be summed into this rank's"
            )


def reduce_expert_grads(module: nn.Module, dp_group=None) -> None:
    """Give every expert-parallel parameter of `module` the gradient DDP gives replicas (in place).

    Call on every rank after the backward and before the optimizer step (once per step with gradient
    accumulation). Each local expert's gradient (megamoe's backward: the sum over its EP group's tokens)
    is summed over `dp_group` and divided by N = ep size x dp size, the number of ranks whose mean loss
    the data-parallel wrapper differentiates (module docstring).

    dp_group: the process group of the ranks holding the same experts (mesh["dp"].get_group() in the
        2-D layout); None in the 1-D layout, where each rank's experts exist nowhere else.
    A parameter without a gradient (its layer was not used this step) gets zeros, so that every rank
    joins the same collectives. Frozen parameters (requires_grad=False) are skipped.
    Raises ValueError, before any gradient is touched, if dp_group shares a rank other than this one with
    the EP group of any of these parameters (e.g. the EP group itself, or the world in the 2-D layout):
    that rank holds different experts, whose gradients the sum would mix into these; and if FSDP2 manages one of
    these parameters (a DTensor: fully_shard was not given it in ignored_params), or a DistributedDataParallel at or
    under `module` does (ddp_ignore_experts was not called before wrapping), either of which mixes the ranks' experts.
    """
    _check_module("module", module)
    check_group("dp_group", dp_group)
    groups = _expert_groups(module)
    _check_not_data_parallel(module, groups)
    check_ddp_leaves_experts_alone(module)
    found = groups.values()
    if dp_group is not None:
        _check_dp_group(dp_group, {id(group): group for _, group in found}.values())
    dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
    pending = []
    for p, group in found:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        divisor = dist.get_world_size(group) * dp_size
        if dp_group is None:
            p.grad.div_(divisor)
        else:
            pending.append((p.grad, divisor, dist.all_reduce(p.grad, group=dp_group, async_op=True)))
    # All reductions are in flight before the first wait; each grad is divided once its sum has arrived.
    for grad, divisor, work in pending:
        work.wait()
        grad.div_(divisor)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_(module.parameters(), ...) for a model with expert-parallel parameters (in place;
    returns the total norm, the same on every rank).

    The norm is that of the whole model's gradient, as one process holding every expert would take it: each EP
    group's experts summed over the group (every expert once; their replicas over a data-parallel group hold the
    same gradient after reduce_expert_grads), the other parameters as they are (replicas, e.g. under DDP: the same
    on every rank; DTensors, e.g. under FSDP2: over their mesh). Every gradient is then scaled by
    min(1, max_norm / (norm + 1e-6)), as torch does. A collective over every EP group: every rank must call it,
    after reduce_expert_grads. norm_type: a p-norm's p > 0, or inf (float("inf") or "inf"). Raises ValueError as
    reduce_expert_grads does if FSDP2 or DDP manages an expert-parallel parameter.
    """
    _check_module("module", module)
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if norm_type == "inf":  # as torch.nn.utils.clip_grad_norm_ takes it
        norm_type = float("inf")
    if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0, inf or 'inf', got {norm_type!r}")
    from torch.distributed.tensor import DTensor

    norm_type = float(norm_type)
    found = _expert_groups(module)
    _check_not_data_parallel(module, found)
    check_ddp_leaves_experts_alone(module)
    by_group: dict[int, tuple[object, list[nn.Parameter]]] = {}
    replicas, by_mesh = [], {}
    for p in module.parameters():
        if id(p) in found:
            group = found[id(p)][1]
            by_group.setdefault(id(group), (group, []))[1].append(p)
        elif p.grad is None:
            continue
        elif isinstance(p.grad, DTensor):
            by_mesh.setdefault(id(p.grad.device_mesh), []).append(p.grad)
        else:
            replicas.append(p.grad)
    norms = []
    # Every rank joins each EP group's reduction, in the order of the modules, even with no gradient of its own.
    for group, params in by_group.values():
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type) if grads else params[0].new_zeros(())
        # Summed in fp32 at least (a bf16 model's norms are bf16).
        local = local.to(device=params[0].device, dtype=torch.promote_types(local.dtype, torch.float32))
        if norm_type == float("inf"):
            # A NaN does not survive a MAX reduction (gloo keeps the operand its comparison favours: a rank's NaN came
            # back as the others' finite maximum, and error_if_nonfinite missed it), so a flag of it travels beside.
            nan = local.isnan()
            both = torch.stack([local.masked_fill(nan, 0), nan.to(local.dtype)])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            norms.append(both[0].masked_fill(both[1] > 0, float("nan")))
        else:
            local = local.pow(norm_type)
            dist.all_reduce(local, group=group)
            norms.append(local.pow(1 / norm_type))
    if replicas:
        norms.append(torch.nn.utils.get_total_norm(replicas, norm_type))
    for grads in by_mesh.values():
        norms.append(torch.nn.utils.get_total_norm(grads, norm_type).full_tensor())
    if not norms:
        return torch.zeros(())
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # a host sync, as in torch.nn.utils.clip_grad_norm_
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), "
                           "so it cannot be clipped; error_if_nonfinite=False clips anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in module.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def shard_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make optimizer.state_dict() hold the state of module's expert-parallel parameters as module.state_dict() holds
    the parameters: each state tensor with one entry per local expert along dim 0 (as many dims as the parameter,
    dim 0 of size E_local: AdamW's exp_avg and exp_avg_sq, SGD's momentum_buffer, ..., and Adafactor's factored
    row_var [E_local, 2I, 1] and col_var [E_local, 1, H]) as a DTensor [E, ...] sharded over the parameter's EP group,
    so that torch.distributed.checkpoint saves every rank's; optimizer.load_state_dict takes them back (and, as
    load_state_dict does, a one-process state of all experts: each rank keeps its rows). Registers a state_dict
    post-hook and a load_state_dict pre-hook on optimizer (call once, after building it); returns optimizer. Other
    parameters' state, and scalars (a step count), are left as they are."""
    _check_module("module", module)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    groups = {key: group for key, (_, group) in _expert_groups(module).items()}
    optimizer.register_state_dict_post_hook(functools.partial(_shard_optimizer_state, groups))
    optimizer.register_load_state_dict_pre_hook(functools.partial(_load_optimizer_shards, groups))
    return optimizer


def _expert_entries(groups: dict, optimizer: torch.optim.Optimizer, state_dict: dict, state: dict):
    """(key, parameter, EP group, a copy of its entry of `state`) of each expert parameter with state. The keys are
    the ones state_dict's param_groups list, in the order of optimizer.param_groups' parameters (as
    Optimizer.load_state_dict pairs them): indices from Optimizer.state_dict(), names from torch's
    get_optimizer_state_dict."""
    keys = [key for param_group in state_dict["param_groups"] for key in param_group["params"]]
    params = [p for param_group in optimizer.param_groups for p in param_group["params"]]
    for key, p in zip(keys, params):
        entry = state.get(key)
        if id(p) in groups and entry:
            yield key, p, groups[id(p)], dict(entry)


def _per_expert(value, p: torch.Tensor) -> bool:
    """Whether an optimizer state entry of expert parameter p may hold one entry per expert along dim 0: a tensor with
    as many dims as p. Not only p's shape: Adafactor factors its second moment of p [E_local, R, C] into row_var
    [E_local, R, 1] and col_var [E_local, 1, C], per expert too (left per rank, DCP would keep one rank's)."""
    return isinstance(value, torch.Tensor) and value.dim() == p.dim() > 0


def _shard_optimizer_state(groups: dict, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    # state_dict["state"] is state_dict()'s own dict, but its entries are the optimizer's live ones: replaced, not
    # changed.
    for key, p, group, entry in _expert_entries(groups, optimizer, state_dict, state_dict["state"]):
        names = tuple(k for k, v in entry.items() if _per_expert(v, p) and v.shape[0] == p.shape[0])
        shard_expert_state(entry, "", names, group)
        state_dict["state"][key] = entry


def _load_optimizer_shards(groups: dict, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    state = dict(state_dict["state"])  # the caller's nested dicts stay as they are
    for key, p, group, entry in _expert_entries(groups, optimizer, state_dict, state):
        names = tuple(k for k, v in entry.items() if _per_expert(v, p))
        load_expert_shards(entry, "", names, group, p.shape[0], where=f"optimizer state_dict['state'][{key!r}]")
        state[key] = entry
    return {**state_dict, "state": state}
