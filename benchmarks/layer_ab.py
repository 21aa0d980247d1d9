"""fwd+bwd (or the training forward alone) of the one-GPU triton backend in named variants of its kernel choice,
in one process, the variants alternating (megamoe.bench.measure.round_order) over 4 rounds (--rounds) of 10 iterations;
median per variant (and each round's), and the peak memory above the inputs (weights and token sets) over its
iterations: allocated, and reserved by the caching allocator from an emptied cache (steady state after the untimed
warmup). Before the timing, every variant's output (and, fwd+bwd, gradients) on one token set is compared bit for bit
with the first variant's (bitwise_equal_to_first), and the first variant's are recorded as sha256 digests (digests), to
compare runs in different processes (e.g. under two Triton releases; each record names its GPU, torch, Triton and
commit: megamoe.bench.measure.run_facts).

Usage: python benchmarks/layer_ab.py WORKLOAD[,WORKLOAD...] VARIANT,VARIANT[,...] OUT.json [--pass fwd+bwd,fwd]
       [--rounds N] [--routing balanced,skewed]   (an sm_90 GPU)
Variants (each a change to the tile choice that every run reads through the public path, megamoe.experts):
  default   the tile table as it ships
  pointer   the pointer-load core (configs.tma_kernel_configs answers None, so experts.one_gpu_configs picks it)
  rows      gate_up_fwd on gathered rows (a gather pass) where the table gathers x inside the kernel's loads
  gather    gate_up_fwd gathering x inside its loads on every workload (the table: where it measured faster)
  gather-s3 the gathering gate_up_fwd with 3 stages and two staging buffers per consumer (the table: 4 and 1)
  no-handoff  gate_up_fwd on x rows with its epilogue on the consumer warpgroups (3 stages, two staging buffers
            each) instead of the table's hand-off kernel (TileConfig.handoff)
  no-skip   the Gluon weight grads without the schedule's row_src: an expert's last row step computed even where
            it holds padding rows only (the default skips it)
  no-spread-x  dw_gate_up's x rows by a spread pass of their own after gate_up_dgrad, not spread by a warp of
            gate_up_dgrad's kernel beside its GEMM (kernels.gate_up_dgrad_spreads_x)
  group_m:N every GEMM's tiles swept N row blocks per column block (the table: 8)
  GEMM.group_m:N  the same for one GEMM of the table (e.g. down_dgrad.group_m:4)
"""
import argparse, dataclasses, functools, hashlib, json, statistics, torch, megamoe
from megamoe.backends.triton import configs
from megamoe.backends.triton import experts as te
from megamoe.backends.triton import kernels
from megamoe.bench.measure import round_order, run_facts
from megamoe.bench.problem import make_weights, make_tokens, forward_backward, forward_TH
from megamoe.bench.routing import ROUTINGS
from megamoe.bench.workloads import PASSES, WORKLOADS, comma_names, layer_flops

SHIPPED = (te.tma_kernel_configs, configs._GATHER_X_MAX_H)
# Replaced by variants and restored by select: the weight grads (given row_src by experts_bwd) and whether
# gate_up_dgrad spreads x's rows beside its GEMM.
SHIPPED_KERNELS = {name: getattr(kernels, name) for name in ("dw_down", "dw_gate_up", "gate_up_dgrad_spreads_x")}
NAMED_VARIANTS = ("default", "pointer", "rows", "gather", "gather-s3", "no-handoff", "no-skip", "no-spread-x")
GEMMS = tuple(f.name for f in dataclasses.fields(configs.KernelConfigs) if f.name != "combine")


def without_row_src(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        kwargs.pop("row_src", None)
        return fn(*args, **kwargs)
    return call


def gather_s3(*args):
    table = SHIPPED[0](*args)
    if table is None or not table.gate_up_fwd.gather:
        return table
    return dataclasses.replace(table, gate_up_fwd=dataclasses.replace(table.gate_up_fwd, num_stages=3))


def no_handoff(*args):
    table = SHIPPED[0](*args)
    if table is None or not table.gate_up_fwd.handoff:
        return table
    return dataclasses.replace(table, gate_up_fwd=dataclasses.replace(table.gate_up_fwd, handoff=False))


def with_group_m(group_m: int, gemm: str | None):
    """The table with group_m on every GEMM's entry (gemm None) or on the one named."""
    def table(*args):
        t = SHIPPED[0](*args)
        if t is None:
            return t
        names = [f.name for f in dataclasses.fields(t) if f.name != "combine"] if gemm is None else [gemm]
        return dataclasses.replace(t, **{name: dataclasses.replace(getattr(t, name), group_m=group_m) for name in names})
    return table


def variant_error(variant: str) -> str:
    """Why select does not know variant ("" where it does)."""
    gemm, group_m, n = variant.rpartition("group_m:")
    known_gemm = gemm == "" or (gemm.endswith(".") and gemm[:-1] in GEMMS)
    if variant in NAMED_VARIANTS or (group_m and known_gemm and n.isdigit() and int(n) >= 1):
        return ""
    return (f"unknown variant {variant!r}: {', '.join(NAMED_VARIANTS)}, group_m:N or GEMM.group_m:N "
            f"(N >= 1; GEMM one of {', '.join(GEMMS)})")


def select(variant: str) -> None:
    te.tma_kernel_configs, configs._GATHER_X_MAX_H = SHIPPED
    for name, fn in SHIPPED_KERNELS.items():
        setattr(kernels, name, fn)
    if variant == "pointer":
        te.tma_kernel_configs = lambda *a: None
    elif variant == "rows":
        configs._GATHER_X_MAX_H = 0
    elif variant == "gather":
        configs._GATHER_X_MAX_H = 1 << 30
    elif variant == "gather-s3":
        te.tma_kernel_configs = gather_s3
    elif variant == "no-handoff":
        te.tma_kernel_configs = no_handoff
    elif variant == "no-skip":
        for name in ("dw_down", "dw_gate_up"):
            setattr(kernels, name, without_row_src(SHIPPED_KERNELS[name]))
    elif variant == "no-spread-x":
        kernels.gate_up_dgrad_spreads_x = lambda *args: False
    elif "group_m:" in variant:
        gemm, _, n = variant.rpartition("group_m:")
        te.tma_kernel_configs = with_group_m(int(n), gemm.removesuffix(".") or None)
    elif variant != "default":
        raise ValueError(variant_error(variant))


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("workloads", metavar="WORKLOAD", type=comma_names(WORKLOADS))
parser.add_argument("variants")
parser.add_argument("json_path")
parser.add_argument("--pass", dest="passes", default="fwd+bwd", type=comma_names(PASSES), help="fwd+bwd and/or fwd (the training forward)")
parser.add_argument("--rounds", type=int, default=4)
parser.add_argument("--routing", default="balanced,skewed", type=comma_names(ROUTINGS))
args = parser.parse_args()
for v in args.variants.split(","):
    if error := variant_error(v):
        parser.error(f"VARIANT: {error}")
if args.rounds < 1:
    parser.error(f"--rounds must be at least 1, got {args.rounds}")


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (16 hex digits)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def step(pass_name, weights, tokens, cfg):
    if pass_name == "fwd":
        forward_TH(megamoe.experts, weights, tokens, config=cfg).detach()
    else:
        forward_backward(megamoe.experts, weights, tokens, config=cfg)


facts = run_facts(torch.device("cuda"))
out = []
variants = args.variants.split(",")
for name in args.workloads:
    w = WORKLOADS[name]; E = w.one_gpu_experts or w.num_experts; T = w.tokens_per_gpu
    dev = torch.device("cuda")
    weights = make_weights(w, range(E), torch.bfloat16, dev)
    for routing, pass_name in [(r, p) for r in args.routing for p in args.passes]:
        g = torch.Generator(device=dev).manual_seed(1)
        toks = [make_tokens(w, T, E, routing, torch.bfloat16, g) for _ in range(3)]
        cfg = megamoe.MoEConfig(backend="triton")
        times = {v: [] for v in variants}
        round_medians = {v: [] for v in variants}
        peak = dict.fromkeys(variants, 0)
        reserved = dict.fromkeys(variants, 0)
        # Every variant's bits against the first's on one token set before any timing (fwd: the output).
        results = {}
        for v in variants:
            select(v)
            r = forward_backward(megamoe.experts, weights, toks[0], config=cfg)
            results[v] = {"out": r["out"]} if pass_name == "fwd" else r
        equal = {v: all(torch.equal(results[v][key], results[variants[0]][key]) for key in results[v])
                 for v in variants}
        digests = {key: digest(value) for key, value in results[variants[0]].items()}
        del results
        select("default")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        inputs_bytes, inputs_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        for rnd in range(args.rounds):
            for v in round_order(variants, rnd):
                select(v)
                torch.cuda.empty_cache()  # the allocator's cache as this variant alone leaves it (untimed warmup)
                for i in range(3):
                    step(pass_name, weights, toks[i % 3], cfg)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
                for i, (a, b) in enumerate(ev):
                    a.record(); step(pass_name, weights, toks[i % 3], cfg); b.record()
                torch.cuda.synchronize()
                round_ms = [a.elapsed_time(b) for a, b in ev]
                times[v] += round_ms
                round_medians[v].append(statistics.median(round_ms))
                peak[v] = max(peak[v], torch.cuda.max_memory_allocated() - inputs_bytes)
                reserved[v] = max(reserved[v], torch.cuda.max_memory_reserved() - inputs_reserved)
        select("default")
        for v, t in times.items():
            ms = statistics.median(t)
            rec = dict(workload=name, routing=routing, pass_name=pass_name, variant=v, ms=ms,
                       tflops=layer_flops(w, T, pass_name) / ms / 1e9, peak_above_inputs_gib=peak[v] / 2**30,
                       reserved_above_inputs_gib=reserved[v] / 2**30, experts=E, round_medians_ms=round_medians[v],
                       bitwise_equal_to_first=equal[v], digests=digests, **facts)
            out.append(rec); print(json.dumps(rec), flush=True)
    del weights; torch.cuda.empty_cache()
json.dump(out, open(args.json_path, "w"), indent=1)
for r in out:
    print(f"{r['workload']:16} {r['routing']:9} {r['pass_name']:7} {r['variant']:9} {r['ms']:7.2f} ms {r['tflops']:5.0f} TF/s "
          f"{r['peak_above_inputs_gib']:6.2f} GiB above inputs ({r['reserved_above_inputs_gib']:.2f} reserved)"
          f"{'' if r['bitwise_equal_to_first'] else '  BITS DIFFER from ' + variants[0]}")
