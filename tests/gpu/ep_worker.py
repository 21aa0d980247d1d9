"""Expert-parallel GPU checks, one process per GPU (run by test_ep_gpu.py through torchrun).

Every rank builds the same global problem (same seed), runs its shard through megamoe.experts with a
group, and compares its outputs and gradients with the fp64 reference of the global problem (error
budget as docs/design.md) — for every backend and direction, bitwise across runs, directions and EP overlap
settings (num_comm_sms, minibatch_tokens), under a CUDA graph, with skewed routing and an empty rank. Exits non-zero on the first failure.
Usage: torchrun --nproc-per-node=N tests/gpu/ep_worker.py [checks|timeout]
"""

import os
import sys

import torch
import torch.distributed as dist

import megamoe


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


def run_ep(ids, p, d_out, rank, world, tokens, experts, config, dtype=torch.bfloat16):
    e_l = experts // world
    rows = slice(rank * tokens, (rank + 1) * tokens)
    leaves = {}
    for n, t in p.items():
        t = t[rows] if n in ("x", "topk_weights") else t[rank * e_l : (rank + 1) * e_l] if n in ("w_gate_up", "w_down") else t
        leaves[n] = (t.float() if n == "topk_weights" else t.to(dtype)).contiguous().requires_grad_()
    out = megamoe.experts(leaves["x"], ids[rows], leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                          shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"),
                          group=dist.group.WORLD, config=config)
    grads = torch.autograd.grad(out, list(leaves.values()), d_out[rows].to(dtype))
    return {"out": out.detach(), **{"d_" + n: g for n, g in zip(leaves, grads)}}


def check_budget(tag, ours, ref64, ref_low):
    """Relative error <= 2x (the bf16 reference's + one bf16 ulp / sqrt(n)) + 1e-5 (see test_triton_gpu.py).
    Shared-expert weights see every rank's tokens in the reference: their per-rank grads are summed first."""
    for name in ref64:
        got = ours[name].double()
        if name.startswith("d_shared"):
            dist.all_reduce(got)
        r = ref64[name].double()
        err = ((got - r).norm() / r.norm().clamp_min(1e-30)).item()
        base = ((ref_low[name].double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        budget = 2 * (base + 2.0**-8 / r.numel() ** 0.5) + 1e-5
        if not torch.isfinite(got).all() or err > budget:
            raise AssertionError(f"{tag}: {name} rel err {err:.3e} > budget {budget:.3e} (bf16 reference {base:.3e})")


def check_bitwise(tag, a, b):
    for name in a:
        if not torch.equal(a[name], b[name]):
            raise AssertionError(f"{tag}: {name} differs bitwise")


# (num_comm_sms, minibatch_tokens) of the EP overlap: the default (ep.DEFAULT_COMM_SMS communication
# programs inside each fused kernel, one ready flag per block), two coarser settings, and few
# communication programs with the finest flags. Bitwise identical.
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


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "checks"
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    {"checks": checks, "timeout": timeout}[mode](rank, world)
    if mode == "checks":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
