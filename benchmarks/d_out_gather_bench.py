"""The backward's d_out rows: spread by a pass (spread_rows) and read by TMA in down_dgrad_router and dw_down (the
table's default), against gathered inside both kernels' loads (cp.async producers: no d_out rows written or read
back). Kernels alone, on one workload's balanced schedule: the gathering kernels' outputs (d_gate_up, h_w, the router
partials, d_w_down) bitwise against the pass's, then every variant timed alternating (triton.testing.do_bench
medians, order rotated every round).

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/d_out_gather_bench.py OUT.json
    [--workloads qwen3-30b-a3b,qwen3-235b-a22b] [--rounds 4]
Variants:
  rows            spread_rows + down_dgrad_router + dw_down on the rows (what the backward runs by default)
  gather          down_dgrad_router + dw_down, both gathering d_out
  spread          spread_rows alone
  dgrad-rows, dgrad-gather   down_dgrad_router alone, on the rows / gathering
  dw-rows, dw-gather         dw_down alone, on the rows / gathering
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import triton

from megamoe.backends.triton import kernels
from megamoe.backends.triton.experts import all_blocks, one_gpu_configs, rows_in_use
from megamoe.bench.measure import alternating_rounds
from megamoe.bench.workloads import WORKLOADS
from megamoe.schedule import build_schedule


def run_workload(name: str, rounds: int) -> list[dict]:
    w = WORKLOADS[name]
    T, H, I, k = w.tokens_per_gpu, w.hidden, w.intermediate, w.top_k
    E = w.one_gpu_experts or w.num_experts
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    d_out = torch.randn(T, H, device=dev, generator=g).to(dt)
    x = torch.empty(T, H, device=dev, dtype=dt)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device=dev, generator=g)
    wgu = torch.empty(E, 2 * I, H, device=dev, dtype=dt)
    wd = torch.randn(E, H, I, device=dev, generator=g).to(dt) * H ** -0.5
    s = build_schedule(ids, E, block_m=128)
    gate_up = torch.randn(s.num_rows, 2 * I, device=dev, generator=g).to(dt)
    gate_up[s.row_src < 0] = 0
    cfg = one_gpu_configs(x, wgu, wd, s)
    dgrad_cfg, dw_cfg = (dataclasses.replace(c, gather=True) for c in (cfg.down_dgrad, cfg.dw_down))
    blocks, in_use = all_blocks(s), rows_in_use(s)
    gather = (s.row_src, k)
    d_out_rows = kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use)

    def spread():
        return kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use)

    def dgrad(rows, gathering):
        return kernels.down_dgrad_router(rows, wd, gate_up, s.row_src, weights, s.block_expert, blocks, store_h_w=True,
                                         config=dgrad_cfg if gathering else cfg.down_dgrad,
                                         gather=gather if gathering else None)

    def dw(rows, h_w, gathering):
        return kernels.dw_down(rows, h_w, s.expert_offsets, E, config=dw_cfg if gathering else cfg.dw_down,
                               gather=gather if gathering else None, row_src=s.row_src)

    # The bits first: every output of the gathering kernels against the pass's rows (the rows in use: the kernels
    # leave the rows past them unwritten, whatever torch.empty gave each call).
    want = dgrad(d_out_rows, False)
    got = dgrad(d_out, True)
    used = int(in_use[-1].item())
    checks = {}
    for part, a, b in zip(("d_gate_up", "h_w", "d_w_part"), got, want):
        checks[part] = torch.equal(a[:used], b[:used])
    h_w = want[1]
    checks["d_w_down"] = torch.equal(dw(d_out, h_w, True), dw(d_out_rows, h_w, False))
    print(name, "bitwise:", checks, flush=True)

    def rows_path():
        rows = spread()
        out = dgrad(rows, False)
        dw(rows, out[1], False)

    def gather_path():
        out = dgrad(d_out, True)
        dw(d_out, out[1], True)

    calls = {"rows": rows_path, "gather": gather_path, "spread": spread,
             "dgrad-rows": lambda: dgrad(d_out_rows, False), "dgrad-gather": lambda: dgrad(d_out, True),
             "dw-rows": lambda: dw(d_out_rows, h_w, False), "dw-gather": lambda: dw(d_out, h_w, True)}
    times = alternating_rounds(calls, rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100))
    out = []
    for variant, t in times.items():
        rec = dict(workload=name, variant=variant, ms=statistics.median(t), rounds_ms=t, bitwise=checks)
        out.append(rec)
        print(f"{name:16} {variant:13} {rec['ms']:.3f} ms  rounds {[round(v, 3) for v in t]}", flush=True)
    return out


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("json_path")
parser.add_argument("--workloads", default="qwen3-30b-a3b,qwen3-235b-a22b")
parser.add_argument("--rounds", type=int, default=4)
args = parser.parse_args()
results = []
for workload in args.workloads.split(","):
    results += run_workload(workload, args.rounds)
    json.dump(results, open(args.json_path, "w"), indent=1)
