"""Tile sweep of down_dgrad with the router epilogue (down_dgrad_router) on the Triton TMA kernel, beside the tile
table's kernel (the Gluon one on Hopper) with and without the router epilogue, on the same rows (balanced routing,
bf16, a Hopper GPU; triton.testing.do_bench medians). Its first run
(benchmarks/results/h200-bwd-sweep-v1.json) also timed a dw_gate_up variant that gathered x inside its loads,
removed since (docs/perf-notes.md, "Memory v2").

Usage: python benchmarks/bwd_sweep.py WORKLOAD[,WORKLOAD...] OUT.json   (a Hopper GPU)
"""
import argparse, json, torch, triton
from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import TileConfig, block_m_for
from megamoe.backends.triton.experts import one_gpu_configs
from megamoe.bench.measure import run_facts
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule

DOWN_DGRAD = [(128, 128, 64, 8, 4, False), (128, 128, 64, 8, 4, True), (128, 128, 64, 8, 3, False),
              (128, 64, 64, 4, 4, False), (128, 64, 64, 4, 6, True), (128, 256, 64, 8, 3, False)]
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS), help="comma-separated workload names")
parser.add_argument("json_path")
args = parser.parse_args()
facts = run_facts(torch.device("cuda"))
out = []
for name in args.workloads:
    w = WORKLOADS[name]; T, H, I, k = w.tokens_per_gpu, w.hidden, w.intermediate, w.top_k
    E = w.one_gpu_experts or w.num_experts
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).to(dt)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices
    tw = torch.rand(T, k, device=dev, generator=g).softmax(-1)
    wgu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5).to(dt)
    wd = (torch.randn(E, H, I, device=dev, generator=g) * I**-0.5).to(dt)
    d_out = torch.randn(T, H, device=dev, generator=g).to(dt)
    s = build_schedule(ids, E, block_m=block_m_for(H, I, dt))
    cfg = one_gpu_configs(x, wgu, wd, s)
    blocks = (s.block_expert, s.num_blocks)
    in_use = s.expert_offsets[-1:]
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
    d_rows = kernels.spread_rows(d_out, s.dest_row, s.row_src, in_use)
    _, gate_up = kernels.gate_up_fwd(x_rows, wgu, *blocks, store_gate_up=True, config=cfg.gate_up_fwd)
    gemm = 2 * T * k * H * I

    def rec(kernel, tile, fn, flops):
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        r = dict(workload=name, kernel=kernel, tile=tile, ms=ms, tflops=flops / ms / 1e9 if flops else None, **facts)
        out.append(r); print(json.dumps(r), flush=True)

    rec("down_dgrad (no router, table)", str(cfg.down_dgrad), lambda: kernels.down_dgrad(d_rows, wd, gate_up, *blocks, config=cfg.down_dgrad), gemm)
    rec("down_dgrad_router (table)", str(cfg.down_dgrad), lambda: kernels.down_dgrad_router(d_rows, wd, gate_up, s.row_src, tw, *blocks, store_h_w=True, config=cfg.down_dgrad), gemm)
    for bm, bn, bk, nw, st, fl in DOWN_DGRAD:
        c = TileConfig(bm, bn, bk, num_warps=nw, num_stages=st, tma=True, flatten=fl)
        rec("down_dgrad_router", str(c), lambda c=c: kernels.down_dgrad_router(d_rows, wd, gate_up, s.row_src, tw, *blocks, store_h_w=True, config=c), gemm)
    torch.cuda.empty_cache()
json.dump(out, open(args.json_path, "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} {r['kernel']:30} {r['tile']:95} {r['ms']:7.3f} ms {r['tflops'] or 0:5.0f} TF/s")
