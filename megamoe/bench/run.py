"""`python -m megamoe bench`: every (workload, routing, backend, pass) gated, timed, printed and written as JSON.

Backends: "torchtitan" (megamoe.bench.baselines: what TorchTitan users run) always runs and is the baseline
of the speed-up column; megamoe's "torch" (the portable path, printed as "portable") and "triton"; the
peers of --peers (hf-grouped_mm, liger) when installed.

Passes: "fwd" is the forward of a training step (x, topk_weights and the weights require grad, so autograd
keeps what the backward needs); "fwd+bwd" adds autograd.grad of sum(out * d_out) for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm

from megamoe.bench.baselines import PEERS
from megamoe.bench.gate import backend_weights, experts_fn, gate_backends, unavailable_reason
from megamoe.bench.measure import (
    CEILING_FLOPS, alternating_rounds, ceiling_matmul, median_ms, reduce_over_ranks, run_facts, short_commit,
)
from megamoe.bench.plot import format_tflops, plot_records
from megamoe.bench.problem import Weights, forward_backward, forward_TH, make_tokens, make_weights
from megamoe.bench.routing import ROUTINGS, expert_load_E
from megamoe.bench.workloads import (
    CPU_WORKLOADS, GPU_WORKLOADS, NUM_INPUT_SETS, PASSES, WORKLOADS, choose_experts_per_gpu, layer_flops,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINE = "torchtitan"
CEILING_TURN = "matmul-8192"  # the MFU ceiling's turn in every round (GPUs)
TABLE_LABELS = {"torch": "portable"}  # megamoe's portable path, not torch's own
TOKEN_SEED = 10_000  # + rank: every rank routes its own tokens
RECORD_FIELDS = (
    "workload", "backend", "pass", "routing", "ep", "tokens", "experts_per_gpu", "dtype", "ms", "round_ms", "iters",
    "warmup", "tflops", "mfu", "ceiling_tflops", "peak_mem_bytes", "peak_mem_above_inputs_bytes", "workspace_bytes",
    "gpu", "torch", "triton", "commit", "status", "detail",
)  # every record's fields (docs/design.md); a backend that did not pass its gate has status "FAILED" or
# "unavailable", detail saying why, and None for what would have been measured


def init_distributed() -> tuple[object, torch.device]:
    """(EP group or None, this rank's device). Under torchrun the group is the whole world: nccl with one
    GPU per local rank, or gloo on CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None, device
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.group.WORLD, device


def default_backends(device: torch.device, group) -> list[str]:
    return [b for b in ("torch", "triton") if not unavailable_reason(b, device, group)]


def _workspace_api(group):
    """The Triton backend's workspace module where a pass can hold a workspace (a group, Triton installed),
    else None."""
    if group is None:
        return None
    try:
        from megamoe.backends.triton.comm import workspace
    except ImportError:
        return None
    return workspace


def memory_record(peak: int, inputs_bytes: int, workspace: int | None, device: torch.device, group) -> dict:
    """A pass's memory fields from this rank's allocator peak, what the inputs held before it and the EP
    workspace held after it (None: none can exist), each the max over ranks. The symmetric-memory
    workspace lies outside the caching allocator, whose peak does not see it; it is allocated at the first
    call (the warm-up), before anything else of the pass, and held to the end, so both peaks add it."""
    held = workspace or 0
    values = reduce_over_ranks([peak + held, peak + held - inputs_bytes, held], dist.ReduceOp.MAX, device, group)
    return {"peak_mem_bytes": int(values[0]), "peak_mem_above_inputs_bytes": int(values[1]),
            "workspace_bytes": None if workspace is None else int(values[2])}


def unused_weight_bytes(weights: Weights, held: Weights) -> int:
    """Bytes of weights (megamoe's layout) that held, a backend's own (gate.backend_weights), does not use: the
    leaves held replaced. They stay allocated during its turn, but that backend alone would not hold them."""
    kept = {id(t) for f in dataclasses.fields(held) for t in _tensors(getattr(held, f.name))}
    return sum(t.numel() * t.element_size() for f in dataclasses.fields(weights)
               for t in _tensors(getattr(weights, f.name)) if id(t) not in kept)


def _tensors(field) -> tuple[torch.Tensor, ...]:
    return field if isinstance(field, tuple) else () if field is None else (field,)


def time_pass(backend, pass_name, weights, token_sets, *, iters, warmup, device, group) -> dict:
    """ms (the median of iters timed calls) and memory of one backend and pass, rotating through token_sets;
    weights (megamoe's layout) are handed to the backend as it holds them (gate.backend_weights: for TorchTitan a
    copy made for the turn, before its memory is measured).
    Memory (GPUs, max over ranks, memory_record): peak_mem_bytes, the caching allocator's peak plus the EP
    symmetric-memory workspace, less the weights in megamoe's layout that a backend holding its own copy does not
    use (unused_weight_bytes); peak_mem_above_inputs_bytes, that less what the weights and input sets already held
    when the pass started (activations, gradients, temporaries, workspace); workspace_bytes, the workspace alone
    (the pass's own: the cached ones are dropped before it, so one of an earlier workload is not counted)."""
    fn = experts_fn(backend)
    run = forward_TH if pass_name == "fwd" else forward_backward
    held = backend_weights(backend, weights)
    unused = unused_weight_bytes(weights, held)

    def step(i):
        run(fn, held, token_sets[i % len(token_sets)], group=group)

    on_gpu = device.type == "cuda"
    workspace_api = _workspace_api(group)
    if on_gpu:
        torch.cuda.synchronize(device)
        if workspace_api is not None:
            # Every rank here, after the last pass's reduction of its times (its kernels are done).
            workspace_api.clear_workspaces()
        torch.cuda.reset_peak_memory_stats(device)
        inputs_bytes = torch.cuda.memory_allocated(device) - unused
    ms = median_ms(step, iters=iters, warmup=warmup, device=device, group=group)
    memory = {"peak_mem_bytes": None, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None}
    if on_gpu:
        workspace = None if workspace_api is None else workspace_api.workspace_bytes(group)
        memory = memory_record(torch.cuda.max_memory_allocated(device) - unused, inputs_bytes, workspace, device,
                               group)
    return {"ms": ms, **memory}


def ceiling_ms(*, iters: int, warmup: int, device: torch.device, group) -> float:
    """Median ms of the 8192^3 bf16 matmul whose TFLOP/s is MFU's denominator. Its operands live only for the
    turn, so no pass's peak memory counts them."""
    matmul = ceiling_matmul(device)
    return median_ms(lambda i: matmul(), iters=iters, warmup=warmup, device=device, group=group)


def time_in_rounds(turns: dict, rounds: int, progress) -> dict:
    """{name: [result per round]} for turns ({name: call}), run in alternating rounds (measure.round_order), so
    that every turn meets the GPU's clock under its power cap as often after each other turn: the backends'
    ratios come from the same rounds, not from one backend timed after another."""
    def run_turn(call):
        result = call()
        progress.update()
        return result

    return alternating_rounds(turns, rounds, run_turn)


def summarise(row: dict, results: list[dict], flops: float, ceiling: float | None) -> None:
    """Fill row from one turn's results over the rounds: ms the median of the rounds' medians (round_ms the
    rounds' own, in order), TFLOP/s and MFU from it, each memory field its maximum over the rounds."""
    row["round_ms"] = [r["ms"] for r in results]
    row["ms"] = statistics.median(row["round_ms"])
    row["tflops"] = flops / row["ms"] / 1e9
    row["mfu"] = row["tflops"] / ceiling if ceiling else None
    for field in ("peak_mem_bytes", "peak_mem_above_inputs_bytes", "workspace_bytes"):
        values = [r[field] for r in results if r[field] is not None]
        row[field] = max(values) if values else None


def run_bench(
    *,
    workloads: list[str] | None,
    backends: list[str] | None,
    routing: str,
    tokens: int | None,
    iters: int | None,
    warmup: int | None,
    dtype: str | None,
    experts_per_gpu: int | None,
    json_path: str | None,
    plot_path: str | None = None,
    peers: list[str] | None = None,
    rounds: int | None = None,
) -> int:
    """Run the benchmark; rank 0 prints the table, writes JSON and draws the plot (megamoe.bench.plot). The JSON is
    written again after each (workload, routing), so a run stopped early (out of memory, a time limit) keeps the
    records it finished.
    peers: names of megamoe.bench.baselines.PEERS to time too; one that cannot run here is a note.
    rounds: alternating rounds per (workload, routing) in which every backend and pass (and on GPUs the MFU
    ceiling's matmul) takes one turn of iters timed iterations (default: 3 on a GPU, 1 on CPU).
    A workload or backend named twice runs once. Returns 1 if a backend failed its gate."""
    unknown = [p for p in peers or () if p not in PEERS]
    if unknown:
        raise ValueError(f"peers: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(PEERS)}")
    group, device = init_distributed()
    world_size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    on_gpu = device.type == "cuda"
    # A name given twice runs once: two runs of one workload would share their rows' keys, and each row's speed-up
    # would be taken against the other run's baseline.
    workloads = list(dict.fromkeys(workloads or (GPU_WORKLOADS if on_gpu else CPU_WORKLOADS)))
    backends = [BASELINE] + [b for b in dict.fromkeys(backends or default_backends(device, group)) if b != BASELINE]
    rows, notes = [], []
    for peer in dict.fromkeys(peers or ()):
        reason = unavailable_reason(peer, device, group)
        if reason:
            notes.append(f"{peer}: {reason}")
        else:
            backends.append(peer)
    if "liger" in backends and rank == 0:
        print("note: liger autotunes its Triton kernels at run time: its first call on each new shape (gate and "
              "timing) can take minutes", flush=True)
    routings = ROUTINGS if routing == "both" else (routing,)
    dtype_name = dtype or ("bf16" if on_gpu else "fp32")
    dtype = DTYPES[dtype_name]
    iters = iters or (20 if on_gpu else 5)
    warmup = warmup if warmup is not None else (5 if on_gpu else 2)
    rounds = rounds or (3 if on_gpu else 1)
    # Every workload's expert count against --experts-per-gpu and the ranks, before anything is timed: a
    # BenchUsageError at the second workload must not come after the first one's timing (and lose it).
    # Free memory is left out here; it only halves the count, and is checked again per workload below.
    for name in workloads:
        choose_experts_per_gpu(WORKLOADS[name], tokens or WORKLOADS[name].tokens_per_gpu, world_size,
                               dtype.itemsize, experts_per_gpu, None)

    facts = {
        "dtype": dtype_name,
        **run_facts(device),
        "iters": iters,  # each round's ms is the median of iters calls after warmup untimed ones
        "warmup": warmup,
    }
    progress = tqdm(total=0, file=sys.stderr, disable=rank != 0)
    ceilings = []
    for name in workloads:
        w = WORKLOADS[name]
        num_tokens = tokens or w.tokens_per_gpu
        free = None
        if on_gpu:
            free = int(reduce_over_ranks([torch.cuda.mem_get_info(device)[0]], dist.ReduceOp.MIN, device, group)[0])
        n_local, why = choose_experts_per_gpu(w, num_tokens, world_size, dtype.itemsize, experts_per_gpu, free)
        num_experts = n_local * world_size
        if why:
            notes.append(f"{name}: {n_local} of {w.num_experts // world_size} experts per GPU ({why})")
        weights = make_weights(w, range(rank * n_local, (rank + 1) * n_local), dtype, device)
        for routing_name in routings:
            # The same seed for both routings: the same x, and the same scores before the skew.
            generator = torch.Generator(device=device).manual_seed(TOKEN_SEED + rank)
            token_sets = [
                make_tokens(w, num_tokens, num_experts, routing_name, dtype, generator) for _ in range(NUM_INPUT_SETS)
            ]
            load_E = expert_load_E(token_sets[0].topk_ids_TK, num_experts).tolist()
            load_E = reduce_over_ranks(load_E, dist.ReduceOp.SUM, device, group)
            load = max(load_E) / (sum(load_E) / num_experts)
            # Gate every backend on the timed problem itself (the first input set) before timing any, so the
            # gate's tensors are gone from the peak memory.
            progress.set_description(f"{name} {routing_name}: gate")
            gates = gate_backends(w, backends, weights, token_sets[0], group)
            these_rows, turns = {}, {}
            for backend in backends:
                status, detail = gates[backend]
                for pass_name in PASSES:
                    these_rows[backend, pass_name] = {
                        "workload": name, "backend": backend, "pass": pass_name, "routing": routing_name,
                        "ep": world_size, "tokens": num_tokens, "experts_per_gpu": n_local, "ms": None,
                        "round_ms": None, "tflops": None, "mfu": None, "ceiling_tflops": None,
                        "peak_mem_bytes": None, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None,
                        **facts, "status": status, "detail": detail, "load": load,
                    }
                    if status == "ok":
                        turns[backend, pass_name] = functools.partial(
                            time_pass, backend, pass_name, weights, token_sets,
                            iters=iters, warmup=warmup, device=device, group=group,
                        )
            if on_gpu:
                turns[CEILING_TURN] = functools.partial(ceiling_ms, iters=iters, warmup=warmup, device=device,
                                                        group=group)
            progress.total += rounds * len(turns)
            progress.set_description(f"{name} {routing_name}: {rounds} rounds of {len(turns)} turns")
            results = time_in_rounds(turns, rounds, progress)
            ceiling = None
            if on_gpu:
                ceiling = CEILING_FLOPS / statistics.median(results.pop(CEILING_TURN)) / 1e9
                ceilings.append(ceiling)
            for (backend, pass_name), row in these_rows.items():
                row["ceiling_tflops"] = ceiling
                if (backend, pass_name) in results:
                    flops = layer_flops(w, num_tokens, pass_name)
                    summarise(row, results[backend, pass_name], flops, ceiling)
            rows += these_rows.values()
            if rank == 0 and json_path:
                write_records(json_path, rows)
            del token_sets, turns  # the turns hold the input sets and the weights
        del weights
        if on_gpu:
            torch.cuda.empty_cache()
    progress.close()

    if rank == 0:
        title = (
            f"megamoe bench: {facts['gpu']}, ep={world_size}, {dtype_name}, median of {rounds} alternating rounds' "
            f"medians of {iters} iterations after {warmup} warm-up, torch {facts['torch']}, triton {facts['triton']}, "
            f"commit {short_commit(facts['commit'])}"
        )
        if ceilings:
            notes.insert(0, f"bf16 matmul ceiling (8192^3), timed in each workload's rounds: "
                            f"{min(ceilings):.0f}-{max(ceilings):.0f} TFLOP/s")
        report(title, notes, rows, on_gpu, json_path)
        if plot_path:
            records = [{k: row[k] for k in RECORD_FIELDS} for row in rows]
            print(f"wrote the plot to {plot_records(records, plot_path, title=title)}")
    if group is not None:
        dist.destroy_process_group()
    return int(any(row["status"] == "FAILED" for row in rows))


def report(title: str, notes: list[str], rows: list[dict], on_gpu: bool, json_path: str | None) -> None:
    """Print the table (and why a backend did not run); write the measured rows as JSON records."""
    print(title)
    for note in notes:
        print(f"note: {note}")
    print(format_table(rows, on_gpu))
    for row in rows:
        if row["status"] != "ok" and row["pass"] == PASSES[0]:
            print(f"{row['status']}: {row['workload']} {row['routing']} {row['backend']}: {row['detail']}")
    if json_path:
        write_records(json_path, rows)
        measured = sum(row["status"] == "ok" for row in rows)
        print(f"wrote {len(rows)} records ({measured} measured) to {json_path}")


def write_records(json_path: str, rows: list[dict]) -> None:
    """The rows as JSON records (RECORD_FIELDS), replacing the file's contents."""
    with open(json_path, "w") as f:
        json.dump([{k: row[k] for k in RECORD_FIELDS} for row in rows], f, indent=1)


def format_table(rows: list[dict], on_gpu: bool) -> str:
    """One line per row: times, rates and the speed-up over the TorchTitan baseline on the same inputs."""
    baseline_ms = {
        (r["workload"], r["routing"], r["pass"]): r["ms"] for r in rows if r["backend"] == BASELINE and r["ms"]
    }
    header = ["workload", "E/GPU", "routing", "max/mean load", "backend", "pass", "ms", "TFLOP/s"]
    header += ["MFU", "peak mem", "above inputs", "EP workspace"] if on_gpu else []
    header += [f"vs {BASELINE}"]
    lines = [header]
    for r in rows:
        backend = TABLE_LABELS.get(r["backend"], r["backend"])
        line = [r["workload"], str(r["experts_per_gpu"]), r["routing"], f"{r['load']:.2f}", backend, r["pass"]]
        if r["ms"] is None:
            lines.append(line + [r["status"]] + ["-"] * (len(header) - len(line) - 1))
            continue
        line += [f"{r['ms']:.3f}", format_tflops(r["tflops"])]
        if on_gpu:
            workspace = r["workspace_bytes"]
            line += [f"{r['mfu']:.1%}", f"{r['peak_mem_bytes'] / 2**30:.2f} GiB",
                     f"{r['peak_mem_above_inputs_bytes'] / 2**30:.2f} GiB",
                     "-" if workspace is None else f"{workspace / 2**30:.2f} GiB"]
        base = baseline_ms.get((r["workload"], r["routing"], r["pass"]))
        line += [f"{base / r['ms']:.2f}x" if base else "-"]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)
