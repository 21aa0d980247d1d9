"""Where the fused one-GPU path's fwd+bwd peak memory goes: one iteration under the caching allocator's
history (torch.cuda.memory._record_memory_history), replayed to the moment of the peak; prints the blocks
live then that were allocated during the iteration, largest first, each with the megamoe frame that
allocated it.

Usage: python benchmarks/mem_trace.py WORKLOAD[,WORKLOAD...] OUT.json [recompute]   (a CUDA GPU)
"""
import argparse
import json
import os

import torch

import megamoe
from megamoe.bench.measure import run_facts
from megamoe.bench.problem import forward_backward, one_gpu_problem
from megamoe.bench.workloads import WORKLOADS, comma_names

# The package's own files, not every path naming megamoe (torch's do, in a .venv inside a clone named megamoe).
PACKAGE = os.path.dirname(megamoe.__file__) + os.sep
BENCH = os.path.join(PACKAGE, "bench") + os.sep


def _where(frames) -> str:
    """The innermost frames in the megamoe package but megamoe.bench (file:line function), else the innermost Python
    frame."""
    ours = [f for f in frames if f["filename"].startswith(PACKAGE) and not f["filename"].startswith(BENCH)]
    pick = ours[:2] or frames[:1]
    return " < ".join(f"{f['filename'].split('megamoe/')[-1]}:{f['line']} {f['name']}" for f in pick)


def peak_blocks(snapshot: dict) -> tuple[int, list[dict]]:
    """(bytes allocated during the trace at its peak, the blocks live at that moment)."""
    live, allocated, peak, at_peak = {}, 0, 0, []
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            allocated += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            allocated -= live.pop(event["addr"])["size"]
        if allocated > peak:
            peak, at_peak = allocated, list(live.values())
    blocks = [{"bytes": e["size"], "where": _where(e.get("frames", []))} for e in at_peak]
    return peak, sorted(blocks, key=lambda b: -b["bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS), help="comma-separated workload names")
    parser.add_argument("json_path")
    parser.add_argument("mode", nargs="?", choices=("recompute",), help="MoEConfig(recompute=True)")
    args = parser.parse_args()
    config = megamoe.MoEConfig(backend="triton", recompute=args.mode == "recompute")
    out = []
    device = torch.device("cuda")
    facts = run_facts(device)
    for name in args.workloads:
        w = WORKLOADS[name]
        weights, tokens = one_gpu_problem(w, device)
        forward_backward(megamoe.experts, weights, tokens, config=config)  # compile, workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        inputs = torch.cuda.memory_allocated(device)
        torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
        forward_backward(megamoe.experts, weights, tokens, config=config)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, blocks = peak_blocks(snapshot)
        record = {"workload": name, "recompute": config.recompute,
                  "peak_above_inputs_bytes": torch.cuda.max_memory_allocated(device) - inputs,
                  "trace_peak_bytes": peak, "blocks": blocks, **facts}
        out.append(record)
        print(f"\n{name}: max_memory_allocated above inputs {record['peak_above_inputs_bytes'] / 2**30:.3f} GiB, "
              f"traced peak {peak / 2**30:.3f} GiB")
        for b in blocks[:16]:
            print(f"  {b['bytes'] / 2**20:9.1f} MiB  {b['where']}")
        del weights, tokens
        torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
