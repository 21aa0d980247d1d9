"""The correctness gate run before timing: each backend's output and gradients against megamoe.reference.

A backend is the callable experts_fn(backend) (megamoe.experts with that MoEConfig backend, or a baseline
or peer of megamoe.bench.baselines); the gate runs exactly what the timing runs.

The gate problem is the timed one with fewer tokens and at most GATE_EXPERTS experts over the group (but
at least one per rank and k in all), so that the fp64 reference of all of them fits next to the timed weights.
fp32: relative error (Frobenius) against the fp64 reference < FP32_REL_TOL. Lower precisions get an
error budget: at most 2x the error of the reference run in that dtype, plus a noise floor. NaN never passes.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

import megamoe
from megamoe.autograd import triton_runs_on
from megamoe.bench import baselines
from megamoe.bench.problem import Tokens, Weights, cast, forward_backward, make_tokens, make_weights
from megamoe.bench.workloads import Workload

GATE_TOKENS = 256
GATE_EXPERTS = 16
GATE_SEED = 20_000  # + rank
FP32_REL_TOL = 1e-4
NOISE_FLOOR = 1e-5
STATUSES = ("ok", "unavailable", "FAILED")  # in order of precedence when ranks disagree


def unavailable_reason(backend: str, device: torch.device, group) -> str:
    """Why backend cannot run here ("" if it can, as far as can be told without running it)."""
    if backend == "triton" and not triton_runs_on(device):
        return "needs Triton and a CUDA GPU of compute capability >= 9.0"
    if backend == "reference" and group is not None:
        return "computes all experts in one process; no expert parallelism"
    if backend in baselines.PEERS:
        return baselines.peer_unavailable_reason(backend, device, group)
    return ""


def experts_fn(backend: str):
    """The callable gated and timed for backend, with megamoe.experts' signature: a baseline or peer of
    megamoe.bench.baselines, or megamoe.experts with MoEConfig(backend=backend)."""
    if backend in baselines.FUNCTIONS:
        return baselines.FUNCTIONS[backend]
    return functools.partial(megamoe.experts, config=megamoe.MoEConfig(backend=backend))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


def reference_results(
    weights_all: Weights, tokens: Tokens, dtype: torch.dtype, local_experts: slice, group
) -> dict[str, torch.Tensor]:
    """megamoe.reference in dtype on this rank's tokens with all the group's experts; the routed weight
    gradients are summed over the group (in fp32, fp64 for fp64) and cut to this rank's experts."""
    results = forward_backward(megamoe.reference.experts, *cast(weights_all, tokens, dtype))
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name in ("d_w_gate_up", "d_w_down"):
        grad = results[name].to(acc_dtype)
        if group is not None:
            dist.all_reduce(grad, group=group)
        results[name] = grad[local_experts]
    return results


def compare(results, ref_fp64, ref_dtype, dtype: torch.dtype) -> list[str]:
    """One message per tensor outside its budget (empty: all pass)."""
    failures = []
    for name, want in ref_fp64.items():
        got = results[name]
        if got.shape != want.shape:
            failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        err = rel_err(got, want)
        budget = FP32_REL_TOL if dtype == torch.float32 else 2 * rel_err(ref_dtype[name], want) + NOISE_FLOOR
        if not err <= budget:  # NaN fails here
            failures.append(f"{name}: rel err {err:.2e} > {budget:.2e}")
    return failures


def gate_one(backend: str, weights, tokens, ref_fp64, ref_dtype, dtype: torch.dtype, group) -> tuple[str, str]:
    """(status, detail) of one backend on this rank."""
    reason = unavailable_reason(backend, weights.w_down_EHI.device, group)
    if reason:
        return "unavailable", reason
    try:
        results = forward_backward(experts_fn(backend), weights, tokens, group=group)
    except (NotImplementedError, ImportError) as e:
        return "unavailable", str(e)
    except Exception as e:  # a backend that crashes fails its gate; the other backends still run
        return "FAILED", f"{type(e).__name__}: {e}"
    failures = compare(results, ref_fp64, ref_dtype, dtype)
    return ("FAILED", "; ".join(failures)) if failures else ("ok", "")


def gate_backends(
    w: Workload,
    backends: list[str],
    routing: str,
    experts_per_gpu: int,
    num_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    group,
) -> dict[str, tuple[str, str]]:
    """{backend: (status, detail)}, status in STATUSES, agreed by all ranks; detail says why if not "ok"."""
    world_size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    # At most GATE_EXPERTS over the group, but at least one per rank and k in all.
    n_local = min(experts_per_gpu, max(GATE_EXPERTS // world_size, math.ceil(w.top_k / world_size), 1))
    local = slice(rank * n_local, (rank + 1) * n_local)
    generator = torch.Generator(device=device).manual_seed(GATE_SEED + rank)
    tokens = make_tokens(w, min(num_tokens, GATE_TOKENS), n_local * world_size, routing, dtype, generator)
    weights = make_weights(w, range(local.start, local.stop), dtype, device)
    weights_all = make_weights(w, range(n_local * world_size), dtype, device)
    ref_fp64 = reference_results(weights_all, tokens, torch.float64, local, group)
    ref_dtype = None if dtype == torch.float32 else reference_results(weights_all, tokens, dtype, local, group)

    gates = {}
    for backend in backends:
        status, detail = gate_one(backend, weights, tokens, ref_fp64, ref_dtype, dtype, group)
        if group is not None:
            worst = torch.tensor([STATUSES.index(status)], device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            if STATUSES[worst.item()] != status:
                status, detail = STATUSES[worst.item()], "on another rank"
        gates[backend] = (status, detail)
    return gates
