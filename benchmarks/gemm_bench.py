"""Every grouped GEMM of the fused one-GPU path against torch._grouped_mm (cuBLAS) on identical operands.

Usage: python benchmarks/gemm_bench.py [--workload NAME ...] [--routing balanced|skewed] [--rounds N] [--json PATH]

Per workload the operands are the real ones of a training step: balanced (or skewed) routing, the
schedule's expert-major rows padded per expert to its block_m, and the same segments handed to
torch._grouped_mm (offsets = the schedule's expert_offsets). Each GEMM is timed as the fused path runs it
(with its epilogue: SwiGLU after gate/up fwd; after down dgrad, on the unweighted d_out rows, the router
weight, the SwiGLU backward, h_w = w * h and the router-weight gradient's row sums, kernels.down_dgrad_router as
the path runs it) and as cuBLAS plus the torch ops that epilogue replaces. Variants:
    "fused"        the tile table's kernel as the one-GPU path runs it (on Hopper: the Gluon kernels,
                   kernels/gluon_*.py; the weight grads given the schedule's row_src, which skip an expert's
                   last row step where it is padding only)
    "fused-noskip" the Gluon weight-grad kernel without row_src (every padding row step computed)
    "tma"          the Triton TMA kernel (kernels/tma_gemm.py) of the same tile, 8 warps, at most 3 stages (the
                   Gluon kernels' bitwise reference)
    "pointer"      the pointer-load core (kernels/grouped_gemm.py + weight_grad.py; the EP kernels' core)
    "cublas"       torch._grouped_mm + the torch ops the fused epilogue replaces
    "cublas+gather" gate_up_fwd only: the same, with x's rows gathered by a torch index first (what cuBLAS needs
                   where the fused kernel gathers them in its loads, H <= 2048); "fused" then runs on x itself
    "cublas-gemm"  torch._grouped_mm alone (the GEMMs with an epilogue only)
    "tma (tile)"   with --sweep: the TMA kernels with candidate tiles, flattened ("tma-flat") or not
Every variant is checked against cuBLAS before it is timed (relative Frobenius error); the checked variants of a
GEMM are then timed in --rounds alternating rounds in megamoe.bench.measure.round_order's order (the median is reported, every
round is in the JSON). TF/s counts
2*M*N*K over the rows in use, padding included (cuBLAS computes it; the fused weight grads skip some of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import torch.nn.functional as F
import triton

from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import TileConfig, block_m_for, kernel_configs, tma_kernel_configs, triton_tile
from megamoe.backends.triton.kernels._common import range_of
from megamoe.bench.measure import alternating_rounds, run_facts
from megamoe.bench.routing import route
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule

# --sweep: candidate tiles of the TMA kernels, (block_m, block_n, block_k, warps, stages), each run
# flattened and not.
SWEEP = {
    "gate_up_fwd": [(128, 128, 32, 8, 5), (128, 128, 32, 8, 6), (128, 64, 64, 8, 4), (128, 128, 64, 8, 2)],
    "down_fwd": [(128, 256, 32, 8, 5), (128, 128, 64, 8, 4)],
    "down_dgrad": [(128, 128, 32, 8, 6), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)],
    "gate_up_dgrad": [(128, 256, 32, 8, 5), (128, 128, 64, 8, 4)],
    "dw_down": [(128, 256, 32, 8, 5), (128, 128, 64, 4, 4)],
    "dw_gate_up": [(128, 256, 32, 8, 5), (128, 128, 64, 4, 4)],
}
MAX_REL_ERR = 2e-2  # bf16 outputs of fp32 accumulations in different orders; NaN fails


def swiglu_torch(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_bwd_torch(gate_up, d_h):
    g, u = gate_up.float().chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    d_h = d_h.float()
    return torch.cat([d_h * u * sig * (1 + g * (1 - sig)), d_h * g * sig], dim=-1).to(gate_up.dtype)


def down_dgrad_router_torch(d_out_rows, w_down, gate_up, row_w, offs):
    """What down_dgrad_router's epilogue replaces, in torch: d_h = d_out_rows @ w_down per expert (cuBLAS), the
    router-weight gradient's row sums <d_h, h>, h_w = w * h, and the SwiGLU backward of w * d_h; returns d_gate_up."""
    d_h = torch._grouped_mm(d_out_rows, w_down, offs=offs).float()
    g, u = gate_up.float().chunk(2, dim=-1)
    h = F.silu(g) * u
    d_w_rows = (d_h * h).sum(-1)
    h_w = (h * row_w[:, None]).to(gate_up.dtype)
    return swiglu_bwd_torch(gate_up, d_h * row_w[:, None]), h_w, d_w_rows


def problem(name: str, routing: str, tokens: int | None):
    w = WORKLOADS[name]
    T, H, I, k = tokens or w.tokens_per_gpu, w.hidden, w.intermediate, w.top_k
    E = w.one_gpu_experts or w.num_experts
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    ids, tw = route(routing, T, E, k, g)
    wgu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5).to(dt)
    wd = (torch.randn(E, H, I, device=dev, generator=g) * I**-0.5).to(dt)
    d_out = torch.randn(T, H, device=dev, generator=g).to(dt)
    bm = block_m_for(H, I, dt)
    s = build_schedule(ids, E, block_m=bm)
    in_use = s.expert_offsets[-1:]
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
    d_out_rows = kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use)
    row_w = torch.where(s.row_src >= 0, tw.reshape(-1)[s.row_src.clamp(min=0).long()], 0.0)
    d_y = (d_out_rows.float() * row_w[:, None]).to(dt)
    cfg = kernel_configs(H, I, dt, dev, bm)
    tma_cfg = tma_kernel_configs(H, I, dt, dev, bm)
    blocks = (s.block_expert, range_of(s.num_blocks, "num_blocks"))
    order = dict(expert_offsets=s.expert_offsets)  # the schedule's, as experts.py passes them (the tile order's)
    h, gate_up = kernels.gate_up_fwd(x_rows, wgu, *blocks, **order, store_gate_up=True, config=cfg.gate_up_fwd)
    d_gu = kernels.down_dgrad(d_y, wd, gate_up, *blocks, **order, config=cfg.down_dgrad)
    rows = int(in_use)  # host read: a benchmark, outside anything timed
    return dict(w=w, E=E, rows=rows, x=x, x_rows=x_rows, d_out_rows=d_out_rows, row_w=row_w, tw=tw, d_y=d_y, wgu=wgu,
                wd=wd, h=h, gate_up=gate_up, d_gu=d_gu,
                s=s, cfg=cfg, tma_cfg=tma_cfg, blocks=blocks, order=order, offs=s.expert_offsets[1:].contiguous())


def gemms(p, sweep: bool) -> dict:
    """{gemm: (flops, {variant: fn})}: each fn returns the GEMM's output (rows past the rows in use ignored)."""
    w, s, cfg, tma_cfg, blocks, offs = p["w"], p["s"], p["cfg"], p["tma_cfg"], p["blocks"], p["offs"]
    order = p["order"]
    H, I, E, R = w.hidden, w.intermediate, p["E"], p["rows"]
    x_rows, d_y, wgu, wd, h, gate_up, d_gu = (p[n] for n in ("x_rows", "d_y", "wgu", "wd", "h", "gate_up", "d_gu"))
    d_out_rows, row_w, tw = p["d_out_rows"], p["row_w"], p["tw"]
    wgu_t, wd_t = wgu.transpose(1, 2), wd.transpose(1, 2)
    x, k = p["x"], w.top_k

    def gate_up_fwd(c):
        """gate_up_fwd with tile c as the one-GPU path runs it: on x with the rows gathered in its loads where c
        gathers (experts._gate_up), else on the spread rows."""
        a, gather = (x, (s.row_src, k)) if c.gather else (x_rows, None)
        return lambda: kernels.gate_up_fwd(a, wgu, *blocks, **order, store_gate_up=True, config=c, gather=gather)[0]

    def down_dgrad_router(c):
        """down_dgrad with tile c as the one-GPU path runs it: on the unweighted d_out rows, the router epilogue
        storing h_w (experts.py, for d_w_down)."""
        return lambda: kernels.down_dgrad_router(d_out_rows, wd, gate_up, s.row_src, tw, *blocks, **order,
                                                 store_h_w=True, config=c)[0]

    def torch_gather():
        """x's row of every schedule row (zeros for padding), as a torch index: what cuBLAS needs where the fused
        kernel gathers in its loads."""
        return torch.cat([x, x.new_zeros(1, H)])[torch.where(s.row_src >= 0, s.row_src // k, x.shape[0])]

    def tile(t, flatten):
        return TileConfig(*t[:3], num_warps=t[3], num_stages=t[4], tma=True, flatten=flatten)

    table = {
        "gate_up_fwd": (2 * 2 * R * H * I, {
            "pointer": lambda: kernels.gate_up_fwd(x_rows, wgu, *blocks, **order, store_gate_up=True,
                                                   config=cfg.gate_up_fwd)[0],
            "cublas": lambda: swiglu_torch(torch._grouped_mm(x_rows, wgu_t, offs=offs)),
            "cublas-gemm": lambda: torch._grouped_mm(x_rows, wgu_t, offs=offs),
            "cublas+gather": lambda: swiglu_torch(torch._grouped_mm(torch_gather(), wgu_t, offs=offs)),
        }, gate_up_fwd),
        "down_fwd": (2 * R * H * I, {
            "pointer": lambda: kernels.down_fwd(h, wd, *blocks, **order, config=cfg.down_fwd),
            "cublas": lambda: torch._grouped_mm(h, wd_t, offs=offs),
        }, lambda c: lambda: kernels.down_fwd(h, wd, *blocks, **order, config=c)),
        "down_dgrad": (2 * R * H * I, {
            "pointer": down_dgrad_router(cfg.down_dgrad),
            "cublas": lambda: down_dgrad_router_torch(d_out_rows, wd, gate_up, row_w, offs)[0],
            "cublas-gemm": lambda: torch._grouped_mm(d_out_rows, wd, offs=offs),
        }, down_dgrad_router),
        "gate_up_dgrad": (2 * 2 * R * H * I, {
            "pointer": lambda: kernels.gate_up_dgrad(d_gu, wgu, *blocks, **order, config=cfg.gate_up_dgrad),
            "cublas": lambda: torch._grouped_mm(d_gu, wgu, offs=offs),
        }, lambda c: lambda: kernels.gate_up_dgrad(d_gu, wgu, *blocks, **order, config=c)),
        "dw_down": (2 * R * H * I, {
            "pointer": lambda: kernels.dw_down(d_y, h, s.expert_offsets, E, config=cfg.dw_down),
            "cublas": lambda: torch._grouped_mm(d_y.t(), h, offs=offs),
        }, lambda c, rs=None: lambda: kernels.dw_down(d_y, h, s.expert_offsets, E, config=c, row_src=rs)),
        "dw_gate_up": (2 * 2 * R * H * I, {
            "pointer": lambda: kernels.dw_gate_up(d_gu, x_rows, s.expert_offsets, E, config=cfg.dw_gate_up),
            "cublas": lambda: torch._grouped_mm(d_gu.t(), x_rows, offs=offs),
        }, lambda c, rs=None: lambda: kernels.dw_gate_up(d_gu, x_rows, s.expert_offsets, E, config=c, row_src=rs)),
    }
    out = {}
    for name, (flops, variants, make_tma) in table.items():
        entry = getattr(tma_cfg, name)
        if name.startswith("dw_"):
            variants["fused"] = make_tma(entry, s.row_src)
            if entry.gluon:
                variants["fused-noskip"] = make_tma(entry)
        else:
            variants["fused"] = make_tma(entry)
        if entry.gluon:  # the Triton TMA kernel reads rows: no gathering variant
            variants["tma"] = make_tma(dataclasses.replace(triton_tile(entry), gather=False))
        for t in SWEEP[name] if sweep else ():
            for flat in (False, True):
                variants[f"tma{'-flat' if flat else ''} {t}"] = make_tma(tile(t, flat))
        out[name] = (flops, variants)
    return out


def rel_err(got, want, rows: int, dw: bool) -> float:
    if not dw:
        got, want = got[:rows], want[:rows]
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def run(name: str, routing: str, tokens: int | None, sweep: bool, rounds: int) -> list[dict]:
    """Every variant of every GEMM checked against cuBLAS, then the checked ones timed in `rounds` alternating
    rounds (round_order; do_bench medians): a record per variant with the rounds' median and each round."""
    p = problem(name, routing, tokens)
    records = []
    for gemm, (flops, variants) in gemms(p, sweep).items():
        want = variants["cublas"]()
        recs, checked = {}, {}
        for variant, fn in variants.items():
            rec = recs[variant] = {"workload": name, "routing": routing, "rows": p["rows"], "gemm": gemm,
                                   "variant": variant}
            try:
                # cublas-gemm is the cuBLAS variant's own first step (its output is the pre-epilogue GEMM).
                err = 0.0 if variant == "cublas-gemm" else rel_err(fn(), want, p["rows"], gemm.startswith("dw_"))
                rec.update(status="ok" if err <= MAX_REL_ERR else "WRONG", rel_err=err)
                if rec["status"] == "ok":
                    checked[variant] = fn
            except Exception as error:  # out of shared memory, compile failure: report and go on
                rec.update(status=f"{type(error).__name__}: {str(error)[:120]}")
        times = alternating_rounds(checked, rounds,
                                   lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
        for variant, rec in recs.items():
            if variant in times:
                ms = statistics.median(times[variant])
                rec.update(ms=ms, ms_rounds=times[variant], tflops=flops / ms / 1e9)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    return records


def summary(records: list[dict]) -> str:
    """TF/s per (workload, GEMM): cuBLAS with the torch epilogue, cuBLAS's GEMM alone, the pointer core, the
    Triton TMA kernel, the fused path's kernel (the table's: Gluon on Hopper) and its ratio to cuBLAS (with
    epilogue), and the best swept tile."""
    lines = [f"{'workload':16} {'gemm':14} {'cublas':>7} {'(gemm)':>7} {'pointer':>8} {'tma':>6} {'noskip':>6} "
             f"{'fused':>6} {'fused/cublas':>12}  best swept"]
    for key in dict.fromkeys((r["workload"], r["gemm"]) for r in records):
        rs = [r for r in records if (r["workload"], r["gemm"]) == key and r.get("tflops")]
        by = {r["variant"]: r["tflops"] for r in rs}
        swept = max((r for r in rs if r["variant"].startswith("tma ") or r["variant"].startswith("tma-flat")),
                    key=lambda r: r["tflops"], default=None)
        ratio = by.get("fused", 0) / by["cublas"] if by.get("cublas") else 0
        gemm_only = f"{by['cublas-gemm']:7.0f}" if "cublas-gemm" in by else f"{'-':>7}"
        lines.append(f"{key[0]:16} {key[1]:14} {by.get('cublas', 0):7.0f} {gemm_only} {by.get('pointer', 0):8.0f} "
                     f"{by.get('tma', 0):6.0f} {by.get('fused-noskip', 0):6.0f} {by.get('fused', 0):6.0f} {ratio:11.2f}x  "
                     f"{swept['variant'] if swept else '-'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="extend", type=comma_names(WORKLOADS), metavar="NAME")
    parser.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP tiles of the TMA kernels")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (the median is reported)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    records = []
    for name in args.workload or ["qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]:
        records += run(name, args.routing, args.tokens, args.sweep, args.rounds)
        torch.cuda.empty_cache()
    print(summary(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_facts(torch.device("cuda")), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
