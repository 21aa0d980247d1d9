"""EXPERIMENT (A/B): down_dgrad router-h_w, Triton TMA kernel vs Gluon cooperative vs Gluon 128-row ping-pong.

Usage: PYTHONPATH=$PWD python3 benchmarks/down_dgrad_pp_ab.py OUT.json WORKLOAD...   (small, or a workload name)
Per workload: the three kernels' outputs over the block range, bitwise compared with the Triton kernel's and
rerun; then ROUNDS rounds of do_bench medians, the three kernels alternating.
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
    from megamoe.backends.triton.kernels import gluon_down_dgrad_pp as pp
    from megamoe.backends.triton.kernels import gluon_down_dgrad_split as split

    out_path, names = sys.argv[1], sys.argv[2:]
    device = torch.device("cuda")
    records = []
    for name in names:
        for variant in ("router-h_w", "plain") if name.startswith("small") else ("router-h_w", ):
            p = B.small_problem(device, False) if name == "small" else B.workload_problem(name, device)
            d, w, gu, rs, be, bl = p["d_rows"], p["w_down"], p["gate_up"], p["row_src"], p["block_expert"], p["blocks"]
            weights = p["weights"]
            cfg = tma_kernel_configs(p["H"], p["I"], torch.bfloat16, device, B.BLOCK_M).down_dgrad
            if variant == "plain":
                fns = {"triton": lambda: (kernels.down_dgrad(d, w, gu, be, bl, config=cfg), None, None),
                       "coop": lambda: (coop.down_dgrad_gluon(d, w, gu, be, bl), None, None),
                       "pp": lambda: (pp.down_dgrad_gluon(d, w, gu, be, bl), None, None),
                       "split": lambda: (split.down_dgrad_gluon(d, w, gu, be, bl), None, None)}
            else:
                fns = {"triton": lambda: kernels.down_dgrad_router(d, w, gu, rs, weights, be, bl, store_h_w=True,
                                                                  config=cfg),
                       "coop": lambda: coop.down_dgrad_router_gluon(d, w, gu, rs, weights, be, bl, store_h_w=True),
                       "pp": lambda: pp.down_dgrad_router_gluon(d, w, gu, rs, weights, be, bl, store_h_w=True),
                       "split": lambda: split.down_dgrad_router_gluon(d, w, gu, rs, weights, be, bl, store_h_w=True)}
            want = fns["triton"]()
            rec = dict(workload=name, variant=variant, H=p["H"], I=p["I"], rows=p["row_range"][1] - p["row_range"][0])
            for k in ("coop", "pp", "split"):
                got = fns[k]()
                again = fns[k]()
                torch.cuda.synchronize()
                rec[f"{k}_bitwise"] = B._compare(want, got, p["row_range"])
                rec[f"{k}_repeatable"] = B._all_equal(B._compare(got, again, p["row_range"]))
                print(name, variant, k, rec[f"{k}_bitwise"], rec[f"{k}_repeatable"], flush=True)
            flops = 2 * rec["rows"] * p["H"] * p["I"]
            for k in fns:
                rec[f"{k}_ms"] = []
            for _ in range(ROUNDS):
                for k, fn in fns.items():
                    rec[f"{k}_ms"].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            for k in fns:
                rec[f"{k}_tflops"] = flops / min(rec[f"{k}_ms"]) / 1e9
            records.append(rec)
            print(json.dumps(rec), flush=True)
            del p, want
            torch.cuda.empty_cache()
    existing = json.load(open(out_path)) if os.path.exists(out_path) else []
    json.dump(existing + records, open(out_path, "w"), indent=1)
    for r in records:
        print(f"{r['workload']:16s} {r['variant']:10s} triton {r['triton_tflops']:6.1f}  coop {r['coop_tflops']:6.1f}  "
              f"pp {r['pp_tflops']:6.1f}  split {r['split_tflops']:6.1f} TF/s  split/coop {min(r['coop_ms']) / min(r['split_ms']):.3f}  "
              f"split bitwise {B._all_equal(r['split_bitwise'])} rep {r['split_repeatable']}")


if __name__ == "__main__":
    main()
