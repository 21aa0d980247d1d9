"""EXPERIMENT (A/B): gate_up_fwd, the cooperative Gluon kernel (gluon_gate_up_coop, the epilogue in the two
consumer warpgroups) against the split one (gluon_gate_up: the SwiGLU on an epilogue warpgroup of its own),
alternating in one process, the split one bitwise against the cooperative one.

Usage: PYTHONPATH=$PWD python3 benchmarks/gate_up_split_ab.py OUT.json SPEC...   (SPEC: small or a workload
name, with :gather for x gathered in the loads)
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROUNDS = 3


def main() -> None:
    import torch

    import gluon_gate_up_bench as B
    from megamoe.bench.routing import route
    from megamoe.bench.workloads import WORKLOADS
    from megamoe.backends.triton.kernels import gluon_gate_up as split
    from megamoe.backends.triton.kernels import gluon_gate_up_coop as coop

    out_path, specs = sys.argv[1], sys.argv[2:]
    device = torch.device("cuda")
    records = []
    for spec in specs:
        name, _, mode = spec.partition(":")
        gather = mode == "gather"
        if name == "small":
            p = B.small_problem(device)
        else:
            w = WORKLOADS[name]
            g = torch.Generator(device=device).manual_seed(0)
            E = w.one_gpu_experts or w.num_experts
            ids, _ = route("balanced", w.tokens_per_gpu, E, w.top_k, g)
            p = B._schedule_problem(name, ids, E, w.top_k, w.hidden, w.intermediate, g)
        s, wgu = p["s"], p["w"]
        x = p["x"] if gather else p["x_rows"]
        kw = dict(store_gate_up=True, gather=(s.row_src, p["top_k"]) if gather else None)
        fns = {"coop": lambda: coop.gate_up_fwd_gluon(x, wgu, s.block_expert, s.num_blocks, tile=coop.TILES["s3b2"], **kw),
               "split": lambda: split.gate_up_fwd_gluon(x, wgu, s.block_expert, s.num_blocks, **kw)}
        want = fns["coop"]()  # bitwise equal to the Triton kernel (tests/gpu)
        rows = slice(0, p["rows_used"])
        rec = dict(workload=name, gather=gather, H=p["H"], I=p["I"], rows=p["rows_used"])
        for k, fn in fns.items():
            h, gu = fn()
            again = fn()
            torch.cuda.synchronize()
            rec[f"{k}_bitwise"] = B.compare(h, want[0], rows)["equal"] and B.compare(gu, want[1], rows)["equal"]
            rec[f"{k}_repeatable"] = B.compare(h, again[0], rows)["equal"] and B.compare(gu, again[1], rows)["equal"]
            rec[f"{k}_ms"] = []
        flops = 2 * p["rows_used"] * p["H"] * 2 * p["I"]
        for _ in range(ROUNDS):
            for k, fn in fns.items():
                rec[f"{k}_ms"].append(B.bench_ms(fn))
        for k in fns:
            rec[f"{k}_tflops"] = flops / min(rec[f"{k}_ms"]) / 1e9
        records.append(rec)
        print(spec, " ".join(f"{k} {rec[k + '_tflops']:.1f}" + ("" if rec[k + "_bitwise"] and rec[k + "_repeatable"]
                                                                 else " (NOT BITWISE)") for k in fns),
              f"split/coop {min(rec['coop_ms']) / min(rec['split_ms']):.3f}", flush=True)
        del p, want
        torch.cuda.empty_cache()
    existing = json.load(open(out_path)) if os.path.exists(out_path) else []
    json.dump(existing + records, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
