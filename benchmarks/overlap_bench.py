"""How much of the expert-parallel communication the overlap hides: fused vs (communication + compute).

Usage: torchrun --nproc-per-node=N benchmarks/overlap_bench.py [--workloads A,B] [--tokens T]
           [--num-comm-sms S] [--minibatch-tokens M] [--routing balanced|skewed] [--probes P,Q] [--json PATH]
           [--profile N] [--rounds R]

Per workload (default qwen3-30b-a3b and qwen3-235b-a22b at their 16384 tokens per GPU, E/N experts per
GPU, bf16, no shared expert), each pass ("fwd", "fwd+bwd") of the EP layer (ep.experts_fwd/_bwd; the
schedule is built once, outside the timing) is timed by the probes below, median over iterations of the max over
ranks (megamoe.bench.measure):
  fused    the layer as it runs: the first GEMM's kernel pulls its rows, the second's epilogue pushes its
           rows (on Hopper the Gluon kernels, kernels/gluon_ep.py and gluon_rows.py; elsewhere one
           persistent Triton kernel per direction, kernels/ep_fused.py, which runs the weight grads too)
  compute  the one-GPU GEMM kernels (same tiles) with no communication at all, on every SM (wrong
           results, timing only): the best the layer could do if communication were free (ep_probes.py)
  comm     the exchanges alone (barriers, publishes, whole pulls/pushes, the final copies), no compute
           (ep_probes.py)
  serial   no overlap: whole exchanges around plain GEMMs on every SM (the layer with overlap=False)
  one_gpu  EP = 1 only: the one-GPU path on the same schedule (its Gluon kernels, no exchange), what a group of
           one runs through megamoe.experts: the time the EP kernels would match with no peer to talk to
  fused_no_handoff  fused with gate_up_fwd's pulling kernel keeping its epilogue on the consumers where the table
           hands it off (H > 2048; elsewhere the same kernels as fused): the A/B of that choice
--probes times a subset (hidden/exposed need fused, compute and comm).
hidden = compute + comm - fused (the communication time that ran under compute), reported as a
fraction of comm; exposed = fused - compute (it includes what the SMs given to communication cost the
GEMMs). Gate before timing: fused and serial give bitwise equal outputs and gradients.
--rounds R: every probe timed R times, in rounds in a balanced order (megamoe.bench.measure.alternating_rounds:
no probe always runs first or after the same neighbour); the median over rounds is reported, every round in the
JSON. --profile N: after the timing, the GPU time per kernel of N fwd+bwd calls of the fused layer (and of the one-GPU
path at EP = 1), rank 0's, from torch.profiler: where the fused layer's time goes (printed; in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics

import torch
import torch.distributed as dist

from megamoe.backends.triton import ep, experts
from megamoe.backends.triton.configs import block_m_for
from megamoe.bench.measure import alternating_rounds, kernel_times, median_ms, run_facts
from megamoe.bench.routing import ROUTINGS, route
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.config import MoEConfig
from megamoe.schedule import build_schedule

from ep_probes import comm_bwd, comm_fwd, compute_bwd, compute_fwd  # benchmarks/ is the script's directory

@contextlib.contextmanager
def _no_handoff():
    """The EP table with gate_up_fwd's hand-off off (its pulling kernel keeps the epilogue on the consumers)."""
    shipped = ep.ep_tma_kernel_configs

    def table(*args):
        t = shipped(*args)
        return t if t is None else dataclasses.replace(t, gate_up_fwd=dataclasses.replace(t.gate_up_fwd, handoff=False))

    ep.ep_tma_kernel_configs = table
    try:
        yield
    finally:
        ep.ep_tma_kernel_configs = shipped


def _without_handoff(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _no_handoff():
            return fn(*args, **kwargs)
    return call


# What each probe runs: (forward, backward), called as ep.experts_fwd / ep.experts_bwd are.
PASSES = {
    "fused": (ep.experts_fwd, ep.experts_bwd),
    "compute": (compute_fwd, compute_bwd),
    "comm": (comm_fwd, comm_bwd),
    "serial": (functools.partial(ep.experts_fwd, overlap=False), functools.partial(ep.experts_bwd, overlap=False)),
    "one_gpu": (experts.experts_fwd, experts.experts_bwd),
    "fused_no_handoff": (_without_handoff(ep.experts_fwd), _without_handoff(ep.experts_bwd)),
}
PROBES = tuple(PASSES)
PROFILE_TOP = 16  # kernels printed per profiled probe (the JSON has all)


def _problem(name: str, tokens: int, routing: str, group, config: MoEConfig, rank: int):
    w = WORKLOADS[name]
    world = dist.get_world_size(group)
    if w.num_experts % world:
        raise ValueError(f"{name}: {w.num_experts} experts do not split over {world} ranks")
    local = w.num_experts // world
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    ids, weights = route(routing, tokens, w.num_experts, w.top_k, g)
    dtype = torch.bfloat16
    p = dict(
        x=torch.randn(tokens, w.hidden, generator=g, device="cuda").to(dtype),
        topk_weights=weights.float().contiguous(),
        w_gate_up=(torch.randn(local, 2 * w.intermediate, w.hidden, generator=g, device="cuda") / w.hidden**0.5).to(dtype),
        w_down=(torch.randn(local, w.hidden, w.intermediate, generator=g, device="cuda") / w.intermediate**0.5).to(dtype),
        d_out=torch.randn(tokens, w.hidden, generator=g, device="cuda").to(dtype),
    )
    schedule = build_schedule(
        ids, w.num_experts, group=group, config=config,
        gather_routing=ep.routing_exchange(p["x"], p["w_gate_up"], group, config),
    )
    return p, schedule


def _run(p, schedule, group, config, probe: str, backward: bool):
    fwd, bwd = PASSES[probe]
    out, saved = fwd(p["x"], p["topk_weights"], p["w_gate_up"], p["w_down"], None, None, schedule, group, config)
    if not backward:
        return [out]
    grads = bwd(p["d_out"], p["x"], p["topk_weights"], p["w_gate_up"], p["w_down"], None, None, schedule, group,
                config, saved)
    return [out, *(g for g in grads if g is not None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="qwen3-30b-a3b,qwen3-235b-a22b", type=comma_names(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU (default: the workload's)")
    parser.add_argument("--num-comm-sms", type=int, default=None)
    parser.add_argument("--minibatch-tokens", type=int, default=None)
    parser.add_argument("--routing", default="balanced", choices=ROUTINGS)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--probes", default=",".join(p for p in PROBES if p != "fused_no_handoff"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, GPU time per kernel over N fwd+bwd calls of fused (and one_gpu)")
    args = parser.parse_args()
    probes = args.probes.split(",")
    if not set(probes) <= set(PROBES):
        raise SystemExit(f"--probes must be among {PROBES}, got {args.probes}")
    if args.rounds < 1 or args.iters < 1:
        parser.error(f"--rounds and --iters must be at least 1, got {args.rounds} and {args.iters}")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    group, world = dist.group.WORLD, dist.get_world_size()
    facts = run_facts(device)
    if world > 1:  # the one-GPU path takes a group of one only
        probes = [p for p in probes if p != "one_gpu"]
    records = []
    for name in args.workloads:
        w = WORKLOADS[name]
        # block_m resolved as megamoe.experts resolves it (the routing exchange sizes its workspace with it).
        config = MoEConfig(backend="triton", num_comm_sms=args.num_comm_sms, minibatch_tokens=args.minibatch_tokens,
                           block_m=block_m_for(w.hidden, w.intermediate, torch.bfloat16))
        tokens = args.tokens or w.tokens_per_gpu
        p, schedule = _problem(name, tokens, args.routing, group, config, rank)
        gluon = ep.ep_configs(p["x"], p["w_gate_up"], p["w_down"], schedule).gate_up_fwd.gluon  # which core pulls
        # Correctness gate: the overlapped layer and the serial one agree bitwise (outputs and grads).
        fused, serial = (_run(p, schedule, group, config, probe, True) for probe in ("fused", "serial"))
        same = torch.tensor([all(torch.equal(a, b) for a, b in zip(fused, serial))], device=device, dtype=torch.int32)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise SystemExit(f"{name}: the overlapped EP layer differs bitwise from the serial one; not timing")
        del fused, serial
        for pass_name in ("fwd", "fwd+bwd"):
            calls = {what: functools.partial(_run, p, schedule, group, config, what, pass_name == "fwd+bwd")
                     for what in probes}
            rounds = alternating_rounds(calls, args.rounds, lambda call: median_ms(
                lambda i: call(), iters=args.iters, warmup=args.warmup, device=device, group=group))
            ms = {what: statistics.median(rounds[what]) if what in rounds else float("nan") for what in PROBES}
            hidden = ms["compute"] + ms["comm"] - ms["fused"]
            records.append({
                "workload": name, "ep": world, "tokens": tokens, "routing": args.routing, "pass": pass_name,
                "num_comm_sms": ep.comm_programs(config, device, gluon=gluon),
                "blocks_per_flag": ep.group_blocks(schedule, config),
                **{f"{k}_ms": v for k, v in ms.items()}, "rounds_ms": rounds,
                "hidden_ms": hidden, "hidden_frac": hidden / ms["comm"],
                "exposed_ms": ms["fused"] - ms["compute"], "speedup_vs_serial": ms["serial"] / ms["fused"], **facts,
            })
        if args.profile:
            profiled = [what for what in ("fused", "one_gpu") if what in probes]
            records[-1]["profile"] = {what: kernel_times(
                lambda what=what, p=p, s=schedule: _run(p, s, group, config, what, True), args.profile)
                for what in profiled}
            if rank == 0:
                for what, prof in records[-1]["profile"].items():
                    print(f"{name} fwd+bwd {what}: {prof['gpu_us_per_iteration']:.0f} us of kernels, "
                          f"{prof['idle_us_per_iteration']:.0f} us idle")
                    for k in prof["kernels"][:PROFILE_TOP]:
                        print(f"  {k['us']:8.1f} us  x{k['launches']:<3d} {k['kernel'][:90]}")
        del p, schedule
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"EP={world}, num_comm_sms={config.num_comm_sms}, minibatch_tokens={config.minibatch_tokens}")
        print(f"{'workload':17} {'pass':8} {'comm SMs':>8} {'fused':>7} {'compute':>7} {'comm':>7} {'c+c':>7} "
              f"{'serial':>7} {'hidden':>7} {'hid%':>5} {'exposed':>7} {'1-GPU':>7}")
        for r in records:
            print(f"{r['workload']:17} {r['pass']:8} {r['num_comm_sms']:8d} {r['fused_ms']:7.3f} {r['compute_ms']:7.3f} "
                  f"{r['comm_ms']:7.3f} {r['compute_ms'] + r['comm_ms']:7.3f} {r['serial_ms']:7.3f} "
                  f"{r['hidden_ms']:7.3f} {100 * r['hidden_frac']:5.1f} {r['exposed_ms']:7.3f} {r['one_gpu_ms']:7.3f}"
                  + (f"  no-handoff {r['fused_no_handoff_ms']:7.3f}" if r['fused_no_handoff_ms'] == r['fused_no_handoff_ms'] else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{k: None if v != v else v for k, v in r.items()} for r in records], f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
