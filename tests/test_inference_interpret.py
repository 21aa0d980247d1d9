"""Inference and partial backward of the Triton backend, run by Triton's interpreter on CPU.

The same subprocess pattern as tests/test_triton_interpret.py (whose problem helpers and one-rank CPU
workspace this file reuses):

    TRITON_INTERPRET=1 pytest tests/test_inference_interpret.py     # direct
    pytest tests/test_inference_interpret.py                        # re-runs itself in such a subprocess

dtypes fp32 and fp16 (the interpreter cannot run bf16 tl.dot). Checked on the one-GPU driver
(backends/triton/experts.py), called directly on CPU tensors:
- experts_fwd(save_for_backward=False): the same out, bit for bit, nothing saved, gate_up not stored;
- experts_bwd(needs_grad=...): the gradients asked for are bitwise those of the full backward, the others
  None, and the kernels of the others are not launched (counted, or made to raise), in the default and
  MoEConfig.recompute modes;
and on the expert-parallel driver (ep.py) on a one-rank group: the same bits in inference and with any
needs_grad, and the unfused path's weight-grad kernels skipped for frozen weights.
"""

from __future__ import annotations


import pytest
import torch
from conftest import INTERPRET, INTERPRETER_WARNINGS, interpreted, interpreter_suite, poisoned_empty

pytestmark = INTERPRETER_WARNINGS
test_interpreter_suite = interpreter_suite(__file__)


if INTERPRET:
    from megamoe.backends.triton import ep, kernels
    from megamoe.backends.triton.experts import experts_bwd, experts_fwd
    from megamoe.config import MoEConfig
    from megamoe.schedule import build_schedule
    from test_triton_interpret import CASES, fake_workspace, make_problem

DTYPES = [torch.float32, torch.float16]
NAMES = ["x", "topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"]
FWD_CASES = ["T37-H48-I40-E5-k3-shared", "T40-H32-I32-E8-k2-empty-experts"]
# what requires grad
PARTIAL = {
    "frozen-weights": {"x", "topk_weights"},
    "frozen-w_down": {"x", "topk_weights", "w_gate_up", "shared_gate_up"},
    "x-no-grad": {"topk_weights", "w_gate_up", "w_down", "shared_gate_up", "shared_down"},
    "only-topk_weights": {"topk_weights"},
    "only-w_down": {"w_down", "shared_down"},
}
GEMMS = ["gate_up_fwd", "down_fwd", "down_dgrad", "down_dgrad_router", "gate_up_dgrad", "dw_down", "dw_gate_up"]


class Counter:
    """Counts (and records the keyword arguments of) calls to the wrapped functions; `fail` ones raise."""

    def __init__(self, fail=()):
        self.calls: dict[str, list] = {}
        self.fail = set(fail)

    def wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            if name in self.fail:
                raise AssertionError(f"{name} must not run here")
            self.calls.setdefault(name, []).append(kwargs)
            return fn(*args, **kwargs)

        return wrapper

    def count(self, name) -> int:
        return len(self.calls.get(name, []))


def spy_one_gpu(monkeypatch, counter: Counter) -> None:
    """Every GEMM launcher experts.py calls (whichever core its tiles select) and the gather/combine kernels."""
    for name in (*GEMMS, "spread_rows", "combine", "row_sums"):
        monkeypatch.setattr(kernels, name, counter.wrap(name, getattr(kernels, name)))


def setup(case, dtype):
    T, H, I, E, k, routing, shared, block_m = CASES[case]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, dtype, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    return (x, weights, wgu, wd, sgu, sd), d_out, build_schedule(ids, E, block_m=block_m)


def full_run(inputs, d_out, s, config=None):
    out, saved = experts_fwd(*inputs, s, None, config)
    return out, experts_bwd(d_out, inputs[0], *inputs[1:], s, None, config, saved)


# ----------------------------------------------------------------------------------------------------
# One GPU: inference


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", FWD_CASES)
def test_inference_forward_same_bits_nothing_saved(case, dtype, monkeypatch):
    inputs, _, s = setup(case, dtype)
    with poisoned_empty():
        want, saved = experts_fwd(*inputs, s, None)
        assert sum(t.numel() for t in saved) > 0
        counter = Counter()
        spy_one_gpu(monkeypatch, counter)
        got, saved = experts_fwd(*inputs, s, None, save_for_backward=False)
    assert saved == (), f"inference saved {len(saved)} tensors"
    assert torch.equal(got, want), f"out: inference differs (max diff {(got.double() - want.double()).abs().max():.3e})"
    # gate_up is not stored (the SwiGLU epilogue alone), every other kernel runs once.
    assert [c["store_gate_up"] for c in counter.calls["gate_up_fwd"]] == [False]
    assert counter.count("down_fwd") == 1 and counter.count("combine") == 1 and counter.count("spread_rows") == 1
    assert all(counter.count(n) == 0 for n in ("down_dgrad", "gate_up_dgrad", "dw_down", "dw_gate_up", "row_sums"))


# ----------------------------------------------------------------------------------------------------
# One GPU: only the gradients asked for


@interpreted
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("needed", list(PARTIAL))
def test_partial_backward(needed, dtype, recompute, monkeypatch):
    trainable = PARTIAL[needed]
    inputs, d_out, s = setup("T37-H48-I40-E5-k3-shared", dtype)
    config = MoEConfig(recompute=recompute)
    needs = tuple(n in trainable for n in NAMES)
    need_x, need_w, need_gu, need_d = needs[:4]
    rows_part = need_x or need_w or need_gu or need_d
    with poisoned_empty():
        want_out, want = full_run(inputs, d_out, s, config)
        out, saved = experts_fwd(*inputs, s, None, config)
        # A kernel whose gradient is not needed raises if launched; the expert-parallel kernels never run here.
        fail = {n for n, need in [("dw_down", need_d), ("dw_gate_up", need_gu), ("gate_up_dgrad", need_x),
                                  ("down_dgrad_router", rows_part), ("combine", need_x), ("down_dgrad", False),
                                  ("row_sums", need_w)]
                if not need}
        counter = Counter(fail)
        spy_one_gpu(monkeypatch, counter)
        got = experts_bwd(d_out, inputs[0], *inputs[1:], s, None, config, saved, needs_grad=needs)
    assert torch.equal(out, want_out)
    for name, g, w in zip(NAMES, got, want):
        if name in trainable:
            assert g is not None, f"d_{name} asked for, not computed"
            assert torch.equal(g, w), f"d_{name}: differs from the full backward (max diff {(g.double() - w.double()).abs().max():.3e})"
        else:
            assert g is None, f"d_{name} not asked for, yet computed"
    assert counter.count("dw_down") == need_d and counter.count("dw_gate_up") == need_gu
    assert counter.count("gate_up_dgrad") == need_x and counter.count("combine") == need_x
    assert counter.count("down_dgrad_router") == rows_part
    # h_w (d_w_down's operand) is stored only for d_w_down
    assert [c["store_h_w"] for c in counter.calls.get("down_dgrad_router", [])] == [need_d] * rows_part
    # the d_out gather, one of x for dw_gate_up, and (recompute) one of x for the gate/up GEMM
    assert counter.count("spread_rows") == rows_part + need_gu + (recompute and rows_part)
    assert counter.count("gate_up_fwd") == (rows_part and recompute)


# ----------------------------------------------------------------------------------------------------
# Expert parallelism (ep.py) on one rank, CPU workspace


EP_DIRECTIONS = {"pull-push": ("pull", "push"), "push-pull": ("push", "pull")}


@interpreted
@pytest.mark.parametrize("directions", list(EP_DIRECTIONS))
def test_ep_inference_and_partial_backward(directions, monkeypatch):
    """ep.py: inference gives the same out and saves nothing; with any needs_grad, every gradient asked
    for is bitwise the full backward's; on the unfused path (push-pull) the weight-grad kernels of frozen
    weights are not launched (the fused kernel computes them inside, whatever is needed)."""
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    inputs, d_out, s = setup("T37-H48-I40-E5-k3-shared", torch.float16)
    dispatch, combine = EP_DIRECTIONS[directions]
    config = MoEConfig(dispatch=dispatch, combine=combine)
    x = inputs[0]
    with poisoned_empty():
        want_out, saved = ep.experts_fwd(*inputs, s, None, config)
        want = ep.experts_bwd(d_out, x, *inputs[1:], s, None, config, saved)
        got_out, none_saved = ep.experts_fwd(*inputs, s, None, config, save_for_backward=False)
        assert none_saved == ()
        assert torch.equal(got_out, want_out), "ep.py inference out differs"
        for needed, trainable in PARTIAL.items():
            needs = tuple(n in trainable for n in NAMES)
            out, saved = ep.experts_fwd(*inputs, s, None, config)
            counter = Counter()
            if directions != "pull-push":
                for name in ("dw_down", "dw_gate_up"):
                    monkeypatch.setattr(kernels, name, counter.wrap(name, getattr(kernels, name)))
            got = ep.experts_bwd(d_out, x, *inputs[1:], s, None, config, saved, needs_grad=needs)
            monkeypatch.undo()
            monkeypatch.setattr(ep, "get_workspace", fake_workspace)
            for name, g, w in zip(NAMES, got, want):
                if name in trainable:
                    assert g is not None and torch.equal(g, w), f"{needed}: d_{name} differs from the full backward"
            if directions != "pull-push":
                assert counter.count("dw_down") == ("w_down" in trainable), needed
                assert counter.count("dw_gate_up") == ("w_gate_up" in trainable), needed
