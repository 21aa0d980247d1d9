"""Per-kernel times of the fused one-GPU path (CUDA events via triton.testing.do_bench, median).

Usage: python benchmarks/kernel_breakdown.py [--workload NAME ...] [--routing balanced|skewed]
    [--weights routing|uniform|balanced|skewed] [--json PATH]
Prints, per kernel, ms and TFLOP/s (GEMMs: 2 * T * k * H * I per GEMM, gate and up two, padding rows not counted,
unlike benchmarks/gemm_bench.py) or GB/s (memory-bound kernels: row_pass_bytes), and the fwd/bwd sums, so
docs/perf-notes.md can say where the time goes; the JSON's records add the GPU, torch, Triton and commit
(megamoe.bench.measure.run_facts). Balanced routing unless --routing skewed (megamoe.bench.routing), bf16;
--weights keeps the routing's expert ids but swaps its weights, to tell what the ids cost from what the weights'
values do (routing_weights). The
kernels are the ones experts.py runs for this problem, each timed alone: the tiles and core it picks
(experts.one_gpu_configs: the Gluon kernels on Hopper), gate_up_fwd gathering x in its loads where the tile says so
(then no gather pass), x's rows spread beside gate_up_dgrad where its kernel has room (then only their padding
zeroed by a pass), the weight grads given row_src (their padding-only row steps skipped). Passes the path does not run here are timed as phase "alt", outside the
totals. benchmarks/gemm_bench.py compares the GEMMs with cuBLAS; benchmarks/profile_layer.py profiles the layer whole.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import block_m_for
from megamoe.backends.triton.experts import one_gpu_configs
from megamoe.backends.triton.kernels.schedule import place_routing
from megamoe.bench.measure import run_facts
from megamoe.bench.routing import ROUTINGS, route
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule


def row_pass_bytes(tokens: int, top_k: int, hidden: int, rows_in_use: int) -> dict:
    """Bytes a 16-bit row pass moves, each once (as benchmarks/combine_bench.py counts them): spread_rows reads
    [T, H] (each token row once, stored to its k rows) and writes the rows in use, padding (zeros) included;
    combine reads the T * k pairs' rows and writes [T, H]."""
    return {"spread_rows": 2 * (tokens + rows_in_use) * hidden, "combine": 2 * (tokens * top_k + tokens) * hidden}


WEIGHTS = ("routing", "uniform") + ROUTINGS


def routing_weights(routing: str, weights: str, T: int, E: int, k: int, generator: torch.Generator):
    """(topk_ids, topk_weights) of route(routing, ...), with the weights replaced where `weights` says: "routing"
    its own, "uniform" 1 / k each, a routing name the weights that routing draws from the same generator state
    (so "balanced" ids with "skewed" weights are the ids of one draw and the weights of the other)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    state = generator.get_state()
    ids, tw = route(routing, T, E, k, generator)
    if weights == "uniform":
        tw = torch.full_like(tw, 1.0 / k)
    elif weights not in ("routing", routing):
        other = torch.Generator(device=generator.device)
        other.set_state(state)
        tw = route(weights, T, E, k, other)[1]
    return ids, tw


def breakdown(name: str, tokens: int | None, experts_cap: int | None, routing: str = "balanced",
              weights: str = "routing") -> list[dict]:
    w = WORKLOADS[name]
    T = tokens or w.tokens_per_gpu
    H, I, k = w.hidden, w.intermediate, w.top_k
    E = min(w.num_experts, experts_cap or w.one_gpu_experts or w.num_experts)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    ids, tw = routing_weights(routing, weights, T, E, k, g)
    wgu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5).to(dt)
    wd = (torch.randn(E, H, I, device=dev, generator=g) * I**-0.5).to(dt)
    d_out = torch.randn(T, H, device=dev, generator=g).to(dt)
    bm = block_m_for(H, I, dt)
    s = build_schedule(ids, E, block_m=bm)
    cfg = one_gpu_configs(x, wgu, wd, s)  # the tiles (and core) the one-GPU backend runs here: TMA on Hopper
    in_use = s.expert_offsets[-1:]
    blocks = (s.block_expert, s.num_blocks)
    order = dict(expert_offsets=s.expert_offsets)  # the schedule's, as experts.py passes them (the tile order's)
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
    d_out_rows = kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use)
    h, gate_up = kernels.gate_up_fwd(x_rows, wgu, *blocks, **order, store_gate_up=True, config=cfg.gate_up_fwd)
    y = kernels.down_fwd(h, wd, *blocks, **order, config=cfg.down_fwd)

    def down_dgrad():
        return kernels.down_dgrad_router(d_out_rows, wd, gate_up, s.row_src, tw, *blocks, **order, store_h_w=True,
                                         config=cfg.down_dgrad)

    d_gu, h_w, d_w_part = down_dgrad()
    d_x_rows = kernels.gate_up_dgrad(d_gu, wgu, *blocks, **order, config=cfg.gate_up_dgrad)
    gathers = cfg.gate_up_fwd.gather  # experts._gate_up: x's rows gathered in gate_up_fwd's loads
    # experts_bwd: x's rows spread beside gate_up_dgrad's GEMM where its kernel has room (and R <= 2 E I)
    spreads = s.num_rows <= E * 2 * I and kernels.gate_up_dgrad_spreads_x(cfg.gate_up_dgrad, x)

    def gate_up_fwd():
        a, gather = (x, (s.row_src, k)) if gathers else (x_rows, None)
        return kernels.gate_up_fwd(a, wgu, *blocks, **order, store_gate_up=True, config=cfg.gate_up_fwd, gather=gather)

    def gate_up_dgrad():
        spread_x = (x, s.dest_row, x_rows) if spreads else None
        return kernels.gate_up_dgrad(d_gu, wgu, *blocks, **order, config=cfg.gate_up_dgrad, spread_x=spread_x)

    gemm = 2 * T * k * H * I  # one GEMM of the three (gate and up count as two); padding rows not counted
    moved = row_pass_bytes(T, k, H, int(in_use))  # host read: outside anything timed
    rows_bytes, combine_bytes = moved["spread_rows"], moved["combine"]
    # phase "alt": timed for comparison, not in the totals.
    steps = {
        "schedule": (lambda: build_schedule(ids, E, block_m=bm, place_routing=place_routing), 0, 0, "fwd"),
        "schedule_torch": (lambda: build_schedule(ids, E, block_m=bm), 0, 0, "alt"),
        "gather_x": (lambda: kernels.spread_rows(x, s.dest_row, s.row_src, in_use), 0, rows_bytes,
                     "alt" if gathers else "fwd"),
        "gate_up_fwd": (gate_up_fwd, 2 * gemm, 0, "fwd"),
        "down_fwd": (lambda: kernels.down_fwd(h, wd, *blocks, **order, config=cfg.down_fwd), gemm, 0, "fwd"),
        "combine": (lambda: kernels.combine(y, tw, s.dest_row, None, config=cfg.combine), 0, combine_bytes, "fwd"),
        "gather_d_out": (lambda: kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use), 0, rows_bytes, "bwd"),
        "down_dgrad": (down_dgrad, gemm, 0, "bwd"),
        "router_grad": (lambda: kernels.row_sums(d_w_part, s.dest_row, torch.float32), 0, 0, "bwd"),
        "x_padding": (lambda: kernels.spread_rows(x, s.dest_row, s.row_src, in_use, padding_only=True), 0, 0,
                      "bwd" if spreads else "alt"),
        "gate_up_dgrad": (gate_up_dgrad, 2 * gemm, 0, "bwd"),
        "dw_down": (lambda: kernels.dw_down(d_out_rows, h_w, s.expert_offsets, E, config=cfg.dw_down, row_src=s.row_src),
                    gemm, 0, "bwd"),
        "gather_x_again": (lambda: kernels.spread_rows(x, s.dest_row, s.row_src, in_use), 0, rows_bytes,
                           "alt" if spreads else "bwd"),
        "dw_gate_up": (lambda: kernels.dw_gate_up(d_gu, x_rows, s.expert_offsets, E, config=cfg.dw_gate_up,
                                                  row_src=s.row_src), 2 * gemm, 0, "bwd"),
        "combine_dx": (lambda: kernels.combine(d_x_rows, None, s.dest_row, None, config=cfg.combine), 0, combine_bytes, "bwd"),
    }
    records = []
    for kernel, (fn, flops, nbytes, phase) in steps.items():
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        records.append({"workload": name, "routing": routing, "weights": weights, "tokens": T, "experts": E,
                        "kernel": kernel, "phase": phase, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
                        "gbps": nbytes / ms / 1e6 if nbytes else None})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="extend", type=comma_names(WORKLOADS), metavar="NAME")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--experts-per-gpu", type=int, default=None)
    parser.add_argument("--routing", choices=ROUTINGS, default="balanced")
    parser.add_argument("--weights", choices=WEIGHTS, default="routing",
                        help="the routing's own weights, 1/k each, or another routing's (the same expert ids)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = args.workload or ["qwen3-30b-a3b", "qwen3-235b-a22b"]
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    top_k = max(WORKLOADS[n].top_k for n in names)
    if args.experts_per_gpu is not None and args.experts_per_gpu < top_k:
        parser.error(f"--experts-per-gpu must be >= the workloads' k ({top_k}), got {args.experts_per_gpu}")
    facts = run_facts(torch.device("cuda"))
    records = []
    for name in names:
        records += [{**r, **facts}
                    for r in breakdown(name, args.tokens, args.experts_per_gpu, args.routing, args.weights)]
    print(f"{'workload':16} {'kernel':18} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>8}")
    for r in records:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else ""
        gb = f"{r['gbps']:.0f}" if r["gbps"] else ""
        print(f"{r['workload']:16} {r['kernel']:18} {r['ms']:8.3f} {tf:>8} {gb:>8}")
    for name in dict.fromkeys(r["workload"] for r in records):
        for phase in ("fwd", "bwd"):
            total = sum(r["ms"] for r in records if r["workload"] == name and r["phase"] == phase)
            print(f"{name:16} {phase + ' total':18} {total:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
