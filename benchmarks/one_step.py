"""A few fwd+bwd iterations of the fused one-GPU path on a workload's problem, and nothing else: the program to
run under an external profiler (ncu picks kernels by name, e.g. --kernel-name down_dgrad_ws_kernel
--launch-skip 1 --launch-count 1).

Usage: python benchmarks/one_step.py WORKLOAD [ITERATIONS]   (a CUDA GPU; default 2 iterations)
"""
import argparse

import torch

import megamoe
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("iterations", nargs="?", type=int, default=2)
    args = parser.parse_args()
    weights, tokens = one_gpu_problem(WORKLOADS[args.workload], torch.device("cuda"))
    config = megamoe.MoEConfig(backend="triton")
    for _ in range(args.iterations):
        forward_backward(megamoe.experts, weights, tokens, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
