"""How much of a fwd+bwd of the fused one-GPU path is launch cost: the same iteration timed eagerly back to
back (what the bench reports) and as a CUDA graph replayed back to back (the host's launch work and the gaps
it leaves gone; the kernels and their order the same). The difference bounds what fewer launches or a
graph-captured training step can gain.

Usage: python benchmarks/graph_vs_eager.py WORKLOAD[,WORKLOAD...] OUT.json   (a CUDA GPU)
"""
import argparse
import json

import torch

import megamoe
from megamoe.bench.measure import cuda_graph, median_ms, run_facts
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS, comma_names

ITERS, WARMUP = 30, 5


def measure(name: str, device: torch.device) -> dict:
    config = megamoe.MoEConfig(backend="triton")
    weights, tokens = one_gpu_problem(WORKLOADS[name], device)

    def step(i):
        forward_backward(megamoe.experts, weights, tokens, config=config)

    eager_ms = median_ms(step, iters=ITERS, warmup=WARMUP, device=device)
    replay, _ = cuda_graph(lambda: step(0))
    graph_ms = median_ms(lambda i: replay(), iters=ITERS, warmup=WARMUP, device=device)
    eager_again_ms = median_ms(step, iters=ITERS, warmup=WARMUP, device=device)
    return {"workload": name, "eager_ms": eager_ms, "graph_ms": graph_ms, "eager_again_ms": eager_again_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS), help="comma-separated workload names")
    parser.add_argument("json_path")
    args = parser.parse_args()
    device = torch.device("cuda")
    facts = run_facts(device)
    out = []
    for name in args.workloads:
        record = {**measure(name, device), **facts}
        out.append(record)
        print(f"{name}: eager {record['eager_ms']:.3f} ms, graph replay {record['graph_ms']:.3f} ms, "
              f"eager again {record['eager_again_ms']:.3f} ms", flush=True)
        torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(out, f, indent=1)

if __name__ == "__main__":
    main()
