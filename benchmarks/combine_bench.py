"""The memory-bound row passes of the one-GPU path, alone, in tile variants: combine (out[t] = sum_j w * rows[dest_row[t,
j]], the forward's; without weights, the backward's d_x) and spread_rows (x or d_out spread to their receive rows).

Usage (a CUDA GPU):  PYTHONPATH=$PWD python3 benchmarks/combine_bench.py OUT.json [--workload NAME ...] [--rounds N]

Per workload (balanced routing, the schedule megamoe.schedule.build_schedule builds, bf16): every variant is checked
bit for bit against the table's kernel on the same inputs, then the variants alternate over --rounds rounds of
triton.testing.do_bench (median per round); the table gives each variant's median ms and GB/s (bytes read and
written once: combine k * T rows read + T rows written; spread_rows T rows read + the rows in use written).
Variants: combine "table" (the tile table's entry) and "BTxBH/wW" tiles (tokens and columns per program, warps);
spread_rows "table" and "BRxBH/pP" (rows and columns per step, programs per SM). References (kind "reference", not
checked): "fill" (zero_ of the [rows in use, H] rows: writes only) and "copy" (a device copy of them: reads and
writes), the bandwidth a pass of these bytes can reach (spread_rows writes k rows a token read: the fill's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import triton

from megamoe.backends.triton import configs, kernels
from megamoe.backends.triton.kernels import gather
from megamoe.bench.measure import alternating_rounds, run_facts
from megamoe.bench.problem import one_gpu_problem
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule

COMBINE_TILES = [(8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8), (4, 512, 4), (4, 1024, 8)]
SPREAD_TILES = [(8, 256, 8), (16, 256, 8), (8, 512, 8), (8, 256, 16), (4, 512, 8), (4, 1024, 16)]


def combine_variants(table: configs.TileConfig) -> dict:
    variants = {"table": table}
    for bt, bh, warps in COMBINE_TILES:
        variants[f"{bt}x{bh}/w{warps}"] = dataclasses.replace(table, block_m=bt, block_n=bh, num_warps=warps)
    return variants


def spread_with(block_r: int, block_h: int, per_sm: int):
    def run(*args):
        saved = gather._SPREAD_TILE
        gather._SPREAD_TILE = (block_r, block_h, per_sm)
        try:
            return kernels.spread_rows(*args)
        finally:
            gather._SPREAD_TILE = saved
    return run


def bench_workload(name: str, rounds: int) -> list[dict]:
    w = WORKLOADS[name]
    device = torch.device("cuda")
    _, tokens = one_gpu_problem(w, device)
    num_experts = w.one_gpu_experts or w.num_experts
    s = build_schedule(tokens.topk_ids_TK, num_experts, block_m=128)
    x, weights = tokens.x_TH.detach(), tokens.topk_weights_TK.detach().contiguous()
    rows = torch.randn(s.num_rows, w.hidden, device=device).to(x.dtype)
    in_use = s.expert_offsets[-1:]
    used_rows = int(s.expert_offsets[-1].item())  # the byte count only, outside the timing
    T, H, k = x.shape[0], w.hidden, w.top_k
    table = configs.tma_kernel_configs(H, w.intermediate, x.dtype, device, 128).combine
    cases = {}  # (kernel, variant) -> (call, bytes)
    combine_bytes = (k * T + T) * H * x.element_size()
    for label, tile in combine_variants(table).items():
        for kind, wts in (("combine", weights), ("combine_dx", None)):
            cases[(kind, label)] = (lambda tile=tile, wts=wts: kernels.combine(rows, wts, s.dest_row, None, config=tile),
                                    combine_bytes)
    spread_bytes = (T + used_rows) * H * x.element_size()
    cases[("spread_rows", "table")] = (lambda: kernels.spread_rows(x, s.dest_row, s.row_src, in_use), spread_bytes)
    for br, bh, per_sm in SPREAD_TILES:
        run = spread_with(br, bh, per_sm)
        cases[("spread_rows", f"{br}x{bh}/p{per_sm}")] = (lambda run=run: run(x, s.dest_row, s.row_src, in_use),
                                                          spread_bytes)
    used = rows[:used_rows]
    scratch = torch.empty_like(used)
    references = {("reference", "fill"): (lambda: scratch.zero_(), used.numel() * used.element_size()),
                  ("reference", "copy"): (lambda: scratch.copy_(used), 2 * used.numel() * used.element_size())}
    records = []
    for (kind, label), (call, _) in cases.items():  # bits against the table's kernel (rows past the range: unwritten)
        want = cases[(kind, "table")][0]()
        got = call()
        same = torch.equal(got[:used_rows if kind == "spread_rows" else T].view(torch.int16),
                           want[:used_rows if kind == "spread_rows" else T].view(torch.int16))
        records.append(dict(kind="check", workload=name, kernel=kind, variant=label, ok=bool(same)))
    cases.update(references)
    times = alternating_rounds({key: call for key, (call, _) in cases.items()}, rounds,
                               lambda call: triton.testing.do_bench(call, warmup=10, rep=40))
    for (kind, label), ms in times.items():
        med = statistics.median(ms)
        records.append(dict(kind="time", workload=name, kernel=kind, variant=label, ms=med, round_ms=ms,
                            gbps=cases[(kind, label)][1] / med / 1e6))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path")
    parser.add_argument("--workload", action="extend", type=comma_names(WORKLOADS), metavar="NAME")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    records = []
    for name in args.workload or ["qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "mixtral-8x7b"]:
        records += bench_workload(name, args.rounds)
        torch.cuda.empty_cache()
    with open(args.json_path, "w") as f:
        json.dump(dict(run_facts(torch.device("cuda")), records=records), f, indent=1)
    bad = [r for r in records if r["kind"] == "check" and not r["ok"]]
    for r in bad:
        print(f"BITS DIFFER: {r}")
    for name in dict.fromkeys(r["workload"] for r in records):
        refs = {r["variant"]: r for r in records if r["kind"] == "time" and r["workload"] == name
                and r["kernel"] == "reference"}
        print(f"{name} references: " + ", ".join(f"{v} {r['ms'] * 1e3:.1f} us ({r['gbps']:.0f} GB/s)"
                                                 for v, r in refs.items()))
        for kind in ("combine", "combine_dx", "spread_rows"):
            rs = sorted((r for r in records if r["kind"] == "time" and r["workload"] == name and r["kernel"] == kind),
                        key=lambda r: r["ms"])
            base = next(r for r in rs if r["variant"] == "table")
            print(f"{name} {kind}: table {base['ms'] * 1e3:.1f} us ({base['gbps']:.0f} GB/s); best "
                  + ", ".join(f"{r['variant']} {r['ms'] * 1e3:.1f} ({base['ms'] / r['ms']:.3f}x)" for r in rs[:4]))
    print(f"checks: {sum(r['ok'] for r in records if r['kind'] == 'check')} ok, {len(bad)} differ")


if __name__ == "__main__":
    main()
