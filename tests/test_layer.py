"""MoELayer: routing by hand, tokens_per_expert, the Switch aux loss, and the layer against the reference
experts on the same routing (forward and every gradient, the router's included)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import megamoe
from megamoe import MoEConfig, MoELayer
from conftest import assert_close_budget, assert_close_tight, assert_equal

H, I, E, K = 12, 8, 6, 2


def make_layer(gen, *, hidden=H, inter=I, num_experts=E, top_k=K, shared=0, score_func="softmax", norm=True,
               dtype=torch.float64, config=None) -> MoELayer:
    layer = MoELayer(hidden, inter, num_experts, top_k, shared_intermediate_size=shared, score_func=score_func,
                     norm_topk_prob=norm, config=config, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():  # from the test's generator, not the global RNG
            p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(p.shape[-1]))
    return layer


def hand_route(layer: MoELayer, x_TH: torch.Tensor):
    """(ids [T,k], weights [T,k], probs [T,E]) in fp64 by plain loops over tokens."""
    logits = x_TH.double() @ layer.router.weight.double().t()
    ids, weights, probs = [], [], []
    for row in logits.tolist():
        if layer.score_func == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        # By logit: the order of the scores (both score functions increase), also where scores saturate to ties.
        order = sorted(range(len(row)), key=lambda e: -row[e])[: layer.top_k]
        w = [scores[e] for e in order]
        if layer.norm_topk_prob:
            w = [v / sum(w) for v in w]
        ids.append(order)
        weights.append(w)
        probs.append([s / sum(scores) for s in scores])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64), torch.tensor(probs, dtype=torch.float64)


def route_math(layer: MoELayer, x_TH: torch.Tensor):
    """The router written independently of MoELayer.route (differentiable): fp32 scores (fp64 in a float64 layer),
    top-k by a stable descending sort, optional renormalisation of the k weights."""
    logits = x_TH @ layer.router.weight.t()
    if logits.dtype != torch.float64:
        logits = logits.float()
    scores = torch.softmax(logits, -1) if layer.score_func == "softmax" else torch.sigmoid(logits)
    ids = torch.argsort(scores, dim=-1, descending=True, stable=True)[:, : layer.top_k]
    weights = scores.gather(1, ids)
    if layer.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def reference_layer(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's math with megamoe.reference.experts, through an independent differentiable router."""
    x_TH = x.reshape(-1, layer.hidden_size)
    ids, weights = route_math(layer, x_TH)
    out = megamoe.reference.experts(x_TH, ids, weights, layer.w_gate_up, layer.w_down,
                                    shared_gate_up=layer.shared_gate_up, shared_down=layer.shared_down)
    return out.view_as(x)


def forward_backward(layer: MoELayer, x: torch.Tensor, d_out: torch.Tensor, fn=None):
    """out and the gradients of <out, d_out> w.r.t. x and every parameter (by name)."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = (layer(x) if fn is None else fn(layer, x))
    names = [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad(out, [x, *layer.parameters()], d_out, allow_unused=True)
    return out.detach(), dict(zip(["x", *names], grads))


CONFIGS = list(itertools.product(["softmax", "sigmoid"], [True, False], [0, 4]))
CONFIG_IDS = [f"{s}-{'norm' if n else 'nonorm'}-shared{sh}" for s, n, sh in CONFIGS]
SHAPES = pytest.mark.parametrize("x_shape", [(2, 5, H), (7, H)], ids=["BSH-2x5", "TH-7"])


@SHAPES
@pytest.mark.parametrize("score_func,norm,shared", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference_on_same_routing(rng, x_shape, score_func, norm, shared):
    layer = make_layer(rng, shared=shared, score_func=score_func, norm=norm)
    x = torch.randn(x_shape, generator=rng, dtype=torch.float64)
    d_out = torch.randn(x_shape, generator=rng, dtype=torch.float64)
    out, grads = forward_backward(layer, x, d_out)
    ref_out, ref_grads = forward_backward(layer, x, d_out, fn=reference_layer)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close_tight("out", out, ref_out, 1e-12)
    for name, ref in ref_grads.items():
        assert grads[name] is not None, f"d_{name}: no gradient"
        assert_close_tight(f"d_{name}", grads[name], ref, 1e-10)


@pytest.mark.parametrize("score_func,norm,shared", CONFIGS, ids=CONFIG_IDS)
def test_gradients_reach_every_parameter(rng, score_func, norm, shared):
    layer = make_layer(rng, shared=shared, score_func=score_func, norm=norm)
    x = torch.randn(9, H, generator=rng, dtype=torch.float64, requires_grad=True)
    (layer(x) * torch.randn(9, H, generator=rng, dtype=torch.float64)).sum().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None, f"d_{name}: no gradient"
        assert torch.isfinite(p.grad).all(), f"d_{name}: non-finite gradient"
        assert p.grad.abs().sum() > 0, f"d_{name}: all-zero gradient"
    assert (layer.shared_gate_up is not None) == (shared > 0)


@pytest.mark.parametrize("score_func,norm,shared", CONFIGS[:4], ids=CONFIG_IDS[:4])
def test_routing_by_hand(rng, score_func, norm, shared):
    layer = make_layer(rng, shared=shared, score_func=score_func, norm=norm)
    x = torch.randn(11, H, generator=rng, dtype=torch.float64)
    ids, weights, probs = layer.route(x)
    hand_ids, hand_weights, hand_probs = hand_route(layer, x)
    assert_equal("topk_ids", ids.long(), hand_ids)
    assert weights.dtype == torch.float64 and probs.dtype == torch.float64  # a float64 layer keeps its precision
    assert_close_tight("topk_weights", weights, hand_weights, 1e-12)
    assert_close_tight("probs", probs, hand_probs, 1e-12)
    if norm:
        assert_close_tight("sum of topk_weights", weights.sum(-1), torch.ones(11, dtype=torch.float64), 1e-12)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_routing_where_fp32_scores_saturate(score_func):
    """Logits far from 0, where fp32 scores saturate into ties (sigmoid: 1.0 above a logit of about 17, 0.0 below
    about -104; softmax: 0.0 more than about 104 below the largest): the top k are still the experts of the k
    largest logits, and the renormalised weights, the aux loss's probabilities, the aux loss and the output stay
    finite, as the fp64 math by hand. Before, top-k among the ties took the experts of the smallest logits, and a
    sigmoid router whose logits all underflowed divided 0 by 0 (NaN weights, output and aux_loss)."""
    layer = MoELayer(H, I, 4, 2, score_func=score_func, dtype=torch.float32)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.tensor([-10.0, -20.0, -20.25, -20.5])  # logits exact in fp32
    x = torch.zeros(3, H)
    x[:, 0] = torch.tensor([20.0, -20.0, 0.5])  # logits -200 to -410, 200 to 410, and ordinary ones
    ids, weights, probs = layer.route(x)
    hand_ids, hand_weights, hand_probs = hand_route(layer, x)
    assert_equal("topk_ids", ids, hand_ids)
    assert_close_tight("topk_weights", weights.double(), hand_weights, 1e-6)
    assert_close_tight("probs", probs.double(), hand_probs, 1e-6)
    out = layer(x)
    assert torch.isfinite(out).all(), f"out: non-finite {out}"
    counts = torch.bincount(hand_ids.reshape(-1), minlength=4).double()
    hand_aux = 4 * (counts / hand_ids.numel() * hand_probs.mean(0)).sum()
    assert_close_tight("aux_loss", layer.aux_loss.detach().double(), hand_aux, 1e-6)


@SHAPES
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_tokens_per_expert_and_aux_loss(rng, x_shape, score_func):
    """tokens_per_expert is the brute-force count; aux_loss = E * sum_e f_e * P_e (Switch Transformer),
    differentiable with respect to the router weight with the hand formula's gradient."""
    layer = make_layer(rng, score_func=score_func)
    x = torch.randn(x_shape, generator=rng, dtype=torch.float64)
    layer(x)
    x_TH = x.reshape(-1, H)
    num_tokens = x_TH.shape[0]
    ids, _, _ = hand_route(layer, x_TH)
    counts = [0] * E
    for t in range(num_tokens):
        for j in range(K):
            counts[int(ids[t, j])] += 1
    assert_equal("tokens_per_expert", layer.tokens_per_expert, torch.tensor(counts, dtype=torch.int32))
    assert int(layer.tokens_per_expert.sum()) == num_tokens * K

    weight = layer.router.weight.detach().clone().requires_grad_()
    logits = x_TH @ weight.t()
    scores = torch.softmax(logits, -1) if score_func == "softmax" else torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    hand = sum(E * counts[e] / (num_tokens * K) * probs[:, e].mean() for e in range(E))
    assert layer.aux_loss.dim() == 0
    assert_close_tight("aux_loss", layer.aux_loss.detach(), hand.detach(), 1e-12)

    (d_router,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)
    (hand_d_router,) = torch.autograd.grad(hand, weight)
    assert d_router.abs().sum() > 0, "aux_loss has no gradient w.r.t. router.weight"
    assert_close_tight("d aux_loss / d router.weight", d_router, hand_d_router, 1e-12)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_float64_layer_passes_gradcheck(rng, backend, score_func):
    """A float64 layer routes in float64 (not through fp32 scores), so torch.autograd.gradcheck of the whole layer,
    aux loss included, holds: with respect to x and the router weight (the experts' are linear in the routing)."""
    layer = make_layer(rng, shared=4, score_func=score_func, config=MoEConfig(backend=backend))
    x = torch.randn(5, H, generator=rng, dtype=torch.float64, requires_grad=True)

    def run(x, router_weight):
        out = torch.func.functional_call(layer, {"router.weight": router_weight}, (x,))
        return out, layer.aux_loss

    assert torch.autograd.gradcheck(run, (x, layer.router.weight.detach().clone().requires_grad_()))


def test_batched_and_flat_inputs_agree(rng):
    layer = make_layer(rng, shared=4)
    x = torch.randn(3, 4, H, generator=rng, dtype=torch.float64)
    out_bsh, out_th = layer(x), layer(x.reshape(12, H))
    assert out_bsh.shape == (3, 4, H)
    assert_equal("out", out_bsh.reshape(12, H), out_th)


def test_reference_and_torch_backends_agree(rng):
    x = torch.randn(10, H, generator=rng, dtype=torch.float64)
    state = make_layer(rng, shared=4).state_dict()
    outs = {}
    for backend in ("reference", "torch"):
        layer = make_layer(rng, shared=4, config=MoEConfig(backend=backend))
        layer.load_state_dict(state)
        outs[backend] = layer(x)
    assert_close_tight("out", outs["torch"], outs["reference"], 1e-12)


def test_parameter_shapes(rng):
    layer = make_layer(rng, shared=5)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "router.weight": (E, H), "w_gate_up": (E, 2 * I, H), "w_down": (E, H, I),
        "shared_gate_up": (10, H), "shared_down": (H, 5),
    }
    assert layer.num_local_experts == E
    assert layer.tokens_per_expert.shape == (E,) and layer.tokens_per_expert.dtype == torch.int32
    assert "tokens_per_expert" not in layer.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_layer(rng, dtype):
    """A bf16/fp32 layer: output in its dtype, within the error budget of the fp64 math on the same routing."""
    layer = make_layer(rng, hidden=32, inter=16, shared=8, dtype=dtype)
    x = torch.randn(24, 32, generator=rng, dtype=torch.float64).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    ids, weights, _ = layer.route(x)
    args = [layer.w_gate_up, layer.w_down]
    shared = {"shared_gate_up": layer.shared_gate_up, "shared_down": layer.shared_down}
    with torch.no_grad():
        ref64 = megamoe.reference.experts(x.double(), ids, weights.double(), *[a.double() for a in args],
                                          **{k: v.double() for k, v in shared.items()})
        ref_low = megamoe.reference.experts(x, ids, weights, *args, **shared)
    if dtype == torch.float32:
        assert_close_tight("out", out.detach(), ref64, 1e-5)
    else:
        assert_close_budget("out", out.detach(), ref64, ref_low)


def test_router_kept_in_fp32_in_a_bf16_layer(rng):
    """A common recipe keeps the router in fp32 (layer.router.float()): the router runs in its own dtype (x cast
    to it), routing from fp32 logits; the experts stay bf16. Before: F.linear's RuntimeError (bf16 != float)."""
    layer = make_layer(rng, hidden=32, inter=16, shared=8, dtype=torch.bfloat16)
    layer.router.float()
    x = torch.randn(24, 32, generator=rng).bfloat16().requires_grad_()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    ids, weights, _ = layer.route(x)
    logits = layer.router(x.detach().float())
    assert torch.equal(ids, torch.topk(torch.softmax(logits, -1), layer.top_k, dim=-1).indices)
    (out.float().sum() + layer.aux_loss).backward()
    assert x.grad.dtype == torch.bfloat16 and layer.router.weight.grad.dtype == torch.float32


def test_experts_follow_x_when_only_they_are_fp32(rng):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) with the experts in ignored_params (megamoe.parallel's
    expert-parallel recipe) hands the layer a bf16 x, a bf16 router and shared expert, and the fp32 experts: the
    experts are cast for the call, as autocast casts them (the same bits as the fp32 layer under autocast), and
    their gradients arrive in fp32. Before: "x must have the layer's dtype torch.float32" at the first forward."""
    layer = make_layer(rng, hidden=32, inter=16, shared=8, dtype=torch.float32)
    x = torch.randn(24, 32, generator=rng)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        (want.float().square().sum() + layer.aux_loss).backward()
    want_grads = {n: p.grad for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    # What FSDP2 does to the parameters it manages, for the forward; the experts stay fp32.
    layer.router.bfloat16()
    layer.shared_gate_up.data, layer.shared_down.data = layer.shared_gate_up.bfloat16(), layer.shared_down.bfloat16()
    out = layer(x.bfloat16())
    (out.float().square().sum() + layer.aux_loss).backward()
    assert_equal("out", out, want)
    for name, p in layer.named_parameters():
        assert p.grad.dtype == p.dtype, name
        assert_equal(f"d_{name}", p.grad.float(), want_grads[name])
    assert layer.w_gate_up.dtype == layer.w_down.dtype == torch.float32
    # Only the experts follow: a bf16 x beside an fp32 router is still the TypeError naming the layer's dtype.
    layer.router.float()
    with pytest.raises(TypeError, match="x must have the layer's dtype torch.float32"):
        layer(x.bfloat16())


def test_fp32_x_beside_an_fp32_router_in_a_bf16_layer_is_an_error(rng):
    """The router kept in fp32 in a bf16 layer without a shared expert (test_router_kept_in_fp32_in_a_bf16_layer):
    an fp32 x is then in the dtype of every parameter but the experts, yet it is a mistake, not FSDP2's mixed
    precision (which hands a narrower x to fp32 experts): the TypeError naming the layer's dtype, not the bf16
    experts silently run in fp32 (an fp32 output, and fp32 copies of the experts held for the backward)."""
    layer = make_layer(rng, hidden=32, inter=16, shared=0, dtype=torch.bfloat16)
    layer.router.float()
    with pytest.raises(TypeError, match="x must have the layer's dtype torch.bfloat16"):
        layer(torch.randn(24, 32, generator=rng))


@pytest.mark.parametrize("x_shape", [(0, H), (2, 0, H)], ids=["T0", "B2-S0"])
def test_empty_batch(rng, x_shape):
    """No tokens: an empty output, zero counts and aux_loss exactly 0 (not 0 * NaN from a mean over no rows);
    backward through both gives finite (zero) gradients."""
    layer = make_layer(rng, shared=4)
    x = torch.zeros(x_shape, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    assert_equal("tokens_per_expert", layer.tokens_per_expert, torch.zeros(E, dtype=torch.int32))
    assert layer.aux_loss.dim() == 0 and float(layer.aux_loss.detach()) == 0.0, f"aux_loss = {layer.aux_loss}"
    (out.sum() + layer.aux_loss).backward()
    for name, p in layer.named_parameters():
        assert p.grad is None or torch.equal(p.grad, torch.zeros_like(p)), f"d_{name} not zero"


@pytest.mark.parametrize(
    "make_x,error,words",
    [
        (lambda: [[0.0] * H], TypeError, "torch.Tensor"),
        (lambda: torch.tensor(1.0, dtype=torch.float64), ValueError, "shape ()"),
        (lambda: torch.zeros(3, H + 1, dtype=torch.float64), ValueError, f"H={H}"),
        (lambda: torch.zeros(3, H, dtype=torch.float32), TypeError, "dtype torch.float64"),
        (lambda: torch.zeros(3, H, dtype=torch.float64, device="meta"), ValueError, "device cpu"),
    ],
    ids=["list", "0-d", "wrong-H", "wrong-dtype", "wrong-device"],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(rng, make_x, error, words):
    """forward's x: a TypeError / ValueError saying what was given and what the layer takes (not torch's own
    error from inside the router), and the layer's last routing statistics left as they were."""
    layer = make_layer(rng)
    layer(torch.rand(4, H, generator=rng, dtype=torch.float64))
    before = layer.tokens_per_expert.clone(), layer.aux_loss
    with pytest.raises(error) as info:
        layer(make_x())
    assert words in str(info.value), info.value
    assert_equal("tokens_per_expert", layer.tokens_per_expert, before[0])
    assert layer.aux_loss is before[1]


def test_capacity_overflow_changes_nothing(rng):
    """A call rejected inside megamoe.experts (here a capacity overflow, raised at once on the CPU) leaves the
    previous call's tokens_per_expert and aux_loss in place."""
    layer = make_layer(rng, config=MoEConfig(backend="torch", capacity_factor=0.01))
    before = layer.tokens_per_expert.clone(), layer.aux_loss
    with pytest.raises(megamoe.CapacityOverflowError):
        layer(torch.rand(64, H, generator=rng, dtype=torch.float64))
    assert_equal("tokens_per_expert", layer.tokens_per_expert, before[0])
    assert layer.aux_loss is before[1]


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn, torch.complex64], ids=str)
def test_dtype_the_experts_do_not_run_is_rejected(dtype):
    """A dtype forward could never take (x must be float16, bfloat16, float32 or float64): a TypeError naming it
    at construction. Before, float8 passed the floating-point check and failed in torch's uniform_ with a
    NotImplementedError ("check_uniform_bounds" not implemented for 'Float8_e4m3fn')."""
    with pytest.raises(TypeError, match=rf"\bdtype\b.*float64.*{dtype}"):
        MoELayer(H, I, E, K, dtype=dtype)


def test_repr_names_what_tells_layers_apart():
    """Layers that differ in their shared expert, top-k normalisation or config print differently."""
    plain = repr(MoELayer(16, 8, 4, 2))
    shared = repr(MoELayer(16, 8, 4, 2, shared_intermediate_size=8, norm_topk_prob=False))
    configured = repr(MoELayer(16, 8, 4, 2, config=MoEConfig(backend="torch", recompute=True)))
    assert "shared_intermediate_size=0" in plain and "norm_topk_prob=True" in plain, plain
    assert "config=" not in plain, plain
    assert "shared_intermediate_size=8" in shared and "norm_topk_prob=False" in shared, shared
    assert "config=MoEConfig(backend='torch'," in configured and "recompute=True)" in configured, configured

