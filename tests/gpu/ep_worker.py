"""Expert-parallel GPU checks, one process per GPU, or every process on GPU 0 with MEGAMOE_TEST_ONE_GPU_RANKS=1
(run by test_ep_gpu.py through torchrun).

Every rank builds the same global problem (same seed), runs its shard through megamoe.experts with a
group, and compares its outputs and gradients with the fp64 reference of the global problem (error
budget as docs/design.md) — for every backend and direction, bitwise across runs, directions and EP overlap
settings (num_comm_sms, minibatch_tokens), under a CUDA graph, with skewed routing and an empty rank, in
inference and with frozen experts. Exits non-zero on the first failure.
Modes beyond "checks": "timeout" (a peer that never arrives), "workspace" (one workspace reused across T),
"mismatch" (ranks each on a different already-checked shape), "reject" (a rank rejecting its arguments).
"ep-kernels" runs the EP path's own functions (ep.experts_fwd / _bwd) on any number of GPUs, one included.
Usage: torchrun --nproc-per-node=N tests/gpu/ep_worker.py [checks|ep-kernels|timeout|workspace|mismatch|reject]
"""

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's error budget
from conftest import BF16_ULP, assert_close_budget

import megamoe
from megamoe.backends.triton.configs import block_m_for
from megamoe.bench.measure import cuda_graph


# Set to "1" to run every rank on GPU 0 (test_ep_gpu.py's two ranks on one GPU).
ONE_GPU_RANKS = "MEGAMOE_TEST_ONE_GPU_RANKS"


def problem(seed, tokens, hidden, inter, experts, topk, world, routing="balanced", shared=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = tokens * world
    scores = torch.rand(total, experts, generator=g, device="cuda")
    if routing == "rank0":  # everything to rank 0's experts: the other ranks receive nothing
        scores[:, experts // world :] -= 2.0
    ids = scores.topk(topk, dim=-1).indices
    p = {
        "x": torch.randn(total, hidden, generator=g, device="cuda", dtype=torch.float64),
        "topk_weights": torch.rand(total, topk, generator=g, device="cuda", dtype=torch.float64),
        "w_gate_up": torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda", dtype=torch.float64) / hidden**0.5,
        "w_down": torch.randn(experts, hidden, inter, generator=g, device="cuda", dtype=torch.float64) / inter**0.5,
    }
    if shared:
        p["shared_gate_up"] = torch.randn(2 * shared, hidden, generator=g, device="cuda", dtype=torch.float64) / hidden**0.5
        p["shared_down"] = torch.randn(hidden, shared, generator=g, device="cuda", dtype=torch.float64) / shared**0.5
    d_out = torch.randn(total, hidden, generator=g, device="cuda", dtype=torch.float64)
    return ids, p, d_out


def run_reference(ids, p, d_out, dtype):
    leaves = {n: (t.to(dtype) if n != "topk_weights" else t.float() if dtype != torch.float64 else t).requires_grad_() for n, t in p.items()}
    out = megamoe.reference.experts(leaves["x"], ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                                    shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"))
    grads = torch.autograd.grad(out, list(leaves.values()), d_out.to(out.dtype))
    return {"out": out.detach(), **{"d_" + n: g for n, g in zip(leaves, grads)}}


def shard(result, rank, world, tokens, experts):
    e_l = experts // world
    local = {}
    for name, t in result.items():
        if name in ("out", "d_x", "d_topk_weights"):
            local[name] = t[rank * tokens : (rank + 1) * tokens]
        elif name in ("d_w_gate_up", "d_w_down"):
            local[name] = t[rank * e_l : (rank + 1) * e_l]
        else:
            local[name] = t
    return local


def local_inputs(p, rank, world, tokens, experts, dtype):
    """This rank's part of the global problem's inputs: its tokens' x and topk_weights (fp32), its experts'
    weights, the shared expert's whole; in dtype, contiguous, detached."""
    e_l = experts // world
    rows = slice(rank * tokens, (rank + 1) * tokens)
    local = {}
    for n, t in p.items():
        t = t[rows] if n in ("x", "topk_weights") else t[rank * e_l : (rank + 1) * e_l] if n in ("w_gate_up", "w_down") else t
        local[n] = (t.float() if n == "topk_weights" else t.to(dtype)).detach().contiguous()
    return local


def run_ep(ids, p, d_out, rank, world, tokens, experts, config, dtype=torch.bfloat16):
    rows = slice(rank * tokens, (rank + 1) * tokens)
    leaves = {n: t.requires_grad_() for n, t in local_inputs(p, rank, world, tokens, experts, dtype).items()}
    out = megamoe.experts(leaves["x"], ids[rows], leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                          shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"),
                          group=dist.group.WORLD, config=config)
    grads = torch.autograd.grad(out, list(leaves.values()), d_out[rows].to(dtype))
    return {"out": out.detach(), **{"d_" + n: g for n, g in zip(leaves, grads)}}


def check_budget(tag, ours, ref64, ref_low):
    """conftest.assert_close_budget with the one-bf16-ulp noise floor. Shared-expert weights see every rank's
    tokens in the reference: their per-rank grads are summed first."""
    for name in ref64:
        got = ours[name].double()
        if name.startswith("d_shared"):
            dist.all_reduce(got)
        assert_close_budget(f"{tag}: {name}", got, ref64[name], ref_low[name], ulp=BF16_ULP)


def check_bitwise(tag, a, b):
    for name in a:
        if not torch.equal(a[name], b[name]):
            raise AssertionError(f"{tag}: {name} differs bitwise")


# (num_comm_sms, minibatch_tokens) of the EP overlap: the default (ep.comm_programs: every CTA's pull warps
# on Hopper, one ready flag per block), two coarser settings, and few communication programs with the
# finest flags. Bitwise identical.
OVERLAPS = [(None, None), (8, 1024), (32, 4096), (4, 1)]


def checks(rank, world):
    torch.manual_seed(0)
    x = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
    chosen = megamoe.autograd.resolve_backend(megamoe.MoEConfig(), x, dist.group.WORLD)
    if chosen != "triton":
        raise AssertionError(f'backend "auto" with a one-host group chose {chosen!r}, expected "triton"')
    cases = [  # (tokens per rank, H, I, E, k, routing, shared)
        (1000, 256, 128, 8 * world, 4, "balanced", 0),
        (333, 2880, 256, 4 * world, 2, "balanced", 128),
        (512, 512, 256, 4 * world, 2, "rank0", 0),
        (1, 256, 128, 2 * world, 1, "balanced", 0),
    ]
    backends = ["torch", "triton"]
    for tokens, hidden, inter, experts, topk, routing, shared in cases:
        tag = f"T{tokens}-H{hidden}-I{inter}-E{experts}-k{topk}-{routing}-S{shared}"
        ids, p, d_out = problem(1234, tokens, hidden, inter, experts, topk, world, routing, shared)
        ref64 = shard(run_reference(ids, p, d_out, torch.float64), rank, world, tokens, experts)
        ref16 = shard(run_reference(ids, p, d_out, torch.bfloat16), rank, world, tokens, experts)
        for backend in backends:
            directions = [("pull", "push"), ("push", "pull"), ("pull", "pull"), ("push", "push")] if backend == "triton" else [("auto", "auto")]
            overlaps = OVERLAPS if backend == "triton" else OVERLAPS[:1]
            first = None
            for dispatch, combine in directions:
                for num_comm_sms, minibatch_tokens in overlaps:
                    config = megamoe.MoEConfig(backend=backend, dispatch=dispatch, combine=combine,
                                               num_comm_sms=num_comm_sms, minibatch_tokens=minibatch_tokens)
                    what = f"{tag} {backend} {dispatch}/{combine} comm_sms={num_comm_sms} minibatch={minibatch_tokens}"
                    result = run_ep(ids, p, d_out, rank, world, tokens, experts, config)
                    if first is None:
                        check_budget(what, result, ref64, ref16)
                        again = run_ep(ids, p, d_out, rank, world, tokens, experts, config)
                        check_bitwise(f"{what} rerun", result, again)
                        first = result
                    else:
                        check_bitwise(f"{what} vs {directions[0]} {overlaps[0]}", result, first)
            print(f"rank {rank} {tag} {backend}: ok", flush=True)
    for num_comm_sms, minibatch_tokens in ((None, None), (4, 1)):
        graph_check(rank, world, megamoe.MoEConfig(backend="triton", num_comm_sms=num_comm_sms, minibatch_tokens=minibatch_tokens))
    inference_and_partial(rank, world)


def inference_and_partial(rank, world):
    """On the fused path: under no_grad and inference_mode the training forward's out, bit for bit, a workspace
    first allocated under inference_mode serving a training step after it, and a backward asked for x and
    topk_weights alone (frozen experts) giving the full backward's d_x and d_topk_weights bit for bit."""
    tokens, hidden, inter, experts, topk = 256, 256, 128, 4 * world, 2
    ids, p, d_out = problem(13, tokens, hidden, inter, experts, topk, world)
    config = megamoe.MoEConfig(backend="triton")
    full = run_ep(ids, p, d_out, rank, world, tokens, experts, config)
    local = local_inputs(p, rank, world, tokens, experts, torch.bfloat16)
    rows = slice(rank * tokens, (rank + 1) * tokens)

    def forward(inputs):
        return megamoe.experts(inputs["x"], ids[rows], inputs["topk_weights"], inputs["w_gate_up"], inputs["w_down"],
                               group=dist.group.WORLD, config=config)

    for mode in (torch.no_grad, torch.inference_mode):
        megamoe.clear_workspaces()  # the first call allocates the workspace, here under mode
        with mode():
            out = forward(local)
        check_bitwise(f"{mode.__name__} out", {"out": out}, {"out": full["out"]})
        again = run_ep(ids, p, d_out, rank, world, tokens, experts, config)  # training on that workspace
        check_bitwise(f"training after {mode.__name__} allocated the workspace", again, full)
    leaves = dict(local, x=local["x"].clone().requires_grad_(), topk_weights=local["topk_weights"].clone().requires_grad_())
    out = forward(leaves)
    d_x, d_w = torch.autograd.grad(out, [leaves["x"], leaves["topk_weights"]], d_out[rows].to(out.dtype))
    check_bitwise("frozen experts", {"out": out.detach(), "d_x": d_x, "d_topk_weights": d_w},
                  {n: full[n] for n in ("out", "d_x", "d_topk_weights")})
    print(f"rank {rank} inference and partial backward: ok", flush=True)


def run_ep_kernels(ids, p, d_out, rank, world, tokens, experts, config, overlap=True, dtype=torch.bfloat16):
    """run_ep through the expert-parallel path itself (ep.experts_fwd / _bwd: workspace, exchanges and the fused
    kernels), whatever the group's size: megamoe.experts takes the one-GPU path for a group of one, so this is
    how one GPU runs the EP kernels (pulls from and pushes to its own symmetric memory)."""
    from megamoe.backends.triton import ep, place_routing

    rows = slice(rank * tokens, (rank + 1) * tokens)
    local = local_inputs(p, rank, world, tokens, experts, dtype)
    group = dist.group.WORLD
    config = dataclasses.replace(config, block_m=block_m_for(local["x"].shape[1], local["w_down"].shape[2], dtype))
    schedule = megamoe.build_schedule(
        ids[rows], experts, group=group, config=config, place_routing=place_routing,
        gather_routing=ep.routing_exchange(local["x"], local["w_gate_up"], group, config))
    args = (local["x"], local["topk_weights"], local["w_gate_up"], local["w_down"], local.get("shared_gate_up"),
            local.get("shared_down"))
    out, saved = ep.experts_fwd(*args, schedule, group, config, overlap=overlap)
    grads = ep.experts_bwd(d_out[rows].to(dtype), *args, schedule, group, config, saved, overlap=overlap)
    names = ["d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_shared_gate_up", "d_shared_down"]
    return {"out": out, **{n: g for n, g in zip(names, grads) if g is not None}}


def run_one_gpu(ids, p, d_out, experts, config, dtype=torch.bfloat16):
    """The one-GPU path's functions (experts.experts_fwd / _bwd) on the whole problem: what the EP path at one
    rank must equal bit for bit."""
    from megamoe.backends.triton import experts as one_gpu

    local = local_inputs(p, 0, 1, ids.shape[0], experts, dtype)
    config = dataclasses.replace(config, block_m=block_m_for(local["x"].shape[1], local["w_down"].shape[2], dtype))
    schedule = megamoe.build_schedule(ids, experts, config=config)
    args = (local["x"], local["topk_weights"], local["w_gate_up"], local["w_down"], local.get("shared_gate_up"),
            local.get("shared_down"))
    out, saved = one_gpu.experts_fwd(*args, schedule, None, config)
    grads = one_gpu.experts_bwd(d_out.to(dtype), *args, schedule, None, config, saved)
    names = ["d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_shared_gate_up", "d_shared_down"]
    return {"out": out, **{n: g for n, g in zip(names, grads) if g is not None}}


def ep_kernels(rank, world):
    """The EP path's kernels on any number of GPUs, one included: against the fp64 reference, bitwise across
    reruns, dispatch/combine directions, overlap settings and the unfused layer, and under a CUDA graph; on one
    GPU bitwise equal to the one-GPU path too (the same math: the router weight in down_dgrad's epilogue)."""
    cases = [  # (tokens per rank, H, I, E, k, routing, shared)
        (1000, 256, 128, 8 * world, 4, "balanced", 0),
        (333, 2880, 256, 4 * world, 2, "balanced", 128),
        (1, 256, 128, 2 * world, 1, "balanced", 0),
    ]
    directions = [("pull", "push"), ("push", "pull"), ("pull", "pull"), ("push", "push")]
    for tokens, hidden, inter, experts, topk, routing, shared in cases:
        tag = f"T{tokens}-H{hidden}-I{inter}-E{experts}-k{topk}-{routing}-S{shared}"
        ids, p, d_out = problem(4321, tokens, hidden, inter, experts, topk, world, routing, shared)
        ref64 = shard(run_reference(ids, p, d_out, torch.float64), rank, world, tokens, experts)
        ref16 = shard(run_reference(ids, p, d_out, torch.bfloat16), rank, world, tokens, experts)
        fused = run_ep_kernels(ids, p, d_out, rank, world, tokens, experts, megamoe.MoEConfig(backend="triton"))
        check_budget(f"{tag} fused", fused, ref64, ref16)
        again = run_ep_kernels(ids, p, d_out, rank, world, tokens, experts, megamoe.MoEConfig(backend="triton"))
        check_bitwise(f"{tag} fused rerun", fused, again)
        if world == 1:
            check_bitwise(f"{tag} EP at one rank vs the one-GPU path", fused,
                          run_one_gpu(ids, p, d_out, experts, megamoe.MoEConfig(backend="triton")))
        for dispatch, combine in directions:
            for (num_comm_sms, minibatch_tokens), overlap in [(OVERLAPS[0], False), *((o, True) for o in OVERLAPS)]:
                config = megamoe.MoEConfig(backend="triton", dispatch=dispatch, combine=combine,
                                           num_comm_sms=num_comm_sms, minibatch_tokens=minibatch_tokens)
                got = run_ep_kernels(ids, p, d_out, rank, world, tokens, experts, config, overlap=overlap)
                check_bitwise(f"{tag} {dispatch}/{combine} comm_sms={num_comm_sms} minibatch={minibatch_tokens} "
                              f"overlap={overlap} vs the fused default", got, fused)
        print(f"rank {rank} {tag} EP kernels: ok", flush=True)
    ep_graph_check(rank, world)


def ep_graph_check(rank, world):
    """The EP path's forward+backward captured in a CUDA graph; replays with new x, routing and d_out == eager."""
    tokens, hidden, inter, experts, topk = 512, 256, 128, 4 * world, 2
    ids, p, d_out = problem(8, tokens, hidden, inter, experts, topk, world)
    config = megamoe.MoEConfig(backend="triton")
    g = torch.Generator(device="cuda").manual_seed(9)

    def step():
        result = run_ep_kernels(ids, p, d_out, rank, world, tokens, experts, config)
        return [result[n] for n in ("out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down")]

    replay, static = cuda_graph(step)
    for trial in range(3):
        p["x"].copy_(torch.randn(p["x"].shape, generator=g, device="cuda", dtype=p["x"].dtype))
        d_out.copy_(torch.randn(d_out.shape, generator=g, device="cuda", dtype=d_out.dtype))
        ids.copy_(torch.rand(ids.shape[0], experts, generator=g, device="cuda").topk(topk, -1).indices)
        replay()
        eager = step()
        for name, a, b in zip(["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down"], static, eager):
            if not torch.equal(a, b):
                raise AssertionError(f"EP kernels, cuda graph replay {trial}: {name} differs from eager")
    print(f"rank {rank} EP kernels cuda graph: ok", flush=True)


def graph_check(rank, world, config):
    """Capture forward+backward with EP in a CUDA graph (barriers, ready-flag memsets and the GEMMs'
    communication programs included); replay with new x and routing == eager, bitwise."""
    tokens, hidden, inter, experts, topk = 512, 256, 128, 4 * world, 2
    e_l = experts // world
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    w_gate_up = (torch.randn(e_l, 2 * inter, hidden, generator=g, device="cuda") / 16).bfloat16().requires_grad_()
    w_down = (torch.randn(e_l, hidden, inter, generator=g, device="cuda") / 11).bfloat16().requires_grad_()
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16().requires_grad_()
    weights = torch.rand(tokens, topk, generator=g, device="cuda").requires_grad_()
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(topk, -1).indices
    d_out = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()

    def step():
        out = megamoe.experts(x, ids, weights, w_gate_up, w_down, group=dist.group.WORLD, config=config)
        return [out, *torch.autograd.grad(out, [x, weights, w_gate_up, w_down], d_out)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for trial in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16())
            ids.copy_(torch.rand(tokens, experts, generator=g, device="cuda").topk(topk, -1).indices)
        graph.replay()
        eager = step()
        for name, a, b in zip(["out", "d_x", "d_w", "d_wgu", "d_wd"], static, eager):
            if not torch.equal(a, b):
                raise AssertionError(f"cuda graph replay {trial}: {name} differs from eager")
    print(f"rank {rank} cuda graph (comm_sms={config.num_comm_sms}, minibatch={config.minibatch_tokens}): ok", flush=True)


def timeout(rank, world):
    """Rank 1 never takes part: rank 0's exchange must fail within comm_timeout_ms instead of hanging."""
    tokens, hidden, inter, experts, topk = 64, 128, 64, 2 * world, 1
    config = megamoe.MoEConfig(backend="triton", comm_timeout_ms=2000)
    ids, p, d_out = problem(5, tokens, hidden, inter, experts, topk, world)
    # A first call where everyone takes part allocates the workspace (a collective).
    run_ep(ids, p, d_out, rank, world, tokens, experts, config)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        run_ep(ids, p, d_out, rank, world, tokens, experts, config)
        torch.cuda.synchronize()  # must raise: the peer never arrives
        print("rank 0: NO ERROR (the bounded wait did not fire)", flush=True)
        sys.exit(3)
    else:
        import time

        time.sleep(30)


def workspace(rank, world):
    """One workspace per (group, hidden size, dtype), sized for the largest T: a smaller T reuses it (nothing
    allocated, results bitwise those of a fresh exactly-sized workspace); the default directions (pull
    dispatch, push combine) hold no receive rows; push dispatch grows it by them."""
    from megamoe.backends.triton.comm import workspace as ws_module

    tokens, hidden, inter, experts, topk = 256, 256, 128, 4 * world, 2
    config = megamoe.MoEConfig(backend="triton")
    ids, p, d_out = problem(11, tokens, hidden, inter, experts, topk, world)
    megamoe.clear_workspaces()
    run_ep(ids, p, d_out, rank, world, tokens, experts, config)
    (held,) = ws_module._WORKSPACES.values()
    if held.sizes.rows != 0 or held.sizes.tokens != tokens:
        raise AssertionError(f"default directions: workspace sizes {held.sizes}, want T={tokens} and no receive rows")
    small = 100
    ids_s, p_s, d_out_s = problem(12, small, hidden, inter, experts, topk, world)
    reused = run_ep(ids_s, p_s, d_out_s, rank, world, small, experts, config)
    if list(ws_module._WORKSPACES.values()) != [held]:
        raise AssertionError("a smaller T allocated a workspace")
    megamoe.clear_workspaces()
    check_bitwise("T=100 on views of the T=256 workspace vs an exactly-sized one", reused,
                  run_ep(ids_s, p_s, d_out_s, rank, world, small, experts, config))
    run_ep(ids_s, p_s, d_out_s, rank, world, small, experts, megamoe.MoEConfig(backend="triton", dispatch="push"))
    (grown,) = ws_module._WORKSPACES.values()
    if grown.sizes.rows == 0:
        raise AssertionError("push dispatch ran without receive rows in the workspace")
    print(f"rank {rank} workspace: ok", flush=True)


def mismatch(rank, world):
    """Each rank calls with a shape the agreement check has seen (so none checks again), but not the same
    one: the routing exchange's device check fails (an error at the next synchronisation), not a hang and
    not a result."""
    hidden, inter, experts, topk = 128, 64, 2 * world, 1
    config = megamoe.MoEConfig(backend="triton", comm_timeout_ms=5000)
    for tokens in (64, 32):  # both shapes checked and run on every rank
        ids, p, d_out = problem(5, tokens, hidden, inter, experts, topk, world)
        run_ep(ids, p, d_out, rank, world, tokens, experts, config)
    torch.cuda.synchronize()
    dist.barrier()
    # The test requires this line from every rank: the failure it expects is the mismatched call's, not a
    # crash before it (any crash exits non-zero too).
    print(f"rank {rank}: agreeing shapes ran", flush=True)
    tokens = 64 if rank == 0 else 32
    ids, p, d_out = problem(5, tokens, hidden, inter, experts, topk, world)
    run_ep(ids, p, d_out, rank, world, tokens, experts, config)
    torch.cuda.synchronize()  # must raise: the ranks' shapes differ
    print(f"rank {rank}: NO ERROR (ranks on different shapes ran)", flush=True)
    sys.exit(3)


def reject(rank, world):
    """On each backend (a first call of its shape): rank 1 rejects its w_down (transposed); every other rank
    gets a ValueError naming it within seconds, and a good call afterwards runs (the collectives are in step)."""
    import time

    tokens, hidden, inter, experts, topk = 64, 128, 64, 2 * world, 2
    ids, p, d_out = problem(6, tokens, hidden, inter, experts, topk, world)
    for backend in ("torch", "triton"):
        config = megamoe.MoEConfig(backend=backend, comm_timeout_ms=5000)
        spoiled = dict(p, w_down=p["w_down"].transpose(1, 2)) if rank == 1 else p
        start = time.monotonic()
        try:
            run_ep(ids, spoiled, d_out, rank, world, tokens, experts, config)
        except (TypeError, ValueError) as e:
            message, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - start
        else:
            raise AssertionError(f"{backend}: rank {rank} raised nothing")
        want = "ValueError: w_down must be" if rank == 1 else "ValueError: megamoe.experts: rank 1 of the expert-parallel group rejected"
        if not message.startswith(want) or elapsed > 3:
            raise AssertionError(f"{backend}: rank {rank} after {elapsed:.1f}s: {message}")
        run_ep(ids, p, d_out, rank, world, tokens, experts, config)
        torch.cuda.synchronize()
        print(f"rank {rank} {backend} rejection: ok", flush=True)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "checks"
    rank = int(os.environ["LOCAL_RANK"])
    if os.environ.get(ONE_GPU_RANKS) == "1":
        # Every rank on GPU 0, time-sliced: NCCL refuses two ranks on one GPU, so the group is gloo's, and
        # symmetric memory is told the ranks' buffers may share a device. No speed is measured this way.
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    modes = {"checks": checks, "ep-kernels": ep_kernels, "timeout": timeout, "workspace": workspace, "mismatch": mismatch,
             "reject": reject}
    modes[mode](rank, world)
    if mode in ("checks", "ep-kernels", "workspace", "reject"):
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
