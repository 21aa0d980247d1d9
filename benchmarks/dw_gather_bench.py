"""dw_gate_up's x operand: spread into rows first (the default backward: spread_rows or a warp of gate_up_dgrad's
kernel, then the Gluon weight-grad kernel reads x_rows by TMA) against gathered inside the kernel's loads (a cp.async
producer warpgroup: no x_rows pass, a quarter less backward peak memory), at several tiles and ring depths of the
gathering kernel. Kernels alone, on one workload's balanced schedule: every variant's d_w_gate_up bitwise against the
default pair's, then the variants timed alternating (triton.testing.do_bench medians, order per round from
megamoe.bench.measure.round_order; the pair's time is spread_rows + the kernel, in one call).

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/dw_gather_bench.py OUT.json
    [--workloads qwen3-30b-a3b,qwen3-235b-a22b] [--rounds 4]
Variants (name: ConsumerTile, gathered or not):
  rows            the table's tile on x_rows after spread_rows (what the backward runs where gate_up_dgrad cannot
                  spread x)
  gather          the same tile gathering x (3 stages; what MoEConfig.recompute runs)
  gather-pp4      128 x 128 ping-pong tiles, 4 stages, gathering (32 KB a stage: a deeper ring in the same memory)
  gather-pp5      the same, 5 stages (224 KB)
  rows-pp4        128 x 128 ping-pong, 4 stages, on x_rows after spread_rows
  dgrad+rows      gate_up_dgrad, spread_rows, the table's tile on x_rows (the backward without spread_x)
  dgrad-beside    gate_up_dgrad spreading x beside its GEMM (spread_x; the padding rows by spread_rows'
                  padding_only pass first), the table's tile on those x_rows (what the backward runs where
                  gate_up_dgrad_spreads_x; left out where it cannot)
The variants print as they finish (a hang loses only what follows); OUT.json is written after each workload.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from megamoe.backends.triton import kernels
from megamoe.backends.triton.experts import all_blocks, one_gpu_configs
from megamoe.backends.triton.kernels import gluon_dw
from megamoe.backends.triton.kernels.gluon_common import ConsumerTile
from megamoe.bench.measure import alternating_rounds, run_facts
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule


def variants(table_tile: ConsumerTile) -> dict:
    """name: (tile, gathered)."""
    pp = dict(block_m=128, block_n=128, pingpong=True)
    return {"rows": (table_tile, False), "gather": (table_tile, True),
            "gather-pp4": (ConsumerTile(stages=4, **pp), True), "gather-pp5": (ConsumerTile(stages=5, **pp), True),
            "rows-pp4": (ConsumerTile(stages=4, **pp), False), "dgrad+rows": (table_tile, "dgrad"),
            "dgrad-beside": (table_tile, "beside")}


def run_workload(name: str, rounds: int) -> list[dict]:
    w = WORKLOADS[name]
    T, H, I, k = w.tokens_per_gpu, w.hidden, w.intermediate, w.top_k
    E = w.one_gpu_experts or w.num_experts
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices
    wgu = torch.randn(E, 2 * I, H, device=dev, generator=g).to(dt)  # gate_up_dgrad's weights (dgrad variants)
    wd = torch.empty(E, H, I, device=dev, dtype=dt)
    s = build_schedule(ids, E, block_m=128)
    table_cfg = one_gpu_configs(x, wgu, wd, s)
    cfg = table_cfg.dw_gate_up
    rows = s.row_src.numel()
    d_gate_up = torch.randn(rows, 2 * I, device=dev, generator=g).to(dt)
    d_gate_up[s.row_src < 0] = 0  # padding rows are zero, as down_dgrad leaves them
    in_use = s.expert_offsets[-1:]
    out = torch.empty(E, 2 * I, H, device=dev, dtype=dt)
    flops = 2 * T * k * 2 * I * H

    blocks = all_blocks(s)

    def call(tile: ConsumerTile, gathered: bool | str, poison: bool = False):
        if gathered in ("dgrad", "beside"):  # gate_up_dgrad first, x_rows by a pass or beside it
            if gathered == "beside":
                x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use, padding_only=True)
                if poison:  # the check: a token row the spread leaves unwritten shows as NaN
                    x_rows[s.row_src >= 0] = float("nan")
            kernels.gate_up_dgrad(d_gate_up, wgu, s.block_expert, blocks, config=table_cfg.gate_up_dgrad,
                                  spread_x=(x, s.dest_row, x_rows) if gathered == "beside" else None)
            if gathered == "dgrad":
                x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
            return gluon_dw.dw_gluon(d_gate_up, x_rows, s.expert_offsets, E, tile, out=out, row_src=s.row_src)
        if gathered:
            return gluon_dw.dw_gluon(d_gate_up, x, s.expert_offsets, E, tile, out=out, gather_b=(s.row_src, k),
                                     row_src=s.row_src)
        x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
        return gluon_dw.dw_gluon(d_gate_up, x_rows, s.expert_offsets, E, tile, out=out, row_src=s.row_src)

    table = variants(ConsumerTile.of(cfg))
    if not kernels.gate_up_dgrad_spreads_x(table_cfg.gate_up_dgrad, x):
        del table["dgrad-beside"]
    want = call(*table["rows"]).clone()
    records, fns = [], {}
    for v, (tile, gathered) in table.items():
        got = call(tile, gathered, poison=True)
        equal = torch.equal(got.view(torch.int16), want.view(torch.int16))
        records.append(dict(kind="check", workload=name, variant=v, tile=str(tile), gathered=gathered is True,
                            equal=equal))
        print(json.dumps(records[-1]), flush=True)
        fns[v] = lambda tile=tile, gathered=gathered: call(tile, gathered)
    times = alternating_rounds(fns, rounds,
                               lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    for v, ms in times.items():
        med = statistics.median(ms)
        records.append(dict(kind="time", workload=name, variant=v, ms=med, round_ms=ms, tflops=flops / med / 1e9))
        print(json.dumps(records[-1]), flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path")
    parser.add_argument("--workloads", default="qwen3-30b-a3b,qwen3-235b-a22b", type=comma_names(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    records = [dict(kind="env", **run_facts(torch.device("cuda")))]
    for name in args.workloads:
        records += run_workload(name, args.rounds)
        with open(args.json_path, "w") as f:
            json.dump(records, f, indent=1)
        torch.cuda.empty_cache()
    for r in records:
        if r["kind"] == "time":
            print(f"{r['workload']:16} {r['variant']:11} {r['ms']:7.3f} ms {r['tflops']:5.0f} TF/s")
    print("all bitwise equal:", all(r["equal"] for r in records if r["kind"] == "check"))


if __name__ == "__main__":
    main()
