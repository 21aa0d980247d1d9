"""Inference and partial backward on the torch backend, through the public API (megamoe.experts).

- Inference (torch.no_grad(), torch.inference_mode(), no input requiring grad): the same out, bit for bit,
  and the backend is asked to save nothing and saves nothing.
- Frozen weights / x or topk_weights not requiring grad: the gradients that are asked for are bitwise those
  of the full backward, the others are None (a parameter's .grad stays None), and their work is not done
  (the backend's GEMMs and helpers are counted).
- torch.compile(fullgraph=True) in both modes; expert parallelism over 2 gloo ranks, including ranks that
  need different gradients (the exchanges are collectives: skipping must stay local).

The Triton backend's counterpart runs in the interpreter: tests/test_inference_interpret.py.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import pytest
import torch

import megamoe
from megamoe.backends import swiglu, torch_native
from conftest import assert_equal, init_gloo, leave_gloo, make_problem, run_gloo_workers

CONFIG = megamoe.MoEConfig(backend="torch")
NAMES = ["x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"]
WEIGHTS = ["w_gate_up", "w_down", "shared_gate_up", "shared_down"]


def _problem(seed: int, dtype: torch.dtype, shared: int = 8, T: int = 19, H: int = 32, I: int = 24, E: int = 6, k: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return make_problem(gen, T, H, I, E, k, shared_intermediate=shared).cast(dtype)


def _leaves(p, trainable: set[str]) -> dict[str, torch.Tensor]:
    leaves = {}
    for name in NAMES:
        t = getattr(p, name)
        if t is not None:
            leaves[name] = t.detach().clone().requires_grad_(name in trainable)
    return leaves


def _call(p, leaves, config=CONFIG, **kwargs):
    return megamoe.experts(
        leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
        shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"), config=config, **kwargs,
    )


def _run(p, trainable: set[str], config=CONFIG, **kwargs):
    """out and the .grad of every leaf (None where it did not require grad) after out.backward(d_out)."""
    leaves = _leaves(p, trainable)
    out = _call(p, leaves, config, **kwargs)
    if out.requires_grad:
        out.backward(p.d_out.to(out.dtype))
    return out.detach(), {name: t.grad for name, t in leaves.items()}


class Spy:
    """Wraps module attributes to record calls (args, kwargs, result); `fail` names make them raise."""

    def __init__(self, monkeypatch, module, names, fail=()):
        self.calls = {name: [] for name in names}
        for name in names:
            real = getattr(module, name)

            def wrapper(*args, _name=name, _real=real, **kwargs):
                if _name in fail:
                    raise AssertionError(f"{_name} must not run here")
                result = _real(*args, **kwargs)
                self.calls[_name].append((args, kwargs, result))
                return result

            monkeypatch.setattr(module, name, wrapper)

    def count(self, name: str) -> int:
        return len(self.calls[name])


# --------------------------------------------------------------------------------------------- inference

INFERENCE_MODES = {
    "no_grad": lambda: torch.no_grad(),
    "inference_mode": lambda: torch.inference_mode(),
    "nothing-requires-grad": contextlib.nullcontext,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("shared", [0, 8], ids=["no-shared", "shared"])
@pytest.mark.parametrize("mode", list(INFERENCE_MODES))
def test_inference_same_bits_nothing_saved(mode, shared, dtype, monkeypatch):
    p = _problem(1, dtype, shared)
    want, _ = _run(p, set(NAMES))
    spy = Spy(monkeypatch, torch_native, ["experts_fwd", "rows_fwd", "rows_infer"])
    leaves = _leaves(p, set() if mode == "nothing-requires-grad" else set(NAMES))
    with INFERENCE_MODES[mode]():
        out = _call(p, leaves)
    assert out.grad_fn is None and not out.requires_grad
    assert_equal("out", out, want)
    ((_, kwargs, (_, saved)),) = spy.calls["experts_fwd"]
    assert kwargs["save_for_backward"] is False
    assert saved == (), f"inference saved {len(saved)} tensors"
    assert spy.count("rows_fwd") == 0 and spy.count("rows_infer") == 1


def test_training_forward_saves(monkeypatch):
    p = _problem(2, torch.float32)
    spy = Spy(monkeypatch, torch_native, ["experts_fwd"])
    _run(p, {"x"})
    ((_, kwargs, (_, saved)),) = spy.calls["experts_fwd"]
    assert kwargs["save_for_backward"] is True and len(saved) == 6


def test_inference_under_autocast_and_layer():
    """MoELayer under inference_mode (router included) and autocast: the same bits as with grad enabled."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(32, 24, 6, 2, shared_intermediate_size=8, config=CONFIG)
    x = torch.randn(3, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        with torch.inference_mode():
            got = layer(x)
    assert_equal("out", got, want)


def test_layer_reset_after_inference_mode_forward():
    """A forward under inference_mode leaves tokens_per_expert an inference tensor (the forward's counts), which
    cannot change in place outside inference_mode: reset_parameters afterwards still re-initialises the layer,
    as it does after a forward with grad enabled (was: RuntimeError "Inplace update to inference tensor")."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(32, 24, 6, 2, config=CONFIG)
    with torch.inference_mode():
        layer(torch.randn(3, 32))
    torch.manual_seed(1)
    layer.reset_parameters()
    torch.manual_seed(1)
    fresh = megamoe.MoELayer(32, 24, 6, 2, config=CONFIG)
    for (name, got), want in zip(layer.state_dict().items(), fresh.state_dict().values()):
        assert_equal(name, got, want)
    assert_equal("tokens_per_expert", layer.tokens_per_expert, torch.zeros(6, dtype=torch.int32))


# --------------------------------------------------------------------------------------------- partial backward

# (what requires grad) -> what must not run in the backward
PARTIAL = {
    "frozen-weights": {"x", "topk_weights"},
    "frozen-w_down": {"x", "topk_weights", "w_gate_up", "shared_gate_up", "shared_down"},
    "frozen-w_gate_up": {"x", "topk_weights", "w_down", "shared_down"},
    "x-no-grad": {"topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"},
    "only-topk_weights": {"topk_weights"},
    "only-x": {"x"},
    "only-w_down": {"w_down"},
}


def _gemm_kinds(calls, p) -> list[str]:
    """The backward's grouped GEMMs by what they compute (from their operands' shapes)."""
    E, two_i, H = p.w_gate_up.shape
    kinds = []
    for (a, b, _), _, _ in calls:
        if b.dim() == 2:
            kinds.append("dw_down" if a.shape[0] == H else "dw_gate_up")
        elif tuple(b.shape) == (E, two_i, H):
            kinds.append("d_x_rows")
        else:
            kinds.append("down_dgrad")
    return kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(PARTIAL))
def test_partial_backward(case, dtype, monkeypatch):
    trainable = PARTIAL[case]
    p = _problem(3, dtype)
    want_out, want = _run(p, set(NAMES))
    leaves = _leaves(p, trainable)
    out = _call(p, leaves)
    assert_equal("out", out.detach(), want_out)
    spy = Spy(monkeypatch, torch_native, ["experts_bwd", "grouped_mm", "swiglu_bwd", "to_rows", "to_pairs", "slot_sum",
                                          "pair_weight_grads"])
    shared_spy = Spy(monkeypatch, swiglu, ["swiglu_bwd"])  # the shared expert's (backends/swiglu.py)
    out.backward(p.d_out.to(dtype))
    for name, t in leaves.items():
        if name in trainable:
            assert_equal(f"d_{name}", t.grad, want[name])
        else:
            assert t.grad is None, f"{name} does not require grad, yet got a .grad"
    # The backend was asked only for what is needed, and returned None for the rest.
    ((_, kwargs, grads),) = spy.calls["experts_bwd"]
    assert kwargs["needs_grad"] == tuple(name in trainable for name in NAMES)
    for name, g in zip(NAMES, grads):
        assert (g is not None) == (name in trainable), f"d_{name}: {'computed' if g is not None else 'missing'}"
    # ... and did only that work.
    gemms = _gemm_kinds(spy.calls["grouped_mm"], p)
    need_x, need_gu, need_d = "x" in trainable, "w_gate_up" in trainable, "w_down" in trainable
    assert gemms.count("dw_down") == need_d
    assert gemms.count("dw_gate_up") == need_gu
    assert gemms.count("d_x_rows") == need_x
    assert gemms.count("down_dgrad") == (need_x or need_gu)
    assert spy.count("to_rows") == (need_x or need_gu or need_d)  # the d_y gather
    assert spy.count("to_pairs") == need_x and spy.count("slot_sum") == need_x
    assert spy.count("pair_weight_grads") == ("topk_weights" in trainable)
    # SwiGLU backward: experts (d_x or d_w_gate_up) and shared expert (d_x or d_shared_gate_up), each once.
    assert spy.count("swiglu_bwd") == (need_x or need_gu)
    assert shared_spy.count("swiglu_bwd") == (need_x or "shared_gate_up" in trainable)


def test_module_with_frozen_experts_trains_router():
    """The usual fine-tuning set-up: frozen expert weights, trainable router. Router grads as with trainable
    experts, expert .grad stays None."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(32, 24, 6, 2, shared_intermediate_size=8, config=CONFIG)
    x = torch.randn(2, 5, 32)
    layer(x).square().sum().backward()
    want = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    for name, p in layer.named_parameters():
        if name != "router.weight":
            p.requires_grad_(False)
    layer(x).square().sum().backward()
    for name, p in layer.named_parameters():
        if name == "router.weight":
            assert_equal(name, p.grad, want[name])
        else:
            assert p.grad is None, name


# --------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("case", ["inference", "frozen-weights", "x-no-grad"])
def test_compile_fullgraph(case, monkeypatch):
    torch._dynamo.reset()
    p = _problem(4, torch.float32)
    fn = torch.compile(megamoe.experts, fullgraph=True)
    if case == "inference":
        want, _ = _run(p, set())
        leaves = _leaves(p, set(NAMES))
        spy = Spy(monkeypatch, torch_native, ["experts_fwd"])
        with torch.no_grad():
            got = fn(leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                     shared_gate_up=leaves["shared_gate_up"], shared_down=leaves["shared_down"], config=CONFIG)
        assert got.grad_fn is None
        assert_equal("out", got, want)
        assert [kwargs["save_for_backward"] for _, kwargs, _ in spy.calls["experts_fwd"]] == [False]
        return
    trainable = PARTIAL[case]
    want_out, want = _run(p, trainable)
    leaves = _leaves(p, trainable)
    spy = Spy(monkeypatch, torch_native, ["experts_bwd"])
    out = fn(leaves["x"], p.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
             shared_gate_up=leaves["shared_gate_up"], shared_down=leaves["shared_down"], config=CONFIG)
    out.backward(p.d_out)
    assert [kwargs["needs_grad"] for _, kwargs, _ in spy.calls["experts_bwd"]] == [tuple(n in trainable for n in NAMES)]
    assert_equal("out", out.detach(), want_out)  # the same ops as eager, inside the custom ops: the same bits
    for name, t in leaves.items():
        if name in trainable:
            assert_equal(f"d_{name}", t.grad, want[name])
        else:
            assert t.grad is None, name


# --------------------------------------------------------------------------------------------- expert parallelism

EP_WORLD = 2
EP_CASES = {
    # name -> per rank, the names that require grad (None: inference under no_grad)
    "inference": [None, None],
    "full": [set(NAMES), set(NAMES)],
    "frozen-weights": [{"x", "topk_weights"}, {"x", "topk_weights"}],
    "x-no-grad": [set(WEIGHTS) | {"topk_weights"}, set(WEIGHTS) | {"topk_weights"}],
    # ranks asking for different gradients: the collectives must still match up
    "mixed": [{"x"}, set(WEIGHTS)],
    "mixed-topk-only": [{"topk_weights"}, {"x", "w_down"}],
}


def _ep_worker(rank, world, port, problem, out_dir):
    try:
        init_gloo(rank, world, port)
        group = torch.distributed.group.WORLD
        T = problem["x"].shape[0] // world
        E_l = problem["w_gate_up"].shape[0] // world
        tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * E_l, (rank + 1) * E_l)
        local = {
            "x": problem["x"][tok], "topk_weights": problem["topk_weights"][tok],
            "w_gate_up": problem["w_gate_up"][exp], "w_down": problem["w_down"][exp],
            "shared_gate_up": problem["shared_gate_up"], "shared_down": problem["shared_down"],
        }
        ids, d_out = problem["topk_ids"][tok], problem["d_out"][tok]
        results = {}
        for case, per_rank in EP_CASES.items():
            trainable = per_rank[rank]
            leaves = {n: t.detach().clone().requires_grad_(trainable is not None and n in trainable) for n, t in local.items()}
            ctx = torch.no_grad() if trainable is None else contextlib.nullcontext()
            with ctx:
                out = megamoe.experts(leaves["x"], ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
                                      shared_gate_up=leaves["shared_gate_up"], shared_down=leaves["shared_down"],
                                      group=group, config=CONFIG)
            if out.requires_grad:
                out.backward(d_out)
            results[case] = (out.detach(), {n: t.grad for n, t in leaves.items()})
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        leave_gloo(rank, world)


def test_ep_gloo_inference_and_partial_backward(tmp_path):
    gen = torch.Generator().manual_seed(5)
    p = make_problem(gen, EP_WORLD * 5, 8, 4, 2 * EP_WORLD, 2, shared_intermediate=4)
    results = run_gloo_workers(_ep_worker, EP_WORLD, (p.__dict__, str(tmp_path)), tmp_path, 180, "inference EP")
    for r in results:
        assert "error" not in r, r.get("error")
    for rank, r in enumerate(results):
        full_out, full = r["full"]
        for case, per_rank in EP_CASES.items():
            out, grads = r[case]
            assert_equal(f"rank{rank} {case} out", out, full_out)
            trainable = per_rank[rank] or set()
            for name, g in grads.items():
                if name in trainable:
                    assert_equal(f"rank{rank} {case} d_{name}", g, full[name])
                else:
                    assert g is None, f"rank{rank} {case}: {name} got a .grad"


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing(reentrant):
    """torch.utils.checkpoint: the reentrant variant runs the first forward under no_grad (nothing saved)
    and recomputes with grad; both give the plain run's bits."""
    from torch.utils.checkpoint import checkpoint

    p = _problem(6, torch.float32)
    want_out, want = _run(p, set(NAMES))
    leaves = _leaves(p, set(NAMES))

    def fn(x, w, wgu, wd, sgu, sd):
        return megamoe.experts(x, p.topk_ids, w, wgu, wd, shared_gate_up=sgu, shared_down=sd, config=CONFIG)

    out = checkpoint(fn, *(leaves[n] for n in NAMES), use_reentrant=reentrant)
    out.backward(p.d_out)
    assert_equal("out", out.detach(), want_out)
    for name, t in leaves.items():
        assert_equal(f"d_{name}", t.grad, want[name])
