"""The benchmarked MoE layers (real models' MoE layers, per GPU), the FLOPs they are credited with, and how many experts fit."""

from __future__ import annotations

import argparse
import dataclasses

PASSES = ("fwd", "fwd+bwd")
NUM_INPUT_SETS = 3  # random input sets rotated through the timed iterations


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model's MoE layer, per GPU. shared_intermediate = 0 means no shared expert."""

    name: str
    hidden: int  # H
    intermediate: int  # I, per routed expert
    num_experts: int  # E, global
    top_k: int  # k
    shared_intermediate: int  # I_s
    tokens_per_gpu: int  # T
    one_gpu_experts: int | None = None  # experts kept by default when the layer runs on one GPU


WORKLOADS = {
    w.name: w
    for w in (
        Workload("qwen3-30b-a3b", 2048, 768, 128, 8, 0, 16384),
        Workload("qwen3-235b-a22b", 4096, 1536, 128, 8, 0, 16384),
        Workload("deepseek-v3", 7168, 2048, 256, 8, 2048, 8192, one_gpu_experts=32),
        Workload("gpt-oss-120b", 2880, 2880, 128, 4, 0, 16384),
        Workload("mixtral-8x7b", 4096, 14336, 8, 2, 0, 8192),
        Workload("kimi-k2", 7168, 2048, 384, 8, 2048, 4096, one_gpu_experts=32),
        # Not a model: small enough to run fwd+bwd on a CPU in seconds, with a shared expert.
        Workload("cpu-small", 256, 128, 8, 2, 128, 512),
    )
}
GPU_WORKLOADS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b", "kimi-k2")
CPU_WORKLOADS = ("cpu-small",)


def layer_flops(w: Workload, num_tokens: int, pass_name: str) -> int:
    """FLOPs of one layer on num_tokens tokens, counted as every published MoE benchmark here counts them.

    Forward: 6*T*k*H*I for the routed experts (gate, up and down matmuls) + 6*T*H*I_s for the shared
    expert; backward = 2x forward. Experts cut to fit a GPU do not change it: every token still goes to k.
    """
    if pass_name not in PASSES:
        raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}")
    fwd = 6 * num_tokens * w.hidden * (w.top_k * w.intermediate + w.shared_intermediate)
    return fwd if pass_name == "fwd" else 3 * fwd


def footprint_bytes(w: Workload, num_tokens: int, experts_per_gpu: int, world_size: int, dtype_bytes: int) -> int:
    """A generous estimate of one GPU's memory for a fwd+bwd run: weights and their grads, the worst-case
    receive rows (all W*T*k pairs of the group on this GPU) with their activations kept for the backward
    and their grads, and the rotated input sets (x and d_out)."""
    weights = (experts_per_gpu * w.intermediate + w.shared_intermediate) * 3 * w.hidden
    rows = world_size * num_tokens * w.top_k
    activations = rows * (2 * w.hidden + 3 * w.intermediate)  # gathered x, gate|up, h, y
    inputs = NUM_INPUT_SETS * num_tokens * 2 * w.hidden
    return (2 * weights + 3 * activations + inputs) * dtype_bytes


def comma_names(allowed):
    """An argparse type: a comma-separated list of names from `allowed`, checked as the command line is parsed
    (with action="extend" the option may also repeat), so a run with a misspelt name stops before anything is timed.
    An empty list (e.g. "" or ",") is an error too, not a silent fall-back to the defaults."""

    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        if not names:
            raise argparse.ArgumentTypeError(f"no name given; choose from {', '.join(allowed)}")
        for name in names:
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {name!r}; choose from {', '.join(allowed)}")
        return names

    return parse


class BenchUsageError(ValueError):
    """Options that cannot run together (e.g. --experts-per-gpu below k): `python -m megamoe bench` reports it
    as a usage error naming the option, before anything is timed."""


def choose_experts_per_gpu(
    w: Workload,
    num_tokens: int,
    world_size: int,
    dtype_bytes: int,
    cap: int | None,
    free_bytes: int | None,
) -> tuple[int, str]:
    """Experts per GPU (E / W unless cut), and why it was cut ("" when it was not).

    cap: --experts-per-gpu; None applies the workload's one-GPU default. free_bytes: free GPU memory
    (None on CPU); the count is halved until footprint_bytes fits in 90% of it.
    """
    if w.num_experts % world_size != 0:
        raise BenchUsageError(f"{w.name}: {w.num_experts} experts do not split evenly over {world_size} ranks")
    n, why = w.num_experts // world_size, ""
    if cap is not None and cap < n:
        n, why = cap, f"--experts-per-gpu {cap}"
    elif cap is None and world_size == 1 and w.one_gpu_experts is not None and w.one_gpu_experts < n:
        n, why = w.one_gpu_experts, "default cut on one GPU"
    if free_bytes is not None:
        while n > 1 and footprint_bytes(w, num_tokens, n, world_size, dtype_bytes) > 0.9 * free_bytes:
            n, why = n // 2, f"to fit {free_bytes / 2**30:.0f} GiB free"
    if n * world_size < w.top_k:
        cut = f" ({why})" if why else ""  # e.g. --experts-per-gpu 1
        raise BenchUsageError(f"{w.name}: {n} experts per GPU{cut} x {world_size} ranks is fewer than k = {w.top_k}")
    return n, why
