"""A/B of megamoe's portable path (MoEConfig(backend="torch")): the committed torch_native.py against the
working tree's, fwd+bwd through the bench harness (megamoe.bench.problem), alternating old/new every iteration.

    python benchmarks/torch_path_ab.py --workload qwen3-30b-a3b --workload mixtral-8x7b --json ab.json
    python benchmarks/torch_path_ab.py --workload cpu-small          # CPU smoke test
    torchrun --nproc-per-node=2 benchmarks/torch_path_ab.py --workload qwen3-30b-a3b   # EP over NCCL

The old backend is `git show REF:megamoe/backends/torch_native.py` (--old-ref, default HEAD) or a file
(--old-file), imported as a module and swapped in for megamoe.autograd.BACKENDS["torch"] around each old
call. Each timed call is one forward_backward on one of NUM_INPUT_SETS token sets; time is the median
over --iters iterations (CUDA events on a GPU, perf_counter on CPU; with a group, each iteration's max
over ranks). Before timing: new vs old relative difference of every output (fp64 Frobenius), and whether
two runs of the new path are bitwise equal. With --titan (default when megamoe.bench.baselines has it),
the TorchTitan-style baseline is timed in the same rotation.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import megamoe
import megamoe.autograd
from megamoe.bench.measure import run_facts
from megamoe.bench.problem import forward_backward, make_tokens, make_weights, torchtitan_weights
from megamoe.bench.run import DTYPES, unused_weight_bytes
from megamoe.bench.workloads import NUM_INPUT_SETS, WORKLOADS, comma_names, choose_experts_per_gpu

ROOT = Path(__file__).resolve().parent.parent
BACKEND_PATH = "megamoe/backends/torch_native.py"
TOKEN_SEED = 1234


def load_old_backend(ref: str, path: str | None):
    """The old torch_native as a module (named megamoe_torch_native_old)."""
    if path is None:
        try:
            source = subprocess.run(["git", "show", f"{ref}:{BACKEND_PATH}"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"cannot read {ref}:{BACKEND_PATH} with git ({e}); pass --old-file PATH instead")
        handle = tempfile.NamedTemporaryFile("w", suffix="_torch_native_old.py", delete=False)
        handle.write(source)
        handle.close()
        path = handle.name
    name = "megamoe_torch_native_old"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def with_backend(module, fn):
    """fn, run with megamoe.autograd.BACKENDS["torch"] = module (forward and backward both look it up)."""

    def run(*args, **kwargs):
        saved = megamoe.autograd.BACKENDS["torch"]
        megamoe.autograd.BACKENDS["torch"] = module
        try:
            return fn(*args, **kwargs)
        finally:
            megamoe.autograd.BACKENDS["torch"] = saved

    return run


def variants(old_module, titan: bool) -> dict:
    """name -> step(weights, tokens, group) running one forward_backward; "titan" takes TorchTitan's (w1, w3)
    weights (megamoe.bench.problem.torchtitan_weights), the others megamoe's."""
    torch_fn = functools.partial(megamoe.experts, config=megamoe.MoEConfig(backend="torch"))
    steps = {
        "old": with_backend(old_module, lambda w, t, g: forward_backward(torch_fn, w, t, group=g)),
        "new": lambda w, t, g: forward_backward(torch_fn, w, t, group=g),
    }
    if titan:
        from megamoe.bench.baselines import FUNCTIONS

        steps["titan"] = lambda w, t, g: forward_backward(FUNCTIONS["torchtitan"], w, t, group=g)
    return steps


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def max_over_ranks(values: list[float], device, group) -> list[float]:
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def time_alternating(steps: dict, held: dict, token_sets, *, iters: int, warmup: int, device, group) -> dict:
    """Median ms of each step on its weights (held[name]); every iteration runs each step once, the order rotating
    by one each time."""
    names = list(steps)
    on_gpu = device.type == "cuda"
    for i in range(warmup):
        for name in names:
            steps[name](held[name], token_sets[i % len(token_sets)], group)
    times = {name: [] for name in names}
    pending = []
    for i in range(iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            tokens = token_sets[i % len(token_sets)]
            if group is not None:  # start every rank's call together: the max over ranks is the call's time
                dist.all_reduce(torch.zeros(1, device=device), group=group)
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[name](held[name], tokens, group)
                end.record()
                pending.append((name, start, end))
            else:
                t0 = time.perf_counter()
                steps[name](held[name], tokens, group)
                times[name].append((time.perf_counter() - t0) * 1e3)
    if on_gpu:
        torch.cuda.synchronize(device)
        for name, start, end in pending:
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(max_over_ranks(times[name], device, group)) for name in names}


def peak_mem(step, weights, tokens, device, group, unused: int = 0) -> int | None:
    """The allocator's peak over one step, less unused: bytes of weights held for other steps, not this one's."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step(weights, tokens, group)
    torch.cuda.synchronize(device)
    return int(max_over_ranks([torch.cuda.max_memory_allocated(device) - unused], device, group)[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="extend", required=True, metavar="NAME", type=comma_names(WORKLOADS),
                        help=f"repeatable or comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--tokens", type=int, help="tokens per GPU (default: the workload's)")
    parser.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--experts-per-gpu", type=int, help="cap on experts per GPU (default: the workload's rule)")
    parser.add_argument("--old-ref", default="HEAD", help="git revision of the old torch_native.py (default HEAD)")
    parser.add_argument("--old-file", help="the old torch_native.py as a file (instead of --old-ref)")
    parser.add_argument("--titan", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the TorchTitan-style baseline (default: when megamoe.bench.baselines has it)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    names = args.workload
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")

    group, rank, world = None, 0, 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    titan = args.titan
    if titan is None:
        try:
            from megamoe.bench.baselines import FUNCTIONS

            titan = "torchtitan" in FUNCTIONS
        except ImportError:
            titan = False
    old_module = load_old_backend(args.old_ref, args.old_file)
    steps = variants(old_module, titan)
    say = print if rank == 0 else (lambda *a, **k: None)
    facts = {**run_facts(device), "ep": world, "dtype": dtype_name, "routing": args.routing,
             "iters": args.iters, "warmup": args.warmup, "old": args.old_file or args.old_ref}
    say(f"torch path A/B: {facts['gpu']}, ep={world}, {dtype_name}, {args.routing}, median of {args.iters} "
        f"(alternating {'/'.join(steps)}), torch {torch.__version__}, old = {facts['old']}")

    records = []
    for name in names:
        w = WORKLOADS[name]
        num_tokens = args.tokens or w.tokens_per_gpu
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        n_local, why = choose_experts_per_gpu(w, num_tokens, world, dtype.itemsize, args.experts_per_gpu, free)
        num_experts = n_local * world
        weights = make_weights(w, range(rank * n_local, (rank + 1) * n_local), dtype, device)
        generator = torch.Generator(device=device).manual_seed(TOKEN_SEED + rank)
        token_sets = [make_tokens(w, num_tokens, num_experts, args.routing, dtype, generator)
                      for _ in range(NUM_INPUT_SETS)]

        results = {v: steps[v](weights, token_sets[0], group) for v in ("old", "new")}
        rerun = steps["new"](weights, token_sets[0], group)
        bitwise = all(torch.equal(rerun[k], results["new"][k]) for k in rerun)
        bitwise = bool(max_over_ranks([0.0 if bitwise else 1.0], device, group)[0] == 0.0)
        diffs = {k: max_over_ranks([rel_diff(results["new"][k], results["old"][k])], device, group)[0]
                 for k in results["new"]}
        del results, rerun

        held = dict.fromkeys(steps, weights)
        if titan:  # TorchTitan's own copy (its w1, w3), made before timing and dropped with the workload's weights
            held["titan"] = torchtitan_weights(weights)
        ms = time_alternating(steps, held, token_sets, iters=args.iters, warmup=args.warmup,
                              device=device, group=group)
        # Each step's peak leaves out the gate/up weights of the other layout (megamoe's, or TorchTitan's copy).
        mem = {v: peak_mem(steps[v], held[v], token_sets[0], device, group,
                           sum(unused_weight_bytes(other, held[v]) for other in (weights, held.get("titan", weights))))
               for v in steps}
        record = {"workload": name, "tokens": num_tokens, "experts_per_gpu": n_local, **facts,
                  **{f"{v}_ms": ms[v] for v in steps}, **{f"{v}_peak_mem_bytes": mem[v] for v in steps},
                  "speedup_new_vs_old": ms["old"] / ms["new"], "new_bitwise_rerun": bitwise,
                  "rel_diff_new_vs_old": diffs}
        if "titan" in ms:
            record["new_over_titan"] = ms["new"] / ms["titan"]
        records.append(record)
        note = f" ({why})" if why else ""
        say(f"  {name}: T={num_tokens}, {n_local} experts/GPU{note}; new rerun bitwise: {bitwise}; "
            f"rel diff new vs old: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
        del weights, held, token_sets
        if device.type == "cuda":
            torch.cuda.empty_cache()

    gib = 2**30
    header = ["workload", "old ms", "new ms", "old/new"] + (["titan ms", "new/titan"] if titan else [])
    if device.type == "cuda":
        header.append("peak GiB old/new" + ("/titan" if titan else ""))
    rows = []
    for r in records:
        row = [r["workload"], f"{r['old_ms']:.2f}", f"{r['new_ms']:.2f}", f"{r['speedup_new_vs_old']:.3f}x"]
        if titan:
            row += [f"{r['titan_ms']:.2f}", f"{r['new_over_titan']:.3f}"]
        if device.type == "cuda":
            row.append("/".join(f"{r[f'{v}_peak_mem_bytes'] / gib:.1f}" for v in steps))
        rows.append(row)
    say("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        say("| " + " | ".join(row) + " |")
    if args.json and rank == 0:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
        say(f"wrote {args.json}")
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
