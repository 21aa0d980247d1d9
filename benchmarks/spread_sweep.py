"""EXPERIMENT: spread_rows_kernel's block shape and grid (tokens per step, columns per step, programs per SM,
warps), best of 3 alternating do_bench medians per workload; the rows checked equal to the launcher's.

Usage: PYTHONPATH=$PWD python3 benchmarks/spread_sweep.py OUT.json
"""

from __future__ import annotations

import json
import sys

SHAPES = [(8, 256, 8, 4), (8, 512, 8, 4), (16, 256, 8, 4), (8, 256, 16, 4), (4, 512, 16, 4), (16, 512, 4, 8),
          (8, 1024, 8, 8)]


def main() -> None:
    import torch
    import triton

    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.kernels._common import num_sms, range_of
    from megamoe.bench.routing import route
    from megamoe.bench.workloads import WORKLOADS
    from megamoe.schedule import build_schedule

    device = torch.device("cuda")
    records = []
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
        w = WORKLOADS[name]
        E = w.one_gpu_experts or w.num_experts
        g = torch.Generator(device=device).manual_seed(0)
        ids, _ = route("balanced", w.tokens_per_gpu, E, w.top_k, g)
        s = build_schedule(ids, E, block_m=128)
        x = torch.randn(w.tokens_per_gpu, w.hidden, device=device, generator=g).to(torch.bfloat16)
        in_use = s.expert_offsets[-1:]
        used = int(in_use.item())
        want = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
        rr = range_of(in_use, "rows_in_use")

        def run(bt, bh, per_sm, warps):
            out = torch.empty(s.row_src.numel(), w.hidden, dtype=x.dtype, device=device)
            grid = (min(per_sm * num_sms(device), triton.cdiv(max(x.shape[0], out.shape[0]), bt)),)
            kernels.spread_rows_kernel[grid](x, s.dest_row, s.row_src, rr, out, x.shape[0], w.hidden, w.top_k,
                                             BLOCK_T=bt, BLOCK_H=bh, num_warps=warps)
            return out

        ms = {shape: [] for shape in SHAPES}
        for shape in SHAPES:
            assert torch.equal(run(*shape)[:used], want[:used]), shape
        for _ in range(3):
            for shape in SHAPES:
                ms[shape].append(triton.testing.do_bench(lambda: run(*shape), warmup=10, rep=50, return_mode="median"))
        for shape in SHAPES:
            records.append(dict(workload=name, shape=shape, ms=ms[shape]))
            print(f"{name:16s} {shape} {min(ms[shape]):.3f} ms", flush=True)
    json.dump(records, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
