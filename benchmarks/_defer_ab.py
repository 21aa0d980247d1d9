import dataclasses, json, sys, torch, triton
sys.path.insert(0, "benchmarks")
from gemm_bench import problem
from megamoe.backends.triton import kernels
out = []
for spec in sys.argv[1].split(","):
    name, _, routing = spec.partition(":")
    p = problem(name, routing or "balanced", None)
    s, blocks, tc = p["s"], p["blocks"], p["tma_cfg"]
    E, R = p["E"], p["rows"]
    empty = int((s.expert_offsets[1:] == s.expert_offsets[:-1]).sum())
    make = {
        "down_fwd": lambda c: lambda: kernels.down_fwd(p["h"], p["wd"], *blocks, config=c),
        "gate_up_dgrad": lambda c: lambda: kernels.gate_up_dgrad(p["d_gu"], p["wgu"], *blocks, config=c),
        "dw_down": lambda c: lambda: kernels.dw_down(p["d_y"], p["h"], s.expert_offsets, E, config=c, row_src=s.row_src),
        "dw_gate_up": lambda c: lambda: kernels.dw_gate_up(p["d_gu"], p["x_rows"], s.expert_offsets, E, config=c,
                                                          row_src=s.row_src),
    }
    for gemm, mk in make.items():
        entry = getattr(tc, gemm)
        fns = {"base": mk(entry), "defer": mk(dataclasses.replace(entry, defer_store=True))}
        a, b = fns["base"](), fns["defer"]()
        torch.cuda.synchronize()
        eq = torch.equal(a, b) if gemm.startswith("dw") else torch.equal(a[:R], b[:R])
        ms = {k: [] for k in fns}
        for rnd in range(4):
            for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                ms[k].append(triton.testing.do_bench(fns[k], warmup=10, rep=60, return_mode="median"))
        rec = dict(workload=name, routing=routing or "balanced", empty_experts=empty, gemm=gemm, bitwise_equal=eq,
                   ms=ms, best={k: min(v) for k, v in ms.items()})
        out.append(rec); print(json.dumps(rec), flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} {r['routing']:8} e0={r['empty_experts']} {r['gemm']:14} eq={r['bitwise_equal']} "
          f"base {r['best']['base']:.3f} defer {r['best']['defer']:.3f} speedup {r['best']['base']/r['best']['defer']:.3f}")
