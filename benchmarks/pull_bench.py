"""The pulling gate_up_fwd (kernels/gluon_ep.py, the expert-parallel forward's first GEMM) against the one-GPU path's
x spread + gate_up_fwd, kernels alone, on one GPU (the pull's one rank is this GPU: its rows come from x).

Usage: python benchmarks/pull_bench.py OUT.json [--workloads a,b] [--rounds N]   (an sm_90 GPU)

Variants, each checked bit for bit (h and gate_up over the rows in use) against "spread+gemm" before any timing:
  spread+gemm   kernels.spread_rows, then kernels.gate_up_fwd with the one-GPU tile on rows (the one-GPU path's
                forward at H > 2048; at smaller H that path gathers x in gate_up_fwd's loads, and the tile here is
                its gathering tile's, on rows)
  gemm          kernels.gate_up_fwd on the spread rows alone (what the pulls would cost if they were free)
  pull          kernels.gate_up_fwd_pull, every CTA's pull warps copying x's rows beside the GEMM (the EP table's
                tile: 3 stages)
  claims        the same kernel with every ready flag raised and the pull counter past its end before the launch:
                no copy, the tile claims and flag acquires alone (its rows: the spread rows)
Timed in --rounds alternating rounds (triton.testing.do_bench medians, megamoe.bench.measure.round_order), median reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import triton

from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import block_m_for, ep_tma_kernel_configs, tma_kernel_configs
from megamoe.backends.triton.kernels import gluon_ep
from megamoe.backends.triton.kernels._common import range_of
from megamoe.bench.measure import alternating_rounds, run_facts
from megamoe.bench.problem import one_gpu_problem
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("json_path")
parser.add_argument("--workloads", default="qwen3-235b-a22b,mixtral-8x7b", type=comma_names(WORKLOADS))
parser.add_argument("--rounds", type=int, default=4)
args = parser.parse_args()
if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")

SHIPPED_WORK_BUFFER = gluon_ep.work_buffer


def raised_work_buffer(num_groups, num_row_blocks, device):
    """gluon_ep.work_buffer with the pull counter and every ready flag at 2^30: no pull unit left, every flag up."""
    work, offset = SHIPPED_WORK_BUFFER(num_groups, num_row_blocks, device)
    work[:offset] = 1 << 30
    work[1] = 0  # the tile counter
    return work, offset


def measure(name: str) -> list[dict]:
    """The variants' records at one workload (its tensors freed on return)."""
    w = WORKLOADS[name]
    H, I, k = w.hidden, w.intermediate, w.top_k
    dev, dt = torch.device("cuda"), torch.bfloat16
    weights, tokens = one_gpu_problem(w, dev)
    x, wgu = tokens.x_TH.detach(), weights.w_gate_up_E2IH.detach()
    bm = block_m_for(H, I, dt)
    s = build_schedule(tokens.topk_ids_TK, wgu.shape[0], block_m=bm)
    in_use = s.expert_offsets[-1:]
    blocks = range_of(s.num_blocks, "num_blocks")
    one_gpu = dataclasses.replace(tma_kernel_configs(H, I, dt, dev, bm).gate_up_fwd, gather=False)
    ep_cfg = ep_tma_kernel_configs(H, I, dt, dev, bm).gate_up_fwd
    live = s.row_src >= 0
    pull = kernels.RowPull(torch.tensor([x.data_ptr()], dtype=torch.int64, device=dev),
                           torch.where(live, 0, -1).to(torch.int32),
                           torch.where(live, s.row_src // k, 0).to(torch.int32),
                           torch.cuda.get_device_properties(dev).multi_processor_count, 1, 10 ** 10)
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
    pull_rows = torch.empty_like(x_rows)

    def spread_gemm():
        rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
        return kernels.gate_up_fwd(rows, wgu, s.block_expert, blocks, store_gate_up=True, config=one_gpu)

    def gemm():
        return kernels.gate_up_fwd(x_rows, wgu, s.block_expert, blocks, store_gate_up=True, config=one_gpu)

    def pulled():
        return kernels.gate_up_fwd_pull(pull_rows, wgu, s.block_expert, blocks, pull, config=ep_cfg)

    def claims():
        gluon_ep.work_buffer = raised_work_buffer
        try:
            return kernels.gate_up_fwd_pull(x_rows, wgu, s.block_expert, blocks, pull, config=ep_cfg)
        finally:
            gluon_ep.work_buffer = SHIPPED_WORK_BUFFER

    calls = {"spread+gemm": spread_gemm, "gemm": gemm, "pull": pulled, "claims": claims}
    rows = int(in_use)  # host read: outside anything timed
    reference = spread_gemm()
    equal = {}
    for variant, fn in calls.items():
        out = fn()
        equal[variant] = all(torch.equal(a[:rows], b[:rows]) for a, b in zip(out, reference))
    records = []
    checked = {v: fn for v, fn in calls.items() if equal[v]}
    times = alternating_rounds(checked, args.rounds, lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200))
    flops = 2 * 2 * rows * H * I
    for variant in calls:
        tile = one_gpu if variant in ("spread+gemm", "gemm") else ep_cfg
        rec = dict(workload=name, variant=variant, bitwise_equal=equal[variant], tile=str(tile))
        if variant in times:
            ms = statistics.median(times[variant])
            rec.update(ms=ms, tflops=flops / ms / 1e9, rounds_ms=times[variant])
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


facts = run_facts(torch.device("cuda"))
records = []
for name in args.workloads:
    records += [{**r, **facts} for r in measure(name)]
    torch.cuda.empty_cache()

json.dump(records, open(args.json_path, "w"), indent=1)
for r in records:
    timing = f"{r['ms']:7.3f} ms {r['tflops']:5.0f} TF/s" if "ms" in r else "  not timed"
    print(f"{r['workload']:16} {r['variant']:12} {timing}  bitwise {'equal' if r['bitwise_equal'] else 'DIFFERENT'}")
