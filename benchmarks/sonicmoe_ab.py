"""megamoe, SonicMoE and the TorchTitan-style path side by side: one process, one device, the same weights,
tokens and routing, the paths alternating (megamoe.bench.measure.round_order) over ROUNDS rounds of ITERS
iterations after 3 untimed ones; median per path, and on GPUs its peak memory above the inputs. Before timing, each other
path's output (and, for fwd+bwd, its four gradients d_x, d_topk_weights, d_w_gate_up, d_w_down) is compared with
megamoe's. On GPUs the 8192^3 bf16 matmul of the bench's MFU ceiling (megamoe.bench.measure.ceiling_matmul) opens
every round, so each path's MFU is against a ceiling timed in the same rounds, at the same clock and power state (an
H200 reaches its power cap within a second of sustained load), and, over a multiple of the paths' count (of twice
it where that is odd: 2 for the default pair, 6 with --torchtitan), every path runs right after each other path and
after the ceiling equally often, across the rounds' boundaries too (round_turns): the turn before sets the clock.
--profile N: after the timing, each path's GPU time per kernel over N calls (torch.profiler), where one path's time
goes.

SonicMoE (Dao-AILab/sonic-moe at 8565e84: CuTe DSL kernels, with quack at 3d0ab3ec, the commit its requirements
pin, and nvidia-cutlass-dsl 4.2.1; no quack-kernels release on PyPI has the modules it imports) computes the
experts part: the token gather inside the up-projection's loads, SwiGLU in its epilogue, the down-projection,
the weighted sum over a token's k experts. Two entry points (--sonic):
  fixed-k  its top-k layer (moe_TC_softmax_topk_layer) after the router: the experts' row counts and offsets,
           TC_topk_router_metadata, _UpProjection, _DownProjection with fixed k, on the given top-k ids and scores
           (the default; the counts by torch ops, not its count_cumsum, which launches on the legacy default
           stream whatever the current one: sonic_fixed_k)
  general  moe_general_routing_inputs on the flattened (token, expert, score) triples
  none     no SonicMoE (megamoe against the TorchTitan-style path only; runs on a CPU too)
Its gate/up weight interleaves gate and up rows (row 2j gate j, row 2j + 1 up j); it gets a copy of megamoe's
w_gate_up in that order, made once before timing (its w_down layout is megamoe's, shared as is), and its gate/up
gradient, in the same order, is reordered for the comparison only: timed calls leave it as SonicMoE returns it. It has no
shared expert: with SonicMoE, a workload with one (deepseek-v3, kimi-k2) is compared on its routed experts alone, the
shared expert left out of every path (records carry routed_only: true; FLOPs and MFU count the routed experts only).
--torchtitan adds the TorchTitan-style path (megamoe.bench.baselines, the bench's headline baseline) to the
alternation.

Usage: python benchmarks/sonicmoe_ab.py WORKLOAD[,WORKLOAD...] OUT.json [--routing balanced,skewed]
       [--sonic fixed-k,general|none] [--torchtitan] [--pass fwd+bwd,fwd] [--backend auto] [--rounds 4] [--iters 10]
       [--graph] [--profile N]
--graph: each path's call (on the first input set) captured once as a CUDA graph and the replays timed: the
kernels without the host's launch work, as in a training step captured whole; a path that cannot be captured (a
host synchronisation) is reported with its error instead of a time, as is one whose replay's results differ from
an eager call's (beyond the comparison's tolerance), checked once right after its capture and, for the
token-sized results, again after every other path's replay (the graphs share one memory pool); no peak memory
(the pool counts).
Set-up for SonicMoE (an sm_90 GPU): `pip install nvidia-cutlass-dsl==4.2.1` (its `cutlass` package lives in
nvidia_cutlass_dsl/python_packages, which a .pth file adds to the path; with `pip install --target DIR` put
DIR/nvidia_cutlass_dsl/python_packages on PYTHONPATH yourself), and sonic-moe's `sonicmoe/` (8565e84) and
quack's `quack/` (3d0ab3ec) on PYTHONPATH (`git archive` of each). For a GPU machine without a package index,
scripts/sonicmoe_pack.sh packs all of it into one folder to copy there (its header says how to unpack it).
"""
import argparse, contextlib, dataclasses, functools, importlib.util, json, statistics, torch
from megamoe.bench.gate import backend_weights, experts_fn
from megamoe.bench.measure import (
    CEILING_FLOPS, call_times_ms, ceiling_matmul, cuda_graph, kernel_times, round_order, run_facts,
)
from megamoe.bench.problem import Tokens, forward_TH, forward_backward, make_tokens, make_weights, megamoe_layout
from megamoe.bench.routing import ROUTINGS
from megamoe.bench.workloads import WORKLOADS, layer_flops
from megamoe.config import BACKENDS

PASSES = ("fwd+bwd", "fwd")
TOKEN_KEYS = ("out", "d_x", "d_topk_weights")  # the results of one row per token (not the weight gradients)
MAX_REL_DIFF = 2e-2  # bf16 paths with fp32 accumulation in different orders; NaN fails
WARMUP = 3
PROFILE_TOP = 12  # kernels printed per path with --profile (the JSON has all)
CEILING = "matmul-8192"  # the ceiling's turn in the rounds (GPUs)


def sonic_fixed_k(x, ids, scores, w1, w2):
    """SonicMoE's top-k layer (moe_TC_softmax_topk_layer) after its router: the fixed-k metadata and kernels
    (is_varlen_K False) on the given ids and scores instead of its own softmax top-k. The experts' row counts and
    their running sum (its count_cumsum's outputs) come from torch ops: count_cumsum launches on the legacy
    default stream whatever the current one is, so on a side stream it races the ids it reads and a CUDA graph
    captured there leaves it out (replays then read offsets that nothing rewrote)."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import TC_topk_router_metadata, _DownProjection, _UpProjection

    num_tokens, k = ids.shape
    stream = torch.cuda.current_stream().cuda_stream
    flat = ids.reshape(-1).long()
    counts = torch.zeros(w2.shape[-1], dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    ids = ids.to(torch.int32)
    offsets, x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, per_token_offset = TC_topk_router_metadata(ids, offsets, k)
    meta = (x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, per_token_offset, False, ActivationType.SWIGLU)
    y1, z = _UpProjection.apply(x, w1, None, offsets, num_tokens * k, k, stream, *meta, False)
    return _DownProjection.apply(y1, z, w2, None, scores, offsets, num_tokens, k, stream, *meta)


def sonic_general(x, ids, scores, w1, w2):
    """SonicMoE's general-routing entry point on the flattened (token, expert, score) triples."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    num_tokens, k = ids.shape
    token_indices = torch.arange(num_tokens, device=x.device, dtype=torch.int32).repeat_interleave(k)
    out, _ = moe_general_routing_inputs(x, scores.flatten(), token_indices, ids.flatten().to(torch.int32), w1, None,
                                        w2, None, w2.shape[-1], torch.cuda.current_stream().cuda_stream,
                                        ActivationType.SWIGLU)
    return out


SONIC_PATHS = {"fixed-k": sonic_fixed_k, "general": sonic_general}


def sonic_run(entry: str, backward: bool, w_gate_up_interleaved, w_down, tokens: Tokens,
              compare: bool = False) -> dict[str, torch.Tensor]:
    """SonicMoE's output (and the gradients of sum(out * d_out)), keyed as problem.forward_backward's. Its gate/up
    gradient comes in its own interleaved row order; compare: reordered as megamoe's (a copy of the whole
    gradient, made for the comparison only: timed calls return it as SonicMoE leaves it, "d_w_gate_up_interleaved")."""
    x, scores = tokens.x_TH, tokens.topk_weights_TK
    out = SONIC_PATHS[entry](x, tokens.topk_ids_TK, scores, w_gate_up_interleaved.permute(1, 2, 0),
                             w_down.permute(1, 2, 0))
    if not backward:
        return {"out": out.detach()}
    leaves = [x, scores, w_gate_up_interleaved, w_down]
    d_x, d_scores, d_w1, d_w_down = torch.autograd.grad(out, leaves, tokens.d_out_TH)
    grads = {"out": out.detach(), "d_x": d_x, "d_topk_weights": d_scores, "d_w_down": d_w_down}
    if not compare:
        return {**grads, "d_w_gate_up_interleaved": d_w1}
    num_experts, two_inter, hidden = d_w1.shape
    d_w_gate_up = d_w1.view(num_experts, two_inter // 2, 2, hidden).transpose(1, 2).reshape(d_w1.shape)
    return {**grads, "d_w_gate_up": d_w_gate_up}


def bench_run(fn, backward: bool, weights, tokens: Tokens, compare: bool = False) -> dict[str, torch.Tensor]:
    """megamoe or a baseline of the bench (an experts fn) on the problem: problem.forward_backward's dict, or
    {"out"} for the forward alone (run as in training: autograd records it); weights as the path holds them
    (gate.backend_weights). compare: unused (rel_diff joins TorchTitan's (w1, w3) gradients)."""
    if backward:
        return forward_backward(fn, weights, tokens)
    return {"out": forward_TH(fn, weights, tokens).detach()}


def rel_diff(a, b) -> float:
    """||a - b|| / ||b|| of two results of one key, each in megamoe's layout first (problem.megamoe_layout)."""
    a, b = megamoe_layout(a).float(), megamoe_layout(b).float()
    return ((a - b).norm() / b.norm()).item()


def _replay_diff(replay, captured: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> dict[str, float]:
    """A replay's results (the tensors the capture returned, refreshed) against an eager call's on the same inputs,
    relative difference per key: a graph that left out or mis-recorded work shows here, not as a fast time."""
    replay()
    return {key: rel_diff(captured[key], eager[key]) for key in eager}


def _capture(run, tokens, pool) -> tuple:
    """run(tokens) captured as a CUDA graph in pool: (its replay, the replay's relative difference per key to an
    eager call, {key: (the replay's result, the eager call's on the CPU)} for the TOKEN_KEYS). The weight gradients'
    memory is left to the pool: later captures reuse it."""
    replay, captured = cuda_graph(functools.partial(run, tokens), pool=pool)
    eager = run(tokens)
    diff = _replay_diff(replay, captured, eager)
    return replay, diff, {key: (captured[key], eager[key].cpu()) for key in TOKEN_KEYS if key in captured}


def round_turns(paths: list[str], rnd: int, on_gpu: bool) -> list[str]:
    """Round rnd's turns: on GPUs the ceiling's first, then the paths in round_order's order. The rounds run back to
    back, so a round's first turn follows the last turn of the round before; with the ceiling opening every round,
    each path follows each other path and the ceiling equally often over round_order's period, the rounds'
    boundaries included. (Inside the rotation, the ceiling made those boundaries pair the same turns every time:
    with three paths over 8 rounds SonicMoE followed the matmul in 4 of its turns, megamoe in 2, and megamoe the
    lighter TorchTitan-style turn in 3.)"""
    return ([CEILING] if on_gpu else []) + round_order(paths, rnd)


def run_workload(name: str, pass_name: str, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The paths on one workload and pass, per routing: a record per (routing, path)."""
    w = WORKLOADS[name]
    routed_only = bool(args.sonic and w.shared_intermediate)  # SonicMoE runs no shared expert: no path does
    if routed_only:
        w = dataclasses.replace(w, shared_intermediate=0)
    E = w.one_gpu_experts or w.num_experts; T = w.tokens_per_gpu
    backward = pass_name == "fwd+bwd"
    weights = make_weights(w, range(E), dtype, device)
    paths = {"megamoe": functools.partial(bench_run, experts_fn(args.backend), backward, weights)}
    if args.torchtitan:
        paths["torchtitan"] = functools.partial(bench_run, experts_fn("torchtitan"), backward,
                                                backend_weights("torchtitan", weights))
    if args.sonic:
        inter = weights.w_down_EHI.shape[2]
        w1 = (weights.w_gate_up_E2IH.detach().view(E, 2, inter, w.hidden).transpose(1, 2)
              .reshape(E, 2 * inter, w.hidden).contiguous().requires_grad_())
        for entry in args.sonic:
            paths[f"sonicmoe-{entry}"] = functools.partial(sonic_run, entry, backward, w1, weights.w_down_EHI)
    on_gpu = device.type == "cuda"
    records = []
    for routing in args.routing:
        g = torch.Generator(device=device).manual_seed(1)
        toks = [make_tokens(w, T, E, routing, dtype, g) for _ in range(3)]
        ours = paths["megamoe"](toks[0])
        diffs = {}
        for p, run in paths.items():
            if p != "megamoe":
                theirs = run(toks[0], compare=True)
                diffs[p] = {key: rel_diff(theirs[key], ours[key]) for key in ours}
                print(f"{name} {routing}: {p} against megamoe, relative difference "
                      + ", ".join(f"{key} {d:.1e}" for key, d in diffs[p].items()), flush=True)
                del theirs
        del ours
        turns = dict(paths)
        graph_errors = {}
        if args.graph:
            turns, kept = {}, {}
            # One memory pool for all the paths' graphs (they never replay concurrently): a graph's intermediates and
            # weight gradients reuse the memory of those captured before it. Three pools side by side did not fit
            # gpt-oss-120b's fwd+bwd beside each other on an 80 GB H100.
            pool = torch.cuda.graph_pool_handle()
            for p, run in paths.items():
                try:
                    replay, replay_diff, kept[p] = _capture(run, toks[0], pool)
                except Exception as error:  # e.g. a host synchronisation inside the path: reported, not timed
                    graph_errors[p] = f"{type(error).__name__}: {error}"
                    print(f"{name} {routing} {pass_name} {p}: not captured as a CUDA graph: {graph_errors[p]}",
                          flush=True)
                    # A capture that failed part-way may never give its claim on the pool back (torch releases it
                    # when a graph is reset after a completed capture): the later paths take a new pool.
                    pool = torch.cuda.graph_pool_handle()
                    continue
                if not all(d <= MAX_REL_DIFF for d in replay_diff.values()):
                    graph_errors[p] = "its replay differs from its eager call: " + ", ".join(
                        f"{key} {d:.1e}" for key, d in replay_diff.items())
                    print(f"{name} {routing} {pass_name} {p}: {graph_errors[p]}; not timed", flush=True)
                    continue
                turns[p] = lambda tokens, replay=replay: replay()
            for p in list(turns):  # each replay again after every other graph's, against its eager call's results
                for q in turns:
                    if q != p:
                        turns[q](None)
                turns[p](None)
                diff = {key: rel_diff(got, want.to(device)) for key, (got, want) in kept[p].items()}
                if not all(d <= MAX_REL_DIFF for d in diff.values()):
                    graph_errors[p] = "its replay after the other graphs' differs from its eager call: " + ", ".join(
                        f"{key} {d:.1e}" for key, d in diff.items())
                    print(f"{name} {routing} {pass_name} {p}: {graph_errors[p]}; not timed", flush=True)
                    del turns[p]
            del kept
        timed = list(turns)
        times = {p: [] for p in timed}
        peak = dict.fromkeys(timed, 0)
        if on_gpu:
            matmul = ceiling_matmul(device)
            turns[CEILING] = lambda _: matmul()
            times[CEILING] = []
            torch.cuda.synchronize()
            inputs_bytes = torch.cuda.memory_allocated()
        for rnd in range(args.rounds):
            for p in round_turns(timed, rnd, on_gpu):
                for i in range(WARMUP):
                    turns[p](toks[i % 3])
                if on_gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times[p] += call_times_ms(lambda i: turns[p](toks[i % 3]), iters=args.iters, warmup=0, device=device)
                if on_gpu and p in paths:
                    peak[p] = max(peak[p], torch.cuda.max_memory_allocated() - inputs_bytes)
        # Per round, the median of its iterations: what the turn before did to each turn stays readable in the JSON.
        round_ms = {p: [statistics.median(t[i:i + args.iters]) for i in range(0, len(t), args.iters)]
                    for p, t in times.items()}
        ceiling = CEILING_FLOPS / statistics.median(times.pop(CEILING)) / 1e9 if on_gpu else None
        profiles = {p: kernel_times(functools.partial(turns[p], toks[0]), args.profile) for p in timed
                    if args.profile and p in paths}
        for p, t in times.items():
            ms = statistics.median(t)
            diff = diffs.get(p)
            if p in profiles:
                print(f"{name} {routing} {pass_name} {p}: {profiles[p]['gpu_us_per_iteration']:.0f} us of kernels, "
                      f"{profiles[p]['idle_us_per_iteration']:.0f} us idle between them", flush=True)
                for r in profiles[p]["kernels"][:PROFILE_TOP]:
                    print(f"  {r['us']:8.1f} us  x{r['launches']:<3} {r['kernel'][:110]}", flush=True)
            tflops = layer_flops(w, T, pass_name) / ms / 1e9
            records.append(dict(
                workload=name, routing=routing, pass_name=pass_name, path=p, ms=ms, tflops=tflops,
                ceiling_tflops=ceiling, mfu=tflops / ceiling if ceiling else None, ms_rounds=round_ms[p],
                ceiling_ms_rounds=round_ms.get(CEILING),
                # With --graph the captured graphs' memory pools count as allocated: no peak.
                peak_above_inputs_gib=peak[p] / 2**30 if on_gpu and not args.graph else None, experts=E, tokens=T,
                graph=args.graph, routed_only=routed_only, **args.facts,
                rel_diff_to_megamoe=diff, agrees=None if diff is None else all(d <= MAX_REL_DIFF for d in diff.values()),
                **({"profile": profiles[p]} if p in profiles else {})))
            print(json.dumps(records[-1]), flush=True)
        records += [dict(workload=name, routing=routing, pass_name=pass_name, path=p, graph=True, graph_error=error,
                         **args.facts) for p, error in graph_errors.items()]
        # This routing's graphs go now: one still held would keep their whole pool through the next routing.
        turns = replay = None
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", help="comma-separated workload names")
    parser.add_argument("json_path")
    parser.add_argument("--routing", default="balanced,skewed")
    parser.add_argument("--sonic", default="fixed-k",
                        help=f"SonicMoE entry points, comma-separated ({', '.join(SONIC_PATHS)}), or none")
    parser.add_argument("--torchtitan", action="store_true", help="add the TorchTitan-style path")
    parser.add_argument("--pass", dest="passes", default="fwd+bwd",
                        help=f"comma-separated passes ({', '.join(PASSES)}), each timed in this process (compiled once)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="megamoe's backend (MoEConfig.backend)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--graph", action="store_true",
                        help="time each path as a CUDA graph of one call, replayed (its host work gone; a CUDA GPU)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, each path's GPU time per kernel over N calls (torch.profiler; a CUDA GPU)")
    args = parser.parse_args(argv)
    # A name given twice runs once (twice, its records would repeat and the speed line read the later one only).
    args.sonic = [] if args.sonic == "none" else args.sonic.split(",")
    args.routing = list(dict.fromkeys(args.routing.split(",")))
    args.passes = list(dict.fromkeys(args.passes.split(",")))
    workloads = list(dict.fromkeys(args.workloads.split(",")))
    if unknown := set(args.passes) - set(PASSES):
        parser.error(f"--pass: unknown passes {sorted(unknown)}; allowed: {', '.join(PASSES)}")
    if unknown := set(args.routing) - set(ROUTINGS):
        parser.error(f"--routing: unknown routings {sorted(unknown)}; allowed: {', '.join(ROUTINGS)}")
    if unknown := set(args.sonic) - set(SONIC_PATHS):
        parser.error(f"--sonic: unknown entry points {sorted(unknown)}; allowed: {', '.join(SONIC_PATHS)} or none")
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; allowed: {', '.join(WORKLOADS)}")
    if args.rounds < 1 or args.iters < 1:
        parser.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.graph and device.type != "cuda":
        parser.error("--graph needs a CUDA GPU")
    if args.profile < 0 or (args.profile and device.type != "cuda"):
        parser.error(f"--profile takes a count >= 0 of profiled calls and needs a CUDA GPU, got {args.profile} "
                     f"on {device.type}")
    # SonicMoE's own entry points (not a stand-in put in SONIC_PATHS) need its stack and a GPU: said before any set-up.
    sonic = [e for e in args.sonic if SONIC_PATHS[e] in (sonic_fixed_k, sonic_general)]
    sonic_found = importlib.util.find_spec("sonicmoe") is not None
    if sonic and (device.type != "cuda" or not sonic_found):
        parser.error(f"--sonic {','.join(sonic)} runs SonicMoE, which needs a CUDA GPU (sm_90) and sonic-moe "
                     f"importable (set-up: this script's docstring); here: {device.type}, sonicmoe "
                     f"{'found' if sonic_found else 'not found'}; --sonic none times without it")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # What ran, on every record: the code, the machine, the versions, the dtype and megamoe's backend.
    args.facts = dict(run_facts(device), dtype=str(dtype).removeprefix("torch."), megamoe_backend=args.backend)
    out = []
    # --graph: every call on one side stream, the capturing one (measure.cuda_graph: the backward's leaves).
    with torch.cuda.stream(torch.cuda.Stream()) if args.graph else contextlib.nullcontext():
        for name in workloads:
            if args.sonic and WORKLOADS[name].shared_intermediate:
                print(f"{name}: its routed experts only (SonicMoE runs no shared expert)", flush=True)
            for pass_name in args.passes:
                out += run_workload(name, pass_name, args, device, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                json.dump(out, open(args.json_path, "w"), indent=1)  # after each pass: a run cut short keeps what it has
    timed = [r for r in out if "ms" in r]
    for r in out:
        if "ms" not in r:
            print(f"{r['workload']:16} {r['routing']:9} {r['pass_name']:7} {r['path']:18} not captured: "
                  f"{r['graph_error'][:80]}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}% MFU (ceiling {r['ceiling_tflops']:.0f})" if r["mfu"] else ""
        print(f"{r['workload']:16} {r['routing']:9} {r['pass_name']:7} {r['path']:18} {r['ms']:8.2f} ms "
              f"{r['tflops']:6.1f} TF/s {mfu} agrees {r['agrees']}")
    for key in dict.fromkeys((r["workload"], r["routing"], r["pass_name"]) for r in timed):
        ms = {r["path"]: r["ms"] for r in timed if (r["workload"], r["routing"], r["pass_name"]) == key}
        if "megamoe" in ms and len(ms) > 1:  # against the other paths timed (with --graph, those captured)
            print(f"{key[0]:16} {key[1]:9} {key[2]:7} megamoe's speed: " + ", ".join(
                f"{t / ms['megamoe']:.3f}x {p}'s" for p, t in ms.items() if p != "megamoe"))
    return out


if __name__ == "__main__":
    main()
