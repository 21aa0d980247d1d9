"""Timing (median over iterations of the max over ranks), GPU time per kernel, the bf16 matmul ceiling, and
git/version facts (run_facts: what every JSON result of the bench and of benchmarks/*.py records)."""

from __future__ import annotations

import collections
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

CEILING_SIZE = 8192


def reduce_over_ranks(values: list[float], op, device: torch.device, group) -> list[float]:
    """Element-wise op (dist.ReduceOp.MAX, MIN, SUM) of values over the ranks of group (values without a group)."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def round_order(names: list, r: int) -> list:
    """The order in which round r of an alternating comparison runs `names`: a Williams design, so that over n
    rounds (n = len(names) even) or 2n (n odd) every name runs in every position equally often and right after
    every other name equally often. On a GPU at its power cap what ran just before sets the clock a turn starts
    at (a light turn leaves headroom, a matmul none), so a plain rotation, where each name always follows the
    same neighbour, favours one name systematically; this design spreads that over all of them. Within rounds
    only: run back to back, a round's first turn follows the round before's last, pairs the design does not
    balance (benchmarks/sonicmoe_ab.py opens every round with the same turn, its ceiling matmul, for that)."""
    n = len(names)
    if n == 0:  # nothing to run (sonicmoe_ab.py --graph when no path's graph passed its checks)
        return []
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    row = [(i + r) % n for i in first]
    if n % 2 and (r // n) % 2:  # odd n: the second n rounds run the mirrored square
        row.reverse()
    return [names[i] for i in row]


def alternating_rounds(calls: dict, rounds: int, time_ms) -> dict:
    """{name: [time_ms(call) per round]} for every call of `calls` ({name: call}): each round times every call
    once, in round_order's order (the A/B the benchmarks' variant comparisons rest on; time_ms is e.g. a
    triton.testing.do_bench median)."""
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in round_order(list(calls), r):
            times[name].append(time_ms(calls[name]))
    return times


def median_ms(step, *, iters: int, warmup: int, device: torch.device, group=None) -> float:
    """Median of call_times_ms(...)."""
    return statistics.median(call_times_ms(step, iters=iters, warmup=warmup, device=device, group=group))


def call_times_ms(step, *, iters: int, warmup: int, device: torch.device, group=None) -> list[float]:
    """Each of iters timed calls step(i) (after warmup untimed ones), in ms, each the max over the ranks of
    group. CUDA events on GPUs (back to back, one synchronisation at the end), time.perf_counter on CPU."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1 (timed calls), got {iters}")
    for i in range(warmup):
        step(i)
    on_gpu = device.type == "cuda"
    times_ms = []
    if on_gpu:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i in range(iters):
        if group is not None:
            # Start every rank's iteration together, so the max over ranks is the iteration's time.
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        if on_gpu:
            events[i][0].record()
            step(warmup + i)
            events[i][1].record()
        else:
            start = time.perf_counter()
            step(warmup + i)
            times_ms.append((time.perf_counter() - start) * 1e3)
    if on_gpu:
        torch.cuda.synchronize(device)
        times_ms = [start.elapsed_time(end) for start, end in events]
    return reduce_over_ranks(times_ms, dist.ReduceOp.MAX, device, group)


def kernel_times(run, iters: int) -> dict:
    """GPU time per kernel of run() (already warmed up), from torch.profiler (CUPTI), as the mean over iters
    back-to-back calls: {"gpu_us_per_iteration", "idle_us_per_iteration" (the GPU idle between kernels),
    "kernels": [{"kernel", "us", "launches"}] largest first, "largest_gaps": the 20 longest idle gaps with the
    kernels around them}. A CUDA GPU."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    on_gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    gaps, last = [], None  # last: of the kernels started so far, the one that ends last
    for event in on_gpu:
        per_kernel[event.name][0] += event.device_time / iters
        per_kernel[event.name][1] += 1
        # Idle only once every earlier kernel ended (kernels on other streams overlap): no gap where one still runs.
        if last is not None and event.time_range.start > last.time_range.end:
            gaps.append({"us": event.time_range.start - last.time_range.end, "after": last.name[:60],
                         "before": event.name[:60]})
        if last is None or event.time_range.end > last.time_range.end:
            last = event
    gaps.sort(key=lambda g: -g["us"])
    kernels = sorted(({"kernel": k, "us": v[0], "launches": v[1] // iters} for k, v in per_kernel.items()),
                     key=lambda r: -r["us"])
    return {"gpu_us_per_iteration": sum(r["us"] for r in kernels),
            "idle_us_per_iteration": sum(g["us"] for g in gaps) / iters,
            "kernels": kernels, "largest_gaps": gaps[:20]}


def cuda_graph(step, warmup: int = 2, pool=None):
    """step() captured once as a CUDA graph: (the graph's replay, what step returned while captured). The replay
    re-runs step's kernels on the tensors the capture saw, without the host's launch work, and refreshes the
    returned tensors in place (check them after a replay: a kernel launched outside the capture, e.g. on another
    stream, is not in the graph). step runs warmup times first, as a capture needs (allocator
    pools and compiled kernels settled); warm-up and capture run on the current stream, or on a new side stream
    where that is the default stream (which cannot capture). A backward captured on a stream other than the one its
    leaves' gradient nodes were made on syncs with that stream and fails the capture: run the eager calls on the
    capturing stream too. A step that synchronises with the host raises here (torch's error). pool: a
    torch.cuda.graph_pool_handle() shared with other graphs (None: the graph's own pool); graphs sharing one must not
    replay concurrently."""
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream() if caller == torch.cuda.default_stream() else caller
    stream.wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            result = step()
    caller.wait_stream(stream)
    return graph.replay, result


CEILING_FLOPS = 2 * CEILING_SIZE**3


def ceiling_matmul(device: torch.device):
    """A call of the 8192^3 bf16 matmul (CEILING_FLOPS) whose TFLOP/s is the denominator of MFU."""
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (
        torch.randn(CEILING_SIZE, CEILING_SIZE, generator=generator, device=device, dtype=torch.bfloat16)
        for _ in range(2)
    )
    return lambda: a @ b


def short_commit(commit: str) -> str:
    """git_commit's result for a title: the hash cut to 12 characters, its "-dirty" kept."""
    head, dirty, _ = commit.partition("-dirty")
    return head[:12] + dirty


def git_commit(checkout: Path = Path(__file__).parent) -> str:
    """HEAD of the checkout megamoe runs from, with "-dirty" where tracked files differ from it (a result then
    says that it was not measured on that commit's code), or "unknown" outside a git checkout or in one that does not
    track `checkout` (an installed megamoe in a virtual environment inside another repository)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    # A checkout git does not track is not megamoe's repository but one around it: an installed megamoe in a
    # virtual environment inside the user's own project would otherwise report that project's commit.
    if head is None or git("ls-files", "--error-unmatch", "--", ".") is None:
        return "unknown"
    changes = git("status", "--porcelain", "--untracked-files=no")
    return head if changes == "" else f"{head}-dirty"


def triton_version() -> str | None:
    """Triton's version, or None where it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def run_facts(device: torch.device) -> dict:
    """What produced a result, for every JSON record: "gpu" (the CUDA device's name, "cpu" on the CPU), "torch",
    "triton" (None without Triton) and "commit" (git_commit). device: the one this process (rank) runs on."""
    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton_version(), "commit": git_commit()}
