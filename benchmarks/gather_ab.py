"""gate_up_fwd on gathered rows (spread_rows, then the GEMM reads x_rows by TMA) against gate_up_fwd gathering
x inside its loads (gather=(row_src, k): A by pointer, the weights by TMA), same tiles: bitwise equal h and
gate_up, and the time of each (balanced routing, bf16, a Hopper GPU; triton.testing.do_bench medians), with
tile variants of the gathering kernel. The Triton TMA kernel at the table's gate_up_fwd tile (configs.triton_tile:
the table runs the Gluon kernel, whose gather is benchmarks/gluon_gate_up_bench.py's).

Usage: python benchmarks/gather_ab.py WORKLOAD[,WORKLOAD...] OUT.json   (a Hopper GPU)
"""
import argparse, dataclasses, json, torch, triton
from megamoe.backends.triton import kernels
from megamoe.backends.triton.configs import block_m_for, triton_tile
from megamoe.backends.triton.experts import one_gpu_configs
from megamoe.bench.measure import run_facts
from megamoe.bench.workloads import WORKLOADS, comma_names
from megamoe.schedule import build_schedule

VARIANTS = [dict(), dict(num_stages=4, block_k=32), dict(flatten=True), dict(num_stages=2)]
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
    wgu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5).to(dt)
    wd = (torch.randn(E, H, I, device=dev, generator=g) * I**-0.5).to(dt)
    s = build_schedule(ids, E, block_m=block_m_for(H, I, dt))
    cfg = triton_tile(one_gpu_configs(x, wgu, wd, s).gate_up_fwd)
    blocks = (s.block_expert, s.num_blocks)
    in_use = s.expert_offsets[-1:]
    flops = 2 * T * k * H * 2 * I

    def rows_then_gemm():
        return kernels.gate_up_fwd(kernels.spread_rows(x, s.dest_row, s.row_src, in_use), wgu, *blocks,
                                   store_gate_up=True, config=cfg)

    want = rows_then_gemm()
    used = int(s.expert_offsets[-1])
    for i, v in enumerate([None] + VARIANTS):
        c = cfg if v is None else dataclasses.replace(cfg, **v)
        fn = rows_then_gemm if v is None else (
            lambda c=c: kernels.gate_up_fwd(x, wgu, *blocks, store_gate_up=True, config=c, gather=(s.row_src, k)))
        got = fn()
        same = v is None or all(torch.equal(a[:used], b[:used]) for a, b in zip(got, want))
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        r = dict(workload=name, mode="spread_rows + gemm" if v is None else "gather in loads", tile=str(c),
                 ms=ms, tflops=flops / ms / 1e9, bitwise_equal=same, **facts)
        out.append(r); print(json.dumps(r), flush=True)
    torch.cuda.empty_cache()
json.dump(out, open(args.json_path, "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} {r['mode']:20} {r['ms']:7.3f} ms {r['tflops']:5.0f} TF/s equal={r['bitwise_equal']} {r['tile']}")
