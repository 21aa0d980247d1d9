"""Whether a fwd+bwd of the fused one-GPU path slows down under sustained load (the GPU's power limit lowering
its clock): ITERS iterations back to back, each timed by CUDA events, reported as the mean of each WINDOW of
iterations, beside the SM clock and power that nvidia-smi samples meanwhile (every 50 ms, in a background
process). A flat series means the bench's medians are the kernels' steady speed; a falling clock means
they are the speed at the power limit, where fewer bytes moved (and fewer instructions) buy time.

Usage: python benchmarks/sustained.py WORKLOAD OUT.json   (a CUDA GPU, nvidia-smi on the PATH)
"""
import argparse
import json
import subprocess
import time

import torch

import megamoe
from megamoe.bench.measure import run_facts
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS

ITERS, WINDOW = 300, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("json_path")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = megamoe.MoEConfig(backend="triton")
    weights, tokens = one_gpu_problem(WORKLOADS[args.workload], device)
    for _ in range(3):
        forward_backward(megamoe.experts, weights, tokens, config=config)
    torch.cuda.synchronize()
    time.sleep(2.0)  # start from an idle, cool GPU
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
    for start, end in events:
        start.record()
        forward_backward(megamoe.experts, weights, tokens, config=config)
        end.record()
    torch.cuda.synchronize()
    time.sleep(0.3)
    smi.terminate()
    samples = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.strip()]
    ms = [a.elapsed_time(b) for a, b in events]
    windows = [sum(ms[i:i + WINDOW]) / WINDOW for i in range(0, ITERS, WINDOW)]
    record = {"workload": args.workload, **run_facts(device), "window": WINDOW, "window_ms": windows,
              "iteration_ms": ms,
              "smi": [{"time": s[0], "sm_mhz": float(s[1]), "power_w": float(s[2]), "temp_c": float(s[3])}
                      for s in samples if len(s) == 4]}
    with open(args.json_path, "w") as f:
        json.dump(record, f, indent=1)
    print("ms per iteration, mean of each", WINDOW, ":", " ".join(f"{w:.2f}" for w in windows))
    print("SM MHz / W / C samples:", " ".join(f"{s['sm_mhz']:.0f}/{s['power_w']:.0f}/{s['temp_c']:.0f}"
                                              for s in record["smi"]))


if __name__ == "__main__":
    main()
