"""Edge cases users reach on the Triton backend, run by Triton's interpreter on CPU: topk_weights in x's
16-bit dtype, and the empty batch (T = 0, a rank with no tokens this step).

The same subprocess pattern as tests/test_triton_interpret.py:

    TRITON_INTERPRET=1 pytest tests/test_triton_edge_interpret.py     # direct
    pytest tests/test_triton_edge_interpret.py                        # re-runs itself in such a subprocess

dtypes fp32 and fp16 (the interpreter cannot run bf16 tl.dot; the combine kernel has no dot and runs in
bf16 too). Checked:
- combine takes router weights in fp32 or the rows' dtype: 16-bit weights give the bits of the same
  weights widened to fp32 first, fp32 weights the reference's slot sum bit for bit (fp32, j in order),
  any other dtype is a ValueError naming weights;
- the one-GPU driver (experts_fwd / experts_bwd on CPU tensors) and the public `megamoe.experts` with the
  Triton backend forced ("auto" picks the torch path on CPU) against megamoe.reference: fp16
  topk_weights within the error budget, d_topk_weights in topk_weights' dtype (what the backward op's
  fake implementation promises torch.compile); a token picking one expert in several slots, every gradient
  within the error budget; T = 0: an empty out and d_x, exact-zero weight gradients;
- the expert-parallel driver (ep.py) on a one-rank group, fused and unfused: d_topk_weights in fp16
  topk_weights' dtype; T = 0 (on every rank) the same empty results without touching the workspace;
- the Triton placement kernels at T = 0 give the torch placement.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from conftest import (
    INTERPRET, INTERPRETER_WARNINGS, Problem, assert_close_budget, assert_equal, interpreted, interpreter_suite,
    make_problem, poisoned_empty, run_experts, run_reference,
)

pytestmark = INTERPRETER_WARNINGS
test_interpreter_suite = interpreter_suite(__file__)


if INTERPRET:
    import megamoe
    from megamoe.backends.triton import ep, kernels
    from megamoe.backends.triton.configs import TileConfig
    from megamoe.backends.triton.experts import experts_bwd, experts_fwd
    from megamoe.backends.triton.kernels.schedule import place_routing
    from megamoe.config import MoEConfig
    from megamoe.schedule import build_schedule, place_routing_torch, receive_rows
    from test_triton_interpret import fake_workspace

DTYPES = [torch.float32, torch.float16]
NAMES = ["x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"]
COMBINE = TileConfig(4, 16, 1, num_warps=4, num_stages=1) if INTERPRET else None
# (T, H, I, E, k, shared I): several row blocks of block_m = 16 and of the combine's tiles.
SHAPE = (23, 32, 24, 5, 3, 16)
# ep.py's two paths (MoEConfig fields): the fused kernels, and whole exchanges around the one-GPU GEMMs.
EP_PATHS = {"fused": dict(dispatch="pull", combine="push"), "unfused": dict(dispatch="push", combine="pull")}


def problem(seed: int, num_tokens: int, dtype: torch.dtype, weights_dtype: torch.dtype | None = None,
            shared: bool = True) -> tuple[Problem, Problem]:
    """(the fp64 problem, the same in dtype with topk_weights in weights_dtype, default fp32)."""
    _, hidden, inter, experts, top_k, shared_inter = SHAPE
    gen = torch.Generator().manual_seed(seed)
    p64 = make_problem(gen, max(num_tokens, 1), hidden, inter, experts, top_k,
                       shared_intermediate=shared_inter * shared)
    if num_tokens == 0:  # the weights of a one-token problem, no token
        per_token = ("x", "topk_ids", "topk_weights", "d_out")
        p64 = dataclasses.replace(p64, **{name: getattr(p64, name)[:0] for name in per_token})
    return p64, p64.cast(dtype, weights_dtype)


def backend_run(p: Problem, block_m: int = 16, ep_config=None) -> dict[str, torch.Tensor]:
    """experts_fwd + experts_bwd, every gradient asked for; {"out", "d_<name>"}: of the one-GPU driver, or
    with ep_config (a MoEConfig) of ep.py on a one-rank group (with the workspace ep.get_workspace gives)."""
    schedule = build_schedule(p.topk_ids, p.w_gate_up.shape[0], block_m=block_m)
    inputs = (p.x, p.topk_weights, p.w_gate_up, p.w_down, p.shared_gate_up, p.shared_down)
    fwd, bwd = (experts_fwd, experts_bwd) if ep_config is None else (ep.experts_fwd, ep.experts_bwd)
    with poisoned_empty():
        out, saved = fwd(*inputs, schedule, None, ep_config)
        grads = bwd(p.d_out, p.x, *inputs[1:], schedule, None, ep_config, saved)
    return {"out": out, **{f"d_{name}": g for name, g in zip(NAMES, grads) if g is not None}}


@pytest.fixture
def triton_backend(monkeypatch):
    """megamoe.experts on CPU tensors runs the Triton backend (its placement: the torch one on CPU)."""
    autograd = importlib.import_module("megamoe.autograd")
    monkeypatch.setattr(autograd, "resolve_backend", lambda config, x, group: "triton")


# ----------------------------------------------------------------------------------------------------
# combine: router weights in the rows' dtype


def combine_case(dtype, seed=3):
    T, H, k, N = 11, 40, 3, 50
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(N, H, generator=gen).to(dtype)
    weights = torch.rand(T, k, generator=gen)
    index = torch.randperm(N, generator=gen)[: T * k].to(torch.int32).view(T, k).contiguous()
    index[2, 1] = -1  # a pair cut by a capacity: no row, counts as zero
    shared = torch.randn(T, H, generator=gen).to(dtype)
    return rows, weights, index, shared


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_combine_takes_weights_in_rows_dtype(dtype):
    rows, weights, index, shared = combine_case(dtype)
    weights = weights.to(dtype)
    with poisoned_empty():
        got = kernels.combine(rows, weights, index, shared, config=COMBINE)
        want = kernels.combine(rows, weights.float(), index, shared, config=COMBINE)
    assert_equal("out (16-bit weights against the same weights in fp32)", got, want)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_combine_fp32_weights_is_the_reference_slot_sum(dtype):
    """fp32 products, summed in fp32 slot by slot (j = 0..k-1), the shared rows last, one rounding: the
    reference's own sum, bit for bit (the interpreter rounds every product and sum, as torch does; not
    bf16 rows, which it rounds from fp32 by truncation where GPUs round to nearest)."""
    rows, weights, index, shared = combine_case(dtype)
    with poisoned_empty():
        got = kernels.combine(rows, weights, index, shared, config=COMBINE)
    y = torch.where((index >= 0)[..., None], rows.float()[index.long().clamp(min=0)], 0.0)
    want = torch.zeros(rows.shape[1], dtype=torch.float32).expand(index.shape[0], -1)
    for j in range(index.shape[1]):
        want = want + weights[:, j : j + 1] * y[:, j]
    assert_equal("out", got, (want + shared.float()).to(dtype))


@interpreted
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_combine_refuses_other_weight_dtypes(weights_dtype):
    rows, weights, index, _ = combine_case(torch.float16)
    with pytest.raises(ValueError, match="weights must be a contiguous float32 .* got torch.(bfloat16|float64)"):
        kernels.combine(rows, weights.to(weights_dtype), index, None, config=COMBINE)


# ----------------------------------------------------------------------------------------------------
# topk_weights in x's dtype through the experts


@interpreted
def test_experts_fwd_fp16_topk_weights():
    """The forward with fp16 router weights: the bits of the same weights in fp32 (widened exactly), and
    within the error budget of the reference run with fp16 weights."""
    p64, low = problem(11, SHAPE[0], torch.float16, torch.float16)
    schedule = build_schedule(low.topk_ids, SHAPE[3], block_m=16)
    args = (low.x, low.topk_weights, low.w_gate_up, low.w_down, low.shared_gate_up, low.shared_down)
    with poisoned_empty():
        got, _ = experts_fwd(*args, schedule, None, save_for_backward=False)
        want, _ = experts_fwd(args[0], args[1].float(), *args[2:], schedule, None, save_for_backward=False)
    assert_equal("out (fp16 topk_weights against the same weights in fp32)", got, want)
    assert_close_budget("out", got, run_reference(p64)["out"], run_reference(low)["out"])


@interpreted
def test_experts_bwd_fp16_topk_weights():
    p64, low = problem(12, SHAPE[0], torch.float16, torch.float16)
    ours, ref64, ref_low = backend_run(low), run_reference(p64), run_reference(low)
    for name in ref64:
        assert_close_budget(name, ours[name], ref64[name], ref_low[name])


@interpreted
def test_experts_bwd_d_topk_weights_in_their_dtype():
    _, low = problem(12, SHAPE[0], torch.float16, torch.float16)
    got = backend_run(low)["d_topk_weights"].dtype
    assert got == torch.float16, f"d_topk_weights is {got}, topk_weights float16"


@interpreted
@pytest.mark.parametrize("path", list(EP_PATHS))
def test_ep_bwd_d_topk_weights_in_their_dtype(path, monkeypatch):
    """ep.py (one rank, CPU workspace) with fp16 topk_weights: d_topk_weights in fp16 as on one GPU, the bits
    of the fp32 weights' gradient rounded once (the gradient <d_out, y> does not depend on the weights)."""
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    _, low = problem(16, SHAPE[0], torch.float16, torch.float16)
    config = MoEConfig(**EP_PATHS[path])
    got = backend_run(low, ep_config=config)["d_topk_weights"]
    wide = dataclasses.replace(low, topk_weights=low.topk_weights.float())
    want = backend_run(wide, ep_config=config)["d_topk_weights"]
    assert_equal("d_topk_weights (fp16 topk_weights against the same in fp32, rounded)", got, want.half())


@interpreted
def test_public_experts_fp16_topk_weights(triton_backend):
    """megamoe.experts (custom ops, autograd) on the Triton backend, block_m its own (128)."""
    p64, low = problem(13, SHAPE[0], torch.float16, torch.float16)
    ours, ref64, ref_low = run_experts(low), run_reference(p64), run_reference(low)
    for name in ref64:
        assert ours[name].dtype == ref_low[name].dtype, f"{name}: {ours[name].dtype} != {ref_low[name].dtype}"
        assert_close_budget(name, ours[name], ref64[name], ref_low[name])


@interpreted
@pytest.mark.parametrize("name", ["x", "topk_weights", "w_gate_up", "w_down"])
def test_public_experts_inplace_change_after_forward_raises(name, triton_backend):
    """On the Triton backend too, an input changed in place between the forward and the backward (an optimizer
    step, x.add_(1)) is torch's version-counter error, not gradients of the changed values (the backward
    re-reads x and the weights to spread rows and, in a second backward, to recompute gate_up)."""
    _, p = problem(21, SHAPE[0], torch.float32, shared=False)
    leaves = {n: getattr(p, n).detach().clone().requires_grad_() for n in p.float_names}
    out = megamoe.experts(leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"])
    with torch.no_grad():
        leaves[name].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(p.d_out)


@interpreted
def test_public_experts_retain_graph_backward_twice(triton_backend):
    """Through megamoe.experts (autograd): the first backward frees the saved gate_up, the second (retain_graph)
    recomputes it, and the gradients accumulate to exactly twice the first's, after a torch.autograd.grad of
    one input in between (which already released gate_up)."""
    _, p = problem(22, SHAPE[0], torch.float16)
    leaves = {n: getattr(p, n).detach().clone().requires_grad_() for n in p.float_names}
    out = megamoe.experts(leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                          shared_gate_up=leaves["shared_gate_up"], shared_down=leaves["shared_down"])
    some = torch.autograd.grad(out, [leaves["topk_weights"]], p.d_out, retain_graph=True)[0]
    out.backward(p.d_out, retain_graph=True)
    first = {n: leaf.grad.clone() for n, leaf in leaves.items()}
    out.backward(p.d_out)
    for n, leaf in leaves.items():
        assert_equal(f"d_{n} after two backwards", leaf.grad, 2 * first[n])
    assert_equal("d_topk_weights of autograd.grad([topk_weights])", some, first["topk_weights"])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_public_experts_repeated_expert_in_token(dtype, triton_backend):
    """A token that picks one expert in several slots (token 1 in all three; experts 3 and 4 get no token):
    each slot a row of its own, every gradient within the error budget of the reference."""
    num_tokens, hidden, inter, num_experts, top_k, shared_inter = SHAPE
    ids = torch.tensor([[1, 1, 2], [0, 0, 0], [2, 1, 2], [1, 0, 1]]).repeat(6, 1)[:num_tokens]
    p64 = make_problem(torch.Generator().manual_seed(23), num_tokens, hidden, inter, num_experts, top_k,
                       shared_intermediate=shared_inter, topk_ids=ids)
    low = p64.cast(dtype)
    ours, ref64, ref_low = run_experts(low), run_reference(p64), run_reference(low)
    for name in ref64:
        assert_close_budget(name, ours[name], ref64[name], ref_low[name])


# ----------------------------------------------------------------------------------------------------
# The empty batch


def assert_empty_batch_results(got: dict[str, torch.Tensor], p: Problem) -> None:
    """out and d_x [0, H], d_topk_weights [0, k] (each in its input's dtype), every weight gradient exact zeros."""
    assert_equal("out", got["out"], p.x.new_empty(0, p.x.shape[1]))
    for name in p.float_names:
        leaf = getattr(p, name)
        want = leaf.new_empty(leaf.shape) if leaf.shape[0] == 0 else torch.zeros_like(leaf)
        assert_equal(f"d_{name}", got[f"d_{name}"], want)


@interpreted
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "noshared"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_experts_empty_batch(dtype, shared):
    _, p = problem(14, 0, dtype, shared=shared)
    assert_empty_batch_results(backend_run(p), p)


def no_workspace(*args, **kwargs):
    raise AssertionError("the empty batch looked up the symmetric workspace")


@interpreted
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "noshared"])
@pytest.mark.parametrize("path", list(EP_PATHS))
def test_ep_empty_batch(path, shared, monkeypatch):
    """ep.py with T = 0 (on every rank: the ranks agree on T), training and inference: the empty batch's
    results, and nothing exchanged: the workspace is never looked up (tests/test_ep_gloo.py runs it through
    megamoe.experts on 2 and 4 ranks)."""
    monkeypatch.setattr(ep, "get_workspace", no_workspace)
    _, p = problem(17, 0, torch.float16, shared=shared)
    config = MoEConfig(**EP_PATHS[path])
    assert_empty_batch_results(backend_run(p, ep_config=config), p)
    schedule = build_schedule(p.topk_ids, p.w_gate_up.shape[0], block_m=16)
    out, saved = ep.experts_fwd(p.x, p.topk_weights, p.w_gate_up, p.w_down, p.shared_gate_up, p.shared_down, schedule,
                                None, config, save_for_backward=False)
    assert_equal("out (inference)", out, p.x.new_empty(0, p.x.shape[1]))
    assert saved == (), f"inference saved {len(saved)} tensors"


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_public_experts_empty_batch(dtype, triton_backend):
    """Training (forward + backward) and inference (no_grad) through megamoe.experts; the reference gives
    the same (its gradients materialised: it never touches the weights of experts nobody routes to)."""
    _, p = problem(15, 0, dtype)
    assert_empty_batch_results(run_experts(p), p)
    leaves = {name: getattr(p, name).detach().clone().requires_grad_() for name in p.float_names}
    ref = megamoe.reference.experts(leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"],
                                    leaves["w_down"], shared_gate_up=leaves["shared_gate_up"],
                                    shared_down=leaves["shared_down"])
    grads = torch.autograd.grad(ref, list(leaves.values()), p.d_out, allow_unused=True, materialize_grads=True)
    assert_empty_batch_results({"out": ref.detach(), **{f"d_{n}": g for n, g in zip(leaves, grads)}}, p)
    with torch.no_grad():
        out = megamoe.experts(p.x, p.topk_ids, p.topk_weights, p.w_gate_up, p.w_down,
                              shared_gate_up=p.shared_gate_up, shared_down=p.shared_down)
    assert_equal("out (no_grad)", out, p.x.new_empty(0, p.x.shape[1]))


@interpreted
@pytest.mark.parametrize("block_m", [16, 128])
def test_placement_empty_batch(block_m):
    """The Triton placement (what build_schedule runs on GPUs) at T = 0: the torch placement's tensors."""
    flat_ids = torch.empty(0, dtype=torch.int64)
    num_experts, top_k = SHAPE[3], SHAPE[4]
    rows = receive_rows(0, top_k, num_experts, 1, block_m, None)
    want = place_routing_torch(flat_ids, num_experts=num_experts, world_size=1, rank=0, block_m=block_m, num_rows=rows)
    got = place_routing(flat_ids, num_experts=num_experts, world_size=1, rank=0, block_m=block_m, num_rows=rows)
    for field in dataclasses.fields(want):
        assert_equal(field.name, getattr(got, field.name), getattr(want, field.name))
