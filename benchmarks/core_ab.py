"""fwd+bwd of the one-GPU triton backend with the TMA GEMM core against the pointer-load core, in one
process, the cores alternating (order reversed every other round) over 4 rounds of 10 iterations; median.

Usage: python benchmarks/core_ab.py WORKLOAD[,WORKLOAD...] OUT.json   (a CUDA GPU of sm_90)
The pointer core is selected by making configs.tma_kernel_configs answer None (experts.one_gpu_configs then
picks it), so both runs go through the same public path, megamoe.experts.
"""
import json, statistics, sys, torch, megamoe
from megamoe.backends.triton import experts as te
from megamoe.bench.problem import make_weights, make_tokens, forward_backward
from megamoe.bench.workloads import WORKLOADS, layer_flops
tma_cfgs = te.tma_kernel_configs
out = []
for name in sys.argv[1].split(","):
    w = WORKLOADS[name]; E = w.one_gpu_experts or w.num_experts; T = w.tokens_per_gpu
    dev = torch.device("cuda")
    weights = make_weights(w, range(E), torch.bfloat16, dev)
    for routing in ("balanced", "skewed"):
        g = torch.Generator(device=dev).manual_seed(1)
        toks = [make_tokens(w, T, E, routing, torch.bfloat16, g) for _ in range(3)]
        cfg = megamoe.MoEConfig(backend="triton")
        times = {"tma": [], "pointer": []}
        for rnd in range(4):
            for core in (("tma", "pointer") if rnd % 2 == 0 else ("pointer", "tma")):
                te.tma_kernel_configs = tma_cfgs if core == "tma" else (lambda *a: None)
                for i in range(3):
                    forward_backward(megamoe.experts, weights, toks[i % 3], config=cfg)
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
                for i, (a, b) in enumerate(ev):
                    a.record(); forward_backward(megamoe.experts, weights, toks[i % 3], config=cfg); b.record()
                torch.cuda.synchronize()
                times[core] += [a.elapsed_time(b) for a, b in ev]
        te.tma_kernel_configs = tma_cfgs
        for core, t in times.items():
            ms = statistics.median(t)
            rec = dict(workload=name, routing=routing, core=core, ms=ms, tflops=layer_flops(w, T, "fwd+bwd") / ms / 1e9, experts=E)
            out.append(rec); print(json.dumps(rec), flush=True)
    del weights; torch.cuda.empty_cache()
json.dump(out, open(sys.argv[2], "w"), indent=1)
for r in out: print(f"{r['workload']:16} {r['routing']:9} {r['core']:8} {r['ms']:7.2f} ms {r['tflops']:5.0f} TF/s")
