"""MoELayer under DDP and FSDP2 (fully_shard) with expert parallelism, on CPU with gloo.

One spawn per layout (a module-scoped fixture): 2 processes for the 1-D layout (DP group == EP group), 4 for
the 2-D DeviceMesh ("dp", "ep") = 2 x 2. Each worker runs every wrapper recipe for one training step
(forward + backward + reduce_expert_grads + SGD) on its share of one global batch and saves its parameters;
the parent checks them against a single process that trains one full MoELayer on the whole batch.

Convention (megamoe.parallel): every parameter gets the gradient of L = (1/N) sum_r L_r, the mean over the
N ranks of each rank's loss; L_r = sum(out_r * d_out_r) + AUX * aux_loss_r over rank r's tokens x_r. This
is DDP's averaging for the router and shared expert; for an expert it is (1/N) x the gradient of all
tokens routed to it, from every rank. The single process computes exactly that: one layer holding all E
experts, run once per rank's tokens (aux_loss is per rank), the N losses averaged, one backward, one step.
"""

from __future__ import annotations

import math
import os
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from megamoe import MoELayer
from megamoe.parallel import (
    clip_grad_norm_, ddp_ignore_experts, expert_parameters, non_expert_parameters, reduce_expert_grads,
    shard_optimizer_state,
)
from conftest import assert_close_tight, init_gloo, leave_gloo, rel_err, run_gloo_workers

T, H, I, I_SHARED, K = 6, 8, 4, 4, 2  # tokens per rank, hidden, expert and shared intermediate, top-k
EXPERTS_PER_RANK = 2  # of the EP group
AUX, LR = 0.1, 0.5
TOL = 1e-12  # fp64: only the order of the sums differs from the single process
SPAWN_TIMEOUT_S = 120
LAYOUTS = {"1d-W2": dict(world=2, dp=1), "2d-dp2xep2": dict(world=4, dp=2)}
# "-clip": then clip_grad_norm_ (the single process: torch's); the last three: mistakes, the first of them refused
RECIPES = ("ddp", "fsdp2", "ddp-clip", "fsdp2-clip", "ddp-naive", "ddp-no-reduce", "ddp-torch-clip")
MAX_NORM = 0.05  # well below the gradient's norm (checked), so clipping changes every parameter


def _ep_size(layout: dict) -> int:
    return layout["world"] // layout["dp"]


def make_problem(layout: dict) -> dict:
    """Initial full-layer state (all E experts) and the global batch, rank r's tokens at [r*T, (r+1)*T)."""
    gen = torch.Generator().manual_seed(7 + layout["world"])
    num_experts = EXPERTS_PER_RANK * _ep_size(layout)
    layer = MoELayer(H, I, num_experts, K, shared_intermediate_size=I_SHARED, dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
    n = layout["world"] * T
    return dict(state=layer.state_dict(), num_experts=num_experts,
                x=torch.randn(n, H, generator=gen, dtype=torch.float64),
                d_out=torch.randn(n, H, generator=gen, dtype=torch.float64))


def _layer(problem: dict, group=None, expert_slice=slice(None)) -> MoELayer:
    layer = MoELayer(H, I, problem["num_experts"], K, shared_intermediate_size=I_SHARED, group=group,
                     dtype=torch.float64)
    state = dict(problem["state"])
    state["w_gate_up"], state["w_down"] = state["w_gate_up"][expert_slice], state["w_down"][expert_slice]
    layer.load_state_dict(state)
    return layer


def _loss(out: torch.Tensor, layer: MoELayer, d_out: torch.Tensor) -> torch.Tensor:
    return (out * d_out).sum() + AUX * layer.aux_loss


def single_process_step(problem: dict, world: int, clip: bool = False) -> dict[str, torch.Tensor]:
    """Parameters after one SGD step on the gradient of (1/N) sum_r L_r, all experts in one layer; with clip, the
    gradient clipped to MAX_NORM first (torch.nn.utils.clip_grad_norm_; its norm under "norm")."""
    layer = _layer(problem)
    losses = []
    for r in range(world):
        tok = slice(r * T, (r + 1) * T)
        losses.append(_loss(layer(problem["x"][tok]), layer, problem["d_out"][tok]))
    (sum(losses) / world).backward()
    norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), MAX_NORM) if clip else None
    torch.optim.SGD(layer.parameters(), lr=LR).step()
    return {"norm": norm, **{n: p.detach() for n, p in layer.named_parameters()}}


# --------------------------------------------------------------------------------------------- workers


def _step(recipe: str, problem: dict, rank: int, world: int, mesh) -> dict[str, torch.Tensor]:
    """One training step of this rank under `recipe`; returns its full (unsharded) parameters."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    ep_group = mesh["ep"].get_group()
    dp_group = mesh["dp"].get_group() if "dp" in mesh.mesh_dim_names else None
    ep_rank = dist.get_rank(ep_group)
    layer = _layer(problem, ep_group, slice(ep_rank * EXPERTS_PER_RANK, (ep_rank + 1) * EXPERTS_PER_RANK))
    experts = expert_parameters(layer)
    if recipe in ("ddp", "ddp-clip", "ddp-no-reduce", "ddp-torch-clip"):
        # The layer is the wrapped module itself in the 1-D layout (the case DDP's own ignore list gets
        # wrong, see ddp_ignore_experts) and a submodule in the 2-D one.
        root = layer if dp_group is None else torch.nn.Sequential(layer)
        ddp_ignore_experts(root)
        model = DistributedDataParallel(root)  # the default group: the whole world
    elif recipe == "ddp-naive":  # the mistake the recipe avoids: DDP treats the experts as replicas
        return _ddp_naive_rejections(DistributedDataParallel(layer if dp_group is None else torch.nn.Sequential(layer)),
                                     problem["x"][rank * T:(rank + 1) * T])
    elif recipe in ("fsdp2", "fsdp2-clip"):
        from torch.distributed.device_mesh import init_device_mesh

        world_mesh = init_device_mesh("cpu", (world,))  # non-expert parameters: sharded over every rank
        model = fully_shard(layer, mesh=world_mesh, ignored_params=set(experts.values()))
    else:
        raise ValueError(recipe)
    tok = slice(rank * T, (rank + 1) * T)
    with warnings.catch_warnings():
        # FSDP2 warns that MoELayer returns a view (out.view_as(x)); nothing here modifies it in place.
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        out = model(problem["x"][tok])
    _loss(out, layer, problem["d_out"][tok]).backward()
    if recipe != "ddp-no-reduce":
        reduce_expert_grads(layer, dp_group=dp_group)
    norm = None
    if recipe.endswith("-clip"):
        clip = torch.nn.utils.clip_grad_norm_ if recipe == "ddp-torch-clip" else clip_grad_norm_
        norm = clip(layer.parameters() if recipe == "ddp-torch-clip" else layer, MAX_NORM)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    # Two groups, foreach: under FSDP2 one group mixing DTensors and the plain expert tensors would fail.
    groups = [{"params": list(experts.values())}, {"params": list(non_expert_parameters(layer).values())}]
    torch.optim.SGD(groups, lr=LR, foreach=True).step()
    return {"norm": norm, **{n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                             for n, p in layer.named_parameters()}}


def _ddp_naive_rejections(model, x: torch.Tensor) -> dict[str, str | None]:
    """What reduce_expert_grads, clip_grad_norm_ and the forward raise (or None) on a DDP wrapper that was not told to
    ignore the experts."""
    found = {}
    for name, call in (("reduce_expert_grads", lambda: reduce_expert_grads(model)),
                       ("clip_grad_norm_", lambda: clip_grad_norm_(model, MAX_NORM)),
                       ("forward", lambda: model(x))):
        try:
            call()
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def _overlapping_dp_groups(problem: dict, mesh) -> dict[str, tuple[str | None, bool]]:
    """reduce_expert_grads with a dp_group that shares ranks with the EP group (the EP group itself; the world,
    which in the 2-D layout holds the EP group): per group, (the ValueError's text or None, whether every
    gradient was left untouched). Without the check each is a valid collective that completes on every rank."""
    ep_group = mesh["ep"].get_group()
    found = {}
    for name, dp_group in (("ep group", ep_group), ("world", dist.group.WORLD)):
        layer = _layer(problem, ep_group, slice(0, EXPERTS_PER_RANK))
        error = None
        try:
            reduce_expert_grads(layer, dp_group=dp_group)
        except ValueError as e:
            error = str(e)
        found[name] = (error, all(p.grad is None for p in layer.parameters()))
    return found


def _worker(rank: int, world: int, port: int, dp: int, in_path: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_gloo(rank, world, port)
    if dp == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    else:
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "ep"))
    problem = torch.load(in_path, weights_only=False)
    layer = _layer(problem, mesh["ep"].get_group(), slice(0, EXPERTS_PER_RANK))
    results = {"expert_names": sorted(expert_parameters(layer)), "non_expert_names": sorted(non_expert_parameters(layer))}
    for recipe in RECIPES:
        try:
            results[recipe] = _step(recipe, problem, rank, world, mesh)
        except Exception as e:  # noqa: BLE001 - reported by the parent with the traceback
            results[recipe] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            break  # a failed collective leaves the ranks out of step: later recipes would hang
    else:
        results["overlapping_dp_groups"] = _overlapping_dp_groups(problem, mesh)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=str)
def run(request, tmp_path_factory):
    """(layout, problem, results[rank][recipe]) from one spawn of the layout's gloo processes."""
    layout = LAYOUTS[request.param]
    world = layout["world"]
    problem = make_problem(layout)
    tmp = tmp_path_factory.mktemp(request.param)
    in_path = str(tmp / "problem.pt")
    torch.save(problem, in_path)
    results = run_gloo_workers(_worker, world, (layout["dp"], in_path, str(tmp)), tmp, SPAWN_TIMEOUT_S, request.param)
    return layout, problem, results


def _params(results, rank: int, recipe: str) -> dict:
    res = results[rank].get(recipe)
    assert res is not None, f"rank {rank}: {recipe} did not run (an earlier recipe failed)"
    if "error" in res:
        pytest.fail(f"rank {rank}: {recipe} raised {res['error']}\n{res['traceback']}")
    return res


def _expected_on_rank(expected: dict, layout: dict, rank: int) -> dict:
    """The single process's parameters as rank `rank` holds them: its EP slice of the experts."""
    ep_rank = rank % _ep_size(layout)  # mesh ("dp", "ep") is row-major: consecutive ranks form an EP group
    experts = slice(ep_rank * EXPERTS_PER_RANK, (ep_rank + 1) * EXPERTS_PER_RANK)
    return {n: (p[experts] if n in ("w_gate_up", "w_down") else p) for n, p in expected.items()}


@pytest.mark.parametrize("recipe", ["ddp", "fsdp2", "ddp-clip", "fsdp2-clip"])
def test_one_step_matches_single_process(run, recipe):
    """Each rank's parameters after one step are the single process's (with -clip: the gradient clipped by
    parallel.clip_grad_norm_ there, by torch's clip_grad_norm_ over all experts in the single process)."""
    layout, problem, results = run
    clip = recipe.endswith("-clip")
    expected = single_process_step(problem, layout["world"], clip=clip)
    if clip:
        assert expected["norm"] > 4 * MAX_NORM, f"the gradient's norm {expected['norm']} is not clipped by {MAX_NORM}"
    for rank in range(layout["world"]):
        got = _params(results, rank, recipe)
        want = _expected_on_rank(expected, layout, rank)
        assert got.keys() == want.keys(), f"rank {rank}: parameters {sorted(got)}"
        for name, value in want.items():
            if value is not None:
                assert_close_tight(f"{recipe} rank {rank}: {name} after one step", got[name], value, TOL)


def test_ddp_managing_the_experts_is_a_value_error(run):
    """DDP over every parameter (ddp_ignore_experts not called) broadcast rank 0's experts over the others' at
    construction and would average different experts' gradients: the forward, reduce_expert_grads and
    clip_grad_norm_ refuse it, naming the parameter and the fix. Before, the step ran and trained the wrong experts."""
    layout, _, results = run
    prefix = "" if layout["dp"] == 1 else "0."  # the layer wrapped directly, or inside a Sequential
    for rank in range(layout["world"]):
        res = _params(results, rank, "ddp-naive")
        for name, error in res.items():
            assert error is not None, f"rank {rank}: {name} accepted experts managed by DDP"
            assert error.startswith(f"expert-parallel parameter '{prefix}w_gate_up' is managed by "
                                    "DistributedDataParallel") and "ddp_ignore_experts" in error, f"{name}: {error}"


@pytest.mark.parametrize("recipe", ["ddp-no-reduce", "ddp-torch-clip"])
def test_mistakes_do_not_match(run, recipe):
    """Negative controls, so the comparison above can fail. ddp-no-reduce: experts
    ignored by DDP but reduce_expert_grads not called, so their gradients are sums over the EP group's
    tokens instead of the mean objective's (and miss the other dp replicas' tokens in the 2-D layout).
    ddp-torch-clip: torch's clip_grad_norm_ on each rank sees that rank's experts only, so the ranks scale by
    different factors and even the replicas (router, shared expert) differ between ranks."""
    layout, problem, results = run
    expected = single_process_step(problem, layout["world"], clip=recipe == "ddp-torch-clip")
    if recipe == "ddp-torch-clip":
        routers = [_params(results, rank, recipe)["router.weight"] for rank in range(layout["world"])]
        assert max(rel_err(r, routers[0]) for r in routers) > 1e-6, "the replicated router agrees on every rank"
    errors = []
    for rank in range(layout["world"]):
        got, want = _params(results, rank, recipe), _expected_on_rank(expected, layout, rank)
        errors.append(max(rel_err(got[n], want[n]) for n in ("w_gate_up", "w_down")))
        if recipe == "ddp-no-reduce":  # only the experts are wrong
            for name in ("router.weight", "shared_gate_up", "shared_down"):
                assert_close_tight(f"{recipe} rank {rank}: {name} after one step", got[name], want[name], TOL)
    # Clipping by a wrong factor moves a step's update, not the parameters, by that factor: a smaller bound.
    bound = 1e-6 if recipe == "ddp-torch-clip" else 1e-3
    assert min(errors) > bound, f"{recipe} matched the single process on some rank (rel errors per rank {errors})"


def test_reduce_expert_grads_rejects_an_overlapping_dp_group(run):
    """A dp_group sharing a rank with the EP group (there: other experts) would sum different experts'
    gradients: refused, naming dp_group, before any gradient is touched."""
    layout, _, results = run
    for rank in range(layout["world"]):
        checks = results[rank].get("overlapping_dp_groups")
        assert checks is not None, f"rank {rank}: not run (a recipe failed)"
        for name, (error, untouched) in checks.items():
            assert error is not None, f"rank {rank}: dp_group={name} (shares ranks with the EP group) was accepted"
            assert error.startswith("dp_group must be") and "share ranks" in error, error
            assert untouched, f"rank {rank}: dp_group={name}: a gradient was set before the error"


def test_expert_parameters_of_expert_parallel_layer(run):
    layout, _, results = run
    for rank in range(layout["world"]):
        assert results[rank]["expert_names"] == ["w_down", "w_gate_up"], f"rank {rank}"
        assert results[rank]["non_expert_names"] == ["router.weight", "shared_down", "shared_gate_up"], f"rank {rank}"
    replicated = MoELayer(H, I, 4, K, shared_intermediate_size=I_SHARED)
    assert expert_parameters(replicated) == {}, "without a group the experts are replicas, not expert parameters"
    assert len(non_expert_parameters(replicated)) == 5


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parameters_of_patched_hf_model(family):
    """Patched experts modules with a group are found by name (DeepSeek-V3 also marks its block, which owns no
    experts). The group is a stand-in: expert_parameters only reads the patch record."""
    import dataclasses

    pytest.importorskip("transformers")
    from megamoe.integrations import hf
    from test_hf import _model

    model = hf.patch_model(_model(family))
    assert expert_parameters(model) == {}, "patched without a group: replicas"
    for module in model.modules():
        patch = getattr(module, "_megamoe_patch", None)
        if patch is not None:
            setattr(module, "_megamoe_patch", dataclasses.replace(patch, group=object(), local_slice=(0, 1)))
    names = [n for n, _ in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert names, "the tiny model has MoE layers"
    assert list(expert_parameters(model)) == names


# --------------------------------------------------------------------------------------------- init and checkpoints


def _init_and_dcp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Per rank: the experts of MoELayer(group=WORLD) built under the seed every rank uses (the replicated router
    needs it), and what each way of checkpointing restores into a fresh layer built under another seed: DCP through
    model.state_dict(), torch.save / torch.load of each rank's state_dict, and a one-process state dict of all
    experts; a DCP round trip of plain per-rank tensors under one name (the negative control); a deep copy."""
    import copy

    import torch.distributed.checkpoint as dcp

    init_gloo(rank, world, port)
    torch.manual_seed(0)
    layer = MoELayer(H, I, EXPERTS_PER_RANK * world, K, shared_intermediate_size=I_SHARED, group=dist.group.WORLD)
    results = {"init": {n: p.detach().clone() for n, p in layer.named_parameters()}}

    def fresh() -> MoELayer:
        torch.manual_seed(1)
        return MoELayer(H, I, EXPERTS_PER_RANK * world, K, shared_intermediate_size=I_SHARED, group=dist.group.WORLD)

    def restored(model: MoELayer) -> dict[str, bool]:
        return {n: torch.equal(p, saved[n]) for n, p in model.named_parameters()}

    try:
        with torch.no_grad():  # rank-specific experts, replicated router and shared expert
            layer.w_gate_up.add_(rank)
            layer.w_down.add_(rank)
        saved = {n: p.detach().clone() for n, p in layer.named_parameters()}
        state = layer.state_dict()
        results["state_types"] = {n: type(t).__name__ for n, t in state.items()}
        results["global_shapes"] = {n: tuple(t.shape) for n, t in state.items()}

        path = os.path.join(out_dir, "ckpt-dcp")
        dcp.save(layer.state_dict(), checkpoint_id=path)
        results["dcp_path"], results["saved"] = path, saved
        model = fresh()
        loaded = model.state_dict()
        dcp.load(loaded, checkpoint_id=path)
        model.load_state_dict(loaded)
        results["dcp"] = restored(model)

        path = os.path.join(out_dir, f"ckpt-rank{rank}.pt")
        torch.save(layer.state_dict(), path)
        model = fresh()
        model.load_state_dict(torch.load(path, weights_only=True))
        results["torch.save"] = restored(model)
        dist.barrier()  # every rank's file is written
        # Another rank's state dict, as every rank loads it after torch.save on rank 0 alone
        other = torch.load(os.path.join(out_dir, f"ckpt-rank{(rank + 1) % world}.pt"), weights_only=True)
        try:
            fresh().load_state_dict(other)
            results["other rank's"] = None
        except ValueError as e:
            results["other rank's"] = str(e)
        # ... and so is another rank's optimizer state dict (its sharded momentum of the experts)
        model = fresh()
        opt = shard_optimizer_state(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        torch.save(opt.state_dict(), os.path.join(out_dir, f"optim-rank{rank}.pt"))
        dist.barrier()
        other = torch.load(os.path.join(out_dir, f"optim-rank{(rank + 1) % world}.pt"), weights_only=True)
        try:
            shard_optimizer_state(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)).load_state_dict(other)
            results["other rank's optimizer"] = None
        except ValueError as e:
            results["other rank's optimizer"] = str(e)

        full = {n: t.full_tensor() if n in ("w_gate_up", "w_down") else t for n, t in layer.state_dict().items()}
        model = fresh()
        model.load_state_dict(full)  # as a one-process checkpoint of all experts
        results["one-process"] = restored(model)

        # Loaded by assignment (a layer built on meta) and into an optimizer, the one-process state's rows are this
        # rank's own tensors, not views keeping all E experts alive.
        meta = MoELayer(H, I, EXPERTS_PER_RANK * world, K, shared_intermediate_size=I_SHARED, group=dist.group.WORLD,
                        device="meta")
        meta.load_state_dict(full, assign=True)
        one = MoELayer(H, I, EXPERTS_PER_RANK * world, K, shared_intermediate_size=I_SHARED)
        one_opt = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
        for p in one.parameters():
            p.grad = torch.ones_like(p)
        one_opt.step()
        opt = shard_optimizer_state(meta, torch.optim.SGD(meta.parameters(), lr=0.1, momentum=0.9))
        opt.load_state_dict(one_opt.state_dict())
        own = {n: p for n, p in meta.named_parameters() if n in ("w_gate_up", "w_down")}
        own.update({f"{n} momentum": opt.state[p]["momentum_buffer"] for n, p in list(own.items())})
        results["own storage"] = {n: t.untyped_storage().nbytes() == t.numel() * t.element_size() for n, t in own.items()}
        results["assigned"] = restored(meta)

        path = os.path.join(out_dir, "ckpt-plain")
        dcp.save({n: p.detach() for n, p in layer.named_parameters()}, checkpoint_id=path)
        model = fresh()
        plain = {n: p.detach() for n, p in model.named_parameters()}
        dcp.load(plain, checkpoint_id=path)  # into the parameters, in place
        results["plain"] = restored(model)

        kept = layer.state_dict(keep_vars=True)  # torch's contract: the parameters themselves
        results["keep_vars"] = {n: kept[n] is p for n, p in layer.named_parameters()}

        for p in layer.parameters():  # the largest gradient entry is an expert's of the last rank
            p.grad = torch.full_like(p, 1.0 + (rank if p.dim() == 3 else 0))
        largest = clip_grad_norm_(layer, 1e9, "inf")  # the string, as torch takes it; nothing clipped
        results["inf_norm"] = (float(largest), float(world))
        if rank == world - 1:  # a NaN in the last rank's experts alone
            layer.w_down.grad[0, 0, 0] = float("nan")
        results["inf_norm_nan"] = float(clip_grad_norm_(layer, 1e9, "inf"))
        layer.zero_grad(set_to_none=True)

        copied = copy.deepcopy(layer)
        results["deepcopy"] = (copied.group is layer.group, restored(copied),
                               copied.w_gate_up.data_ptr() != layer.w_gate_up.data_ptr())

        for how in ("sharded", "plain"):  # the optimizer's state through DCP, and the negative control
            results[f"optim-{how}"] = _optimizer_round_trip(rank, fresh, os.path.join(out_dir, f"optim-{how}"),
                                                            shard=how == "sharded")
        # Adafactor's factored second moments of an expert weight are not of its shape, but per expert too
        results["optim-sharded-adafactor"] = _optimizer_round_trip(
            rank, fresh, os.path.join(out_dir, "optim-sharded-adafactor"), shard=True,
            optimizer_class=torch.optim.Adafactor)

        # A parametrized expert weight's originals hold this rank's experts: DDP must leave them alone.
        from torch.nn.parallel import DistributedDataParallel
        from torch.nn.utils import parametrizations

        normed = fresh()
        parametrizations.weight_norm(normed, "w_gate_up")
        before = {n: p.detach().clone() for n, p in normed.named_parameters()}
        results["parametrized names"] = sorted(expert_parameters(normed))
        ddp_ignore_experts(normed)
        DistributedDataParallel(normed)  # broadcasts rank 0's replicas at construction
        results["parametrized kept"] = {n: torch.equal(p, before[n]) for n, p in normed.named_parameters()}
        # ... and a DCP checkpoint keeps every rank's originals
        with torch.no_grad():
            for p in expert_parameters(normed).values():
                p.add_(rank + 1)
        path = os.path.join(out_dir, "ckpt-parametrized")
        dcp.save(normed.state_dict(), checkpoint_id=path)
        model = fresh()
        parametrizations.weight_norm(model, "w_gate_up")
        loaded = model.state_dict()
        dcp.load(loaded, checkpoint_id=path)
        model.load_state_dict(loaded)
        saved = dict(normed.named_parameters())
        results["parametrized dcp"] = {n: torch.equal(p, saved[n]) for n, p in model.named_parameters()}

        wrong = dict(state)
        wrong["w_down"] = wrong["w_down"].redistribute(placements=[Shard(1)])
        try:
            fresh().load_state_dict(wrong)
            results["wrong_placement"] = None
        except ValueError as e:
            results["wrong_placement"] = str(e)
    except Exception as e:  # noqa: BLE001 - reported by the parent with the traceback
        results["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


def _optimizer_round_trip(rank: int, fresh, path: str, shard: bool,
                          optimizer_class=torch.optim.AdamW) -> dict[str, bool]:
    """One optimizer_class step on rank-specific expert gradients, its state saved with DCP through torch's
    get_optimizer_state_dict and loaded into a fresh layer's optimizer with set_optimizer_state_dict: per parameter,
    whether every state tensor came back. shard: after parallel.shard_optimizer_state on both optimizers (else plain,
    which loses experts' state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def optimizer(layer):
        opt = optimizer_class(layer.parameters(), lr=1e-3)
        return shard_optimizer_state(layer, opt) if shard else opt

    layer = fresh()
    opt = optimizer(layer)
    experts = {id(p) for p in expert_parameters(layer).values()}
    for p in layer.parameters():  # the replicas' gradients agree across ranks, as after DDP's average
        p.grad = torch.full_like(p, rank + 1.0 if id(p) in experts else 1.0)
    opt.step()
    want = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in layer.named_parameters()}
    dcp.save({"model": layer.state_dict(), "optim": get_optimizer_state_dict(layer, opt)}, checkpoint_id=path)
    other = fresh()
    other_opt = optimizer(other)
    state = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state["model"])
    set_optimizer_state_dict(other, other_opt, state["optim"])
    return {n: all(torch.equal(other_opt.state[p][k], v) for k, v in want[n].items())
            for n, p in other.named_parameters()}


@pytest.fixture(scope="module")
def init_and_dcp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init-dcp")
    return run_gloo_workers(_init_and_dcp_worker, 2, (str(tmp),), tmp, SPAWN_TIMEOUT_S, "init and DCP")


def test_expert_parallel_init_is_the_single_process_layer_sharded(init_and_dcp):
    """Ranks seeded alike get different experts: the single-process layer's, each rank its slice (on the CPU
    generator exactly). Before: every rank drew the same E_local experts (global expert j == j + E_local)."""
    torch.manual_seed(0)
    full = MoELayer(H, I, EXPERTS_PER_RANK * 2, K, shared_intermediate_size=I_SHARED)
    for rank, res in enumerate(init_and_dcp):
        experts = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
        for name, p in full.named_parameters():
            want = p.detach()[experts] if name in ("w_gate_up", "w_down") else p.detach()
            assert torch.equal(res["init"][name], want), f"rank {rank}: {name} differs from the single-process init"


def test_checkpoints_keep_every_ranks_experts(init_and_dcp):
    """model.state_dict() of an expert-parallel layer holds its experts as DTensors [E, ...] sharded over the group:
    DCP, torch.save / torch.load and a one-process state dict of all experts each restore every rank's own experts
    (and the replicas); loaded by assignment or into an optimizer, a one-process state leaves copies of this rank's
    rows, not views of all experts. The negative control: plain per-rank tensors under one name, which DCP takes for
    replicas, lose experts. A deep copy shares the group and copies the weights; a DTensor sharded otherwise is
    refused."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
    for rank, res in enumerate(init_and_dcp):
        assert res["state_types"] == {"router.weight": "Tensor", "w_gate_up": "DTensor", "w_down": "DTensor",
                                      "shared_gate_up": "Tensor", "shared_down": "Tensor"}, f"rank {rank}"
        assert res["global_shapes"]["w_gate_up"] == (EXPERTS_PER_RANK * 2, 2 * I, H), f"rank {rank}"
        for how in ("dcp", "torch.save", "one-process", "assigned", "own storage"):
            assert all(res[how].values()), f"rank {rank}: {how} did not restore {res[how]}"
        assert all(res["keep_vars"].values()), f"rank {rank}: state_dict(keep_vars=True) {res['keep_vars']}"
        got, want = res["inf_norm"]
        assert got == want, f"rank {rank}: clip_grad_norm_ 'inf' norm {got}, want {want} (the largest over the ranks)"
        same_group, copied, own_storage = res["deepcopy"]
        assert same_group and all(copied.values()) and own_storage, f"rank {rank}: deepcopy {res['deepcopy']}"
        error = res["wrong_placement"]
        assert error is not None and "state_dict['w_down'] must be a DTensor" in error, (
            f"rank {rank}: a DTensor sharded on dim 1 was accepted: {error}")
    assert not all(all(res["plain"].values()) for res in init_and_dcp), "the plain round trip was exact"


def test_parametrized_experts_are_expert_parameters(init_and_dcp):
    """A parametrized expert weight (weight_norm on w_gate_up) is held by its originals: expert_parameters names them
    and DDP, after ddp_ignore_experts, leaves every rank's own; the state dict holds them as DTensor shards, so DCP
    restores every rank's. Before: reading layer.w_gate_up computed a new tensor, not a parameter, so the originals
    counted as replicas: DDP copied rank 0's experts over rank 1's, and DCP saved one rank's."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        assert res["parametrized names"] == ["parametrizations.w_gate_up.original0",
                                             "parametrizations.w_gate_up.original1", "w_down"], f"rank {rank}"
        assert all(res["parametrized kept"].values()), f"rank {rank}: changed by DDP {res['parametrized kept']}"
        assert all(res["parametrized dcp"].values()), f"rank {rank}: DCP did not restore {res['parametrized dcp']}"


def test_another_ranks_state_dict_is_a_value_error(init_and_dcp):
    """A state dict saved by one rank (torch.save(model.state_dict()) on rank 0 alone, then loaded everywhere) holds
    that rank's experts only: loading it on another rank is a ValueError naming the entry and the ranks. Before: each
    rank silently loaded the saver's experts as its own."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        error = res["other rank's"]
        saver = (rank + 1) % len(init_and_dcp)
        assert error is not None, f"rank {rank}: loaded rank {saver}'s experts as its own"
        assert error.startswith("state_dict['w_gate_up'] is the shard of experts") and (
            f"that rank {saver} of the expert-parallel group saved, but this is rank {rank}") in error, error


def test_another_ranks_optimizer_state_dict_names_the_entry(init_and_dcp):
    """Loading another rank's sharded optimizer state dict is the same ValueError, naming where the shard sits in the
    optimizer's state dict (parameter 0 is w_gate_up). Before: it named "state_dict['momentum_buffer']", a key of
    neither the model's nor the optimizer's state dict, and not which parameter's state it was."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        error = res["other rank's optimizer"]
        assert error is not None, f"rank {rank}: loaded another rank's optimizer state as its own"
        assert error.startswith("optimizer state_dict['state'][0]['momentum_buffer'] is the shard of experts"), error


def test_inf_norm_of_a_nan_in_one_ranks_experts_is_nan_on_every_rank(init_and_dcp):
    """clip_grad_norm_(..., "inf") with a NaN in the last rank's experts only: NaN on every rank, as torch's norm of the
    whole model's gradient is (so error_if_nonfinite raises everywhere). Before: gloo's MAX reduction dropped the NaN
    for the first rank's finite maximum, and every rank went on with a finite norm."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        assert math.isnan(res["inf_norm_nan"]), f"rank {rank}: inf norm {res['inf_norm_nan']}, want nan"


def test_optimizer_state_checkpoints_keep_every_ranks_experts(init_and_dcp):
    """After parallel.shard_optimizer_state, AdamW's state of every rank's experts survives a DCP round trip through
    torch's get/set_optimizer_state_dict; without it (the negative control) some rank gets another rank's. So does
    Adafactor's, whose factored moments (row_var [E_l, 2I, 1], col_var [E_l, 1, H]) are not of the weight's shape:
    they were left per rank, and every rank loaded one rank's."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        assert all(res["optim-sharded"].values()), f"rank {rank}: not restored {res['optim-sharded']}"
        assert all(res["optim-sharded-adafactor"].values()), (
            f"rank {rank}: Adafactor's state not restored {res['optim-sharded-adafactor']}")
    assert not all(all(res["optim-plain"].values()) for res in init_and_dcp), "the plain optimizer round trip was exact"


def test_dcp_checkpoint_of_expert_parallel_layer_loads_into_one_process(init_and_dcp):
    """DCP reshards: the 2-rank checkpoint loads into a one-process layer of all experts (no process group), each
    rank's experts at its rows."""
    import torch.distributed.checkpoint as dcp

    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
    layer = MoELayer(H, I, EXPERTS_PER_RANK * 2, K, shared_intermediate_size=I_SHARED)
    state = layer.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|not initialized).*")
        dcp.load(state, checkpoint_id=init_and_dcp[0]["dcp_path"])
    layer.load_state_dict(state)
    saved = [res["saved"] for res in init_and_dcp]
    for name, p in layer.named_parameters():
        want = torch.cat([s[name] for s in saved]) if name in ("w_gate_up", "w_down") else saved[0][name]
        assert torch.equal(p, want), f"{name}: not the ranks' saved values"


def _load_dcp_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    """Per rank: MoELayer(group=WORLD) at this world's size (E_local = E / world), loaded from the DCP checkpoint at
    path; saves its parameters (or the error)."""
    import torch.distributed.checkpoint as dcp

    init_gloo(rank, world, port)
    try:
        torch.manual_seed(1)
        layer = MoELayer(H, I, EXPERTS_PER_RANK * 2, K, shared_intermediate_size=I_SHARED, group=dist.group.WORLD)
        state = layer.state_dict()
        dcp.load(state, checkpoint_id=path)
        layer.load_state_dict(state)
        results = {n: p.detach().clone() for n, p in layer.named_parameters()}
    except Exception:  # noqa: BLE001 - reported by the test
        results = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


def test_dcp_checkpoint_of_two_ranks_loads_at_four(init_and_dcp, tmp_path):
    """DCP reshards across expert-parallel sizes: the 2-rank checkpoint loads into a 4-rank layer (one expert a
    rank), each rank's expert the saved one of its global index, the replicas as saved."""
    for rank, res in enumerate(init_and_dcp):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
    loaded = run_gloo_workers(_load_dcp_worker, 4, (init_and_dcp[0]["dcp_path"], str(tmp_path)), tmp_path,
                              SPAWN_TIMEOUT_S, "load at 4 ranks")
    saved = [res["saved"] for res in init_and_dcp]
    for rank, res in enumerate(loaded):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        for name, p in res.items():
            want = torch.cat([s[name] for s in saved])[rank : rank + 1] if name in ("w_gate_up", "w_down") else saved[0][name]
            assert torch.equal(p, want), f"rank {rank}: {name} is not the saved value of its experts"


# ------------------------------------------------------------------- FSDP2 mixed precision, experts ignored


def _fsdp2_mixed_precision_worker(rank: int, world: int, port: int, in_path: str, out_dir: str) -> None:
    """The README's FSDP2 recipe (1-D, experts in ignored_params) with MixedPrecisionPolicy(bf16 params, fp32
    reduce), built on meta, then to_empty, loaded and sharded: one forward + backward + reduce_expert_grads; saves the
    output's dtype and every parameter's full gradient (or the error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world, port)
    problem = torch.load(in_path, weights_only=False)
    try:
        with torch.device("meta"):
            layer = MoELayer(H, I, problem["num_experts"], K, shared_intermediate_size=I_SHARED, group=dist.group.WORLD)
        layer.to_empty(device="cpu")
        layer.load_state_dict(problem["state"])  # the one-process state of all experts: each rank keeps its own
        experts = expert_parameters(layer)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)), ignored_params=set(experts.values()), mp_policy=policy)
        tok = slice(rank * T, (rank + 1) * T)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            out = layer(problem["x"][tok])
        (out.float() * problem["d_out"][tok]).sum().add(AUX * layer.aux_loss).backward()
        reduce_expert_grads(layer)
        results = {"out_dtype": out.dtype, "grads": {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in layer.named_parameters()}}
    except Exception as e:  # noqa: BLE001 - reported by the parent with the traceback
        results = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


def test_fsdp2_mixed_precision_with_ignored_experts(tmp_path):
    """FSDP2's MixedPrecisionPolicy casts x, the router and the shared expert to bf16 for the forward but not the
    experts it ignores: the layer casts them too (as autocast would), and every gradient is fp32, near a single
    process under autocast. Before: TypeError "x must have the layer's dtype torch.float32" at the first forward."""
    world = 2
    problem = make_problem(LAYOUTS["1d-W2"])
    problem["state"] = {k: v.float() for k, v in problem["state"].items()}
    problem["x"], problem["d_out"] = problem["x"].float(), problem["d_out"].float()
    in_path = str(tmp_path / "problem.pt")
    torch.save(problem, in_path)
    results = run_gloo_workers(_fsdp2_mixed_precision_worker, world, (in_path, str(tmp_path)), tmp_path,
                               SPAWN_TIMEOUT_S, "FSDP2 mixed precision")
    for rank, res in enumerate(results):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}\n{res['traceback']}")
    layer = MoELayer(H, I, problem["num_experts"], K, shared_intermediate_size=I_SHARED)
    layer.load_state_dict(problem["state"])
    losses = []
    for r in range(world):
        tok = slice(r * T, (r + 1) * T)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(problem["x"][tok])
        losses.append((out.float() * problem["d_out"][tok]).sum() + AUX * layer.aux_loss)
    (sum(losses) / world).backward()
    for rank, res in enumerate(results):
        assert res["out_dtype"] == torch.bfloat16, f"rank {rank}"
        experts = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
        for name, p in layer.named_parameters():
            want = p.grad[experts] if name in ("w_gate_up", "w_down") else p.grad
            got = res["grads"][name]
            assert got.dtype == torch.float32, f"rank {rank}: d_{name} is {got.dtype}"
            assert rel_err(got, want) < 2e-2, f"rank {rank}: d_{name} rel err {rel_err(got, want):.3e}"


# ------------------------------------------------------------------- FSDP2 managing the experts (a mistake)


def _fsdp2_experts_not_ignored_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """fully_shard(layer) without ignored_params, which shards and all-gathers each rank's own experts as one
    replicated tensor: one forward + backward, then what reduce_expert_grads and clip_grad_norm_ raise (or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world, port)
    results = {}
    try:
        torch.manual_seed(0)
        layer = MoELayer(H, I, EXPERTS_PER_RANK * world, K, group=dist.group.WORLD, dtype=torch.float64)
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            layer(torch.randn(T, H, dtype=torch.float64)).sum().backward()
        for name, call in (("reduce_expert_grads", lambda: reduce_expert_grads(layer)),
                           ("clip_grad_norm_", lambda: clip_grad_norm_(layer, 1.0))):
            try:
                call()
                results[name] = None
            except Exception as e:  # noqa: BLE001 - the parent checks the type and message
                results[name] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - reported by the parent with the traceback
        results["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


def test_fsdp2_managing_the_experts_is_a_value_error(tmp_path):
    """Experts left out of fully_shard's ignored_params become DTensors whose shards are different ranks' experts:
    reduce_expert_grads and clip_grad_norm_ refuse them, naming the parameter and the fix. Before: reduce_expert_grads
    returned as if nothing were wrong and clip_grad_norm_ raised NotImplementedError from inside a collective."""
    results = run_gloo_workers(_fsdp2_experts_not_ignored_worker, 2, (str(tmp_path),), tmp_path, SPAWN_TIMEOUT_S,
                               "FSDP2 managing the experts")
    for rank, res in enumerate(results):
        if "error" in res:
            pytest.fail(f"rank {rank}: {res['error']}")
        for name in ("reduce_expert_grads", "clip_grad_norm_"):
            error = res[name]
            assert error is not None and error.startswith("ValueError: expert-parallel parameter 'w_gate_up' is a "
                                                          "DTensor") and "ignored_params" in error, (
                f"rank {rank}: {name} gave {error}")
