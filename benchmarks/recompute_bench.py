"""fwd+bwd time and peak memory above the inputs of the one-GPU triton backend, default (gate_up kept for the
backward) against MoEConfig(recompute=True) (nothing kept per routed row; the backward reruns the gate/up
GEMM and, on Hopper, dw_gate_up gathers x in its loads instead of a copy of x's rows), in one process, the modes
alternating (order reversed every other round) over 4 rounds of 10 iterations; median time, peak over all
iterations of a mode (the backward's, inside dw_gate_up: lower with recompute by x's rows where they are not
copied), and what a forward leaves allocated for its backward (out included): the memory each layer of a model
holds from its forward to its backward, which is what recompute trades for time.

Usage: python benchmarks/recompute_bench.py WORKLOAD[,WORKLOAD...] OUT.json   (a CUDA GPU)
"""
import argparse, json, statistics, torch, megamoe
from megamoe.bench.measure import run_facts
from megamoe.bench.problem import make_weights, make_tokens, forward_backward, forward_TH
from megamoe.bench.workloads import WORKLOADS, comma_names, layer_flops

MODES = {"default": megamoe.MoEConfig(backend="triton"), "recompute": megamoe.MoEConfig(backend="triton", recompute=True)}
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS), help="comma-separated workload names")
parser.add_argument("json_path")
args = parser.parse_args()
facts = run_facts(torch.device("cuda"))
out = []
for name in args.workloads:
    w = WORKLOADS[name]; E = w.one_gpu_experts or w.num_experts; T = w.tokens_per_gpu
    dev = torch.device("cuda")
    weights = make_weights(w, range(E), torch.bfloat16, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    toks = [make_tokens(w, T, E, "balanced", torch.bfloat16, g) for _ in range(3)]
    times = {m: [] for m in MODES}
    peaks = {m: 0 for m in MODES}
    for rnd in range(4):
        for mode in (tuple(MODES) if rnd % 2 == 0 else tuple(reversed(MODES))):
            cfg = MODES[mode]
            for i in range(3):
                forward_backward(megamoe.experts, weights, toks[i % 3], config=cfg)
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(dev)
            inputs = torch.cuda.memory_allocated(dev)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
            for i, (a, b) in enumerate(ev):
                a.record(); forward_backward(megamoe.experts, weights, toks[i % 3], config=cfg); b.record()
            torch.cuda.synchronize()
            times[mode] += [a.elapsed_time(b) for a, b in ev]
            peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated(dev) - inputs)
    kept = {}
    for mode, cfg in MODES.items():
        torch.cuda.synchronize(); before = torch.cuda.memory_allocated(dev)
        out_TH = forward_TH(megamoe.experts, weights, toks[0], config=cfg)
        torch.cuda.synchronize(); kept[mode] = torch.cuda.memory_allocated(dev) - before
        del out_TH
    for mode, t in times.items():
        ms = statistics.median(t)
        rec = dict(workload=name, routing="balanced", mode=mode, ms=ms, tflops=layer_flops(w, T, "fwd+bwd") / ms / 1e9,
                   peak_mem_above_inputs_bytes=peaks[mode], kept_for_backward_bytes=kept[mode], experts=E, tokens=T,
                   **facts)
        out.append(rec); print(json.dumps(rec), flush=True)
    del weights, toks; torch.cuda.empty_cache()
json.dump(out, open(args.json_path, "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} {r['mode']:10} {r['ms']:7.2f} ms {r['tflops']:5.0f} TF/s "
          f"{r['peak_mem_above_inputs_bytes'] / 2**30:6.2f} GiB above inputs, "
          f"{r['kept_for_backward_bytes'] / 2**30:6.2f} GiB kept from the forward to the backward")
