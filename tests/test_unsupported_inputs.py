"""Inputs the fast paths cannot take: torch.func transforms and forward-mode AD, float64 beside autocast, sparse tensors:
clear TypeErrors instead of silently wrong tangents or torch-internal errors."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import megamoe
from megamoe import MoEConfig, MoELayer, reference


def _problem():
    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = 5, 8, 4, 3, 2
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64)
    wd = torch.randn(E, H, I, generator=g, dtype=torch.float64)
    return x, ids, w, wgu, wd


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("transform", ["jvp", "forward_ad", "grad", "vmap", "jvp_weight"])
def test_function_transforms_raise_naming_the_input(backend, transform):
    x, ids, w, wgu, wd = _problem()
    cfg = MoEConfig(backend=backend)
    with pytest.raises(TypeError, match=r"megamoe\.experts: (x|w_gate_up) is .*reverse-mode autograd only"):
        if transform == "jvp":  # used to return an all-zero tangent
            torch.func.jvp(lambda x: megamoe.experts(x, ids, w, wgu, wd, config=cfg), (x,), (torch.ones_like(x),))
        elif transform == "jvp_weight":
            torch.func.jvp(lambda v: megamoe.experts(x, ids, w, v, wd, config=cfg), (wgu,), (torch.ones_like(wgu),))
        elif transform == "forward_ad":  # used to return no tangent at all
            with fwAD.dual_level():
                megamoe.experts(fwAD.make_dual(x, torch.ones_like(x)), ids, w, wgu, wd, config=cfg)
        elif transform == "grad":
            torch.func.grad(lambda x: megamoe.experts(x, ids, w, wgu, wd, config=cfg).sum())(x)
        else:
            torch.vmap(lambda x: megamoe.experts(x, ids, w, wgu, wd, config=cfg))(torch.stack([x, x]))


def test_reference_backend_still_supports_jvp():
    x, ids, w, wgu, wd = _problem()
    t = torch.randn_like(x)
    got = torch.func.jvp(
        lambda x: megamoe.experts(x, ids, w, wgu, wd, config=MoEConfig(backend="reference")), (x,), (t,)
    )[1]
    want = torch.func.jvp(lambda x: reference.experts(x, ids, w, wgu, wd), (x,), (t,))[1]
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("call", ["experts", "reference.experts"])
def test_reference_vmap_over_topk_ids_is_a_type_error(call):
    """The reference backend (which the fast paths' TypeError recommends for transforms, "though vmap cannot batch
    topk_ids") under torch.vmap: over x it runs, over topk_ids a TypeError naming it (was torch's "data-dependent
    control flow ... please file an issue" from inside the ids' range check)."""
    x, ids, w, wgu, wd = _problem()
    if call == "experts":
        f = lambda x, ids: megamoe.experts(x, ids, w, wgu, wd, config=MoEConfig(backend="reference"))
    else:
        f = lambda x, ids: reference.experts(x, ids, w, wgu, wd)
    xs = torch.stack([x, 2 * x])
    torch.testing.assert_close(torch.vmap(f, in_dims=(0, None))(xs, ids), torch.stack([f(x, ids), f(2 * x, ids)]))
    with pytest.raises(TypeError, match=r"topk_ids is batched by torch\.vmap"):
        torch.vmap(f, in_dims=(None, 0))(x, torch.stack([ids, ids.flip(1)]))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_second_derivative_is_a_clear_error(backend):
    """A backward with create_graph=True works (its first-order gradients are exact); differentiating it again raises
    megamoe's RuntimeError naming the cause and the reference backend (was torch's advice to the op's author: "no
    autograd formula was registered")."""
    x, ids, w, wgu, wd = _problem()
    x.requires_grad_()
    out = megamoe.experts(x, ids, w, wgu, wd, config=MoEConfig(backend=backend))
    d_x, = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    want = torch.autograd.grad(reference.experts(x, ids, w, wgu, wd).square().sum(), x)[0]
    torch.testing.assert_close(d_x, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"megamoe\.experts has no second derivative.*backend='reference'"):
        d_x.square().sum().backward()


@pytest.mark.parametrize("layer_dtype, x_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_layer_float64_under_autocast_is_a_type_error_naming_x(layer_dtype, x_dtype):
    layer = MoELayer(16, 8, 4, 2, dtype=layer_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"x must have the layer's dtype .*float64"):
            layer(torch.randn(3, 16, dtype=x_dtype))


@pytest.mark.parametrize("layer_dtype, x_dtype, hint", [
    (torch.float32, torch.bfloat16, True), (torch.float64, torch.float32, False), (torch.float32, torch.float64, False),
    (torch.float32, torch.int64, False),
], ids=["bf16-x", "fp64-layer", "fp64-x", "int-x"])
def test_layer_wrong_dtype_suggests_autocast_only_where_it_would_run(layer_dtype, x_dtype, hint):
    """Outside autocast, x in another dtype than the layer's: the TypeError suggests autocast only where autocast would
    take it. Before, every such x read "(or run under autocast)", also a float64 or integer x, or a float64 layer,
    which autocast does not cast (the same call under autocast is the TypeError above)."""
    layer = MoELayer(16, 8, 4, 2, dtype=layer_dtype)
    with pytest.raises(TypeError, match=r"x must have the layer's dtype") as info:
        layer(torch.ones(3, 16, dtype=x_dtype))
    assert ("(or run under autocast)" in str(info.value)) == hint, info.value


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layer_under_autocast_still_casts_low_precision_x(x_dtype):
    layer = MoELayer(16, 8, 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(3, 16, dtype=x_dtype)).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
@pytest.mark.parametrize("name", ["x", "topk_ids", "topk_weights", "w_gate_up", "w_down"])
def test_sparse_input_is_a_type_error_naming_it(backend, name):
    x, ids, w, wgu, wd = _problem()
    args = dict(x=x, topk_ids=ids, topk_weights=w, w_gate_up=wgu, w_down=wd)
    args[name] = args[name].to_sparse()
    with pytest.raises(TypeError, match=rf"{name} must be a dense \(torch.strided\) tensor, got layout torch.sparse_coo"):
        megamoe.experts(*args.values(), config=MoEConfig(backend=backend))


def _nested(x: torch.Tensor, layout=torch.strided) -> torch.Tensor:
    """x's rows as a ragged batch of two sequences [2, j, H]."""
    return torch.nested.nested_tensor([x[:2], x[2:]], layout=layout)


# torch's warning on creating a nested tensor of layout torch.strided.
NESTED_PROTOTYPE = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


@NESTED_PROTOTYPE
@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_nested_x_is_a_type_error_naming_it(backend):
    """A nested tensor of layout torch.strided passes the layout check; torch then failed on its ragged shape with
    "Internal error: NestedTensorImpl doesn't support sizes. Please file an issue."."""
    x, ids, w, wgu, wd = _problem()
    with pytest.raises(TypeError, match=r"x must be a dense \(torch.strided\) tensor, got a nested tensor"):
        megamoe.experts(_nested(x), ids, w, wgu, wd, config=MoEConfig(backend=backend))


LAYER_X_NOT_DENSE = {
    "sparse_coo": (lambda x: x.to_sparse(), "got layout torch.sparse_coo"),
    "sparse_csr": (lambda x: x.to_sparse_csr(), "got layout torch.sparse_csr"),
    "nested": (_nested, "got a nested tensor of layout torch.strided"),
    "jagged": (lambda x: _nested(x, torch.jagged), "got a nested tensor of layout torch.jagged"),
}


@NESTED_PROTOTYPE
@pytest.mark.parametrize("kind", list(LAYER_X_NOT_DENSE))
def test_layer_x_not_dense_is_a_type_error(kind):
    """MoELayer's x sparse or nested (a ragged batch): a TypeError saying what it takes, as megamoe.experts gives,
    not torch's from inside the router ("reshape is not implemented for sparse tensors", "cannot view shape
    (2, j1, 8)", "NestedTensorImpl doesn't support sizes")."""
    make, words = LAYER_X_NOT_DENSE[kind]
    layer = MoELayer(8, 4, 3, 2)
    with pytest.raises(TypeError, match=rf"x must be a dense \(torch.strided\) tensor, {words}"):
        layer(make(torch.randn(5, 8)))


def test_build_schedule_sparse_ids_is_a_type_error():
    with pytest.raises(TypeError, match=r"topk_ids must be a dense"):
        megamoe.build_schedule(torch.zeros(4, 2, dtype=torch.long).to_sparse(), 4)


def test_functionalize_still_works():
    x, ids, w, wgu, wd = _problem()
    f = lambda x: megamoe.experts(x, ids, w, wgu, wd, config=MoEConfig(backend="torch"))
    assert torch.equal(torch.func.functionalize(f)(x), f(x))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compiled_jvp_raises_naming_the_input(backend):
    """torch.func.jvp traced by torch.compile: the same TypeError as in eager (the check used to be skipped under
    torch.compile, and the tangent came back silently all zeros)."""
    torch._dynamo.reset()
    x, ids, w, wgu, wd = _problem()
    f = lambda x: megamoe.experts(x, ids, w, wgu, wd, config=MoEConfig(backend=backend))
    compiled = torch.compile(lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1])
    with pytest.raises(TypeError, match=r"megamoe\.experts: x is .*reverse-mode autograd only"):
        compiled(x)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_vmap_over_autograd_grad_matches_a_loop(backend):
    """torch.vmap over torch.autograd.grad (a batch of output gradients through one forward): every gradient is the
    one backward per slice gives, bit for bit (was "Batching rule not implemented for megamoe::experts_bwd")."""
    x, ids, w, wgu, wd = _problem()
    leaves = [t.clone().requires_grad_() for t in (x, w, wgu, wd)]
    out = megamoe.experts(leaves[0], ids, *leaves[1:], config=MoEConfig(backend=backend))
    d_outs = torch.randn(3, *out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    got = torch.vmap(lambda d: torch.autograd.grad(out, leaves, d, retain_graph=True))(d_outs)
    for i, name in enumerate(["x", "topk_weights", "w_gate_up", "w_down"]):
        want = torch.stack([torch.autograd.grad(out, leaves[i], d, retain_graph=True)[0] for d in d_outs])
        assert torch.equal(got[i], want), f"d_{name}"


def test_vmap_of_the_backward_op_over_a_forward_input_is_a_type_error(monkeypatch):
    """The backward op's vmap rule batches d_out alone: called under torch.vmap with one of the forward's inputs
    batched (only a direct caller of the op can), a TypeError, not a result that ignores the batch."""
    x, ids, w, wgu, wd = _problem()
    calls = []
    real = megamoe.autograd._experts_bwd
    monkeypatch.setattr(megamoe.autograd, "_experts_bwd", lambda *args: calls.append(args) or real(*args))
    leaf = x.clone().requires_grad_()
    out = megamoe.experts(leaf, ids, w, wgu, wd, config=MoEConfig(backend="torch"))
    torch.autograd.grad(out, leaf, torch.ones_like(out))
    (args,) = calls
    xs = torch.stack([args[1], args[1]])
    with pytest.raises(TypeError, match=r"can batch only the output gradient"):
        torch.vmap(lambda xb: real(args[0], xb, *args[2:]))(xs)


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian_vectorize"])
def test_legacy_batched_gradients_are_a_type_error(how):
    """torch.autograd's own batched gradients run torch's legacy vmap, which cannot batch the backward op: megamoe's
    TypeError naming them and what works instead (was torch's "Batching rule not implemented")."""
    x, ids, w, wgu, wd = _problem()
    f = lambda x: megamoe.experts(x, ids, w, wgu, wd, config=MoEConfig(backend="torch"))
    with pytest.raises(TypeError, match=r"is_grads_batched=True.*torch\.vmap over torch\.autograd\.grad"):
        if how == "is_grads_batched":
            x.requires_grad_()
            torch.autograd.grad(f(x), x, torch.ones(2, *x.shape, dtype=x.dtype), is_grads_batched=True)
        else:
            torch.autograd.functional.jacobian(f, x, vectorize=True)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_float64_x_beside_float32_weight_under_autocast_names_the_given_dtype(backend):
    """x float64 (which autocast leaves alone) and w_gate_up float32 under autocast: the TypeError says float32, the
    dtype passed (it said the autocast dtype, bfloat16, which the caller never passed)."""
    x, ids, w, wgu, wd = _problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"w_gate_up must have x's dtype torch\.float64, got torch\.float32"):
            megamoe.experts(x, ids, w, wgu.float(), wd, config=MoEConfig(backend=backend))
