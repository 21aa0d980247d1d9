"""A few fwd+bwd iterations of the fused one-GPU path on a workload's problem, and nothing else: the program to
run under an external profiler (ncu picks kernels by name, e.g. --kernel-name down_dgrad_ws_kernel
--launch-skip 1 --launch-count 1).

Usage: python benchmarks/one_step.py WORKLOAD [ITERATIONS]   (a CUDA GPU; default 2 iterations)
"""
import sys

import torch

import megamoe
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS


def main() -> None:
    weights, tokens = one_gpu_problem(WORKLOADS[sys.argv[1]], torch.device("cuda"))
    config = megamoe.MoEConfig(backend="triton")
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
        forward_backward(megamoe.experts, weights, tokens, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
