"""EXPERIMENT (A/B): down_dgrad router-h_w, the cooperative Gluon kernel vs the split kernel with L2 prefetch
distances (gluon_down_dgrad_split.PREFETCH), alternating in one process, bitwise against the Triton kernel.

Usage: PYTHONPATH=$PWD python3 benchmarks/down_dgrad_split_ab.py OUT.json PREFETCHES WORKLOAD...
       (PREFETCHES: comma-separated K-step distances, 0 = none)
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROUNDS = 3


def main() -> None:
    import torch
    import triton

    import gluon_down_dgrad_bench as B
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import tma_kernel_configs
    from megamoe.backends.triton.kernels import gluon_down_dgrad as coop
    from megamoe.backends.triton.kernels import gluon_down_dgrad_split as split

    out_path, prefetches, names = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
    device = torch.device("cuda")
    records = []
    for name in names:
        p = B.small_problem(device, False) if name == "small" else B.workload_problem(name, device)
        d, w, gu, rs, be, bl = p["d_rows"], p["w_down"], p["gate_up"], p["row_src"], p["block_expert"], p["blocks"]
        weights = p["weights"]
        cfg = tma_kernel_configs(p["H"], p["I"], torch.bfloat16, device, B.BLOCK_M).down_dgrad

        def with_prefetch(n):
            def run():
                split.PREFETCH = n
                return split.down_dgrad_router_gluon(d, w, gu, rs, weights, be, bl, store_h_w=True)
            return run

        fns = {"coop": lambda: coop.down_dgrad_router_gluon(d, w, gu, rs, weights, be, bl, store_h_w=True)}
        fns.update({f"split-pf{n}": with_prefetch(n) for n in prefetches})
        want = kernels.down_dgrad_router(d, w, gu, rs, weights, be, bl, store_h_w=True, config=cfg)
        rec = dict(workload=name, H=p["H"], I=p["I"], rows=p["row_range"][1] - p["row_range"][0])
        for k, fn in fns.items():
            got = fn()
            torch.cuda.synchronize()
            rec[f"{k}_bitwise"] = B._all_equal(B._compare(want, got, p["row_range"]))
            rec[f"{k}_ms"] = []
        flops = 2 * rec["rows"] * p["H"] * p["I"]
        for _ in range(ROUNDS):
            for k, fn in fns.items():
                rec[f"{k}_ms"].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        for k in fns:
            rec[f"{k}_tflops"] = flops / min(rec[f"{k}_ms"]) / 1e9
        records.append(rec)
        print(name, " ".join(f"{k} {rec[k + '_tflops']:.1f}{'' if rec[k + '_bitwise'] else ' (NOT BITWISE)'}"
                             for k in fns), flush=True)
        del p, want
        torch.cuda.empty_cache()
    existing = json.load(open(out_path)) if os.path.exists(out_path) else []
    json.dump(existing + records, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
