"""Expert-parallel weights in state dicts: each rank's experts as its shard of the global [E, ...] tensor.

Rank r of an expert-parallel group holds experts [r*E_l, (r+1)*E_l) of every expert weight as a plain tensor
[E_l, ...] (the kernels take it as it is). Under the same name on every rank, such a tensor reads as a replica
to torch.distributed.checkpoint (DCP), which would write one rank's copy only; so the state dicts of
MoELayer(group=...) and of patched Hugging Face experts (integrations.hf.patch_model(..., group=...)) present
these weights as DTensors over the group, sharded on dim 0, with the global shape [E, ...]. They share storage
with the parameters (dcp.load into model.state_dict() loads them in place), and torch.save / torch.load keep
them as DTensors. state_dict(keep_vars=True) keeps the parameters themselves ([E_l, ...]), as torch promises.

Loading accepts, per expert weight:
    a DTensor sharded on dim 0 (Shard(0)) or replicated over the same ranks, global shape [E, ...]: this
        rank's experts (the state dict of an expert-parallel model, e.g. through DCP). A shard must be this rank's
        own: one rank's state dict (torch.save(model.state_dict()) on rank 0 alone) holds that rank's experts only,
        and loading it on another rank is a ValueError;
    a plain tensor [E, ...] (a one-process checkpoint of all experts): a copy of this rank's rows of it;
    a plain tensor [E_l, ...]: as it is (this rank's own slice, as saved before these were DTensors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _mesh(group, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def expert_state_names(module: torch.nn.Module, weights: tuple[str, ...], num_local: int) -> tuple[str, ...]:
    """The state dict entries (below module's prefix) of this rank's experts of module's expert weights: each weight
    or, parametrized (torch.nn.utils.parametrize, e.g. weight_norm), those of its originals with num_local entries
    along dim 0 (the others, e.g. a scalar, are no expert's and stay plain)."""
    from torch.nn.utils import parametrize

    names = []
    for weight in weights:
        if not parametrize.is_parametrized(module, weight):
            names.append(weight)
            continue
        names += [f"parametrizations.{weight}.{original}"
                  for original, p in module.parametrizations[weight].named_parameters(recurse=False)
                  if p.dim() > 0 and p.shape[0] == num_local]
    return tuple(names)


def shard_expert_state(state: dict, prefix: str, names: tuple[str, ...], group) -> None:
    """Replace state[prefix + name], this rank's [E_l, ...] experts, by the DTensor [E, ...] they are the shard of
    (in place; names absent from state are skipped). Left as they are: tensors on the meta device (no mesh there)
    and parameters themselves (state_dict(keep_vars=True), whose contract is the module's own variables)."""
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size(group)
    for name in names:
        local = state.get(prefix + name)
        if (local is None or isinstance(local, (DTensor, torch.nn.Parameter)) or local.device.type == "meta"):
            continue
        shape = torch.Size((local.shape[0] * world, *local.shape[1:]))
        state[prefix + name] = DTensor.from_local(
            local.detach(), _mesh(group, local.device.type), [Shard(0)], run_check=False, shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )


def load_expert_shards(state: dict, prefix: str, names: tuple[str, ...], group, num_local: int, *,
                       where: str = "state_dict") -> None:
    """Replace state[prefix + name] by this rank's [num_local, ...] experts of it (in place; the module
    docstring lists what is accepted). Raises ValueError naming the entry, as where[prefix + name], for a DTensor that
    is neither sharded on dim 0 nor replicated over this group's ranks, whose global shape does not hold num_local
    experts per rank, or that is the shard of another rank of the group (its mesh, pickled with it, says which)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    first = rank * num_local
    for name in names:
        key = prefix + name
        value = state.get(key)
        if value is None or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            ranks = value.device_mesh.mesh.flatten().tolist()
            placements = tuple(value.placements)
            if (ranks != dist.get_process_group_ranks(group) or placements not in ((Shard(0),), (Replicate(),))
                    or value.dim() == 0 or value.shape[0] != num_local * world):
                raise ValueError(
                    f"{where}[{key!r}] must be a DTensor [E={num_local * world}, ...] sharded on dim 0 (Shard(0)) or "
                    f"replicated over the expert-parallel group's ranks {dist.get_process_group_ranks(group)}, or a "
                    f"plain tensor; got a DTensor of shape {tuple(value.shape)} with placements {placements} over "
                    f"ranks {ranks}"
                )
            saved_by = value.device_mesh.get_coordinate()  # None where the saver was outside the mesh: an empty shard
            if placements == (Shard(0),) and saved_by is not None and saved_by != (rank,):
                raise ValueError(
                    f"{where}[{key!r}] is the shard of experts [{saved_by[0] * num_local}, "
                    f"{(saved_by[0] + 1) * num_local}) that rank {saved_by[0]} of the expert-parallel group saved, but "
                    f"this is rank {rank}, which holds experts [{first}, {first + num_local}): a state dict of one "
                    "rank (e.g. torch.save(model.state_dict()) on rank 0 alone) holds that rank's experts only. Load "
                    "each rank's own state dict, load through torch.distributed.checkpoint, or save the full experts "
                    "(value.full_tensor() on every rank)"
                )
            local = value.to_local()
            # A copy of this rank's rows, not a view: a view would keep all E experts alive in what it is loaded
            # into (load_state_dict(assign=True), e.g. after meta-device init; an optimizer's state).
            state[key] = local if placements == (Shard(0),) else local[first : first + num_local].clone()
        elif value.dim() > 0 and value.shape[0] == num_local * world and world > 1:
            state[key] = value[first : first + num_local].clone()
