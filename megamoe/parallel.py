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

Checkpoints: module.state_dict() holds each rank's expert slice as a plain tensor under the same name on every
rank, which torch.distributed.checkpoint (DCP) takes for a replica and saves from one rank only: every rank would
load that rank's experts. Save and load through distributed_state_dict(module) instead, which presents them as
DTensors sharded over their EP group (global shape [E, ...]):

    dcp.save(megamoe.parallel.distributed_state_dict(model), checkpoint_id=path)
    dcp.load(megamoe.parallel.distributed_state_dict(model), checkpoint_id=path)    # in place

Tested on CPU with gloo (tests/test_distributed_wrappers.py) against a one-process run of the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megamoe.config import check_group
# The mark patch_model leaves on the modules it patched: from a module of its own, not from integrations.hf,
# so that `import megamoe` (which imports this module) never loads the Hugging Face adapter or transformers.
from megamoe.integrations._patch_attr import PATCH_ATTR as _HF_PATCH_ATTR
from megamoe.layer import MoELayer

__all__ = ["ddp_ignore_experts", "distributed_state_dict", "expert_parameters", "non_expert_parameters",
           "reduce_expert_grads"]


def _expert_groups(module: nn.Module) -> dict[int, tuple[nn.Parameter, object]]:
    """id(parameter) -> (parameter, EP group) for every expert-parallel parameter under module."""
    found = {}
    for sub in module.modules():
        if isinstance(sub, MoELayer):
            group, params = sub.group, (sub.w_gate_up, sub.w_down)
        else:
            patch = getattr(sub, _HF_PATCH_ATTR, None)
            # The patch record sits on the experts module and, for DeepSeek-V3, on its block too; only the
            # experts module owns the sharded parameters.
            if patch is None or patch.local_slice is None or not hasattr(sub, "gate_up_proj"):
                continue
            group, params = patch.group, (sub.gate_up_proj, sub.down_proj)
        if group is None:
            continue  # all experts on every rank: ordinary replicas, averaged by the wrapper like the rest
        for p in params:
            found[id(p)] = (p, group)
    return found


def expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The expert-parallel parameters of `module`, by their names in module.named_parameters().

    These are the w_gate_up / w_down of every MoELayer built with a group, and the gate_up_proj / down_proj
    of every Hugging Face experts module patched with a group. Expert weights of layers without a group are
    replicas like any other parameter and are not returned. Pass the names to DDP's
    `_set_params_and_buffers_to_ignore_for_model` and the values to fully_shard's `ignored_params`.
    """
    found = _expert_groups(module)
    return {name: p for name, p in module.named_parameters() if id(p) in found}


def non_expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter of `module` but expert_parameters(module), by name: what DDP / FSDP2 manage.

    Under FSDP2 these become DTensors while the experts stay plain tensors, and a foreach optimizer (the
    default on CUDA) cannot mix the two in one parameter group ("got mixed torch.Tensor and DTensor"):
    give the optimizer one group of each.
    """
    found = _expert_groups(module)
    return {name: p for name, p in module.named_parameters() if id(p) not in found}


def distributed_state_dict(module: nn.Module) -> dict:
    """module.state_dict() with every expert-parallel parameter as a DTensor over its EP group, sharded on dim 0
    (global shape [E, ...]; rank r's shard is its experts [r*E_l, (r+1)*E_l)), for torch.distributed.checkpoint.

    A plain module.state_dict() holds rank r's expert slice under the same name on every rank; DCP takes such
    tensors for replicas and writes one rank's only, so a checkpoint saved from it silently lost the other ranks'
    experts (each rank loaded one rank's). The DTensors share storage with the parameters: dcp.load into this
    dict loads the experts in place, and every other entry (FSDP2's DTensors included) is the module's own.
    Replicas over a data-parallel group (2-D layout) hold the same shards; DCP writes each shard once.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    found = _expert_groups(module)
    state = module.state_dict()
    names = {id(p): name for name, p in module.named_parameters()}
    meshes = {}
    for key, (p, group) in found.items():
        name = names.get(key)
        if name is None or name not in state:
            continue
        if id(group) not in meshes:
            meshes[id(group)] = DeviceMesh.from_group(group, p.device.type)
        mesh, world = meshes[id(group)], dist.get_world_size(group)
        shape = torch.Size((p.shape[0] * world, *p.shape[1:]))
        state[name] = DTensor.from_local(p.detach(), mesh, [Shard(0)], run_check=False, shape=shape,
                                         stride=torch.empty(shape, device="meta").stride())
    return state


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
    that rank holds different experts, whose gradients the sum would mix into these.
    """
    check_group("dp_group", dp_group)
    found = _expert_groups(module).values()
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
