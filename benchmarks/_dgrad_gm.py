import json, sys, torch, triton
sys.path.insert(0, "benchmarks")
from gluon_down_dgrad_bench import workload_problem
from megamoe.backends.triton.kernels import gluon_down_dgrad as g5
dev = torch.device("cuda")
out = []
gms = [int(x) for x in sys.argv[2].split(",")]
for name in sys.argv[1].split(","):
    p = workload_problem(name, dev)
    d, w, gu, rs, be, bl, wt = (p[k] for k in ("d_rows", "w_down", "gate_up", "row_src", "block_expert", "blocks", "weights"))
    fns = {gm: (lambda gm=gm: g5.down_dgrad_router_gluon(d, w, gu, rs, wt, be, bl, store_h_w=True,
                                                          config=g5.GluonDownDgradConfig(group_m=gm))) for gm in gms}
    ref = fns[gms[0]]()
    torch.cuda.synchronize()
    r0, r1 = p["row_range"]
    eq = all(all(torch.equal(a[r0:r1], b[r0:r1]) for a, b in zip(ref, fns[gm]())) for gm in gms[1:])
    ms = {gm: [] for gm in gms}
    for rnd in range(4):
        order = gms[rnd % len(gms):] + gms[:rnd % len(gms)]
        for gm in order:
            ms[gm].append(triton.testing.do_bench(fns[gm], warmup=25, rep=100, return_mode="median"))
    rec = dict(workload=name, bitwise_equal=eq, ms=ms, best={gm: min(v) for gm, v in ms.items()})
    out.append(rec); print(json.dumps(rec), flush=True)
json.dump(out, open(sys.argv[3], "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} eq={r['bitwise_equal']} " + " ".join(f"gm{gm} {v:.3f}" for gm, v in r["best"].items()))
