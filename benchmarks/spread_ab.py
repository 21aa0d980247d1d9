"""A/B: the x_rows / d_out_rows pass of the one-GPU path, row-major gather (kernels.gather_rows: a token row
read once per pair) against token-major spread (kernels.spread_rows: read once, written k times), on each
workload's balanced schedule; bitwise equal rows checked, then alternating do_bench medians (best of 3).

Usage: PYTHONPATH=$PWD python3 benchmarks/spread_ab.py OUT.json [WORKLOAD ...]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch
    import triton

    from megamoe.backends.triton import kernels
    from megamoe.bench.routing import route
    from megamoe.bench.workloads import WORKLOADS
    from megamoe.schedule import build_schedule

    out_path, names = sys.argv[1], sys.argv[2:] or ["qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b",
                                                     "deepseek-v3", "mixtral-8x7b", "kimi-k2"]
    device = torch.device("cuda")
    records = []
    for name in names:
        w = WORKLOADS[name]
        E = w.one_gpu_experts or w.num_experts
        g = torch.Generator(device=device).manual_seed(0)
        ids, _ = route("balanced", w.tokens_per_gpu, E, w.top_k, g)
        s = build_schedule(ids, E, block_m=128)
        x = torch.randn(w.tokens_per_gpu, w.hidden, device=device, generator=g).to(torch.bfloat16)
        in_use = s.expert_offsets[-1:]
        fns = {"gather": lambda: kernels.gather_rows(x, s.row_src, None, in_use, div=w.top_k),
               "spread": lambda: kernels.spread_rows(x, s.dest_row, s.row_src, in_use)}
        used = int(in_use.item())  # setup, outside anything timed
        equal = torch.equal(fns["gather"]()[:used], fns["spread"]()[:used])
        ms = {k: [] for k in fns}
        for _ in range(3):
            for k, fn in fns.items():
                ms[k].append(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
        moved = (used + x.numel() // w.hidden) * w.hidden * 2  # written rows + the token rows once
        rec = dict(workload=name, tokens=w.tokens_per_gpu, hidden=w.hidden, top_k=w.top_k, rows=used, equal=equal,
                   gather_ms=ms["gather"], spread_ms=ms["spread"],
                   spread_gbps=moved / min(ms["spread"]) / 1e6)
        records.append(rec)
        print(f"{name:16s} gather {min(ms['gather']):.3f} ms  spread {min(ms['spread']):.3f} ms  "
              f"({min(ms['gather']) / min(ms['spread']):.2f}x, {rec['spread_gbps']:.0f} GB/s)  equal {equal}", flush=True)
    json.dump(records, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
