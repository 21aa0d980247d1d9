"""MoELayer on one Hopper GPU: the fused path with no setting, torch.compile(fullgraph=True), autocast."""

import importlib
import pkgutil

import pytest
import torch
from triton.runtime.jit import JITFunction

import megamoe
from megamoe.autograd import resolve_backend
from megamoe.backends.triton import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a CUDA GPU of sm_90+"
    ),
]


def _layer(shared=0, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return megamoe.MoELayer(512, 256, 16, 4, shared_intermediate_size=shared, device="cuda", dtype=dtype)


def test_auto_picks_the_fused_path():
    layer = _layer()
    x = torch.randn(4, 100, 512, device="cuda", dtype=torch.bfloat16)
    assert resolve_backend(megamoe.MoEConfig(), x, None) == "triton"
    out = layer(x)
    out.float().square().sum().backward()
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert int(layer.tokens_per_expert.sum()) == 4 * 100 * 4


@pytest.mark.parametrize("shared, recompute", [(0, False), (128, False), (0, True)],
                         ids=["no-shared", "shared", "recompute"])
def test_compile_fullgraph_matches_eager(shared, recompute):
    """recompute: the forward keeps no gate_up ([0, 2I]) and the backward reruns gate_up_fwd, compiled as eager."""
    layer = _layer(shared)
    config = megamoe.MoEConfig(recompute=recompute)
    x = torch.randn(2, 333, 512, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn_like(x)
    # The router is computed once, outside both runs, so both see identical routing: the comparison is
    # then about the experts, which are the same custom ops compiled or not (bitwise).
    topk_ids, topk_weights, _ = layer.route(x.view(-1, 512))

    def experts(x_):
        return megamoe.experts(x_.view(-1, 512), topk_ids, topk_weights, layer.w_gate_up, layer.w_down,
                               shared_gate_up=layer.shared_gate_up, shared_down=layer.shared_down, config=config)

    params = [x.requires_grad_()] + [p for p in (layer.w_gate_up, layer.w_down, layer.shared_gate_up, layer.shared_down) if p is not None]
    eager = experts(x)
    eager_grads = torch.autograd.grad(eager, params, d_out.view(-1, 512))
    compiled = torch.compile(experts, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, params, d_out.view(-1, 512))
    assert torch.equal(compiled, eager), "out"
    for i, (a, b) in enumerate(zip(compiled_grads, eager_grads)):
        assert torch.equal(a, b), f"grad {i}"
    # And the whole layer (router included) compiles without graph breaks and trains.
    out = torch.compile(layer, fullgraph=True)(x.detach())
    out.float().square().sum().backward()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_fake_impl_gives_the_real_shapes(recompute):
    """torch.library.opcheck's fake-tensor check of experts_fwd on the fused path: every output's shape, dtype and
    strides as the real op gives them. With recompute the saved gate_up is [0, 2I] (the fake said [R, 2I])."""
    from megamoe.autograd import CONFIG_FIELDS

    layer = _layer()
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    topk_ids, topk_weights, _ = layer.route(x.detach())
    config = megamoe.MoEConfig(backend="triton", block_m=128, recompute=recompute)
    static = [getattr(config, name) for name in CONFIG_FIELDS]
    args = (x, topk_ids, topk_weights, layer.w_gate_up, layer.w_down, None, None, *static, None, True)
    torch.library.opcheck(torch.ops.megamoe.experts_fwd.default, args, test_utils=("test_faketensor",))


def test_autocast_fp32_weights():
    layer = _layer(128, dtype=torch.float32)
    x = torch.randn(300, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert layer.w_down.grad.dtype == torch.float32 and torch.isfinite(layer.w_down.grad).all()


def _compiled_binaries() -> int:
    """How many binaries megamoe's Triton and Gluon kernels have compiled in this process, over every device."""
    count = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                count += sum(len(kernel_cache) for kernel_cache, *_ in value.device_caches.values())
    return count


@pytest.mark.parametrize("shared", [0, 128], ids=["no-shared", "shared"])
def test_a_new_token_count_compiles_nothing(shared):
    """Training whose token count changes from step to step (packed sequences, a short last batch) compiles each
    kernel once per specialisation Triton makes of its integer arguments (divisible by 16 or not), never once per
    count: every size that follows T is a runtime argument."""
    layer = _layer(shared)

    def step(tokens):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        layer(x).float().square().sum().backward()

    for tokens in (1, 7, 16, 64, 100, 333, 1024, 1031):  # small and large, divisible by 16 and not
        step(tokens)
    compiled = _compiled_binaries()
    assert compiled > 0, "the fused path ran no megamoe kernel"
    for tokens in (2, 48, 95, 513, 777, 2000, 2048, 3001):
        step(tokens)
    assert _compiled_binaries() == compiled
