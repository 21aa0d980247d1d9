"""GPU time per kernel of one fwd+bwd of the fused one-GPU path, from torch.profiler (CUPTI): what each
kernel costs on the GPU inside the layer, launch gaps excluded (kernel_breakdown.py times each step alone,
gaps included) and the GPU's idle time between kernels (the largest gaps with the kernels around them).
Balanced routing, bf16, the workload's tokens; the mean over ITERS back-to-back iterations. With --graph the
iteration is captured in a CUDA graph and replayed: no host launch work, so the idle time left is the GPU's own.

Usage: python benchmarks/profile_layer.py WORKLOAD[,WORKLOAD...] OUT.json [--graph]   (a CUDA GPU)
"""
import argparse
import json

import torch

import megamoe
from megamoe.bench.measure import cuda_graph, kernel_times, run_facts
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS, comma_names

ITERS = 5


def profile_one(name: str, device: torch.device, graphed: bool) -> dict:
    config = megamoe.MoEConfig(backend="triton")
    weights, tokens = one_gpu_problem(WORKLOADS[name], device)

    def step():
        forward_backward(megamoe.experts, weights, tokens, config=config)

    if graphed:
        run, _ = cuda_graph(step, warmup=3)
    else:
        run = step
        for _ in range(3):  # warm-up
            step()
    return {"workload": name, "graph": graphed, **kernel_times(run, ITERS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS), help="comma-separated workload names")
    parser.add_argument("json_path")
    parser.add_argument("--graph", action="store_true", help="profile a CUDA graph of the iteration, replayed")
    args = parser.parse_args()
    device = torch.device("cuda")
    facts = run_facts(device)
    out = []
    for name in args.workloads:
        record = {**profile_one(name, device, args.graph), **facts}
        out.append(record)
        print(f"\n{name}: {record['gpu_us_per_iteration']:.0f} us of kernels and {record['idle_us_per_iteration']:.0f} us "
              "idle between them per fwd+bwd")
        for r in record["kernels"]:
            print(f"  {r['us']:8.1f} us  x{r['launches']:<3} {r['kernel'][:100]}")
        for g in record["largest_gaps"][:12]:
            print(f"  gap {g['us']:7.1f} us after {g['after']} before {g['before']}")
        torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(out, f, indent=1)

if __name__ == "__main__":
    main()
