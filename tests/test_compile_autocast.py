"""torch.compile(fullgraph=True) over MoELayer (the custom ops and their fake impls) and torch.autocast."""

import pytest
import torch

import megamoe


def _layer(shared: int) -> megamoe.MoELayer:
    torch.manual_seed(0)
    return megamoe.MoELayer(32, 24, 6, 2, shared_intermediate_size=shared, config=megamoe.MoEConfig(backend="torch"))


@pytest.mark.parametrize("shared", [0, 8], ids=["no-shared", "shared"])
def test_compile_fullgraph_matches_eager(shared):
    layer = _layer(shared)
    x = torch.randn(2, 5, 32)
    eager = layer(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), list(layer.parameters()))
    compiled = torch.compile(layer, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled.square().sum(), list(layer.parameters()))
    # The compiled router may fuse differently; the experts are the same ops.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6, msg="out")
    for (name, _), a, b in zip(layer.named_parameters(), compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_autocast_bf16_casts_like_a_matmul():
    layer = _layer(8)
    x = torch.randn(7, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert p.grad.abs().sum() > 0, name
    # Same as running the layer on bf16 copies of its weights, without autocast.
    bf16 = _layer(8).to(torch.bfloat16)
    bf16.router.to(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        topk_ids, topk_weights, _ = layer.route(x)
    want = megamoe.experts(x.bfloat16(), topk_ids, topk_weights, bf16.w_gate_up, bf16.w_down,
                           shared_gate_up=bf16.shared_gate_up, shared_down=bf16.shared_down,
                           config=megamoe.MoEConfig(backend="torch"))
    assert torch.equal(out, want), "autocast output differs from explicit bf16"


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_autocast_keeps_float64(backend):
    """float64 inputs under autocast stay float64, as a matmul's do (autocast casts only float32/float16/bfloat16):
    the same output, bit for bit, as without autocast."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32, generator=gen, dtype=torch.float64)
    topk_ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(7)])
    topk_weights = torch.rand(7, 2, generator=gen)
    weights = dict(w_gate_up=torch.randn(6, 48, 32, generator=gen, dtype=torch.float64) / 32**0.5,
                   w_down=torch.randn(6, 32, 24, generator=gen, dtype=torch.float64) / 24**0.5,
                   shared_gate_up=torch.randn(16, 32, generator=gen, dtype=torch.float64) / 32**0.5,
                   shared_down=torch.randn(32, 8, generator=gen, dtype=torch.float64) / 8**0.5)
    config = megamoe.MoEConfig(backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ weights["w_down"][0]).dtype == torch.float64  # what autocast does to a float64 matmul
        out = megamoe.experts(x, topk_ids, topk_weights, **weights, config=config)
    assert out.dtype == torch.float64
    want = megamoe.experts(x, topk_ids, topk_weights, **weights, config=config)
    assert torch.equal(out, want), "autocast changed a float64 call"


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("x_dtype, autocast_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_autocast_topk_weights_in_x_dtype(backend, x_dtype, autocast_dtype):
    """topk_weights in x's float16/bfloat16 (allowed beside x) under autocast to the other one: widened to float32
    (it used to be a TypeError, 'topk_weights must be float32 (or x's dtype <the autocast dtype>)'); the same bits
    as the explicit call, and its gradient in its own dtype."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 32, generator=gen).to(x_dtype)
    topk_ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(7)])
    topk_weights = torch.rand(7, 2, generator=gen).to(x_dtype).requires_grad_()
    w_gate_up = (torch.randn(6, 48, 32, generator=gen) / 32**0.5).to(x_dtype)
    w_down = (torch.randn(6, 32, 24, generator=gen) / 24**0.5).to(x_dtype)
    config = megamoe.MoEConfig(backend=backend)
    with torch.autocast("cpu", dtype=autocast_dtype):
        out = megamoe.experts(x, topk_ids, topk_weights, w_gate_up, w_down, config=config)
    want = megamoe.experts(x.to(autocast_dtype), topk_ids, topk_weights.detach().float(), w_gate_up.to(autocast_dtype),
                           w_down.to(autocast_dtype), config=config)
    assert out.dtype == autocast_dtype
    assert torch.equal(out, want), "autocast output differs from the explicit call"
    out.float().sum().backward()
    assert topk_weights.grad is not None and topk_weights.grad.dtype == x_dtype


def test_compile_dynamic_with_a_config_of_numbers():
    """torch.compile(dynamic=True) traces a module's and an argument's int and float attributes as symbols, a
    MoEConfig's too: a capacity_factor (and block_m, comm_timeout_ms) used to fail the trace (math.isfinite on a
    symbolic float in the config's validation; an unhashable symbol in the ops). Now the compiled layer and functional
    call give the eager results, and a changed config is honoured (a recompile: the tiny capacity overflows)."""
    torch.manual_seed(0)
    roomy = megamoe.MoEConfig(backend="torch", capacity_factor=4.0, block_m=16, comm_timeout_ms=1234)
    layer = megamoe.MoELayer(32, 24, 6, 2, config=roomy)
    x = torch.randn(400, 32)
    topk_ids, topk_weights, _ = layer.route(x)
    eager = layer(x)
    # The compiled router may fuse differently (as in test_compile_fullgraph_matches_eager); the experts are the same.
    torch.testing.assert_close(torch.compile(layer, dynamic=True, fullgraph=True)(x), eager, rtol=1e-5, atol=1e-6,
                               msg="layer")
    experts = torch.compile(megamoe.experts, dynamic=True, fullgraph=True)
    want = megamoe.experts(x, topk_ids, topk_weights, layer.w_gate_up, layer.w_down, config=roomy)
    assert torch.equal(experts(x, topk_ids, topk_weights, layer.w_gate_up, layer.w_down, config=roomy), want)
    # 400 tokens x 2 slots need 800 rows; a capacity of 0.25 gives ceil(200 / 16) + 6 experts = 19 blocks (304 rows).
    tiny = megamoe.MoEConfig(backend="torch", capacity_factor=0.25, block_m=16)
    with pytest.raises(megamoe.CapacityOverflowError):  # eager, then compiled
        megamoe.experts(x, topk_ids, topk_weights, layer.w_gate_up, layer.w_down, config=tiny)
    with pytest.raises(megamoe.CapacityOverflowError):
        experts(x, topk_ids, topk_weights, layer.w_gate_up, layer.w_down, config=tiny)


def test_compile_dynamic_with_a_config_built_in_the_trace():
    """A MoEConfig made inside the compiled code from a float the trace holds as a symbol (an argument under
    dynamic=True, or under automatic dynamic shapes once its value changed) failed to trace
    ("torch.* op returned non-Tensor": math.isfinite in the config's validation). Now it gives eager's bits, and a
    changed capacity_factor is honoured (a recompile: the tiny capacity overflows)."""
    torch.manual_seed(0)
    x, topk_ids, topk_weights = torch.randn(400, 32), torch.randint(0, 6, (400, 2)), torch.rand(400, 2)
    w_gate_up, w_down = torch.randn(6, 48, 32) / 32**0.5, torch.randn(6, 32, 24) / 24**0.5

    def f(x, capacity_factor):
        config = megamoe.MoEConfig(backend="torch", capacity_factor=capacity_factor)
        return megamoe.experts(x, topk_ids, topk_weights, w_gate_up, w_down, config=config)

    for dynamic in (True, None):
        torch._dynamo.reset()
        compiled = torch.compile(f, dynamic=dynamic, fullgraph=True)
        for capacity_factor in (4.0, 3.0):
            assert torch.equal(compiled(x, capacity_factor), f(x, capacity_factor)), (dynamic, capacity_factor)
        # 400 tokens x 2 slots need 800 rows; a capacity of 0.25 gives ceil(200 / 16) + 6 experts = 19 blocks.
        with pytest.raises(megamoe.CapacityOverflowError):
            compiled(x, 0.25)
