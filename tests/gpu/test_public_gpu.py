"""The public API on one GPU, as users call it, against the fp64 reference: megamoe.experts with the default
config (backend "auto": the fused Triton path through its custom ops, with the Triton placement kernels)
and megamoe.MoELayer.

Run on a CUDA machine: pytest -m gpu tests/gpu/test_public_gpu.py  (skipped without a GPU on which "auto"
picks the Triton path).

Per benchmarked workload (megamoe.bench.workloads.GPU_WORKLOADS: its H, I, k and shared expert, so the real
tile-table entries run) with T = 512 tokens and at most 16 experts (so that the fp64 reference of every
expert fits), weights and routing made as the bench makes them (megamoe.bench.problem, balanced and skewed
routing of megamoe.bench.routing): the output and every gradient (x, topk_weights, w_gate_up, w_down and
the shared expert's) within the error budget of docs/design.md (with conftest's one-ulp noise floor),
and a second run with the same bits. Also through the public path: topk_weights in bf16, the empty batch,
and backend "torch" (torch._grouped_mm) at two workloads; and MoELayer (router included) forward and backward at a
small size.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BF16_ULP, assert_close_budget

import megamoe
from megamoe.autograd import resolve_backend
from megamoe.bench.problem import Tokens, cast, forward_backward, make_tokens, make_weights
from megamoe.bench.routing import ROUTINGS
from megamoe.bench.workloads import GPU_WORKLOADS, WORKLOADS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPE = torch.bfloat16
NUM_TOKENS = 512
MAX_EXPERTS = 16


@pytest.fixture(autouse=True)
def auto_is_triton():
    x = torch.empty(1, 1, device="cuda", dtype=DTYPE)
    if resolve_backend(megamoe.MoEConfig(), x, None) != "triton":
        pytest.skip('backend "auto" does not pick the Triton path on this GPU')


def assert_within_budget(ours: dict, ref64: dict, ref_low: dict) -> None:
    assert list(ours) == list(ref64), f"results {list(ours)} != the reference's {list(ref64)}"
    for name, want in ref64.items():
        assert_close_budget(name, ours[name], want, ref_low[name], ulp=BF16_ULP)


def assert_same_bits(first: dict, second: dict) -> None:
    for name, a in first.items():
        assert torch.equal(a, second[name]), f"{name}: a second run differs bitwise"


def bench_problem(name: str, routing: str, num_tokens: int = NUM_TOKENS):
    w = WORKLOADS[name]
    num_experts = min(w.num_experts, MAX_EXPERTS)
    weights = make_weights(w, range(num_experts), DTYPE, torch.device("cuda"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    return weights, make_tokens(w, num_tokens, num_experts, routing, DTYPE, generator)


def check_public_experts(weights, tokens, config: megamoe.MoEConfig | None = None) -> None:
    ours = forward_backward(megamoe.experts, weights, tokens, config=config)
    again = forward_backward(megamoe.experts, weights, tokens, config=config)
    ref64 = forward_backward(megamoe.reference.experts, *cast(weights, tokens, torch.float64))
    ref_low = forward_backward(megamoe.reference.experts, *cast(weights, tokens, DTYPE))
    for name, leaf in (("out", tokens.x_TH), ("d_x", tokens.x_TH), ("d_topk_weights", tokens.topk_weights_TK)):
        assert ours[name].dtype == leaf.dtype, f"{name}: {ours[name].dtype}, expected {leaf.dtype}"
    assert_within_budget(ours, ref64, ref_low)
    assert_same_bits(ours, again)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("name", GPU_WORKLOADS)
def test_experts_matches_reference(name, routing):
    check_public_experts(*bench_problem(name, routing))


def test_experts_bf16_topk_weights():
    """topk_weights in x's dtype (accepted by megamoe.experts): within the budget of the reference run with the
    same bf16 weights, and d_topk_weights in bf16."""
    weights, tokens = bench_problem("qwen3-30b-a3b", "skewed")
    tokens = Tokens(tokens.x_TH, tokens.topk_ids_TK, tokens.topk_weights_TK.detach().to(DTYPE).requires_grad_(),
                    tokens.d_out_TH)
    ours = forward_backward(megamoe.experts, weights, tokens)
    assert ours["d_topk_weights"].dtype == DTYPE
    low = forward_backward(megamoe.reference.experts, weights, tokens)
    ref64 = forward_backward(megamoe.reference.experts, *cast(weights, tokens, torch.float64))
    assert_within_budget(ours, ref64, low)
    assert_same_bits(ours, forward_backward(megamoe.experts, weights, tokens))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])  # without and with a shared expert
def test_experts_empty_batch(name):
    """T = 0 (a rank with no tokens this step): an empty output and d_x, exact-zero weight gradients; and
    under torch.no_grad() (inference)."""
    weights, tokens = bench_problem(name, "balanced", num_tokens=0)
    ours = forward_backward(megamoe.experts, weights, tokens)
    assert ours["out"].shape == (0, tokens.x_TH.shape[1]) and ours["d_x"].shape == tokens.x_TH.shape
    assert ours["d_topk_weights"].shape == tokens.topk_weights_TK.shape
    for grad in ("d_w_gate_up", "d_w_down", "d_shared_gate_up", "d_shared_down"):
        if grad in ours:
            assert not ours[grad].any(), f"{grad}: not zero on an empty batch"
    with torch.no_grad():
        out = megamoe.experts(tokens.x_TH, tokens.topk_ids_TK, tokens.topk_weights_TK, weights.w_gate_up_E2IH,
                              weights.w_down_EHI, shared_gate_up=weights.shared_gate_up_2IH,
                              shared_down=weights.shared_down_HI)
    assert out.shape == (0, tokens.x_TH.shape[1])


def test_fwd_bwd_peak_memory_is_the_counted_one():
    """Peak memory above the inputs of one fwd+bwd through megamoe.experts (qwen3-30b-a3b's H, I, k; 16
    experts, 4096 tokens) is at most what the fused path's design counts at its largest moment, dw_gate_up:
    the weight gradients, x_rows [R, H], d_gate_up [R, 2I], out and d_x [T, H], plus 2% for the schedule.
    Fails if the saved gate_up is held to the end of the backward or autograd makes up zero gradients for
    the op's non-differentiable outputs (each another [R, 2I])."""
    from megamoe.backends.triton import block_m_for
    from megamoe.schedule import receive_rows

    name, num_tokens = "qwen3-30b-a3b", 4096
    weights, tokens = bench_problem(name, "balanced", num_tokens=num_tokens)
    forward_backward(megamoe.experts, weights, tokens)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    inputs = torch.cuda.memory_allocated()
    forward_backward(megamoe.experts, weights, tokens)
    peak = torch.cuda.max_memory_allocated() - inputs
    w, num_experts, two = WORKLOADS[name], weights.w_down_EHI.shape[0], DTYPE.itemsize
    rows = receive_rows(num_tokens, w.top_k, num_experts, 1, block_m_for(w.hidden, w.intermediate, DTYPE), None)
    counted = two * (3 * num_experts * w.intermediate * w.hidden + rows * (w.hidden + 2 * w.intermediate)
                     + 2 * num_tokens * w.hidden)
    assert peak <= 1.02 * counted, f"peak {peak / 2**20:.1f} MiB above the inputs > counted {counted / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------------------
# MoELayer


def layer_reference(layer: megamoe.MoELayer, x: torch.Tensor, topk_ids: torch.Tensor, d_out: torch.Tensor,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's math in dtype with its routing choice (topk_ids) fixed: softmax router scores in fp32 (fp64
    for fp64), the k chosen renormalised, then megamoe.reference.experts; out and the gradient of <out, d_out>
    with respect to x and every parameter."""
    params = {name: p.detach().to(dtype).requires_grad_() for name, p in layer.named_parameters()}
    x = x.detach().to(dtype).requires_grad_()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scores = torch.softmax((x @ params["router.weight"].t()).to(acc), -1)
    topk_weights = scores.gather(1, topk_ids)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    out = megamoe.reference.experts(x, topk_ids, topk_weights, params["w_gate_up"], params["w_down"],
                                    shared_gate_up=params.get("shared_gate_up"), shared_down=params.get("shared_down"))
    grads = torch.autograd.grad(out, [x, *params.values()], d_out.to(dtype))
    return {"out": out.detach(), **{f"d_{name}": g for name, g in zip(["x", *params], grads)}}


def layer_run(layer: megamoe.MoELayer, x: torch.Tensor, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    names = [name for name, _ in layer.named_parameters()]
    grads = torch.autograd.grad(out, [x, *layer.parameters()], d_out)
    return {"out": out.detach(), **{f"d_{name}": g for name, g in zip(["x", *names], grads)}}


def test_layer_matches_reference():
    """MoELayer (router, routed experts, shared expert) in bf16: out and the gradient of x and of every parameter,
    the router's included, against the layer's math in fp64 on the same routing; a second run has the same bits."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(512, 256, 16, 4, shared_intermediate_size=128, device="cuda", dtype=DTYPE)
    x = torch.randn(300, 512, device="cuda", dtype=DTYPE)
    d_out = torch.randn_like(x)
    topk_ids = layer.route(x)[0]
    ours = layer_run(layer, x, d_out)
    assert torch.equal(layer.route(x)[0], topk_ids), "the router chose other experts than in the layer's run"
    assert_within_budget(ours, layer_reference(layer, x, topk_ids, d_out, torch.float64),
                         layer_reference(layer, x, topk_ids, d_out, DTYPE))
    assert_same_bits(ours, layer_run(layer, x, d_out))


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recompute"])
def test_x_at_an_unaligned_base(auto_is_triton, recompute):
    """A contiguous x whose base is 2 bytes off 16-byte alignment (a view at an odd offset of a larger buffer), H a
    multiple of 8 and <= 2048 (gate_up_fwd gathers x in its loads; with recompute dw_gate_up too): the same bits
    as an aligned copy of x, not the launchers' TMA ValueError."""
    torch.manual_seed(0)
    T, H, I, E, k = 300, 256, 128, 8, 2
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=dt)
    unaligned = torch.empty(T * H + 1, device=dev, dtype=dt)[1:].view(T, H)
    unaligned.copy_(x)
    assert unaligned.is_contiguous() and unaligned.data_ptr() % 16
    ids = torch.randint(0, E, (T, k), device=dev)
    weights = torch.rand(T, k, device=dev)
    wgu = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).to(dt)
    wd = (torch.randn(E, H, I, device=dev) / I**0.5).to(dt)
    config = megamoe.MoEConfig(backend="triton", recompute=recompute)

    def run(x_in):  # x_in itself (a clone would be aligned), without grad: d_w_gate_up reads it
        leaves = [t.detach().clone().requires_grad_() for t in (weights, wgu, wd)]
        out = megamoe.experts(x_in, ids, *leaves, config=config)
        out.float().square().sum().backward()
        return [out, *(t.grad for t in leaves)]

    for name, a, b in zip(["out", "d_topk_weights", "d_w_gate_up", "d_w_down"], run(x), run(unaligned)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_torch_backend_matches_reference_and_repeats_its_bits(name):
    """backend "torch" on the GPU (torch._grouped_mm, whose fixed reduction order (no split-K varying run to run) the
    torch path's determinism rests on), with and without a shared expert: within the error budget of the fp64
    reference, and a second run with the same bits."""
    check_public_experts(*bench_problem(name, "balanced"), config=megamoe.MoEConfig(backend="torch"))


def test_torch_backend_at_unaligned_bases():
    """backend "torch" on the GPU (torch._grouped_mm, which needs 16-byte-aligned bases off the CPU) with x and both
    weights 2 bytes off alignment (views at an odd offset of larger buffers): the same bits as on aligned copies,
    not torch's "expected data_ptr to be aligned to 16 bytes"."""
    torch.manual_seed(0)
    T, H, I, E, k = 300, 256, 128, 8, 2
    dev, dt = "cuda", torch.bfloat16

    def unaligned(t):
        view = torch.empty(t.numel() + 1, device=dev, dtype=dt)[1:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 16
        return view

    x = torch.randn(T, H, device=dev, dtype=dt)
    ids = torch.randint(0, E, (T, k), device=dev)
    weights = torch.rand(T, k, device=dev)
    wgu = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).to(dt)
    wd = (torch.randn(E, H, I, device=dev) / I**0.5).to(dt)
    config = megamoe.MoEConfig(backend="torch")

    def run(x_in, wgu_in, wd_in):  # the views themselves are the leaves: a clone would be aligned
        leaves = [t.requires_grad_() for t in (x_in, weights.clone(), wgu_in, wd_in)]
        out = megamoe.experts(leaves[0], ids, *leaves[1:], config=config)
        out.float().square().sum().backward()
        return [out, *(t.grad for t in leaves)]

    offset = [unaligned(t) for t in (x, wgu, wd)]  # before x, wgu, wd become leaves that require grad
    names = ["out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down"]
    for name, a, b in zip(names, run(x, wgu, wd), run(*offset)):
        assert torch.equal(a, b), name
