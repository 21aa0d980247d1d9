"""MoELayer and the custom ops against PyTorch's machinery: opcheck, dynamic shapes under torch.compile, the meta
device, deferred (meta) initialisation, copy.deepcopy."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import megamoe
from megamoe import autograd as A

T, H, I, E, K = 5, 32, 24, 6, 2
CONFIG = megamoe.MoEConfig(backend="torch")


def _inputs(gen, tokens=T, experts=E, dtype=torch.float32, shared=False):
    x = torch.randn(tokens, H, generator=gen, dtype=dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:K] for _ in range(tokens)]) if tokens else (
        torch.empty(0, K, dtype=torch.int64))
    w = torch.rand(tokens, K, generator=gen)
    wgu = torch.randn(experts, 2 * I, H, generator=gen, dtype=dtype) / H**0.5
    wd = torch.randn(experts, H, I, generator=gen, dtype=dtype) / I**0.5
    sgu = torch.randn(16, H, generator=gen, dtype=dtype) / H**0.5 if shared else None
    sd = torch.randn(H, 8, generator=gen, dtype=dtype) / 8**0.5 if shared else None
    return x, ids, w, wgu, wd, sgu, sd


def _static(block_m=16, capacity_factor=None):
    config = megamoe.MoEConfig(backend="torch", block_m=block_m, capacity_factor=capacity_factor)
    return [getattr(config, name) for name in A.CONFIG_FIELDS] + [None]


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared", "shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck_experts_ops(shared, dtype):
    """torch.library.opcheck on both ops: schema, autograd registration, fake tensors (contiguous inputs), and
    the AOT dispatcher with dynamic shapes for the inference forward (whose outputs are all defined)."""
    gen = torch.Generator().manual_seed(0)
    tensors = _inputs(gen, dtype=dtype, shared=shared)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    fwd = torch.ops.megamoe.experts_fwd.default
    torch.library.opcheck(fwd, (*tensors, *_static(), False), test_utils=utils + ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(fwd, (*tensors, *_static(), True), test_utils=utils)
    outs = fwd(*tensors, *_static(), True)
    n = len(A.SCHEDULE_TENSORS)
    d_out = torch.randn(T, H, generator=gen, dtype=dtype)
    bwd_args = (d_out, *tensors, list(outs[1:-n]), list(outs[-n:]), *_static(), A.ALL_GRADS_MASK)
    torch.library.opcheck(torch.ops.megamoe.experts_bwd.default, bwd_args, test_utils=utils + ("test_aot_dispatch_dynamic",))


@pytest.mark.parametrize("tokens, dtype, weights_in_x_dtype, capacity_factor, masks", [
    (0, torch.float32, False, None, (A.ALL_GRADS_MASK,)),  # the empty batch
    (T, torch.float16, True, None, (0b000001, 0b000010, 0b001100, 0b110000)),  # single gradients and pairs
    (T, torch.bfloat16, True, 2.0, (0b000010, 0b100001)),
], ids=["T0", "fp16-weights-in-x-dtype", "bf16-capacity"])
def test_opcheck_experts_ops_edge_cases(tokens, dtype, weights_in_x_dtype, capacity_factor, masks):
    """opcheck as above where the fake implementations take other branches: T = 0, topk_weights in x's dtype (its
    gradient's dtype), a capacity_factor (the schedule's rows), and backward masks asking for some gradients only."""
    gen = torch.Generator().manual_seed(3)
    x, ids, w, wgu, wd, sgu, sd = _inputs(gen, tokens=tokens, dtype=dtype, shared=True)
    tensors = (x, ids, w.to(dtype) if weights_in_x_dtype else w, wgu, wd, sgu, sd)
    static = _static(capacity_factor=capacity_factor)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    fwd = torch.ops.megamoe.experts_fwd.default
    torch.library.opcheck(fwd, (*tensors, *static, False), test_utils=utils + ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(fwd, (*tensors, *static, True), test_utils=utils)
    outs = fwd(*tensors, *static, True)
    n = len(A.SCHEDULE_TENSORS)
    d_out = torch.randn(tokens, H, generator=gen, dtype=dtype)
    for mask in masks:
        bwd_args = (d_out, *tensors, list(outs[1:-n]), list(outs[-n:]), *static, mask)
        torch.library.opcheck(torch.ops.megamoe.experts_bwd.default, bwd_args,
                              test_utils=utils + ("test_aot_dispatch_dynamic",))


def test_fake_impls_match_real_strides_for_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(1)
    x, ids, w, wgu, wd, _, _ = _inputs(gen)
    x_t = x.t().contiguous().t()  # [T, H], column-major
    torch.library.opcheck(torch.ops.megamoe.experts_fwd.default, (x_t, ids, w, wgu, wd, None, None, *_static(), False),
                          test_utils="test_faketensor")
    outs = torch.ops.megamoe.experts_fwd(x, ids, w, wgu, wd, None, None, *_static(), True)
    n = len(A.SCHEDULE_TENSORS)
    wgu_t = wgu.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(
        torch.ops.megamoe.experts_bwd.default,
        (torch.randn(T, H, generator=gen), x, ids, w, wgu_t, wd, None, None, list(outs[1:-n]), list(outs[-n:]),
         *_static(), A.ALL_GRADS_MASK),
        test_utils="test_faketensor",
    )


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compile_with_symbolic_expert_count(dynamic):
    """A compiled megamoe.experts with symbolic T and E (dynamic=True, or automatic dynamic shapes on the second
    call): the fake implementation takes a SymInt expert count; the same bits as eager."""
    torch._dynamo.reset()

    def f(x, ids, w, wgu, wd):
        return megamoe.experts(x, ids, w, wgu, wd, config=CONFIG)

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(2)
    for tokens, experts in ((5, 6), (7, 8), (9, 4)):
        x, ids, w, wgu, wd, _, _ = _inputs(gen, tokens=tokens, experts=experts)
        leaves = [t.requires_grad_() for t in (x, wgu, wd)]
        out = compiled(x, ids, w, wgu, wd)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        want = f(x, ids, w, wgu, wd)
        want_grads = torch.autograd.grad(want.square().sum(), leaves)
        assert torch.equal(out, want)
        for a, b in zip(grads, want_grads):
            assert torch.equal(a, b)


def test_compile_marked_dynamic_token_count_is_one_graph():
    """torch._dynamo.mark_dynamic on the token count, first called with T * k < E: one graph for every T >= 2 (T * k
    below and above E), eager's bits. The worst-case receive rows took min(E_local, T * k), a guard on T: T = 2 was
    then a constant, so the first call failed ("You marked L['x'].size()[0] as dynamic but your code specialized it
    to be a constant (2)"), and without mark_dynamic T * k >= E recompiled."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def f(x, ids, w, wgu, wd):
        return megamoe.experts(x, ids, w, wgu, wd, config=CONFIG)

    compiled = torch.compile(f, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    for tokens in (2, 5, 9):  # 2 * K = 4 < E = 6 <= 5 * K
        x, ids, w, wgu, wd, _, _ = _inputs(gen, tokens=tokens)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(w, 0)
        assert torch.equal(compiled(x, ids, w, wgu, wd), f(x, ids, w, wgu, wd)), tokens
    assert counter.frame_count == 1


def test_layer_runs_on_meta():
    layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG, device="meta")
    x = torch.randn(2, 3, H, device="meta")
    y = layer(x)
    assert y.shape == x.shape and y.device.type == "meta"
    (y.sum() + layer.aux_loss).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name


def test_meta_init_then_reset_matches_direct_init():
    """to_empty + reset_parameters under a seed gives the parameters direct construction gives under it (as for
    torch's own layers), and a tokens_per_expert of zeros."""
    kwargs = dict(shared_intermediate_size=8, config=CONFIG)
    torch.manual_seed(0)
    direct = megamoe.MoELayer(H, I, E, K, **kwargs)
    deferred = megamoe.MoELayer(H, I, E, K, device="meta", **kwargs).to_empty(device="cpu")
    torch.manual_seed(0)
    deferred.reset_parameters()
    for (name, a), (_, b) in zip(direct.named_parameters(), deferred.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(deferred.tokens_per_expert, torch.zeros(E, dtype=torch.int32))
    assert direct.router.weight.device.type == "cpu"
    with torch.device("meta"):
        assert megamoe.MoELayer(H, I, E, K).router.weight.device.type == "meta"


@pytest.mark.parametrize("recipe", ["assign", "to_empty"])
def test_meta_init_then_load_state_dict(recipe):
    """torch's fast-load recipes: built on meta, then load_state_dict(assign=True) (and .to()), or to_empty +
    load_state_dict. The source's outputs, and tokens_per_expert zeros on the weights' device: the non-persistent
    buffer was left on meta (.to() failed: "Cannot copy out of meta tensor") or uninitialised."""
    kwargs = dict(shared_intermediate_size=8, config=CONFIG)
    torch.manual_seed(0)
    source = megamoe.MoELayer(H, I, E, K, **kwargs)
    with torch.device("meta"):
        layer = megamoe.MoELayer(H, I, E, K, **kwargs)
    if recipe == "assign":
        layer.load_state_dict(source.state_dict(), assign=True)
        layer.to("cpu")
    else:
        layer.to_empty(device="cpu")
        layer.tokens_per_expert.fill_(-1)  # what uninitialised memory may hold
        layer.load_state_dict(source.state_dict())
    assert torch.equal(layer.tokens_per_expert, torch.zeros(E, dtype=torch.int32))
    x = torch.randn(T, H)
    assert torch.equal(layer(x), source(x))
    assert torch.equal(layer.tokens_per_expert, source.tokens_per_expert)


def test_exported_model_updates_tokens_per_expert():
    """torch.export's module (non-strict, torch's default) of a model holding MoELayer gives the model's output and
    updates the layer's tokens_per_expert buffer, as the README says (was: zeros forever below the root module: the
    forward's new tensor in the buffer's place was not carried into the export)."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), layer)
    x = torch.randn(2, 3, H)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*aux_loss was assigned during export")
        exported = torch.export.export(model, (x,)).module()
    for x in (x, torch.randn(2, 3, H)):
        assert torch.equal(exported(x), model(x))
        assert torch.equal(exported.get_buffer("1.tokens_per_expert"), layer.tokens_per_expert)
        assert int(layer.tokens_per_expert.sum()) == 2 * 3 * K


def test_deepcopy_after_training_forward():
    torch.manual_seed(0)
    layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)
    x = torch.randn(T, H)
    (layer(x).square().sum() + 0.01 * layer.aux_loss).backward()
    copied = copy.deepcopy(layer)
    assert copied.aux_loss is None and layer.aux_loss is not None
    for (name, a), (_, b) in zip(layer.named_parameters(), copied.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(copied(x), layer(x))
    assert torch.equal(copied.aux_loss, layer.aux_loss)


class _Doubled(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


@pytest.mark.parametrize("how", ["module", "weight_norm"])
def test_deepcopy_of_parametrized_layer(how):
    """copy.deepcopy of a layer with a parametrized w_gate_up (as of an nn.Linear with one): torch.nn.utils.parametrize
    makes __getstate__ raise, which MoELayer.__deepcopy__ called ("Serialization of parametrized modules is only
    supported through state_dict()"). The copy computes the same output, and its gradients reach its own original."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)
    if how == "module":
        parametrize.register_parametrization(layer, "w_gate_up", _Doubled())
    else:
        parametrizations.weight_norm(layer, "w_gate_up")
    copied = copy.deepcopy(layer)
    x = torch.randn(T, H)
    assert torch.equal(copied(x), layer(x))
    originals = [dict(m.parametrizations.w_gate_up.named_parameters()) for m in (layer, copied)]
    assert originals[0].keys() == originals[1].keys()
    for name, original in originals[1].items():
        assert original is not originals[0][name], name
    copied(x).square().sum().backward()
    for name, original in originals[1].items():
        assert original.grad is not None and original.grad.abs().sum() > 0, name
        assert originals[0][name].grad is None, name


class _Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return w


def test_forward_computes_each_parametrized_weight_once():
    """A parametrized weight is computed at every read of it: forward reads each once (the input checks, the router
    and the experts used to read w_gate_up, router.weight and shared_gate_up 3 times, shared_down twice). The
    router's twice: its dtype, for x's cast, and nn.Linear's own read, through the router's __call__ (its hooks)."""
    from torch.nn.utils import parametrize

    layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)
    counters = {}
    for name in ("router.weight", "w_gate_up", "w_down", "shared_gate_up", "shared_down"):
        owner, _, attr = name.rpartition(".")
        parametrize.register_parametrization(layer.get_submodule(owner), attr, counters.setdefault(name, _Counted()))
    for counter in counters.values():
        counter.calls = 0  # registering computes it once
    layer(torch.randn(T, H))
    calls = {name: counter.calls for name, counter in counters.items()}
    assert calls == {"router.weight": 2, "w_gate_up": 1, "w_down": 1, "shared_gate_up": 1, "shared_down": 1}, calls


def _block(layer: megamoe.MoELayer, x: torch.Tensor) -> torch.Tensor:
    return x + layer(torch.nn.functional.layer_norm(x, (H,)))


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
def test_layer_under_non_reentrant_checkpointing_keeps_aux_loss_gradient(how):
    """A block with MoELayer under non-reentrant activation checkpointing: the loss with aux_loss and every gradient
    (the router's through aux_loss included) are the plain run's bits."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)

        def forward(self, x):
            return _block(self.moe, x)

    def grads(wrap):
        torch.manual_seed(0)
        block = Block()
        run = block if wrap is None else wrap(block)
        x = torch.randn(2, T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = run(x).square().sum() + 0.1 * block.moe.aux_loss
        assert block.moe.aux_loss.requires_grad
        loss.backward()
        return loss.detach(), [x.grad, *(p.grad for p in block.parameters())]

    wrap = checkpoint_wrapper if how == "checkpoint_wrapper" else (
        lambda block: lambda x: checkpoint(block, x, use_reentrant=False))
    want_loss, want = grads(None)
    got_loss, got = grads(wrap)
    assert torch.equal(got_loss, want_loss)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_training_resumed_from_state_dicts_is_bitwise_the_uninterrupted_run(tmp_path):
    """AdamW on MoELayer: stop after 2 of 4 steps, torch.save the model's and optimizer's state dicts, resume in a
    fresh layer and optimizer: the remaining losses, aux_loss, tokens_per_expert and final parameters are bitwise
    those of the run that never stopped."""
    batches = [torch.randn(2, T, H, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def fresh(seed):
        torch.manual_seed(seed)
        layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)
        return layer, torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)

    def step(layer, optimizer, x):
        loss = _block(layer, x).square().mean() + 0.1 * layer.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach(), layer.aux_loss.detach(), layer.tokens_per_expert.clone()

    layer, optimizer = fresh(0)
    uninterrupted = []
    for s, x in enumerate(batches):
        if s == 2:
            torch.save({"model": layer.state_dict(), "optim": optimizer.state_dict()}, tmp_path / "ckpt.pt")
        uninterrupted.append(step(layer, optimizer, x))
    resumed_layer, resumed_optimizer = fresh(1)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_layer.load_state_dict(state["model"])
    resumed_optimizer.load_state_dict(state["optim"])
    for s in (2, 3):
        for got, want in zip(step(resumed_layer, resumed_optimizer, batches[s]), uninterrupted[s]):
            assert torch.equal(got, want), s
    for (name, a), (_, b) in zip(layer.named_parameters(), resumed_layer.named_parameters()):
        assert torch.equal(a, b), name


def test_compiled_autograd_fullgraph_backward():
    """An eager forward, its backward traced by compiled autograd with fullgraph=True: the eager gradients, bit for
    bit (the backward's Python formula must stay traceable; it runs the same ops)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    x, ids, w, wgu, wd, sgu, sd = _inputs(gen, shared=True)
    leaves = [t.requires_grad_() for t in (x, w, wgu, wd, sgu, sd)]

    def loss():
        return megamoe.experts(x, ids, w, wgu, wd, shared_gate_up=sgu, shared_down=sd, config=CONFIG).square().sum()

    want = torch.autograd.grad(loss(), leaves)
    out = loss()
    with torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=True)):
        out.backward()
    for name, t, g in zip(["x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"], leaves, want):
        assert torch.equal(t.grad, g), f"d_{name}: max diff {(t.grad - g).abs().max():.3e}"


def test_layer_under_fake_tensor_mode():
    """MoELayer built and run (forward, backward) under FakeTensorMode, as for tracing or memory estimation: shapes
    and gradients as on a real device (its construction used to fail: "_apply(): Couldn't swap Linear.weight")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = megamoe.MoELayer(H, I, E, K, shared_intermediate_size=8, config=CONFIG)
        x = torch.randn(2, T, H, requires_grad=True)
        y = layer(x)
        (y.sum() + layer.aux_loss).backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name


def test_dynamically_quantized_router_is_a_type_error_naming_it():
    """torch.ao.quantization.quantize_dynamic(model, {nn.Linear}) swaps the router for a quantized Linear whose weight
    is a method (int8 values): a TypeError naming the router, not an AttributeError from inside."""
    layer = megamoe.MoELayer(16, 8, 4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(layer), {torch.nn.Linear})[0]
    for call in (quantized, quantized.route):  # route() alone too, as forward checks it
        with pytest.raises(TypeError, match=r"router must be a module with a floating-point weight tensor.*"
                                            r"got torch\.ao"):
            call(torch.randn(3, 16))


def test_router_without_weight_is_a_type_error_naming_it():
    """A router module without a weight attribute (here an nn.Sequential around the Linear): the same TypeError, from
    the input checks that announce a rejection to EP peers, not an AttributeError from reading router.weight first."""
    layer = megamoe.MoELayer(16, 8, 4, 2)
    layer.router = torch.nn.Sequential(layer.router)
    for call in (layer, layer.route):
        with pytest.raises(TypeError, match=r"router must be a module with a floating-point weight tensor.*Sequential "
                                            r"without a weight"):
            call(torch.randn(3, 16))


@pytest.mark.parametrize("out_features", [5, 3], ids=["E+1", "E-1"])
def test_router_of_another_expert_count_is_a_value_error_naming_it(out_features):
    """A router put in the layer's place that scores another number of experts than E: a ValueError naming the
    router and the logits' shape, not torch's RuntimeError from counting an id past E (an out-of-bounds scatter,
    a device assert on CUDA) or from the aux loss's mismatched [E] and [E'] terms."""
    layer = megamoe.MoELayer(16, 8, 4, 2)
    layer.router = torch.nn.Linear(16, out_features, bias=False)
    for call in (layer, layer.route):
        with pytest.raises(ValueError, match=rf"router must give \[T, E=4\] logits, got shape \(3, {out_features}\) "
                                             r"from torch\.nn\.modules\.linear\.Linear"):
            call(torch.randn(3, 16))
