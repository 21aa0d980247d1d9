"""fwd+bwd of megamoe's fused path and of SonicMoE side by side: one process, one GPU, the same weights, tokens
and routing, the paths alternating (order rotated every round) over 4 rounds of 10 iterations after 3 untimed
ones; median per path and its peak memory above the inputs. Before timing, each SonicMoE path's output and
four gradients (d_x, d_topk_weights, d_w_gate_up, d_w_down) are compared with megamoe's.

SonicMoE (Dao-AILab/sonic-moe at 8565e84: CuTe DSL kernels, with quack at 3d0ab3ec, the commit its requirements
pin, and nvidia-cutlass-dsl 4.2.1; no quack-kernels release on PyPI has the modules it imports) computes the
experts part: the token gather inside the up-projection's loads, SwiGLU in its epilogue, the down-projection,
the weighted sum over a token's k experts. Two entry points (--sonic):
  fixed-k  its top-k layer (moe_TC_softmax_topk_layer) after the router: count_cumsum, TC_topk_router_metadata,
           _UpProjection, _DownProjection with fixed k, on the given top-k ids and scores (the default)
  general  moe_general_routing_inputs on the flattened (token, expert, score) triples
Its gate/up weight interleaves gate and up rows (row 2j gate j, row 2j + 1 up j); it gets a copy of megamoe's
w_gate_up in that order, made once before timing (its w_down layout is megamoe's, shared as is). It has no
shared expert: workloads with one are skipped, not timed without it.

Usage: python benchmarks/sonicmoe_ab.py WORKLOAD[,WORKLOAD...] OUT.json [--routing balanced,skewed]
       [--sonic fixed-k,general]   (an sm_90 GPU; sonicmoe, quack and cutlass importable)
Set-up: `pip install nvidia-cutlass-dsl==4.2.1` (its `cutlass` package lives in nvidia_cutlass_dsl/python_packages,
which a .pth file adds to the path; with `pip install --target DIR` put DIR/nvidia_cutlass_dsl/python_packages on
PYTHONPATH yourself), and sonic-moe's `sonicmoe/` (8565e84) and quack's `quack/` (3d0ab3ec) on PYTHONPATH
(`git archive` of each). SonicMoE builds a small CUDA extension (count_cumsum) with nvcc on first use.
"""
import argparse, functools, json, statistics, torch, megamoe
from megamoe.bench.problem import Tokens, forward_backward, make_tokens, make_weights
from megamoe.bench.workloads import WORKLOADS, layer_flops
from sonicmoe.count_cumsum import count_cumsum
from sonicmoe.enums import ActivationType
from sonicmoe.functional import TC_topk_router_metadata, _DownProjection, _UpProjection, moe_general_routing_inputs

MAX_REL_DIFF = 2e-2  # two bf16 paths with fp32 accumulation in different orders; NaN fails


def sonic_fixed_k(x, ids, scores, w1, w2):
    """SonicMoE's top-k layer (moe_TC_softmax_topk_layer) after its router: the fixed-k metadata and kernels
    (is_varlen_K False) on the given ids and scores instead of its own softmax top-k."""
    num_tokens, k = ids.shape
    stream = torch.cuda.current_stream().cuda_stream
    ids = ids.to(torch.int32)
    _, offsets = count_cumsum(ids.view(-1), w2.shape[-1], do_cumsum=True)
    offsets, x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, per_token_offset = TC_topk_router_metadata(ids, offsets, k)
    meta = (x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, per_token_offset, False, ActivationType.SWIGLU)
    y1, z = _UpProjection.apply(x, w1, None, offsets, num_tokens * k, k, stream, *meta, False)
    return _DownProjection.apply(y1, z, w2, None, scores, offsets, num_tokens, k, stream, *meta)


def sonic_general(x, ids, scores, w1, w2):
    """SonicMoE's general-routing entry point on the flattened (token, expert, score) triples."""
    num_tokens, k = ids.shape
    token_indices = torch.arange(num_tokens, device=x.device, dtype=torch.int32).repeat_interleave(k)
    out, _ = moe_general_routing_inputs(x, scores.flatten(), token_indices, ids.flatten().to(torch.int32), w1, None,
                                        w2, None, w2.shape[-1], torch.cuda.current_stream().cuda_stream,
                                        ActivationType.SWIGLU)
    return out


SONIC_PATHS = {"fixed-k": sonic_fixed_k, "general": sonic_general}


def sonic_forward_backward(path, w_gate_up_interleaved, w_down, tokens: Tokens) -> dict[str, torch.Tensor]:
    """SonicMoE's output and the gradients of sum(out * d_out), keyed as problem.forward_backward's."""
    x, scores = tokens.x_TH, tokens.topk_weights_TK
    out = SONIC_PATHS[path](x, tokens.topk_ids_TK, scores, w_gate_up_interleaved.permute(1, 2, 0),
                            w_down.permute(1, 2, 0))
    leaves = [x, scores, w_gate_up_interleaved, w_down]
    d_x, d_scores, d_w1, d_w_down = torch.autograd.grad(out, leaves, tokens.d_out_TH)
    num_experts, two_inter, hidden = d_w1.shape
    d_w_gate_up = d_w1.view(num_experts, two_inter // 2, 2, hidden).transpose(1, 2).reshape(d_w1.shape)
    return {"out": out.detach(), "d_x": d_x, "d_topk_weights": d_scores, "d_w_gate_up": d_w_gate_up,
            "d_w_down": d_w_down}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_workload(name: str, routings: list[str], sonic_paths: list[str]) -> list[dict]:
    """Both paths on one workload, balanced and skewed routing: a record per (routing, path)."""
    w = WORKLOADS[name]
    E = w.one_gpu_experts or w.num_experts; T = w.tokens_per_gpu
    dev = torch.device("cuda")
    weights = make_weights(w, range(E), torch.bfloat16, dev)
    inter = weights.w_down_EHI.shape[2]
    w1 = (weights.w_gate_up_E2IH.detach().view(E, 2, inter, w.hidden).transpose(1, 2)
          .reshape(E, 2 * inter, w.hidden).contiguous().requires_grad_())
    cfg = megamoe.MoEConfig(backend="triton")
    paths = {"megamoe": lambda t: forward_backward(megamoe.experts, weights, t, config=cfg),
             **{f"sonicmoe-{p}": functools.partial(sonic_forward_backward, p, w1, weights.w_down_EHI)
                for p in sonic_paths}}
    records = []
    for routing in routings:
        g = torch.Generator(device=dev).manual_seed(1)
        toks = [make_tokens(w, T, E, routing, torch.bfloat16, g) for _ in range(3)]
        ours = paths["megamoe"](toks[0])
        diffs = {}
        for p in paths:
            if p != "megamoe":
                theirs = paths[p](toks[0])
                diffs[p] = {key: rel_diff(theirs[key], ours[key]) for key in ours}
                print(f"{name} {routing}: {p} against megamoe, relative difference "
                      + ", ".join(f"{key} {d:.1e}" for key, d in diffs[p].items()), flush=True)
        agree = all(d <= MAX_REL_DIFF for by_key in diffs.values() for d in by_key.values())
        del ours, theirs
        times = {p: [] for p in paths}
        peak = dict.fromkeys(paths, 0)
        torch.cuda.synchronize()
        inputs_bytes = torch.cuda.memory_allocated()
        order = list(paths)
        for rnd in range(4):
            for p in order[rnd % len(order):] + order[:rnd % len(order)]:
                for i in range(3):
                    paths[p](toks[i % 3])
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
                for i, (a, b) in enumerate(ev):
                    a.record(); paths[p](toks[i % 3]); b.record()
                torch.cuda.synchronize()
                times[p] += [a.elapsed_time(b) for a, b in ev]
                peak[p] = max(peak[p], torch.cuda.max_memory_allocated() - inputs_bytes)
        for p, t in times.items():
            ms = statistics.median(t)
            rec = dict(workload=name, routing=routing, path=p, ms=ms, tflops=layer_flops(w, T, "fwd+bwd") / ms / 1e9,
                       peak_above_inputs_gib=peak[p] / 2**30, experts=E, tokens=T, rel_diff_to_megamoe=diffs,
                       outputs_agree=agree)
            records.append(rec); print(json.dumps(rec), flush=True)
    return records


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("workloads", help="comma-separated workload names")
parser.add_argument("json_path")
parser.add_argument("--routing", default="balanced,skewed")
parser.add_argument("--sonic", default="fixed-k", help=f"SonicMoE entry points, comma-separated: {', '.join(SONIC_PATHS)}")
args = parser.parse_args()
if unknown := set(args.sonic.split(",")) - set(SONIC_PATHS):
    parser.error(f"--sonic: unknown entry points {sorted(unknown)}; allowed: {', '.join(SONIC_PATHS)}")
if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
    parser.error(f"unknown workloads {sorted(unknown)}; allowed: {', '.join(WORKLOADS)}")
out = []
for name in args.workloads.split(","):
    if WORKLOADS[name].shared_intermediate:
        print(f"{name}: skipped (a shared expert, which SonicMoE does not run)", flush=True)
        continue
    out += run_workload(name, args.routing.split(","), args.sonic.split(","))
    torch.cuda.empty_cache()
    json.dump(out, open(args.json_path, "w"), indent=1)  # after each workload: a run cut short keeps what it measured
for r in out:
    print(f"{r['workload']:16} {r['routing']:9} {r['path']:9} {r['ms']:7.2f} ms {r['tflops']:5.0f} TF/s "
          f"{r['peak_above_inputs_gib']:6.2f} GiB above inputs  agree {r['outputs_agree']}")
for key in dict.fromkeys((r["workload"], r["routing"]) for r in out):
    ms = {r["path"]: r["ms"] for r in out if (r["workload"], r["routing"]) == key}
    for p in ms:
        if p != "megamoe":
            print(f"{key[0]:16} {key[1]:9} megamoe / {p} speed {ms[p] / ms['megamoe']:.3f}x")
