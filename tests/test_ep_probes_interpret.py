"""The measurement probes of benchmarks/ep_probes.py, run by Triton's interpreter on CPU.

The same subprocess pattern as tests/test_triton_interpret.py (whose problem helpers and one-rank CPU
workspace this file reuses):

    TRITON_INTERPRET=1 pytest tests/test_ep_probes_interpret.py     # direct
    pytest tests/test_ep_probes_interpret.py                        # re-runs itself in such a subprocess

benchmarks/overlap_bench.py times the expert-parallel layer against its two halves; the halves must be
what their names say, or its hidden/exposed numbers mean nothing. On a one-rank group (fp16):
- "compute" launches every GEMM, weight-grad and slot-sum kernel of the unfused layer once (the router
  weights' row sums included), and no exchange step at all;
- "comm" launches no kernel of the layer's math, and its exchanges deliver the rows the layer's would:
  each receive row holds its token's x row, and in the backward its token's d_out row (padding rows zero),
  for both dispatch directions.
"""

from __future__ import annotations

import collections
import importlib.util
import pathlib

import pytest
import torch
from conftest import INTERPRET, INTERPRETER_WARNINGS, interpreted, interpreter_suite

pytestmark = INTERPRETER_WARNINGS
test_interpreter_suite = interpreter_suite(__file__)


if INTERPRET:
    from megamoe.backends.triton import ep, kernels
    from megamoe.backends.triton.comm import exchange
    from megamoe.config import MoEConfig
    from megamoe.schedule import build_schedule
    from test_triton_interpret import CASES, fake_workspace, make_problem

    _spec = importlib.util.spec_from_file_location(
        "ep_probes", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ep_probes.py")
    ep_probes = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ep_probes)

CASE = "T37-H48-I40-E5-k3-shared"
GEMMS = ["gate_up_fwd", "down_fwd", "down_dgrad_router", "gate_up_dgrad", "dw_down", "dw_gate_up"]
SLOT_SUMS = ["combine", "row_sums"]
FUSED = ["ep_forward", "ep_backward"]
EXCHANGE = ["publish", "pull_rows", "push_tokens", "pull_pairs", "push_rows", "collect_pushed", "dispatch",
            "dispatch_pair_weights", "combine", "gather_routing"]  # every step of comm/exchange.py
DIRECTIONS = {"pull-push": ("pull", "push"), "push-pull": ("push", "pull")}


def _setup(directions, monkeypatch):
    T, H, I, E, k, routing, shared, block_m = CASES[CASE]
    x, ids, weights, wgu, wd, sgu, sd = make_problem(T, H, I, E, k, torch.float16, routing=routing, shared=shared)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).half()
    dispatch, combine = DIRECTIONS[directions]
    config = MoEConfig(dispatch=dispatch, combine=combine)
    monkeypatch.setattr(ep, "get_workspace", fake_workspace)
    return (x, weights, wgu, wd, sgu, sd), d_out, build_schedule(ids, E, block_m=block_m, config=config), config


def _spy(monkeypatch) -> tuple[collections.Counter, collections.Counter]:
    """(kernel launches, exchange steps, those inside exchange steps included) by name, from here on."""
    launches, steps = collections.Counter(), collections.Counter()

    def wrap(counter, name, fn):
        def counted(*args, **kwargs):
            counter[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name in GEMMS + SLOT_SUMS + FUSED:
        monkeypatch.setattr(kernels, name, wrap(launches, name, getattr(kernels, name)))
    for name in EXCHANGE:
        monkeypatch.setattr(exchange, name, wrap(steps, name, getattr(exchange, name)))
    return launches, steps


@interpreted
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the GEMMs multiply unfilled rows, by design
def test_compute_probe_runs_every_kernel_and_no_exchange(monkeypatch):
    inputs, d_out, s, config = _setup("pull-push", monkeypatch)
    launches, steps = _spy(monkeypatch)
    out, saved = ep_probes.compute_fwd(*inputs, s, None, config)
    grads = ep_probes.compute_bwd(d_out, inputs[0], *inputs[1:], s, None, config, saved)
    assert not steps, f"the compute probe ran exchange steps: {dict(steps)}"
    want = {**{name: 1 for name in GEMMS + ["row_sums"]}, "combine": 2}  # the forward's and d_x's slot sums
    assert launches == want, f"kernel launches {dict(launches)}, want {want}"
    assert out.shape == inputs[0].shape
    for name, g, like in zip(["d_x", "d_topk_weights", "d_w_gate_up", "d_w_down", "d_sgu", "d_sd"], grads, inputs):
        assert g is not None and g.shape == like.shape, f"{name}: {None if g is None else tuple(g.shape)}"


@interpreted
@pytest.mark.parametrize("directions", list(DIRECTIONS))
def test_comm_probe_moves_the_rows_and_runs_no_gemm(directions, monkeypatch):
    inputs, d_out, s, config = _setup(directions, monkeypatch)
    x = inputs[0]
    launches, steps = _spy(monkeypatch)
    _, (x_rows,) = ep_probes.comm_fwd(*inputs, s, None, config)
    d_out_rows, _ = ep_probes.comm_bwd(d_out, x, *inputs[1:], s, None, config, ())
    assert not launches, f"the comm probe computed: {dict(launches)}"
    assert steps["publish" if directions == "pull-push" else "dispatch"] >= 2, dict(steps)
    assert steps["combine"] == 2, f"the forward's and the backward's combines: {dict(steps)}"
    used, k = int(s.expert_offsets[-1]), s.top_k
    src = s.row_src[:used].long()
    valid = src >= 0
    token = src.clamp(min=0) // k
    assert torch.equal(x_rows[:used], torch.where(valid[:, None], x[token], 0)), "the dispatch did not deliver x rows"
    assert torch.equal(d_out_rows[:used], torch.where(valid[:, None], d_out[token], 0)), "nor the d_out rows"
