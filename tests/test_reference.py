"""megamoe.reference: gradcheck in fp64, and the forward against a hand-written per-token loop."""

from __future__ import annotations

import math

import pytest
import torch

import megamoe
from conftest import assert_close_tight, assert_equal, make_problem, problem_id, run_reference

GRADCHECK_SHAPES = [(3, 4, 3, 3, 2), (1, 3, 2, 2, 1), (4, 5, 2, 4, 3)]


@pytest.mark.parametrize("shared", [0, 3], ids=["noshared", "shared3"])
@pytest.mark.parametrize("shape", GRADCHECK_SHAPES, ids=problem_id)
def test_gradcheck(rng, shape, shared):
    """d/d(x, topk_weights, w_gate_up, w_down, shared weights) of the reference equal finite differences."""
    num_tokens, hidden, inter, num_experts, top_k = shape
    p = make_problem(rng, num_tokens, hidden, inter, num_experts, top_k, shared_intermediate=shared)
    inputs = [getattr(p, n).clone().requires_grad_() for n in p.float_names]

    def fn(x, topk_weights, w_gate_up, w_down, *shared_w):
        kw = dict(zip(("shared_gate_up", "shared_down"), shared_w))
        return megamoe.reference.experts(x, p.topk_ids, topk_weights, w_gate_up, w_down, **kw)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_repeated_expert_in_token(rng):
    """A token that picks the same expert twice gets both contributions (and both gradients)."""
    p = make_problem(rng, 3, 4, 2, 3, 2, topk_ids=torch.tensor([[1, 1], [0, 2], [2, 2]]))
    inputs = [getattr(p, n).clone().requires_grad_() for n in p.float_names]
    fn = lambda x, w, wg, wd: megamoe.reference.experts(x, p.topk_ids, w, wg, wd)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def loop_forward(p) -> torch.Tensor:
    """The math of docs/design.md written as scalar Python loops over tokens, slots, and matrix entries."""
    x, ids, w = p.x.tolist(), p.topk_ids.tolist(), p.topk_weights.tolist()
    wgu, wd = p.w_gate_up.tolist(), p.w_down.tolist()
    num_tokens, hidden = p.x.shape
    inter = p.w_down.shape[2]

    def mlp(xt, gate_up, down, i_size):
        g = [sum(gate_up[i][h] * xt[h] for h in range(hidden)) for i in range(i_size)]
        u = [sum(gate_up[i_size + i][h] * xt[h] for h in range(hidden)) for i in range(i_size)]
        act = [_silu(g[i]) * u[i] for i in range(i_size)]
        return [sum(down[h][i] * act[i] for i in range(i_size)) for h in range(hidden)]

    out = []
    for t in range(num_tokens):
        row = [0.0] * hidden
        for j, e in enumerate(ids[t]):
            y = mlp(x[t], wgu[e], wd[e], inter)
            row = [row[h] + w[t][j] * y[h] for h in range(hidden)]
        if p.shared_gate_up is not None:
            s = mlp(x[t], p.shared_gate_up.tolist(), p.shared_down.tolist(), p.shared_down.shape[1])
            row = [row[h] + s[h] for h in range(hidden)]
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(num_tokens, hidden)


LOOP_CASES = [
    ((5, 6, 4, 4, 2), "random"),
    ((1, 3, 2, 1, 1), "random"),  # T=1, k=1, E=1
    ((6, 4, 3, 6, 2), "empty"),
    ((4, 4, 3, 3, 3), "one"),  # k = E: every token uses every expert
    ((7, 5, 3, 5, 2), "last"),
]


@pytest.mark.parametrize("shared", [0, 2], ids=["noshared", "shared2"])
@pytest.mark.parametrize("shape,route", LOOP_CASES, ids=[f"{problem_id(s)}-{r}" for s, r in LOOP_CASES])
def test_forward_matches_per_token_loop(rng, shape, route, shared):
    p = make_problem(rng, *shape, shared_intermediate=shared, route=route)
    out = megamoe.reference.experts(p.x, p.topk_ids, p.topk_weights, p.w_gate_up, p.w_down,
                                    shared_gate_up=p.shared_gate_up, shared_down=p.shared_down)
    assert out.dtype == torch.float64
    assert_close_tight("out", out, loop_forward(p), 1e-12)


def test_unrouted_expert_gets_zero_gradient(rng):
    """Experts no token picks get exactly zero weight gradients; routed ones do not."""
    p = make_problem(rng, 6, 4, 3, 6, 2, route="empty")
    grads = run_reference(p)
    used = torch.zeros(6, dtype=torch.bool)
    used[p.topk_ids.flatten()] = True
    for name in ("d_w_gate_up", "d_w_down"):
        g = grads[name]
        assert torch.equal(g[~used], torch.zeros_like(g[~used])), f"{name}: unrouted experts got a gradient"
        assert (g[used].flatten(1).abs().sum(1) > 0).all(), f"{name}: a routed expert got no gradient"


def test_topk_weights_gradient_is_dot_with_expert_output(rng):
    """d_topk_weights[t, j] = <d_out[t], y[t, j]> (docs/design.md), y from the swiglu MLP of expert topk_ids[t, j]."""
    p = make_problem(rng, 5, 6, 4, 4, 2)
    grads = run_reference(p)
    expected = torch.empty(5, 2, dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            e = int(p.topk_ids[t, j])
            y = megamoe.reference.swiglu_mlp(p.x[t : t + 1], p.w_gate_up[e], p.w_down[e])[0]
            expected[t, j] = (p.d_out[t] * y).sum()
    assert_close_tight("d_topk_weights", grads["d_topk_weights"], expected, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_keeps_dtype_and_tracks_fp64(rng, dtype):
    """Output is in x's dtype and close to fp64 (the low-precision reference is the error-budget yardstick)."""
    p = make_problem(rng, 8, 16, 8, 4, 2, shared_intermediate=4)
    low = p.cast(dtype)
    out = megamoe.reference.experts(low.x, low.topk_ids, low.topk_weights, low.w_gate_up, low.w_down,
                                    shared_gate_up=low.shared_gate_up, shared_down=low.shared_down)
    ref = run_reference(p)["out"]
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert_close_tight("out", out, ref, tol)


@pytest.mark.parametrize("shared", [0, 4], ids=["noshared", "shared4"])
def test_under_autocast_casts_like_megamoe_experts(rng, shared):
    """Under torch.autocast the reference casts its float32 inputs but topk_weights to the autocast dtype, as
    megamoe.experts does: the output of bfloat16 copies, bit for bit, and float32 gradients for the float32 inputs
    (was: RuntimeError "Index put requires the source and destination dtypes match")."""
    p = make_problem(rng, 8, 16, 8, 4, 2, shared_intermediate=shared).cast(torch.float32)
    leaves = {n: getattr(p, n).clone().requires_grad_() for n in p.float_names}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = megamoe.reference.experts(
            leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
            shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"),
        )
    low = {n: getattr(p, n) if n == "topk_weights" else getattr(p, n).bfloat16() for n in p.float_names}
    want = megamoe.reference.experts(low["x"], p.topk_ids, low["topk_weights"], low["w_gate_up"], low["w_down"],
                                     shared_gate_up=low.get("shared_gate_up"), shared_down=low.get("shared_down"))
    assert_equal("out", out, want)
    grads = torch.autograd.grad(out, list(leaves.values()), p.d_out.bfloat16())
    for name, grad in zip(leaves, grads):
        assert grad.dtype == torch.float32 and grad.abs().sum() > 0, name


EMPTY_CASES = [("all", 0), ("all", 2), ("x", 0), ("topk_weights", 0), ("w_gate_up", 0), ("w_down", 0),
               ("shared_down", 2)]


@pytest.mark.parametrize("grad_of,shared", EMPTY_CASES, ids=[f"{g}-shared{s}" for g, s in EMPTY_CASES])
def test_empty_batch_like_the_torch_backend(rng, grad_of, shared):
    """T = 0 (an empty batch): the output requires grad when any input does, and every gradient is zeros of its
    input's shape, as from backend="torch" (not an output autograd cannot reach, nor None gradients)."""
    p = make_problem(rng, 0, 4, 3, 3, 2, shared_intermediate=shared, topk_ids=torch.empty(0, 2, dtype=torch.int64))

    def run(fn, **kw):
        leaves = {n: getattr(p, n).clone().requires_grad_(grad_of in ("all", n)) for n in p.float_names}
        out = fn(leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                 shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"), **kw)
        assert out.requires_grad, f"{fn.__module__}: the output does not require grad"
        wanted = [n for n, t in leaves.items() if t.requires_grad]
        grads = torch.autograd.grad(out, [leaves[n] for n in wanted], p.d_out)
        return {"out": out.detach(), **{f"d_{n}": g for n, g in zip(wanted, grads)}}

    ours = run(megamoe.reference.experts)
    want = run(megamoe.experts, config=megamoe.MoEConfig(backend="torch"))
    assert ours.keys() == want.keys()
    for name in want:
        assert_equal(name, ours[name], want[name])
        assert not want[name].any(), f"backend='torch' {name}: not zeros"
