"""Inference forward of megamoe.experts: time and peak memory with grad enabled vs under torch.inference_mode().

    python benchmarks/inference_bench.py --workload qwen3-30b-a3b --workload mixtral-8x7b --json inference.json
    python benchmarks/inference_bench.py --workload all --modes grad,no_grad,inference_mode
    python benchmarks/inference_bench.py --workload cpu-small          # CPU smoke test (perf_counter, no memory)

One GPU, megamoe.experts with the default config (backend "auto": the fused Triton path on Hopper) in
--dtype (default bf16 on a GPU, fp32 on CPU, as the bench), problems from the bench harness (megamoe.bench.problem.make_weights / make_tokens,
weights and x leaves that require grad, as in training). Modes:
    grad            grad enabled: the forward saves what its backward needs (the graph is dropped unused)
    no_grad         under torch.no_grad()
    inference_mode  under torch.inference_mode()
Each mode runs --warmup forwards, then --iters timed ones (CUDA events around each call, rotating over
NUM_INPUT_SETS token sets); the time is the median. Peak memory: torch.cuda.max_memory_allocated after
reset_peak_memory_stats over one forward (output and, with grad, its graph held until after the sync),
reported as the absolute peak and the part above what was allocated before the call (weights, inputs),
and `retained`: what the call left allocated (out, plus the saved activations with grad). Before timing,
each mode's out is compared bitwise with the grad mode's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import megamoe
from megamoe.bench.measure import run_facts
from megamoe.bench.problem import forward_TH, make_tokens, make_weights
from megamoe.bench.run import DTYPES
from megamoe.bench.workloads import GPU_WORKLOADS, NUM_INPUT_SETS, WORKLOADS, comma_names, choose_experts_per_gpu

MODES = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}
TOKEN_SEED = 1234


def forward(weights, tokens, mode: str) -> torch.Tensor:
    with MODES[mode]():
        return forward_TH(megamoe.experts, weights, tokens)


def time_mode(mode: str, weights, token_sets, *, iters: int, warmup: int, device) -> list[float]:
    """Per-iteration ms of one forward in `mode` (CUDA events on a GPU, perf_counter on CPU)."""
    for i in range(warmup):
        forward(weights, token_sets[i % len(token_sets)], mode)
    times, pending = [], []
    for i in range(iters):
        tokens = token_sets[i % len(token_sets)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(weights, tokens, mode)
            end.record()
            pending.append((start, end))
        else:
            t0 = time.perf_counter()
            out = forward(weights, tokens, mode)
            times.append((time.perf_counter() - t0) * 1e3)
        del out  # with grad: the graph and its saved tensors go with it
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in pending]
    return times


def memory_mode(mode: str, weights, tokens, device) -> dict[str, int | None]:
    """Peak and retained bytes of one forward in `mode` (None on CPU)."""
    if device.type != "cuda":
        return {"peak_bytes": None, "peak_above_base_bytes": None, "retained_bytes": None}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = forward(weights, tokens, mode)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    retained = torch.cuda.memory_allocated(device) - base
    del out
    return {"peak_bytes": peak, "peak_above_base_bytes": peak - base, "retained_bytes": retained}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="extend", required=True, metavar="NAME", type=comma_names((*WORKLOADS, "all")),
                        help=f"repeatable or comma list of {', '.join(WORKLOADS)}, or 'all' (the GPU workloads)")
    parser.add_argument("--tokens", type=int, help="tokens (default: the workload's tokens per GPU)")
    parser.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--modes", default=["grad", "inference_mode"], type=comma_names(MODES),
                        help=f"comma list of {', '.join(MODES)} (default grad,inference_mode; grad always runs first)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--experts-per-gpu", type=int, help="cap on experts per GPU (default: the workload's rule)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    names = [g for n in args.workload for g in (GPU_WORKLOADS if n == "all" else (n,))]
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    args.workloads = names
    args.mode_list = ["grad"] + [m for m in args.modes if m != "grad"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        print("note: no CUDA device: CPU smoke run (perf_counter times, no memory figures)", file=sys.stderr)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    facts = {**run_facts(device), "dtype": dtype_name, "routing": args.routing, "iters": args.iters,
             "warmup": args.warmup, "config": repr(megamoe.MoEConfig())}
    print(f"inference forward: {facts['gpu']}, {dtype_name}, {args.routing}, median of {args.iters} after "
          f"{args.warmup} warm-up, modes {', '.join(args.mode_list)}, torch {torch.__version__}")

    records = []
    for name in args.workloads:
        w = WORKLOADS[name]
        num_tokens = args.tokens or w.tokens_per_gpu
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        n_local, why = choose_experts_per_gpu(w, num_tokens, 1, dtype.itemsize, args.experts_per_gpu, free)
        weights = make_weights(w, range(n_local), dtype, device)
        generator = torch.Generator(device=device).manual_seed(TOKEN_SEED)
        token_sets = [make_tokens(w, num_tokens, n_local, args.routing, dtype, generator) for _ in range(NUM_INPUT_SETS)]

        want = forward(weights, token_sets[0], "grad").detach()
        bitwise = {m: bool(torch.equal(forward(weights, token_sets[0], m), want)) for m in args.mode_list}
        del want
        record = {"workload": name, "tokens": num_tokens, "experts_per_gpu": n_local, "experts_cut": why, **facts}
        for mode in args.mode_list:
            times = time_mode(mode, weights, token_sets, iters=args.iters, warmup=args.warmup, device=device)
            record[mode] = {"ms": statistics.median(times), "ms_all": times, "out_bitwise_vs_grad": bitwise[mode],
                            **memory_mode(mode, weights, token_sets[0], device)}
        records.append(record)
        note = f" ({why})" if why else ""
        print(f"  {name}: T={num_tokens}, {n_local} experts{note}; out bitwise vs grad: "
              + ", ".join(f"{m} {bitwise[m]}" for m in args.mode_list))
        del weights, token_sets
        if device.type == "cuda":
            torch.cuda.empty_cache()

    gib = 2**30
    header = ["workload"] + [f"{m} ms" for m in args.mode_list]
    header += [f"grad/{m}" for m in args.mode_list[1:]]
    if device.type == "cuda":
        header += [f"{m} peak/+base/retained GiB" for m in args.mode_list]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in records:
        row = [r["workload"]] + [f"{r[m]['ms']:.3f}" for m in args.mode_list]
        row += [f"{r['grad']['ms'] / r[m]['ms']:.3f}x" for m in args.mode_list[1:]]
        if device.type == "cuda":
            row += ["/".join(f"{r[m][k] / gib:.2f}" for k in ("peak_bytes", "peak_above_base_bytes", "retained_bytes"))
                    for m in args.mode_list]
        print("| " + " | ".join(row) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
