"""Host (CPU) time of one fwd+bwd of the fused one-GPU path against its GPU time: whether the layer is bound
by the host's launch work at a workload's size. Per iteration: the wall time of the Python call (the GPU
queue not waited for) and the CUDA-event time; then a cProfile of one call, the functions with the most
cumulative host time.

Usage: python benchmarks/host_time.py WORKLOAD[,WORKLOAD...] OUT.json   (a CUDA GPU)
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

import megamoe
from megamoe.bench.measure import run_facts
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS, comma_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS), help="comma-separated workload names")
    parser.add_argument("json_path")
    args = parser.parse_args()
    device = torch.device("cuda")
    facts = run_facts(device)
    out = []
    for name in args.workloads:
        w = WORKLOADS[name]
        weights, tokens = one_gpu_problem(w, device)
        for _ in range(3):
            forward_backward(megamoe.experts, weights, tokens)
        torch.cuda.synchronize()
        host, gpu = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            forward_backward(megamoe.experts, weights, tokens)
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end))
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        forward_backward(megamoe.experts, weights, tokens)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        record = {"workload": name, "host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu),
                  "profile": text.getvalue(), **facts}
        out.append(record)
        print(f"{name}: host {record['host_ms']:.2f} ms per fwd+bwd call, GPU {record['gpu_ms']:.2f} ms "
              "(each iteration starting on an idle GPU)")
        print(text.getvalue()[-9000:])
        del weights, tokens
        torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
