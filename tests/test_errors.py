"""Bad input raises clear errors naming the argument; odd-but-valid input (strided views) is accepted and
correct; inputs are never modified; capacity overflow raises CapacityOverflowError on CPU."""

from __future__ import annotations

import re

import pytest
import torch

import megamoe
from megamoe import CapacityOverflowError, MoEConfig, MoELayer, build_schedule
from conftest import assert_close_tight, assert_equal, make_problem

T, H, I, E, K, IS = 6, 8, 4, 4, 2, 4
# "reference.experts": megamoe.reference.experts called directly (public; it checks its arguments as
# megamoe.experts does).
BACKENDS = pytest.mark.parametrize("backend", ["torch", "reference", "reference.experts"])


def args(gen, dtype=torch.float32):
    """Valid keyword arguments of megamoe.experts (with a shared expert)."""
    p = make_problem(gen, T, H, I, E, K, shared_intermediate=IS).cast(dtype)
    return dict(x=p.x, topk_ids=p.topk_ids, topk_weights=p.topk_weights, w_gate_up=p.w_gate_up, w_down=p.w_down,
                shared_gate_up=p.shared_gate_up, shared_down=p.shared_down)


def call(kw, backend="torch"):
    kw = dict(kw)
    if backend == "reference.experts":
        fn = megamoe.reference.experts
    else:
        fn, kw["config"] = megamoe.experts, MoEConfig(backend=backend)
    return fn(kw.pop("x"), kw.pop("topk_ids"), kw.pop("topk_weights"), kw.pop("w_gate_up"), kw.pop("w_down"), **kw)


def expect(exc, name, kw, backend="torch"):
    with pytest.raises(exc) as info:
        call(kw, backend)
    assert re.search(rf"\b{name}\b", str(info.value)), f"message does not name {name!r}: {info.value}"


BAD_SHAPES = {
    # case: (argument, valid kwargs -> bad value); each must raise a ValueError naming the argument
    "x-rank1": ("x", lambda a: a["x"][0]),
    "x-rank3": ("x", lambda a: a["x"].unsqueeze(0)),
    "topk_ids-rank1": ("topk_ids", lambda a: a["topk_ids"][:, 0]),
    "topk_ids-rank3": ("topk_ids", lambda a: a["topk_ids"].unsqueeze(0)),
    "topk_ids-T-mismatch": ("topk_ids", lambda a: a["topk_ids"][:-1]),
    "topk_ids-k0": ("topk_ids", lambda a: a["topk_ids"][:, :0]),
    "topk_weights-rank1": ("topk_weights", lambda a: a["topk_weights"][:, 0]),
    "topk_weights-k-mismatch": ("topk_weights", lambda a: a["topk_weights"][:, :1]),
    "w_gate_up-rank2": ("w_gate_up", lambda a: a["w_gate_up"][0]),
    "w_gate_up-H-mismatch": ("w_gate_up", lambda a: a["w_gate_up"][:, :, :-1]),
    "w_gate_up-odd-2I": ("w_gate_up", lambda a: a["w_gate_up"][:, :-1]),
    "w_down-rank2": ("w_down", lambda a: a["w_down"][0]),
    "w_down-I-mismatch": ("w_down", lambda a: a["w_down"][:, :, :-1]),
    "w_down-H-mismatch": ("w_down", lambda a: a["w_down"][:, :-1]),
    "w_down-E-mismatch": ("w_down", lambda a: a["w_down"][:-1]),
    "shared_gate_up-rank3": ("shared_gate_up", lambda a: a["shared_gate_up"].unsqueeze(0)),
    "shared_gate_up-H-mismatch": ("shared_gate_up", lambda a: a["shared_gate_up"][:, :-1]),
    "shared_gate_up-odd": ("shared_gate_up", lambda a: a["shared_gate_up"][:-1]),
    "shared_down-rank1": ("shared_down", lambda a: a["shared_down"][0]),
    "shared_down-I-mismatch": ("shared_down", lambda a: a["shared_down"][:, :-1]),
    "shared_down-H-mismatch": ("shared_down", lambda a: a["shared_down"][:-1]),
}


@BACKENDS
@pytest.mark.parametrize("case", list(BAD_SHAPES), ids=list(BAD_SHAPES))
def test_bad_shape(rng, case, backend):
    name, bad = BAD_SHAPES[case]
    kw = args(rng)
    kw[name] = bad(kw)
    expect(ValueError, name, kw, backend)


BAD_DTYPES = {
    "x-int": ("x", lambda a: a["x"].to(torch.int32), TypeError),
    "x-bool": ("x", lambda a: a["x"] > 0, TypeError),
    "w_gate_up-vs-x": ("w_gate_up", lambda a: a["w_gate_up"].double(), TypeError),
    "w_down-vs-x": ("w_down", lambda a: a["w_down"].half(), TypeError),
    "shared_gate_up-vs-x": ("shared_gate_up", lambda a: a["shared_gate_up"].double(), TypeError),
    "shared_down-vs-x": ("shared_down", lambda a: a["shared_down"].bfloat16(), TypeError),
    "topk_ids-float": ("topk_ids", lambda a: a["topk_ids"].float(), TypeError),
    "topk_ids-int16": ("topk_ids", lambda a: a["topk_ids"].to(torch.int16), TypeError),
    "topk_weights-fp16-vs-fp32-x": ("topk_weights", lambda a: a["topk_weights"].half(), TypeError),
    "topk_weights-int": ("topk_weights", lambda a: a["topk_weights"].to(torch.int64), TypeError),
    "x-list": ("x", lambda a: a["x"].tolist(), TypeError),
    "topk_ids-list": ("topk_ids", lambda a: a["topk_ids"].tolist(), TypeError),
    "w_down-numpy-like": ("w_down", lambda a: 1.0, TypeError),
}


@BACKENDS
@pytest.mark.parametrize("case", list(BAD_DTYPES), ids=list(BAD_DTYPES))
def test_bad_dtype_or_type(rng, case, backend):
    name, bad, exc = BAD_DTYPES[case]
    kw = args(rng)
    kw[name] = bad(kw)
    expect(exc, name, kw, backend)


BAD_IDS = [(torch.int64, -1), (torch.int64, E), (torch.int64, E + 7), (torch.int64, -(2**40)), (torch.int32, -1),
           (torch.int32, E), (torch.int32, 2**31 - 1)]


@BACKENDS
@pytest.mark.parametrize("ids_dtype,bad_id", BAD_IDS, ids=[f"{str(d)[6:]}-id{v}" for d, v in BAD_IDS])
def test_ids_out_of_range(rng, bad_id, ids_dtype, backend):
    kw = args(rng)
    ids = kw["topk_ids"].clone().to(ids_dtype)
    ids[T // 2, 1] = bad_id
    kw["topk_ids"] = ids
    with pytest.raises(ValueError, match=r"topk_ids") as info:
        call(kw, backend)
    # After "found": the range [0, E) holds E itself, so the whole message would show id E however wrong.
    assert re.search(rf"found {bad_id}\b", str(info.value)), f"message does not show the bad id {bad_id}: {info.value}"


@pytest.mark.parametrize("name", ["topk_ids", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"])
def test_mismatched_devices(rng, name):
    """One argument on `meta` and x on the CPU: a ValueError naming the argument."""
    kw = args(rng)
    kw[name] = kw[name].to("meta")
    expect(ValueError, name, kw)


def test_x_on_other_device(rng):
    kw = args(rng)
    kw["x"] = kw["x"].to("meta")
    with pytest.raises(ValueError, match=r"\bx\b"):
        call(kw)


@BACKENDS
@pytest.mark.parametrize("given", ["shared_gate_up", "shared_down"])
def test_shared_weight_alone(rng, given, backend):
    kw = args(rng)
    kw.pop("shared_down" if given == "shared_gate_up" else "shared_gate_up")
    with pytest.raises(ValueError) as info:
        call(kw, backend)
    assert "shared_gate_up" in str(info.value) and "shared_down" in str(info.value), str(info.value)


def test_bad_config_type(rng):
    kw = args(rng)
    x = kw.pop("x")
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        megamoe.experts(x, kw.pop("topk_ids"), kw.pop("topk_weights"), kw.pop("w_gate_up"), kw.pop("w_down"),
                        config={"backend": "torch"}, **kw)


def test_capacity_overflow_raises_on_cpu(rng):
    kw = args(rng)
    kw["topk_ids"] = torch.tensor([[0, 1]] * T)  # every token on experts 0 and 1
    x = kw.pop("x")
    with pytest.raises(CapacityOverflowError, match="capacity_factor"):
        megamoe.experts(x, kw.pop("topk_ids"), kw.pop("topk_weights"), kw.pop("w_gate_up"), kw.pop("w_down"),
                        config=MoEConfig(backend="torch", capacity_factor=0.25, block_m=1), **kw)
    assert issubclass(CapacityOverflowError, RuntimeError)


def test_capacity_overflow_raises_in_layer(rng):
    layer = MoELayer(H, I, E, 1, config=MoEConfig(backend="torch", capacity_factor=0.1, block_m=1))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(16, H, generator=rng) + 1  # every token prefers expert 0
    with pytest.raises(CapacityOverflowError):
        layer(x)


# --------------------------------------------------------------------------------------------- strided input


def strided_views(kw):
    """Each argument as a non-contiguous view with the same values (transposes, slices of wider tensors)."""
    out = {}
    for name, t in kw.items():
        if name == "topk_ids" or t.dim() == 2:
            view = t.t().contiguous().t()  # column-major
        else:
            wide = torch.zeros(t.shape[0], t.shape[1], 2 * t.shape[2], dtype=t.dtype)
            wide[..., ::2] = t
            view = wide[..., ::2]  # every other element
        assert not view.is_contiguous() and torch.equal(view, t)
        out[name] = view
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@BACKENDS
def test_non_contiguous_inputs_accepted_and_correct(rng, backend, dtype):
    kw = args(rng, dtype)
    d_out = torch.randn(T, H, generator=rng, dtype=dtype)

    def run(inputs):
        leaves = {n: (t.detach().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
        out = call(leaves, backend)
        floats = [n for n, t in leaves.items() if t.is_floating_point()]
        grads = torch.autograd.grad(out, [leaves[n] for n in floats], d_out)
        return {"out": out, **{f"d_{n}": g for n, g in zip(floats, grads)}}

    strided = strided_views(kw)
    ours, ref = run(strided), run({n: t.contiguous() for n, t in kw.items()})
    for name in ref:
        if backend == "torch":  # copies to contiguous first: bitwise the same
            assert_equal(name, ours[name], ref[name])
        else:
            assert_close_tight(name, ours[name], ref[name], 1e-6 if dtype == torch.float32 else 1e-13)


# --------------------------------------------------------------------------------------------- no in-place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@BACKENDS
def test_inputs_not_modified(rng, backend, dtype):
    kw = args(rng, dtype)
    before = {n: t.clone() for n, t in kw.items()}
    leaves = {n: (t.requires_grad_() if t.is_floating_point() else t) for n, t in kw.items()}
    d_out = torch.randn(T, H, generator=rng).to(dtype)
    before["d_out"] = d_out.clone()
    out = call(leaves, backend)
    out.backward(d_out)
    for name, t in [*leaves.items(), ("d_out", d_out)]:
        assert_equal(f"{name} after forward+backward", t.detach(), before[name])


def test_layer_input_not_modified(rng):
    layer = MoELayer(H, I, E, K, shared_intermediate_size=IS)
    x = torch.randn(2, 3, H, generator=rng, requires_grad=True)
    x_before = x.detach().clone()
    params_before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer(x).sum().backward()
    assert_equal("x", x.detach(), x_before)
    for n, p in layer.named_parameters():
        assert_equal(n, p.detach(), params_before[n])


# --------------------------------------------------------------------------------------------- autograd safety

FLOAT_INPUTS = ["x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"]


@pytest.mark.parametrize("name", FLOAT_INPUTS)
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_inplace_change_after_forward_raises(rng, backend, name):
    """An input changed in place between the forward and the backward (say an optimizer step, or x.add_(1)) is
    torch's "modified by an inplace operation" error, as for built-in ops, never gradients of the changed values:
    the ops save their inputs with ctx.save_for_backward (version-checked)."""
    leaves = {n: (t.requires_grad_() if t.is_floating_point() else t) for n, t in args(rng).items()}
    out = call(leaves, backend)
    with torch.no_grad():
        leaves[name].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.ones_like(out))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_retain_graph_backward_twice_accumulates(rng, backend):
    """Two backwards through one forward (retain_graph=True) accumulate exactly twice the gradients, and a
    torch.autograd.grad of some inputs between them gives those inputs' gradients of the full backward."""
    leaves = {n: (t.requires_grad_() if t.is_floating_point() else t) for n, t in args(rng).items()}
    d_out = torch.randn(T, H, generator=rng)
    out = call(leaves, backend)
    some = torch.autograd.grad(out, [leaves["w_down"], leaves["x"]], d_out, retain_graph=True)
    out.backward(d_out, retain_graph=True)
    first = {n: leaves[n].grad.clone() for n in FLOAT_INPUTS}
    out.backward(d_out)
    for n in FLOAT_INPUTS:
        assert_equal(f"d_{n} after two backwards", leaves[n].grad, 2 * first[n])
    assert_equal("d_w_down of autograd.grad([w_down, x])", some[0], first["w_down"])
    assert_equal("d_x of autograd.grad([w_down, x])", some[1], first["x"])


# --------------------------------------------------------------------------------------------- schedule, layer


@pytest.mark.parametrize(
    "topk_ids,num_experts,exc,name",
    [
        ([[0, 1]], 4, TypeError, "topk_ids"),
        (torch.tensor([0, 1]), 4, ValueError, "topk_ids"),
        (torch.tensor([[0.0, 1.0]]), 4, TypeError, "topk_ids"),
        (torch.zeros(3, 0, dtype=torch.int64), 4, ValueError, "topk_ids"),
        (torch.tensor([[0, 4]]), 4, ValueError, "topk_ids"),
        (torch.tensor([[-1, 0]]), 4, ValueError, "topk_ids"),
        (torch.tensor([[0, 1]]), 0, ValueError, "num_experts"),
        (torch.tensor([[0, 1]]), True, ValueError, "num_experts"),
        (torch.tensor([[0, 1]]), 4.0, ValueError, "num_experts"),
    ],
    ids=["list", "rank1", "float", "k0", "id-too-big", "id-negative", "E0", "E-bool", "E-float"],
)
def test_build_schedule_bad_input(topk_ids, num_experts, exc, name):
    with pytest.raises(exc, match=rf"\b{name}\b"):
        build_schedule(topk_ids, num_experts)


def test_build_schedule_default_placement_passed_explicitly_checks_the_ids():
    """place_routing=place_routing_torch (the default, passed by name) is no placement that checks the ids' range
    itself: an id outside [0, E) is build_schedule's ValueError naming topk_ids (was: an IndexError from the
    placement's indexing)."""
    from megamoe.schedule import place_routing_torch

    with pytest.raises(ValueError, match=r"\btopk_ids\b.*\[0, 4\), found 5"):
        build_schedule(torch.tensor([[0, 5]]), 4, place_routing=place_routing_torch)


def test_build_schedule_bad_config():
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        build_schedule(torch.tensor([[0, 1]]), 4, config="torch")


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_size=8.0), "hidden_size"),
        (dict(intermediate_size=-1), "intermediate_size"),
        (dict(num_experts=0), "num_experts"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(shared_intermediate_size=-2), "shared_intermediate_size"),
        (dict(score_func="relu"), "score_func"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_layer_bad_arguments(kwargs, name):
    full = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K) | kwargs
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        MoELayer(full.pop("hidden_size"), full.pop("intermediate_size"), full.pop("num_experts"), full.pop("top_k"),
                 **full)


@pytest.mark.parametrize("value", ["false", 0, 1, 1.0, None], ids=repr)
def test_layer_norm_topk_prob_must_be_bool(value):
    """norm_topk_prob="false" (truthy) and friends: a TypeError naming the argument and what was given."""
    with pytest.raises(TypeError) as info:
        MoELayer(H, I, E, K, norm_topk_prob=value)
    message = str(info.value)
    assert re.search(r"\bnorm_topk_prob\b", message) and "bool" in message and repr(value) in message, message


def test_layer_norm_topk_prob_numpy_bool_names_its_type():
    """NumPy's bool is no bool to the check; its type was shown as plain "bool": "must be a bool, got bool np.True_"."""
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"norm_topk_prob must be a bool, got numpy\.bool"):
        MoELayer(H, I, E, K, norm_topk_prob=np.True_)


def test_layer_bad_config_type():
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        MoELayer(H, I, E, K, config="torch")


def test_layer_wrong_hidden_size(rng):
    layer = MoELayer(H, I, E, K)
    with pytest.raises(ValueError, match=r"\bx\b"):
        layer(torch.randn(3, H + 1, generator=rng))


# --------------------------------------------------------------------------------------------- hostile input


DEGENERATE = {
    # case: (argument the error must name, what it must say is allowed, (T, H, I, E_local)); every other
    # shape consistent with it
    "x-H0": ("x", "H >= 1", (T, 0, I, E)),
    "w_gate_up-E0": ("w_gate_up", "E_local >= 1", (T, H, I, 0)),
    "w_gate_up-I0": ("w_gate_up", "I >= 1", (T, H, 0, E)),
}


@BACKENDS
@pytest.mark.parametrize("case", list(DEGENERATE), ids=list(DEGENERATE))
def test_zero_sizes_rejected(rng, case, backend):
    """H = 0, I = 0 or E_local = 0 with every shape consistent: a ValueError naming the argument, showing its
    shape and saying what is allowed (not "num_experts", not a failure inside torch._grouped_mm)."""
    name, allowed, (t, h, i, e) = DEGENERATE[case]
    kw = dict(x=torch.randn(t, h, generator=rng), topk_ids=torch.zeros(t, K, dtype=torch.int64),
              topk_weights=torch.rand(t, K, generator=rng), w_gate_up=torch.randn(e, 2 * i, h, generator=rng),
              w_down=torch.randn(e, h, i, generator=rng))
    with pytest.raises(ValueError) as info:
        call(kw, backend)
    message = str(info.value)
    assert re.search(rf"\b{name}\b", message), f"message does not name {name!r}: {message}"
    assert str(tuple(kw[name].shape)) in message, f"message does not show {name}'s shape: {message}"
    assert allowed in message, f"message does not say {allowed!r}: {message}"


@pytest.mark.parametrize("group", ["WORLD", 0, object()], ids=["str", "int", "object"])
def test_group_not_a_process_group(rng, group):
    """group="WORLD" and friends: a TypeError naming group and what is expected, from experts, MoELayer and
    build_schedule alike (not an AttributeError from deep inside torch.distributed)."""
    kw = args(rng)
    x = kw.pop("x")
    calls = {
        "experts": lambda: megamoe.experts(x, kw["topk_ids"], kw["topk_weights"], kw["w_gate_up"], kw["w_down"],
                                           group=group, config=MoEConfig(backend="torch")),
        "MoELayer": lambda: MoELayer(H, I, E, K, group=group),
        "build_schedule": lambda: build_schedule(kw["topk_ids"], E, group=group),
    }
    for where, fn in calls.items():
        with pytest.raises(TypeError) as info:
            fn()
        message = str(info.value)
        assert re.search(r"\bgroup\b", message) and "ProcessGroup" in message and "None" in message, (
            f"{where}: {message}"
        )
        assert type(group).__name__ in message, f"{where}: message does not say what was given: {message}"


def test_group_of_a_non_member(rng):
    """The value dist.new_group returns to a rank outside the new group (GroupMember.NON_GROUP_MEMBER, -100): a
    ValueError saying the rank is not a member, from experts, MoELayer, build_schedule and reduce_expert_grads alike
    (as from patch_model). Before: "group must be a torch.distributed ProcessGroup ..., got int -100"."""
    group = torch.distributed.GroupMember.NON_GROUP_MEMBER
    kw = args(rng)
    x = kw.pop("x")
    calls = {
        "experts": ("group", lambda: megamoe.experts(x, kw["topk_ids"], kw["topk_weights"], kw["w_gate_up"],
                                                     kw["w_down"], group=group, config=MoEConfig(backend="torch"))),
        "MoELayer": ("group", lambda: MoELayer(H, I, E, K, group=group)),
        "build_schedule": ("group", lambda: build_schedule(kw["topk_ids"], E, group=group)),
        "reduce_expert_grads": ("dp_group", lambda: megamoe.parallel.reduce_expert_grads(MoELayer(H, I, E, K),
                                                                                          dp_group=group)),
    }
    for where, (name, fn) in calls.items():
        with pytest.raises(ValueError) as info:
            fn()
        message = str(info.value)
        assert message.startswith(f"{name} must be a process group that this rank belongs to") and "-100" in message, (
            f"{where}: {message}")


@pytest.mark.parametrize("given", [None, "parameters", "optimizer"])
def test_parallel_helpers_take_a_module(given):
    """megamoe.parallel's helpers given something other than the model (None, model.parameters(), the optimizer, as
    when the arguments are swapped): a TypeError naming the argument and what was given. Before: AttributeError
    "'NoneType' object has no attribute 'modules'" from inside the helper."""
    layer = MoELayer(H, I, E, K)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    value = {"None": None, "parameters": layer.parameters(), "optimizer": optimizer}[str(given)]
    calls = {
        "expert_parameters": ("module", lambda: megamoe.parallel.expert_parameters(value)),
        "non_expert_parameters": ("module", lambda: megamoe.parallel.non_expert_parameters(value)),
        "ddp_ignore_experts": ("model", lambda: megamoe.parallel.ddp_ignore_experts(value)),
        "reduce_expert_grads": ("module", lambda: megamoe.parallel.reduce_expert_grads(value)),
        "clip_grad_norm_": ("module", lambda: megamoe.parallel.clip_grad_norm_(value, 1.0)),
        "shard_optimizer_state": ("module", lambda: megamoe.parallel.shard_optimizer_state(value, optimizer)),
    }
    for where, (name, fn) in calls.items():
        with pytest.raises(TypeError) as info:
            fn()
        message = str(info.value)
        assert message.startswith(f"{name} must be a torch.nn.Module") and type(value).__name__ in message, (
            f"{where}: {message}")


@pytest.mark.parametrize("block_m", [-1, 0, 3, 48, 2048, 16.0, True], ids=repr)
def test_build_schedule_bad_block_m(block_m):
    """build_schedule's block_m follows MoEConfig.block_m's rule (None or a power of two in [1, 1024])."""
    with pytest.raises(ValueError) as info:
        build_schedule(torch.tensor([[0, 1]]), 4, block_m=block_m)
    message = str(info.value)
    given = message.partition("got ")[2]  # not the range [1, 1024], which holds a 0
    assert re.search(r"\bblock_m\b", message) and "power of two" in message and repr(block_m) in given, message


@pytest.mark.parametrize("capacity_factor", [1e300, 1.7e308])
def test_huge_finite_capacity_is_dropless(capacity_factor):
    """A finite capacity beyond the worst case is the worst case (no OverflowError from inf rows)."""
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    huge = build_schedule(ids, 4, config=MoEConfig(capacity_factor=capacity_factor), block_m=2)
    dropless = build_schedule(ids, 4, block_m=2)
    assert huge.num_rows == dropless.num_rows and int(huge.overflow) == 0


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=repr)
def test_non_finite_capacity_factor(value, monkeypatch):
    """inf (or NaN) is rejected when the config is made, directly or from MEGAMOE_CAPACITY_FACTOR."""
    with pytest.raises(ValueError, match=r"\bcapacity_factor\b.*finite"):
        MoEConfig(capacity_factor=value)
    monkeypatch.setenv("MEGAMOE_CAPACITY_FACTOR", str(value))
    with pytest.raises(ValueError, match=r"\bcapacity_factor\b.*finite"):
        MoEConfig.from_env()


def test_triton_backend_on_cpu(rng):
    """backend="triton" with CPU tensors: a ValueError saying what it needs and where the tensors are (not
    Triton's "0 active drivers")."""
    with pytest.raises(ValueError) as info:
        call(args(rng), "triton")
    message = str(info.value)
    assert re.search(r"\bbackend\b", message) and "triton" in message, message
    if "triton" in megamoe.autograd.BACKENDS:  # else: "not available here (needs Triton)"
        assert "compute capability >= 9.0" in message and "cpu" in message, message


@pytest.mark.skipif("triton" not in megamoe.autograd.BACKENDS, reason="needs Triton")
def test_triton_backend_rejects_float64(rng, monkeypatch):
    """backend="triton" with float64 (which the portable paths run): a TypeError naming the dtypes it runs, where
    the kernels would otherwise accumulate float64 operands in fp32 and return wrong numbers. The device check is
    passed by pretending this CPU is a Hopper GPU, so the dtype check is what answers."""
    monkeypatch.setattr(megamoe.autograd, "triton_runs_on", lambda device: True)
    with pytest.raises(TypeError) as info:
        call(args(rng, torch.float64), "triton")
    message = str(info.value)
    assert "backend='triton'" in message and "float64" in message and "float32" in message, message


@pytest.mark.skipif("triton" not in megamoe.autograd.BACKENDS, reason="needs Triton")
@pytest.mark.parametrize("block_m", [1, 8])
def test_block_m_below_the_triton_tile(block_m, monkeypatch):
    """MoEConfig.block_m below the fused kernels' smallest row tile (16; the config takes any power of two from 1,
    which the torch path runs): "auto" picks the torch path where it would pick triton (before: triton, then a
    ValueError from its tile table), and backend="triton" is a ValueError naming MoEConfig.block_m up front. The
    device check is passed by pretending this CPU is a Hopper GPU."""
    from megamoe.backends.triton.configs import kernel_configs

    monkeypatch.setattr(megamoe.autograd, "triton_runs_on", lambda device: True)
    floor = megamoe.config.TRITON_MIN_BLOCK_M
    x = torch.empty(4, H, dtype=torch.bfloat16)
    assert megamoe.autograd.resolve_backend(MoEConfig(), x, None) == "triton"
    assert megamoe.autograd.resolve_backend(MoEConfig(block_m=floor), x, None) == "triton"
    assert megamoe.autograd.resolve_backend(MoEConfig(block_m=block_m), x, None) == "torch"
    with pytest.raises(ValueError, match="MoEConfig.block_m"):
        megamoe.autograd.resolve_backend(MoEConfig(backend="triton", block_m=block_m), x, None)
    with pytest.raises(ValueError, match="block_m"):  # the tile table checks the same floor
        kernel_configs(H, I, torch.bfloat16, torch.device("cpu"), floor // 2)
    kernel_configs(H, I, torch.bfloat16, torch.device("cpu"), floor)


@pytest.mark.skipif("triton" not in megamoe.autograd.BACKENDS, reason="needs Triton")
def test_triton_backend_not_on_rocm_gpus(monkeypatch):
    """A ROCm build's AMD GPU is a "cuda" device whose capability is its gfx version (9.4 on an MI300): "auto" picks
    the torch path there (before: triton, whose tile table then chose the Hopper Gluon kernels, wgmma and TMA), and
    backend="triton" is a ValueError saying it needs an NVIDIA GPU. Pretended: torch.version.hip and the capability
    query are patched, x a stand-in with a "cuda" device."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    x = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    monkeypatch.setattr(torch.version, "hip", None)
    assert megamoe.autograd.resolve_backend(MoEConfig(), x, None) == "triton"  # an NVIDIA GPU of capability 9.4
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert megamoe.autograd.resolve_backend(MoEConfig(), x, None) == "torch"
    with pytest.raises(ValueError, match=r"backend='triton' needs an NVIDIA GPU .*ROCm"):
        megamoe.autograd.resolve_backend(MoEConfig(backend="triton"), x, None)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: MoELayer(0, I, E, K), "hidden_size"),
        (lambda: MoELayer(H, I, E, 0), "top_k"),
        (lambda: build_schedule(torch.tensor([[0, 1]]), 0), "num_experts"),
        (lambda: MoEConfig(comm_timeout_ms=0), "comm_timeout_ms"),
        (lambda: MoEConfig(num_comm_sms=0), "num_comm_sms"),
    ],
    ids=["layer-hidden_size", "layer-top_k", "schedule-num_experts", "config-comm_timeout_ms", "config-num_comm_sms"],
)
def test_positive_int_one_rule(make, name):
    """One positive-int check, one wording, wherever the rule applies."""
    with pytest.raises(ValueError) as info:
        make()
    assert re.search(rf"\b{name} must be (None or )?a positive int, got 0$", str(info.value)), str(info.value)


@pytest.mark.parametrize("backend", ["reference", "reference.experts"])
def test_reference_on_meta_is_a_value_error(rng, backend):
    """The reference picks each expert's tokens by the routing's values, which meta tensors lack: a ValueError
    saying so and naming the backend that runs on meta, not torch's NotImplementedError from inside nonzero."""
    kw = {name: t.to("meta") for name, t in args(rng).items()}
    with pytest.raises(ValueError, match="meta") as info:
        call(kw, backend)
    assert "backend='torch'" in str(info.value), str(info.value)


def test_layer_with_the_reference_backend_on_meta_is_a_value_error():
    layer = MoELayer(H, I, E, K, config=MoEConfig(backend="reference"), device="meta")
    with pytest.raises(ValueError, match="meta"):
        layer(torch.randn(3, H, device="meta"))
