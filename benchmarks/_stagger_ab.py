import dataclasses, json, sys, torch, triton
sys.path.insert(0, "benchmarks")
from gemm_bench import problem
from megamoe.backends.triton import kernels
out = []
for name in sys.argv[1].split(","):
    p = problem(name, "balanced", None)
    s, blocks, tc = p["s"], p["blocks"], p["tma_cfg"]
    E, R = p["E"], p["rows"]
    make = {
        "down_fwd": lambda c: lambda: kernels.down_fwd(p["h"], p["wd"], *blocks, config=c),
        "gate_up_dgrad": lambda c: lambda: kernels.gate_up_dgrad(p["d_gu"], p["wgu"], *blocks, config=c),
        "dw_down": lambda c: lambda: kernels.dw_down(p["d_y"], p["h"], s.expert_offsets, E, config=c, row_src=s.row_src),
        "dw_gate_up": lambda c: lambda: kernels.dw_gate_up(p["d_gu"], p["x_rows"], s.expert_offsets, E, config=c,
                                                          row_src=s.row_src),
    }
    for gemm, mk in make.items():
        entry = getattr(tc, gemm)
        fns = {"base": mk(entry), "stagger": mk(dataclasses.replace(entry, stagger=True))}
        a, b = fns["base"](), fns["stagger"]()
        torch.cuda.synchronize()
        if gemm.startswith("dw"):
            eq = torch.equal(a, b)
        else:
            eq = torch.equal(a[:R], b[:R])
        ms = {k: [] for k in fns}
        for rnd in range(4):
            for k in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                ms[k].append(triton.testing.do_bench(fns[k], warmup=10, rep=60, return_mode="median"))
        rec = dict(workload=name, gemm=gemm, bitwise_equal=eq, ms=ms, best={k: min(v) for k, v in ms.items()})
        out.append(rec); print(json.dumps(rec), flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} {r['gemm']:14} eq={r['bitwise_equal']} base {r['best']['base']:.3f} stagger {r['best']['stagger']:.3f} "
          f"speedup {r['best']['base']/r['best']['stagger']:.3f}")
