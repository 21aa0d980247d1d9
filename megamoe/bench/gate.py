"""The correctness gate run before timing: each backend's output and every gradient on the timed problem
itself (the timed weights and the first timed input set: all T tokens, every expert of the run) against a
reference of that same problem.

A backend is the callable experts_fn(backend) (megamoe.experts with that MoEConfig backend, or a baseline
or peer of megamoe.bench.baselines); the gate runs exactly what the timing runs, on the same values (the same
tensors, but for TorchTitan's own copy of the gate/up weights, backend_weights).

The reference (`reference`) is megamoe.reference's math streamed one expert at a time, so that it fits
beside the timed problem at full size: each expert's rows go through megamoe.reference.swiglu_mlp and its
autograd, out, d_topk_weights and d_x are accumulated per token, and the expert's weight gradients are
summed over the group and kept by the expert's owner (the experts of other ranks are regenerated from their
seeds, megamoe.bench.problem.expert_weights, rather than gathered). The ground truth runs in fp64 on the CPU
and in fp32 on GPUs (IEEE, no TF32): fp64 runs at 1/2 to 1/64 of the fp32 rate there, and fp32's own
error (~1e-6) is far below every tolerance. fp32 runs must be within FP32_REL_TOL of it (relative
Frobenius error); lower precisions get an error budget: at most 2x the error of the same streamed reference
run in that dtype (matmuls in the dtype, as megamoe.reference runs in it: PyTorch's own error), plus a noise
floor. NaN or inf never passes, even under a budget of inf (the reference in that dtype overflowed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
import torch.distributed as dist

import megamoe
from megamoe.autograd import TRITON_UNAVAILABLE, group_hosts, triton_runs_on
from megamoe.bench import baselines
from megamoe.bench.problem import Tokens, Weights, expert_weights, forward_backward, megamoe_layout, torchtitan_weights
from megamoe.bench.workloads import Workload

FP32_REL_TOL = 1e-4
NOISE_FLOOR = 1e-5
STATUSES = ("ok", "unavailable", "FAILED")  # in order of precedence when ranks disagree
# Elements per fp64 chunk when a result is compared (a whole fp64 copy of the weight gradients would not fit).
_COMPARE_CHUNK = 1 << 24


def unavailable_reason(backend: str, device: torch.device, group) -> str:
    """Why backend cannot run here ("" if it can, as far as can be told without running it). Asking about triton
    with a group gathers the ranks' hosts (megamoe.autograd.group_hosts) at the group's first use: a collective."""
    if backend == "triton" and not triton_runs_on(device):
        # Where megamoe's Triton backend did not load, why (no Triton, or one too old for the kernels).
        return TRITON_UNAVAILABLE or "needs an NVIDIA GPU of compute capability >= 9.0"
    if backend == "triton" and group is not None and len(set(group_hosts(group.group_name, device))) > 1:
        return "expert parallelism over NVLink: needs every rank of the group on one host"
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


def backend_weights(backend: str, weights: Weights) -> Weights:
    """weights as backend holds them: TorchTitan's gate and up as two leaves (problem.torchtitan_weights, new
    copies, made outside the timed calls), every other backend's the same leaves in megamoe's layout."""
    return torchtitan_weights(weights) if backend == "torchtitan" else weights


def ground_truth_dtype(device: torch.device) -> torch.dtype:
    """fp64 on the CPU, fp32 on GPUs (see the module docstring)."""
    return torch.float64 if device.type == "cpu" else torch.float32


def _sq_norms(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(||got - want||^2, ||want||^2), summed in fp64 chunk by chunk."""
    diff = ref = 0.0
    for g, w in zip(got.reshape(-1).split(_COMPARE_CHUNK), want.reshape(-1).split(_COMPARE_CHUNK)):
        g, w = g.double(), w.double()
        diff += (g - w).square().sum().item()
        ref += w.square().sum().item()
    return diff, ref


def _rel_err(diff_sq: float, ref_sq: float) -> float:
    return math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-300)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp64); NaN if got has a NaN."""
    return _rel_err(*_sq_norms(got, want))


@contextlib.contextmanager
def _ieee_fp32():
    """fp32 matmuls without TF32 (a TF32 reference would be no better than what it checks)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class _Pass:
    """megamoe.reference.experts on this rank's tokens in one precision, fed one expert at a time: matmuls in
    `dtype`, the slot sum and d_topk_weights in fp32 (fp64 for fp64), d_x summed over the experts in `dtype`
    (as autograd of the reference sums it). Its input casts are megamoe.bench.problem.cast's."""

    def __init__(self, tokens: Tokens, dtype: torch.dtype):
        self.dtype = dtype
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32
        self.x = tokens.x_TH.detach().to(dtype)
        self.topk_weights = tokens.topk_weights_TK.detach().to(self.acc)
        self.d_out = tokens.d_out_TH.to(self.acc)  # what reaches the slot sum through out.to(x.dtype)
        self.out = torch.zeros_like(self.x, dtype=self.acc)
        self.d_x = torch.zeros_like(self.x)
        self.d_topk_weights = torch.zeros_like(self.topk_weights)

    def _mlp(self, x, w_gate_up, w_down, d_y):
        """(y in the accumulation dtype, d_x rows, d_w_gate_up, d_w_down) of swiglu_mlp on rows x, for d_y."""
        leaves = [t.detach().to(self.dtype).requires_grad_() for t in (x, w_gate_up, w_down)]
        with torch.enable_grad():
            y = megamoe.reference.swiglu_mlp(*leaves)
        return (y.detach().to(self.acc), *torch.autograd.grad(y, leaves, d_y.to(self.dtype)))

    def expert(self, token: torch.Tensor, slot: torch.Tensor, w_gate_up, w_down) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds the pairs (token[i], slot[i]) of one expert; returns its (d_w_gate_up, d_w_down) over them."""
        weight = self.topk_weights[token, slot][:, None]
        d_out = self.d_out[token]
        y, d_x, d_w_gate_up, d_w_down = self._mlp(self.x[token], w_gate_up, w_down, d_out * weight)
        self.out.index_add_(0, token, weight * y)
        self.d_topk_weights[token, slot] = (d_out * y).sum(dim=1)
        self.d_x.index_add_(0, token, d_x)
        return d_w_gate_up, d_w_down

    def shared(self, w_gate_up, w_down) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds the shared expert (last, as the reference does); returns its (d_w_gate_up, d_w_down)."""
        y, d_x, d_w_gate_up, d_w_down = self._mlp(self.x, w_gate_up, w_down, self.d_out)
        self.out += y
        self.d_x += d_x
        return d_w_gate_up, d_w_down


@dataclasses.dataclass
class Reference:
    """The gate's reference of one timed problem on this rank. truth: the output and every gradient (keyed as
    megamoe.bench.problem.forward_backward keys them) in the ground-truth dtype; budget: the relative error
    each result may have against it."""

    truth: dict[str, torch.Tensor]
    budget: dict[str, float]


def reference(
    w: Workload, weights: Weights, tokens: Tokens, group, truth_dtype: torch.dtype | None = None
) -> Reference:
    """The reference of the problem (weights, tokens) of this rank, streamed expert by expert (module docstring).

    weights: this rank's E_l experts, global ids rank * E_l + i (megamoe.bench.problem.make_weights); tokens:
    routed over the group's E_l * W experts. truth_dtype: None for ground_truth_dtype(device). Every rank of
    group calls it (all-reduces per expert, in the same order on every rank). The pairs are sorted by expert
    once, so each expert's rows are a slice.
    """
    device, dtype = tokens.x_TH.device, tokens.x_TH.dtype
    world_size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    num_local = weights.w_down_EHI.shape[0]
    first = rank * num_local
    truth_dtype = truth_dtype or ground_truth_dtype(device)
    truth = _Pass(tokens, truth_dtype)
    low = None if dtype == torch.float32 else _Pass(tokens, dtype)  # the budget's "same reference in the dtype"
    passes = [p for p in (truth, low) if p is not None]
    d_w = {
        "d_w_gate_up": torch.empty(weights.w_gate_up_E2IH.shape, dtype=truth_dtype, device=device),
        "d_w_down": torch.empty(weights.w_down_EHI.shape, dtype=truth_dtype, device=device),
    }
    low_sq = {name: [0.0, 0.0] for name in d_w}  # (||low - truth||^2, ||truth||^2) of each weight gradient
    top_k = tokens.topk_ids_TK.shape[1]
    flat = tokens.topk_ids_TK.flatten()
    by_expert = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_local * world_size).tolist()
    start = 0
    with _ieee_fp32():
        for e in range(num_local * world_size):
            pairs = by_expert[start : start + counts[e]]
            start += counts[e]
            mine = first <= e < first + num_local
            if mine:
                expert = weights.w_gate_up_E2IH[e - first], weights.w_down_EHI[e - first]
            else:
                expert = expert_weights(w, e, dtype, device)
            grads = [p.expert(pairs // top_k, pairs % top_k, *expert) for p in passes]
            if group is not None:  # over every rank's tokens, summed in the accumulation dtype
                grads = [[g.to(p.acc) for g in pass_grads] for p, pass_grads in zip(passes, grads)]
                for g in (g for pass_grads in grads for g in pass_grads):
                    dist.all_reduce(g, group=group)
            if not mine:
                continue
            for i, name in enumerate(d_w):
                d_w[name][e - first] = grads[0][i]
                if low is not None:
                    diff_sq, ref_sq = _sq_norms(grads[1][i], grads[0][i])
                    low_sq[name][0] += diff_sq
                    low_sq[name][1] += ref_sq
        shared = []
        if weights.shared_gate_up_2IH is not None:
            shared = [p.shared(weights.shared_gate_up_2IH, weights.shared_down_HI) for p in passes]

    def results(p: _Pass, index: int, weight_grads: dict) -> dict[str, torch.Tensor]:
        named = {"out": p.out.to(p.dtype), "d_x": p.d_x, "d_topk_weights": p.d_topk_weights, **weight_grads}
        if shared:
            named.update(d_shared_gate_up=shared[index][0], d_shared_down=shared[index][1])
        return named

    want = results(truth, 0, d_w)
    if low is None:
        return Reference(want, dict.fromkeys(want, FP32_REL_TOL))
    errors = {name: rel_err(got, want[name]) for name, got in results(low, 1, {}).items()}
    errors.update({name: _rel_err(*sq) for name, sq in low_sq.items()})
    return Reference(want, {name: 2 * errors[name] + NOISE_FLOOR for name in want})


def compare(results: dict[str, torch.Tensor], ref: Reference) -> list[str]:
    """One message per tensor outside its budget (empty: all pass)."""
    failures = []
    for name, want in ref.truth.items():
        got = megamoe_layout(results[name])
        if got.shape != want.shape:
            failures.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        err = rel_err(got, want)
        if not math.isfinite(err):  # NaN or inf in the result; fails under a budget of inf too (the dtype overflowed)
            failures.append(f"{name}: rel err {err:.2e}, not finite")
        elif not err <= ref.budget[name]:
            failures.append(f"{name}: rel err {err:.2e} > {ref.budget[name]:.2e}")
    return failures


def gate_one(backend: str, weights: Weights, tokens: Tokens, ref: Reference, group) -> tuple[str, str]:
    """(status, detail) of one backend on this rank; weights in megamoe's layout, handed to the backend as it
    holds them (backend_weights)."""
    reason = unavailable_reason(backend, weights.w_down_EHI.device, group)
    if reason:
        return "unavailable", reason
    try:
        results = forward_backward(experts_fn(backend), backend_weights(backend, weights), tokens, group=group)
    except (NotImplementedError, ImportError) as e:
        return "unavailable", str(e)
    except Exception as e:  # a backend that crashes fails its gate; the other backends still run
        return "FAILED", f"{type(e).__name__}: {e}"
    failures = compare(results, ref)
    return ("FAILED", "; ".join(failures)) if failures else ("ok", "")


def gate_backends(
    w: Workload, backends: list[str], weights: Weights, tokens: Tokens, group
) -> dict[str, tuple[str, str]]:
    """{backend: (status, detail)} on the timed problem (weights, tokens) of this rank, status in STATUSES,
    agreed by all ranks; detail says why if not "ok"."""
    device = tokens.x_TH.device
    ref = reference(w, weights, tokens, group)
    gates = {}
    for backend in backends:
        status, detail = gate_one(backend, weights, tokens, ref, group)
        if group is not None:
            worst = torch.tensor([STATUSES.index(status)], device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            if STATUSES[worst.item()] != status:
                status, detail = STATUSES[worst.item()], "on another rank"
        gates[backend] = (status, detail)
    return gates
