"""GPU time per kernel of one fwd+bwd of the fused one-GPU path, from torch.profiler (CUPTI): what each
kernel costs on the GPU inside the layer, launch gaps excluded (kernel_breakdown.py times each step alone,
gaps included) and the GPU's idle time between kernels (the largest gaps with the kernels around them).
Balanced routing, bf16, the workload's tokens; the mean over ITERS back-to-back iterations. With --graph the
iteration is captured in a CUDA graph and replayed: no host launch work, so the idle time left is the GPU's own.

Usage: python benchmarks/profile_layer.py WORKLOAD[,WORKLOAD...] OUT.json [--graph]   (a CUDA GPU)
"""
import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS

ITERS = 5


def profile_one(name: str, device: torch.device, graphed: bool) -> dict:
    config = megamoe.MoEConfig(backend="triton")
    weights, tokens = one_gpu_problem(WORKLOADS[name], device)

    def step():
        forward_backward(megamoe.experts, weights, tokens, config=config)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as a capture needs
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    run = step
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            run()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    on_gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    for event in on_gpu:
        per_kernel[event.name][0] += event.device_time / ITERS
        per_kernel[event.name][1] += 1
    gaps = sorted(({"us": b.time_range.start - a.time_range.end, "after": a.name[:60], "before": b.name[:60]}
                   for a, b in zip(on_gpu, on_gpu[1:])), key=lambda g: -g["us"])
    idle = sum(max(g["us"], 0) for g in gaps) / ITERS
    kernels = sorted(({"kernel": k, "us": v[0], "launches": v[1] // ITERS} for k, v in per_kernel.items()),
                     key=lambda r: -r["us"])
    total = sum(r["us"] for r in kernels)
    return {"workload": name, "graph": graphed, "gpu_us_per_iteration": total, "idle_us_per_iteration": idle,
            "kernels": kernels, "largest_gaps": gaps[:20]}


def main() -> None:
    device = torch.device("cuda")
    graphed = "--graph" in sys.argv[3:]
    out = []
    for name in sys.argv[1].split(","):
        record = profile_one(name, device, graphed)
        out.append(record)
        print(f"\n{name}: {record['gpu_us_per_iteration']:.0f} us of kernels and {record['idle_us_per_iteration']:.0f} us "
              "idle between them per fwd+bwd")
        for r in record["kernels"]:
            print(f"  {r['us']:8.1f} us  x{r['launches']:<3} {r['kernel'][:100]}")
        for g in record["largest_gaps"][:12]:
            print(f"  gap {g['us']:7.1f} us after {g['after']} before {g['before']}")
        torch.cuda.empty_cache()
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=1)

if __name__ == "__main__":
    main()
