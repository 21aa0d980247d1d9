"""The benchmark harness (megamoe.bench, `python -m megamoe bench`): FLOPs, routing, gate, JSON records, EP runs."""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

import megamoe
from megamoe.__main__ import main
from megamoe.bench import gate, measure, problem, run
from megamoe.bench.gate import gate_backends, rel_err
from megamoe.bench.measure import alternating_rounds, kernel_times, median_ms, round_order
from megamoe.bench.problem import cast, forward_backward, make_tokens, make_weights, megamoe_layout, torchtitan_weights
from megamoe.bench.routing import expert_load_E, route
from megamoe.bench.run import RECORD_FIELDS
from megamoe.bench.workloads import WORKLOADS, choose_experts_per_gpu, footprint_bytes, layer_flops
from megamoe.schedule import build_schedule

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["bench", "--workload", "cpu-small", "--tokens", "64", "--iters", "2", "--warmup", "1", "--rounds", "2"]


def test_layer_flops_counts_as_design_md():
    w = WORKLOADS["deepseek-v3"]  # H 7168, I 2048, k 8, shared I 2048
    fwd = 6 * 8192 * 8 * 7168 * 2048 + 6 * 8192 * 7168 * 2048
    assert layer_flops(w, 8192, "fwd") == fwd
    assert layer_flops(w, 8192, "fwd+bwd") == 3 * fwd
    assert layer_flops(WORKLOADS["mixtral-8x7b"], 10, "fwd") == 6 * 10 * 2 * 4096 * 14336
    with pytest.raises(ValueError, match="pass_name"):
        layer_flops(w, 1, "bwd")


def test_kernel_breakdown_swaps_the_routing_weights_and_keeps_the_ids():
    """benchmarks/kernel_breakdown.py --weights: the routing's expert ids with its own weights, 1/k each, or the
    weights another routing draws from the same generator state (how the H100's skew probe told the ids' cost from
    the weights'); an unknown choice is a ValueError naming the argument."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("kernel_breakdown", REPO / "benchmarks" / "kernel_breakdown.py")
    breakdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breakdown)
    T, E, k = 64, 16, 4

    def draw(routing, weights):
        return breakdown.routing_weights(routing, weights, T, E, k, torch.Generator().manual_seed(0))

    balanced_ids, balanced_w = route("balanced", T, E, k, torch.Generator().manual_seed(0))
    skewed_ids, skewed_w = route("skewed", T, E, k, torch.Generator().manual_seed(0))
    assert not torch.equal(balanced_ids, skewed_ids) and not torch.equal(balanced_w, skewed_w)
    for weights in ("routing", "balanced"):
        ids, tw = draw("balanced", weights)
        assert torch.equal(ids, balanced_ids) and torch.equal(tw, balanced_w)
    ids, tw = draw("balanced", "skewed")
    assert torch.equal(ids, balanced_ids) and torch.equal(tw, skewed_w)
    ids, tw = draw("skewed", "uniform")
    assert torch.equal(ids, skewed_ids) and torch.equal(tw, torch.full((T, k), 1.0 / k))
    with pytest.raises(ValueError, match="weights must be one of"):
        draw("balanced", "zipf")


def test_kernel_breakdown_counts_the_bytes_a_row_pass_moves():
    """benchmarks/kernel_breakdown.py's GB/s: spread_rows reads each of x's T rows once (storing it to its k rows) and
    writes the rows in use, padding included; combine reads the T * k pairs' rows and writes T. It counted T * k rows
    read for a spread and no padding, ~1.8x the bytes at k = 8 (4.5 TB/s on an H100, whose HBM gives 3.35)."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("kernel_breakdown", REPO / "benchmarks" / "kernel_breakdown.py")
    breakdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breakdown)
    T, k, H, E = 64, 8, 32, 16
    ids, _ = route("balanced", T, E, k, torch.Generator().manual_seed(0))
    rows = int(build_schedule(ids, E, block_m=16).expert_offsets[-1])
    assert rows > T * k  # padding rows in use
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    moved = breakdown.row_pass_bytes(T, k, H, rows)
    assert moved["spread_rows"] == x.nbytes + rows * H * x.element_size()
    assert moved["combine"] == (T * k + T) * H * x.element_size()


def _tile_order_model():
    spec = importlib.util.spec_from_file_location("tile_order_model", REPO / "benchmarks" / "tile_order_model.py")
    model = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model  # its dataclass looks its module up there
    spec.loader.exec_module(model)
    return model


def test_tile_order_model_orders_and_bytes():
    """benchmarks/tile_order_model.py: both orders visit every tile once; the experts order's groups stay inside
    one expert (the kernels' _common.expert_tile_coords, here over the whole range); with a cache that holds
    everything each box is read once, whatever the order; with a small one the groups that straddle experts read
    the straddled experts' weights again."""
    model = _tile_order_model()
    block_expert = [0] * 5 + [1] * 4 + [2] * 3  # 12 row blocks; groups of 4: across 0-3, 4-7, 8-11
    assert model.tile_order(block_expert, 2, 4, "across")[:8] == [(0, 0), (1, 0), (2, 0), (3, 0),
                                                                  (0, 1), (1, 1), (2, 1), (3, 1)]
    experts = model.tile_order(block_expert, 2, 4, "experts")
    assert experts[8:12] == [(4, 0), (4, 1), (5, 0), (6, 0)]  # expert 0's last block alone, then expert 1's four
    for order in model.ORDERS:
        tiles = model.tile_order(block_expert, 2, 4, order)
        assert sorted(tiles) == [(m, n) for m in range(12) for n in range(2)]
    gemm = model.RowGemm("down_fwd", k=128, n=512, block_n=256, w_step_bytes=256 * 64 * 2)
    a_boxes, w_boxes = 12 * 2, 3 * 2 * 2  # (row block, K step); (expert, column block, K step)
    everything = a_boxes * 128 * 64 * 2 + w_boxes * gemm.w_step_bytes
    for order in model.ORDERS:
        assert model.modelled_reads(block_expert, gemm, order, 2**30, group_m=4, sms=3) == everything
    small = 3 * gemm.w_step_bytes  # not even one expert's weights
    assert (model.modelled_reads(block_expert, gemm, "experts", small, group_m=4, sms=3)
            < model.modelled_reads(block_expert, gemm, "across", small, group_m=4, sms=3))
    with pytest.raises(ValueError, match="order must be one of"):
        model.tile_order(block_expert, 2, 4, "rows")


def test_workload_shapes_are_the_models_published_ones():
    rows = {name: (w.hidden, w.intermediate, w.num_experts, w.top_k, w.shared_intermediate, w.tokens_per_gpu)
            for name, w in WORKLOADS.items()}  # fmt: skip
    assert rows == {
        "qwen3-30b-a3b": (2048, 768, 128, 8, 0, 16384),
        "qwen3-235b-a22b": (4096, 1536, 128, 8, 0, 16384),
        "deepseek-v3": (7168, 2048, 256, 8, 2048, 8192),
        "gpt-oss-120b": (2880, 2880, 128, 4, 0, 16384),
        "mixtral-8x7b": (4096, 14336, 8, 2, 0, 8192),
        "kimi-k2": (7168, 2048, 384, 8, 2048, 4096),
        "cpu-small": (256, 128, 8, 2, 128, 512),
    }


def test_experts_per_gpu_cuts():
    deepseek, qwen = WORKLOADS["deepseek-v3"], WORKLOADS["qwen3-30b-a3b"]
    assert choose_experts_per_gpu(deepseek, 8192, 1, 2, None, None) == (32, "default cut on one GPU")
    assert choose_experts_per_gpu(deepseek, 8192, 2, 2, None, None) == (128, "")
    assert choose_experts_per_gpu(qwen, 16384, 1, 2, 16, None) == (16, "--experts-per-gpu 16")
    free = int(footprint_bytes(qwen, 16384, 32, 1, 2) / 0.9) + 1  # fits 32 experts, not 64
    n, why = choose_experts_per_gpu(qwen, 16384, 1, 2, None, free_bytes=free)
    assert n == 32 and "GiB free" in why
    with pytest.raises(ValueError, match="split evenly"):
        choose_experts_per_gpu(WORKLOADS["cpu-small"], 64, 3, 4, None, None)


def _check_distinct_per_token(topk_ids_TK: torch.Tensor) -> None:
    sorted_ids, _ = topk_ids_TK.sort(dim=1)
    assert (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all(), "topk_ids: an expert repeats within a token"


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_routing_ids_and_weights(routing):
    topk_ids_TK, topk_weights_TK = route(routing, 1024, 64, 8, torch.Generator().manual_seed(0))
    assert topk_ids_TK.shape == (1024, 8) and topk_weights_TK.dtype == torch.float32
    assert ((topk_ids_TK >= 0) & (topk_ids_TK < 64)).all(), "topk_ids: out of range"
    _check_distinct_per_token(topk_ids_TK)
    torch.testing.assert_close(topk_weights_TK.sum(dim=1), torch.ones(1024))


def test_balanced_routing_loads_every_expert_near_the_mean():
    load_E = expert_load_E(route("balanced", 4096, 64, 8, torch.Generator().manual_seed(0))[0], 64)
    mean = 4096 * 8 / 64  # 512; binomial std ~21
    assert load_E.min() >= 0.8 * mean and load_E.max() <= 1.2 * mean, f"load: {load_E.tolist()}"


def test_skewed_routing_overloads_some_experts():
    load_E = expert_load_E(route("skewed", 4096, 128, 8, torch.Generator().manual_seed(0))[0], 128).float()
    assert load_E.max() / load_E.mean() > 8, f"load: {load_E.tolist()}"


def _cpu_problem(dtype, num_tokens=64, routing="skewed"):
    """cpu-small's weights (all 8 experts) and one routed input set, as run_bench makes them."""
    w = WORKLOADS["cpu-small"]
    weights = make_weights(w, range(8), dtype, torch.device("cpu"))
    tokens = make_tokens(w, num_tokens, 8, routing, dtype, torch.Generator().manual_seed(0))
    return w, weights, tokens


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, the gradient scaled: a backend whose forward is right and one gradient wrong."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_passes_torch_and_fails_a_wrong_backend(dtype, monkeypatch):
    w, weights, tokens = _cpu_problem(dtype)
    gates = gate_backends(w, ["torchtitan", "torch", "triton"], weights, tokens, group=None)
    assert gates["torchtitan"] == ("ok", "")
    assert gates["torch"] == ("ok", "")
    assert gates["triton"][0] == "unavailable"

    experts = megamoe.experts
    monkeypatch.setattr(megamoe, "experts", lambda *args, **kwargs: experts(*args, **kwargs) * 1.02)
    gates = gate_backends(w, ["torchtitan", "torch"], weights, tokens, group=None)
    status, detail = gates["torch"]
    assert status == "FAILED" and "out: rel err" in detail, detail
    assert gates["torchtitan"] == ("ok", ""), "the TorchTitan baseline does not run megamoe.experts"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_fails_one_wrong_gradient(dtype, monkeypatch):
    """Every gradient is gated, not only the output: d_w_down 2% off (the forward exact) fails, naming it alone."""
    w, weights, tokens = _cpu_problem(dtype)
    experts = megamoe.experts

    def wrong_d_w_down(x, ids, tw, w_gate_up, w_down, **kwargs):
        return experts(x, ids, tw, w_gate_up, _ScaleGrad.apply(w_down, 1.02), **kwargs)

    monkeypatch.setattr(megamoe, "experts", wrong_d_w_down)
    status, detail = gate_backends(w, ["torch"], weights, tokens, group=None)["torch"]
    assert status == "FAILED" and detail.startswith("d_w_down: rel err") and ";" not in detail, detail


def test_gate_fails_an_inf_result_when_the_reference_in_the_dtype_overflows_too():
    """NaN or inf never pass (docs/design.md). x 100 times larger overflows fp16 (not the fp64 truth): the fp16
    reference's error, and with it the budget, is inf, and the torch backend's out, inf in 2048 elements, passed."""
    w, weights, tokens = _cpu_problem(torch.float16, num_tokens=16, routing="balanced")
    tokens = dataclasses.replace(tokens, x_TH=(tokens.x_TH.detach() * 100).requires_grad_())
    status, detail = gate_backends(w, ["torch"], weights, tokens, group=None)["torch"]
    assert status == "FAILED" and "out: rel err inf, not finite" in detail, detail


def test_torchtitan_runs_on_its_own_gate_and_up_weights():
    """TorchTitan's baseline gets gate and up as two leaves of its own (w1, w3; copies, the rest shared), returns their
    two gradients as its autograd leaves them, and those joined are megamoe's d_w_gate_up; the copy it replaces is
    what its memory figures leave out."""
    w, weights, tokens = _cpu_problem(torch.float32)
    held = gate.backend_weights("torchtitan", weights)
    w1, w3 = held.w_gate_up_E2IH
    assert w1.is_leaf and w3.is_leaf and w1.is_contiguous() and w3.is_contiguous()
    assert torch.equal(torch.cat([w1, w3], dim=1), weights.w_gate_up_E2IH)
    assert held.w_down_EHI is weights.w_down_EHI and held.shared_gate_up_2IH is weights.shared_gate_up_2IH
    assert gate.backend_weights("torch", weights) is weights

    titan = forward_backward(gate.experts_fn("torchtitan"), held, tokens)
    ours = forward_backward(gate.experts_fn("torch"), weights, tokens)
    assert isinstance(titan["d_w_gate_up"], tuple) and len(titan["d_w_gate_up"]) == 2
    assert titan.keys() == ours.keys()
    for name in ours:
        torch.testing.assert_close(megamoe_layout(titan[name]), ours[name], rtol=1e-5, atol=1e-5, msg=name)

    gate_up_bytes = weights.w_gate_up_E2IH.numel() * weights.w_gate_up_E2IH.element_size()
    assert run.unused_weight_bytes(weights, held) == gate_up_bytes
    assert run.unused_weight_bytes(weights, weights) == 0


def test_torchtitan_copies_gate_and_up_with_one_expert_per_rank():
    """With one expert per rank (mixtral-8x7b at EP=8) each half of [1, 2I, H] is already contiguous: TorchTitan's
    w1 and w3 are still copies, so the weight its peak leaves out is one that its turn does not use."""
    weights = make_weights(WORKLOADS["cpu-small"], range(3, 4), torch.float32, torch.device("cpu"))
    held = gate.backend_weights("torchtitan", weights)
    storage = weights.w_gate_up_E2IH.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != storage and t.is_contiguous() for t in held.w_gate_up_E2IH)
    assert torch.equal(torch.cat(held.w_gate_up_E2IH, dim=1), weights.w_gate_up_E2IH)


def test_streamed_reference_is_the_reference():
    """The gate's reference, streamed expert by expert: in fp64 it is megamoe.reference.experts in fp64 (to
    rounding); its fp32 ground truth (what GPUs run) is within 1e-6 of it; its bf16 budgets are the old
    gate's, 2x the error of megamoe.reference.experts run in bf16 (+ the floor), d_x to its summation order."""
    w, weights, tokens = _cpu_problem(torch.bfloat16)
    ref64 = forward_backward(megamoe.reference.experts, *cast(weights, tokens, torch.float64))
    ref_bf16 = forward_backward(megamoe.reference.experts, *cast(weights, tokens, torch.bfloat16))
    streamed = gate.reference(w, weights, tokens, None)
    streamed32 = gate.reference(w, weights, tokens, None, truth_dtype=torch.float32)
    assert list(streamed.truth) == list(ref64), "every output and gradient of forward_backward"
    for name, want in ref64.items():
        assert streamed.truth[name].dtype == torch.float64 and streamed32.truth[name].dtype == torch.float32, name
        assert rel_err(streamed.truth[name], want) < 1e-12, name
        assert rel_err(streamed32.truth[name], want) < 1e-6, name
        budget = 2 * rel_err(ref_bf16[name], want) + gate.NOISE_FLOOR
        assert 0.8 * budget < streamed.budget[name] < 1.25 * budget, (name, streamed.budget[name], budget)
    fp32 = gate.reference(w, *_cpu_problem(torch.float32)[1:], None)
    assert set(fp32.budget.values()) == {gate.FP32_REL_TOL}


def test_run_gates_the_timed_problem(monkeypatch, capsys):
    """run_bench gates the tensors it times (all T tokens, every expert), not a smaller stand-in."""
    gated, timed = [], []

    def spy_gate(w, backends, weights, tokens, group):
        gated.append((weights, tokens))
        return gate_backends(w, backends, weights, tokens, group)

    def spy_time(backend, pass_name, weights, token_sets, **kwargs):
        timed.append((weights, token_sets[0]))
        return {"ms": 1.0, "peak_mem_bytes": None, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None}

    monkeypatch.setattr(run, "gate_backends", spy_gate)
    monkeypatch.setattr(run, "time_pass", spy_time)
    code = run.run_bench(workloads=["cpu-small"], backends=["torch"], routing="skewed", tokens=48, iters=1, warmup=0,
                         dtype=None, experts_per_gpu=None, json_path=None)
    assert code == 0, capsys.readouterr().out
    (weights, tokens), = gated
    assert tokens.x_TH.shape == (48, 256) and weights.w_gate_up_E2IH.shape == (8, 256, 256)
    assert all(w is weights and t is tokens for w, t in timed) and len(timed) == 4  # 2 backends x 2 passes


def test_backends_are_timed_in_alternating_rounds(monkeypatch, capsys, tmp_path):
    """Every (backend, pass) takes one turn per round, in round_order's order; a record's ms is the median of its
    rounds' medians (round_ms, in order), its TFLOP/s follows from that ms, its memory is the rounds' maximum."""
    turns = []

    def fake_time(backend, pass_name, weights, token_sets, **kwargs):
        turns.append((backend, pass_name))
        n = len(turns)
        return {"ms": float(n), "peak_mem_bytes": n, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None}

    monkeypatch.setattr(run, "time_pass", fake_time)
    path = tmp_path / "r.json"
    code = run.run_bench(workloads=["cpu-small"], backends=["torch"], routing="balanced", tokens=48, iters=1,
                         warmup=0, dtype=None, experts_per_gpu=None, json_path=str(path), rounds=3)
    assert code == 0, capsys.readouterr().out
    names = [(b, p) for b in ("torchtitan", "torch") for p in ("fwd", "fwd+bwd")]
    assert turns == [t for r in range(3) for t in round_order(names, r)]
    records = json.loads(path.read_text())
    assert [(r["backend"], r["pass"]) for r in records] == names
    for r in records:
        key = (r["backend"], r["pass"])
        want = [float(i + 1) for i, turn in enumerate(turns) if turn == key]
        assert r["round_ms"] == want and r["ms"] == want[1]
        assert r["tflops"] == pytest.approx(layer_flops(WORKLOADS["cpu-small"], 48, r["pass"]) / want[1] / 1e9)
        assert r["peak_mem_bytes"] == max(want) and r["peak_mem_above_inputs_bytes"] is None


def test_a_backend_that_fails_its_gate_is_recorded_not_timed(monkeypatch, capsys, tmp_path):
    """The JSON keeps a record of a backend that failed its gate (status, why, nothing measured), the run's exit
    code says so, and the other backends are still timed."""
    def gate_with_a_failure(w, backends, weights, tokens, group):
        gates = gate_backends(w, backends, weights, tokens, group)
        gates["torch"] = ("FAILED", "out: rel err 1 > 0.1")
        return gates

    monkeypatch.setattr(run, "gate_backends", gate_with_a_failure)
    path = tmp_path / "r.json"
    code = run.run_bench(workloads=["cpu-small"], backends=["torch"], routing="balanced", tokens=48, iters=1,
                         warmup=0, dtype=None, experts_per_gpu=None, json_path=str(path))
    out = capsys.readouterr().out
    assert code == 1 and "FAILED: cpu-small balanced torch: out: rel err 1 > 0.1" in out, out
    records = {(r["backend"], r["pass"]): r for r in json.loads(path.read_text())}
    assert len(records) == 4 and all(tuple(r) == RECORD_FIELDS for r in records.values())
    for pass_name in ("fwd", "fwd+bwd"):
        failed, timed = records["torch", pass_name], records["torchtitan", pass_name]
        assert failed["status"] == "FAILED" and failed["detail"] == "out: rel err 1 > 0.1"
        assert failed["ms"] is None and failed["round_ms"] is None and failed["tflops"] is None
        assert timed["status"] == "ok" and timed["ms"] > 0


def test_a_run_stopped_early_keeps_the_records_it_finished(monkeypatch, tmp_path):
    """The JSON is written after each (workload, routing): an error while timing the skewed routing (out of memory, a
    time limit's signal) leaves the balanced routing's records in the file."""
    real_time_in_rounds = run.time_in_rounds
    calls = []

    def stop_at_the_second(turns, rounds, progress):
        calls.append(len(turns))
        if len(calls) == 2:
            raise RuntimeError("stopped")
        return real_time_in_rounds(turns, rounds, progress)

    monkeypatch.setattr(run, "time_in_rounds", stop_at_the_second)
    path = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="stopped"):
        run.run_bench(workloads=["cpu-small"], backends=["torch"], routing="both", tokens=16, iters=1, warmup=0,
                      dtype=None, experts_per_gpu=None, json_path=str(path))
    records = json.loads(path.read_text())
    assert {(r["routing"], r["backend"], r["pass"]) for r in records} == {
        ("balanced", b, p) for b in ("torchtitan", "torch") for p in ("fwd", "fwd+bwd")}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in records)


def test_a_name_given_twice_runs_once(monkeypatch, capsys, tmp_path):
    """--workload cpu-small,cpu-small (or a backend twice) times it once: two runs of one workload would share
    their rows' keys, and each row's speed-up would be taken against the other run's baseline (the baseline
    itself then shown at 2x or 0.5x of itself)."""
    timed = iter(range(1, 100))
    monkeypatch.setattr(run, "gate_backends", lambda w, backends, *args: dict.fromkeys(backends, ("ok", "")))
    monkeypatch.setattr(run, "time_pass", lambda *args, **kwargs: {
        "ms": float(next(timed)), "peak_mem_bytes": None, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None,
    })
    path = tmp_path / "r.json"
    code = run.run_bench(workloads=["cpu-small", "cpu-small"], backends=["torch", "torch", "torchtitan"],
                         routing="balanced", tokens=16, iters=1, warmup=0, dtype=None, experts_per_gpu=None,
                         json_path=str(path))
    out = capsys.readouterr().out
    assert code == 0, out
    records = json.loads(path.read_text())
    assert [(r["backend"], r["pass"]) for r in records] == [
        (b, p) for b in ("torchtitan", "torch") for p in ("fwd", "fwd+bwd")
    ]
    titan_lines = [line for line in out.splitlines() if " torchtitan " in line]
    assert len(titan_lines) == 2 and all(line.endswith("1.00x") for line in titan_lines), out


def test_peak_memory_includes_the_ep_workspace():
    """The symmetric-memory workspace lies outside the caching allocator: both peaks add it, and it is also
    reported alone (None where no workspace can exist: no group, or no Triton)."""
    cpu = torch.device("cpu")
    assert run.memory_record(10, 4, 3, cpu, None) == {
        "peak_mem_bytes": 13, "peak_mem_above_inputs_bytes": 9, "workspace_bytes": 3}
    assert run.memory_record(10, 4, None, cpu, None) == {
        "peak_mem_bytes": 10, "peak_mem_above_inputs_bytes": 6, "workspace_bytes": None}


def _bench(tmp_path: Path, launcher: list[str]) -> list[dict]:
    path = tmp_path / "results.json"
    done = subprocess.run(
        [*launcher, "megamoe", *TINY_RUN, "--json", str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cpu-small" in done.stdout and "vs torchtitan" in done.stdout, done.stdout
    return json.loads(path.read_text())


def _check_records(records: list[dict], ep: int) -> None:
    """The TorchTitan baseline and megamoe's portable path, each in every (routing, pass), baseline first."""
    assert {(r["backend"], r["routing"], r["pass"]) for r in records} == {
        (backend, routing, pass_name) for backend in ("torchtitan", "torch") for routing in ("balanced", "skewed")
        for pass_name in ("fwd", "fwd+bwd")
    }
    assert records[0]["backend"] == "torchtitan"
    for r in records:
        assert tuple(r) == RECORD_FIELDS
        problem = (r["workload"], r["ep"], r["tokens"], r["experts_per_gpu"])
        assert problem == ("cpu-small", ep, 64, 8 // ep)
        assert r["ms"] > 0 and r["tflops"] > 0
        assert len(r["round_ms"]) == 2 and r["ms"] == pytest.approx(sum(r["round_ms"]) / 2)
        assert (r["iters"], r["warmup"]) == (2, 1)  # TINY_RUN's: a record says what its ms is the median of
        assert r["gpu"] == "cpu" and r["dtype"] == "fp32" and r["mfu"] is None and r["peak_mem_bytes"] is None
        assert r["peak_mem_above_inputs_bytes"] is None and r["workspace_bytes"] is None
        assert r["torch"] == torch.__version__ and r["commit"]
        assert r["status"] == "ok" and r["detail"] == ""


def test_cli_writes_json_records(tmp_path):
    _check_records(_bench(tmp_path, [sys.executable, "-m"]), ep=1)


def test_torchrun_two_ranks_gloo(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    _check_records(_bench(tmp_path, launcher), ep=2)


def test_bench_sh_runs_in_the_callers_folder(tmp_path):
    """./scripts/bench.sh --json out.json run from another folder writes out.json there, not in the repository
    (setup.sh changes to the repository root). The real scripts, with a stand-in .venv whose python prints
    the folder it runs in instead of setting up or timing anything."""
    scripts, venv_bin, caller = tmp_path / "repo" / "scripts", tmp_path / "repo" / ".venv" / "bin", tmp_path / "caller"
    for folder in (scripts, venv_bin, caller):
        folder.mkdir(parents=True)
    for name in ("bench.sh", "setup.sh"):
        (scripts / name).write_text((REPO / "scripts" / name).read_text())
    (scripts.parent / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())  # setup.sh's install stamp
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')  # as a real one: its absolute path
    (venv_bin / "python").write_text('#!/usr/bin/env bash\n[ "$2" = megamoe ] && echo "$PWD"\nexit 0\n')
    (venv_bin / "python").chmod(0o755)
    done = subprocess.run(["bash", str(scripts / "bench.sh"), "--json", "out.json"], cwd=caller,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(caller), f"bench ran in {done.stdout.strip()}, not the caller's {caller}"


def test_triton_next_sh_installs_each_triton_beside_torch(tmp_path):
    """scripts/test_triton_next.sh runs the compile tests under each tracked Triton beside torch 2.13.0, whose Linux
    wheels on PyPI require triton==3.7.1: asked for in one pip command with torch, 3.8.0 and 3.9.0 cannot resolve
    (they did beside a CPU wheel only, which pins none). The real script, with stand-in venvs whose python answers
    as pip does with that pin, and whose pytest reports the Triton it would run under."""
    script = (REPO / "scripts" / "test_triton_next.sh").read_text()
    versions = re.search(r"for version in ([\d. ]+); do", script).group(1).split()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test_triton_next.sh").write_text(script)
    stand_in = f"""#!{sys.executable}
import pathlib, sys
args, installed = sys.argv[1:], pathlib.Path(sys.argv[0]).with_name("triton")
asked = [arg.partition("==")[2] for arg in args if arg.startswith("triton==")]
if args[:2] == ["-m", "pip"]:
    if "torch==2.13.0" in args:
        if asked not in ([], ["3.7.1"]):
            sys.exit("ResolutionImpossible: torch 2.13.0 depends on triton==3.7.1")
        installed.write_text("3.7.1")
    if asked:
        installed.write_text(asked[0])
elif args[:2] == ["-m", "pytest"]:
    print("pytest under Triton", installed.read_text())
"""
    for version in versions:
        python = tmp_path / f".venv-triton-{version}" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(stand_in)
        python.chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "test_triton_next.sh")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"pytest under Triton (\S+)", done.stdout) == versions


def test_readme_bench_options_exist(capsys):
    """The options the README shows for `python -m megamoe bench` (those `./scripts/bench.sh --help` lists, and
    --rounds) are the bench's own."""
    readme = (REPO / "README.md").read_text()
    listed = re.search(r"`\./scripts/bench\.sh --help` lists the options \(([^)]*)\)", readme).group(1)
    shown = re.findall(r"`(--[a-z-]+)", listed) + re.findall(r"`(--rounds) \d+`", readme)
    assert len(shown) > 5, shown
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    options = set(re.findall(r"(--[a-z-]+)", capsys.readouterr().out))
    assert [option for option in shown if option not in options] == []


def test_readme_redraw_command_runs(tmp_path, capsys, monkeypatch):
    """The README's command that redraws docs/bench.png from saved runs works as shown, from the repository root (its
    files exist, its options parse), drawn here into tmp_path."""
    pytest.importorskip("matplotlib")
    readme = (REPO / "README.md").read_text()
    args = re.search(r"^python -m megamoe (bench --from-json [^#]*?)\s*#", readme, re.MULTILINE).group(1).split()
    args[args.index("--plot") + 1] = str(tmp_path / "bench.png")
    monkeypatch.chdir(REPO)
    assert main(args) == 0
    assert f"from {args.index('--plot') - args.index('--from-json') - 1} file(s)" in capsys.readouterr().out
    assert (tmp_path / "bench.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "option, known", [("--workload", "cpu-small"), ("--backend", "torch"), ("--peers", "hf-grouped_mm")]
)
def test_cli_rejects_unknown_names(option, known, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", option, f"{known},nope"])
    assert exit_info.value.code == 2 and f"{option}: unknown 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--workload", "--backend", "--peers"])
def test_cli_rejects_an_empty_name_list(option, capsys, monkeypatch):
    """`--workload ,` names nothing: an error, not a silent run of the default workloads or backends."""
    monkeypatch.setattr("megamoe.__main__.run_bench", lambda **kwargs: pytest.fail("ran the defaults"))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", option, ","])
    assert exit_info.value.code == 2 and f"{option}: no name given" in capsys.readouterr().err


def test_triton_unavailable_says_why_its_backend_did_not_load():
    """With a Triton too old for the kernels (a 3.6 install reporting "3.5.1"), the bench's reason names the
    version, not "needs Triton and a CUDA GPU", which a Hopper GPU with Triton 3.5 already has."""
    pytest.importorskip("triton")
    code = (
        "import triton\n"
        "triton.__version__ = '3.5.1'\n"
        "import torch\n"
        "from megamoe.bench.gate import unavailable_reason\n"
        "print(unavailable_reason('triton', torch.device('cpu'), None))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "needs triton >= 3.6, found triton 3.5.1" in done.stdout, done.stdout


def test_too_few_experts_names_the_option():
    with pytest.raises(ValueError, match="1 experts per GPU \\(--experts-per-gpu 1\\) x 1 ranks is fewer than k = 8"):
        choose_experts_per_gpu(WORKLOADS["qwen3-30b-a3b"], 16384, 1, 2, 1, None)


def test_git_commit_marks_uncommitted_code(tmp_path):
    """A record's commit is HEAD, with "-dirty" once a tracked file differs from it (untracked files do not
    count), and "unknown" outside a git checkout."""
    from megamoe.bench.measure import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert git_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == f"{head}-dirty"


def test_run_facts_on_the_cpu():
    """run_facts: the four facts every JSON result records, "cpu" as the GPU on the CPU device."""
    facts = measure.run_facts(torch.device("cpu"))
    assert facts == {"gpu": "cpu", "torch": torch.__version__, "triton": measure.triton_version(),
                     "commit": facts["commit"]}
    assert facts["commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", facts["commit"]), facts


def test_titles_keep_the_dirty_mark(monkeypatch, capsys):
    """The printed title and a plot's default title cut the commit to 12 characters but keep "-dirty": a run of
    uncommitted code does not read as a run of HEAD."""
    from megamoe.bench.plot import default_title

    commit = "0123456789abcdef0123456789abcdef01234567-dirty"
    monkeypatch.setattr(measure, "git_commit", lambda: commit)
    monkeypatch.setattr(run, "time_pass", lambda *args, **kwargs: {
        "ms": 1.0, "peak_mem_bytes": None, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None})
    run.run_bench(workloads=["cpu-small"], backends=["torch"], routing="balanced", tokens=16, iters=1, warmup=0,
                  dtype=None, experts_per_gpu=None, json_path=None)
    assert "commit 0123456789ab-dirty" in capsys.readouterr().out.splitlines()[0]
    assert default_title([{"gpu": "cpu", "torch": "2.13.0", "commit": commit}]).endswith("commit 0123456789ab-dirty")


def test_git_commit_is_unknown_in_a_repository_that_does_not_track_megamoe(tmp_path):
    """megamoe installed in a virtual environment inside the user's own repository (untracked or ignored): the
    record's commit is "unknown", not the commit of the user's project."""
    from megamoe.bench.measure import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    git("add", ".gitignore")
    git("commit", "-qm", "the user's project")
    for venv in (".venv", "venv"):  # ignored, and merely untracked
        installed = tmp_path / venv / "lib" / "site-packages" / "megamoe" / "bench"
        installed.mkdir(parents=True)
        (installed / "measure.py").write_text("")
        assert git_commit(installed) == "unknown", venv


def test_experts_per_gpu_below_a_later_workloads_k_fails_before_timing(monkeypatch, capsys):
    """--experts-per-gpu 4 suits cpu-small (k 2) but not qwen3-30b-a3b (k 8): a usage error naming the option
    before anything is timed, not a traceback after cpu-small's timing (whose results it would lose)."""
    def no_timing(*args, **kwargs):
        raise AssertionError("timed before the options were checked")

    monkeypatch.setattr(run, "time_in_rounds", no_timing)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--workload", "cpu-small,qwen3-30b-a3b", "--experts-per-gpu", "4", "--tokens", "16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "qwen3-30b-a3b: 4 experts per GPU (--experts-per-gpu 4) x 1 ranks is fewer than k = 8" in err
    assert "Traceback" not in err


def test_alternating_rounds_runs_the_round_order():
    """Every call timed once a round, in round_order's order (three names: rotations, then their mirror images);
    the times come back per variant in round order."""
    ran = []
    times = alternating_rounds({"a": "A", "b": "B", "c": "C"}, 4, lambda call: ran.append(call) or len(ran))
    assert ran == list("ABC" "BCA" "CAB" "CBA")
    assert times == {"a": [1, 6, 8, 12], "b": [2, 4, 9, 11], "c": [3, 5, 7, 10]}


def test_median_of_no_timed_calls_names_iters():
    """iters 0 times nothing: an error naming iters, before any call (median_ms said 'no median for empty data')."""
    with pytest.raises(ValueError, match="iters must be >= 1 \\(timed calls\\), got 0"):
        median_ms(lambda i: None, iters=0, warmup=1, device=torch.device("cpu"))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_order_balances_positions_and_predecessors(n):
    """Over n rounds (n even) or 2n (n odd) every name runs in every position equally often and right after every
    other name equally often (a Williams design): on a GPU at its power cap the turn before sets the clock, so a
    plain rotation, where a name always follows the same neighbour, would favour one name."""
    names = [f"v{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    rows = [round_order(names, r) for r in range(period)]
    assert all(sorted(row) == names for row in rows)
    positions = collections.Counter((i, name) for row in rows for i, name in enumerate(row))
    assert set(positions.values()) == {period // n}
    if n > 1:
        follows = collections.Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, follows


def test_a_workloads_tensors_are_freed_before_the_next_ones_are_made(monkeypatch, capsys):
    """The previous workload's weights and the previous routing's input sets are gone when the next ones are made
    (and when the next workload measures the free memory its expert count is cut to): the timing turns, which hold
    them, are dropped with them."""
    made = {"weights": [], "tokens": []}
    alive_at_make = []

    def alive(kind):
        return sum(ref() is not None for ref in made[kind])

    def spy_weights(*args):
        alive_at_make.append(("weights", alive("weights")))
        weights = make_weights(*args)
        made["weights"].append(weakref.ref(weights.w_gate_up_E2IH))
        return weights

    def spy_tokens(*args):
        alive_at_make.append(("tokens", alive("tokens")))
        tokens = make_tokens(*args)
        made["tokens"].append(weakref.ref(tokens.x_TH))
        return tokens

    copy = dataclasses.replace(WORKLOADS["cpu-small"], name="cpu-small-copy")
    monkeypatch.setitem(run.WORKLOADS, copy.name, copy)
    monkeypatch.setattr(run, "make_weights", spy_weights)
    monkeypatch.setattr(run, "make_tokens", spy_tokens)
    monkeypatch.setattr(run, "gate_backends", lambda w, backends, *args: dict.fromkeys(backends, ("ok", "")))
    monkeypatch.setattr(run, "time_pass", lambda *args, **kwargs: {
        "ms": 1.0, "peak_mem_bytes": None, "peak_mem_above_inputs_bytes": None, "workspace_bytes": None})
    code = run.run_bench(workloads=["cpu-small", copy.name], backends=["torch"], routing="both", tokens=16, iters=1,
                         warmup=0, dtype=None, experts_per_gpu=None, json_path=None)
    assert code == 0, capsys.readouterr().out
    routing = [("tokens", i) for i in range(run.NUM_INPUT_SETS)]  # only the routing's own earlier sets alive
    assert alive_at_make == [("weights", 0), *routing, *routing] * 2, alive_at_make


def test_torch_path_ab_frees_a_workloads_weights_and_titan_copy(monkeypatch, capsys):
    """benchmarks/torch_path_ab.py: the previous workload's weights, and TorchTitan's copy of them, are gone when the
    next workload measures its free memory and makes its weights."""
    made, alive_at_make = [], []

    def spy_weights(*args):
        alive_at_make.append(sum(ref() is not None for ref in made))
        weights = make_weights(*args)
        made.append(weakref.ref(weights.w_gate_up_E2IH))
        return weights

    def spy_titan(weights):
        held = torchtitan_weights(weights)
        made.extend(weakref.ref(t) for t in held.w_gate_up_E2IH)
        return held

    monkeypatch.setattr(problem, "torchtitan_weights", spy_titan)  # before the script imports it
    spec = importlib.util.spec_from_file_location("torch_path_ab", REPO / "benchmarks" / "torch_path_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    copy = dataclasses.replace(WORKLOADS["cpu-small"], name="cpu-small-copy")
    monkeypatch.setitem(ab.WORKLOADS, copy.name, copy)
    monkeypatch.setattr(ab, "make_weights", spy_weights)
    monkeypatch.setattr(sys, "argv", ["torch_path_ab.py", "--workload", f"cpu-small,{copy.name}", "--tokens", "16",
                                      "--iters", "1", "--warmup", "1", "--titan"])
    assert ab.main() == 0, capsys.readouterr().out
    assert alive_at_make == [0, 0] and len(made) == 6, (alive_at_make, len(made))


def test_torch_path_ab_peaks_leave_out_the_other_layouts_gate_up(monkeypatch, capsys):
    """benchmarks/torch_path_ab.py holds gate/up twice while it measures peaks (megamoe's and TorchTitan's copy): each
    step's peak leaves out the one it does not use, as the bench's do (run.unused_weight_bytes)."""
    spec = importlib.util.spec_from_file_location("torch_path_ab", REPO / "benchmarks" / "torch_path_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    left_out = {}

    def spy_peak_mem(step, weights, tokens, device, group, unused=0):
        left_out["titan" if isinstance(weights.w_gate_up_E2IH, tuple) else "megamoe"] = unused

    monkeypatch.setattr(ab, "peak_mem", spy_peak_mem)
    monkeypatch.setattr(sys, "argv", ["torch_path_ab.py", "--workload", "cpu-small", "--tokens", "16", "--iters", "1",
                                      "--warmup", "0", "--titan"])
    assert ab.main() == 0, capsys.readouterr().out
    w = WORKLOADS["cpu-small"]
    gate_up_bytes = w.num_experts * 2 * w.intermediate * w.hidden * torch.float32.itemsize
    assert left_out == {"megamoe": gate_up_bytes, "titan": gate_up_bytes}, left_out


@pytest.mark.parametrize("script", ["inference_bench", "torch_path_ab"])
def test_cpu_benchmark_scripts_record_what_produced_their_json(script, monkeypatch, tmp_path, capsys):
    """Every record of benchmarks/inference_bench.py's and torch_path_ab.py's JSON carries measure.run_facts' gpu,
    torch, triton and commit (they called the GPU "device" and had no Triton nor commit), and on the CPU their dtype
    defaults to fp32, as the bench's (inference_bench.py ran bf16 there)."""
    spec = importlib.util.spec_from_file_location(script, REPO / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--workload", "cpu-small", "--tokens", "16", "--iters", "1",
                                      "--warmup", "0", "--json", str(path)])
    assert module.main() == 0, capsys.readouterr().out
    facts = measure.run_facts(torch.device("cpu"))
    records = json.loads(path.read_text())
    assert records and all({key: r.get(key) for key in facts} == facts and "device" not in r for r in records), records
    assert {r["dtype"] for r in records} == {"fp32"}, records


def test_every_benchmark_that_writes_json_records_run_facts():
    """A JSON result says which GPU, torch, Triton and commit produced it: every script of benchmarks/ that writes
    JSON takes them from measure.run_facts (kernel_breakdown.py's JSON named no GPU at all, others no commit)."""
    writers = {path.name: path.read_text() for path in (REPO / "benchmarks").glob("*.py")
               if "json.dump" in path.read_text()}
    assert "kernel_breakdown.py" in writers
    assert sorted(name for name, source in writers.items() if "run_facts(" not in source) == []


def test_kernel_times_idle_counts_only_time_no_kernel_runs(monkeypatch):
    """Kernels that overlap (e.g. on two streams): a gap is idle only where no kernel started before it is still
    running, and it names the kernel that ran last into it."""
    cuda = torch.autograd.DeviceType.CUDA

    def kernel(name, start, end):
        return types.SimpleNamespace(name=name, device_type=cuda, device_time=end - start,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    # long runs 0-100 us on one stream while short_1 and short_2 run on another; then 20 us with nothing running.
    events = [kernel("long", 0, 100), kernel("short_1", 10, 20), kernel("short_2", 30, 40), kernel("next", 120, 130)]

    class FakeProfile:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    times = kernel_times(lambda: None, 1)
    assert times["idle_us_per_iteration"] == 20
    # The only gap: a kernel that starts while another still runs leaves none (no negative "gap" listed).
    assert times["largest_gaps"] == [{"us": 20, "after": "long", "before": "next"}]
    assert times["gpu_us_per_iteration"] == 130


def test_mem_trace_names_the_megamoe_frames_of_the_blocks_live_at_the_peak():
    """benchmarks/mem_trace.py labels each block with its innermost frames in the megamoe package: not torch's where
    torch lives in a .venv inside a clone named megamoe (as scripts/test.sh makes it), nor megamoe.bench's."""
    spec = importlib.util.spec_from_file_location("mem_trace", REPO / "benchmarks" / "mem_trace.py")
    mem_trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mem_trace)
    package = Path(megamoe.__file__).parent
    torch_in_clone = {"filename": "/home/u/megamoe/.venv/lib/python3.11/site-packages/torch/nn/functional.py",
                      "line": 1, "name": "silu"}
    frames = [torch_in_clone, {"filename": str(package / "backends" / "torch_native.py"), "line": 2, "name": "swiglu"},
              {"filename": str(package / "bench" / "problem.py"), "line": 3, "name": "forward_TH"},
              {"filename": str(package / "api.py"), "line": 4, "name": "experts"}]
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [torch_in_clone]},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 10, "frames": frames},
    ]]}
    assert mem_trace.peak_blocks(snapshot) == (150, [
        {"bytes": 100, "where": "backends/torch_native.py:2 swiglu < api.py:4 experts"},
        {"bytes": 50, "where": ".venv/lib/python3.11/site-packages/torch/nn/functional.py:1 silu"}])


@pytest.mark.parametrize("args, message", [
    (["layer_ab.py", "qwen3-30b-a3b,qwen3-30b", "default", "out.json"], "WORKLOAD: unknown 'qwen3-30b'"),
    (["layer_ab.py", "qwen3-30b-a3b", "default", "out.json", "--routing", "balanced,skewd"],
     "--routing: unknown 'skewd'"),
    (["layer_ab.py", "qwen3-30b-a3b", "default,group_m:4,down_dgrad.group_m:x", "out.json"],
     "VARIANT: unknown variant 'down_dgrad.group_m:x'"),
    (["layer_ab.py", "qwen3-30b-a3b", "default,dgrad.group_m:4", "out.json"],
     "VARIANT: unknown variant 'dgrad.group_m:4'"),
    (["gemm_bench.py", "--workload", "qwen3-30b-a3b", "--workload", "mixtral"], "--workload: unknown 'mixtral'"),
    (["graph_vs_eager.py", "qwen3-30b-a3b,mixtral", "out.json"], "WORKLOAD: unknown 'mixtral'"),
    (["recompute_bench.py", "qwen3-30b-a3b,mixtral", "out.json"], "WORKLOAD: unknown 'mixtral'"),
    (["mem_trace.py", "qwen3-30b-a3b,mixtral", "out.json"], "WORKLOAD: unknown 'mixtral'"),
    (["mem_trace.py", "qwen3-30b-a3b", "out.json", "recomputed"], "argument mode: invalid choice: 'recomputed'"),
    (["one_step.py", "mixtral"], "argument workload: invalid choice: 'mixtral'"),
    (["sustained.py", "mixtral", "out.json"], "argument workload: invalid choice: 'mixtral'"),
    (["bwd_sweep.py", "qwen3-30b-a3b,mixtral", "out.json"], "WORKLOAD: unknown 'mixtral'"),
    (["gather_ab.py", "qwen3-30b-a3b,mixtral", "out.json"], "WORKLOAD: unknown 'mixtral'"),
    (["profile_layer.py", "qwen3-30b-a3b,mixtral", "out.json", "--graph"], "WORKLOAD: unknown 'mixtral'"),
    (["profile_layer.py", "qwen3-30b-a3b", "out.json", "-graph"], "unrecognized arguments: -graph"),
    (["host_time.py", "qwen3-30b-a3b,mixtral", "out.json"], "WORKLOAD: unknown 'mixtral'"),
    (["kernel_breakdown.py", "--workload", "qwen3-30b-a3b", "--workload", "mixtral"], "--workload: unknown 'mixtral'"),
    (["kernel_breakdown.py", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["kernel_breakdown.py", "--routing", "skewd"], "--routing: invalid choice: 'skewd'"),
    (["kernel_breakdown.py", "--weights", "zipf"], "--weights: invalid choice: 'zipf'"),
    (["kernel_breakdown.py", "--workload", "mixtral-8x7b", "--workload", "qwen3-30b-a3b", "--experts-per-gpu", "4"],
     "--experts-per-gpu must be >= the workloads' k (8), got 4"),
    (["gemm_bench.py", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["overlap_bench.py", "--workloads", "qwen3-30b-a3b,mixtral"], "--workloads: unknown 'mixtral'"),
    (["overlap_bench.py", "--rounds", "0"], "--rounds and --iters must be at least 1, got 0 and 20"),
    (["pull_bench.py", "out.json", "--workloads", "qwen3-235b-a22b,mixtral"], "--workloads: unknown 'mixtral'"),
    (["pull_bench.py", "out.json", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["combine_bench.py", "out.json", "--workload", "qwen3-30b-a3b", "--workload", "mixtral"],
     "--workload: unknown 'mixtral'"),
    (["combine_bench.py", "out.json", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["dw_gather_bench.py", "out.json", "--workloads", "qwen3-30b-a3b,mixtral"], "--workloads: unknown 'mixtral'"),
    (["dw_gather_bench.py", "out.json", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["inference_bench.py", "--workload", "cpu-small", "--tokens", "0", "--iters", "1", "--warmup", "0"],
     "--tokens must be >= 1, got 0"),
    (["torch_path_ab.py", "--workload", "cpu-small", "--tokens", "0", "--iters", "1", "--warmup", "0"],
     "--tokens must be >= 1, got 0"),
    (["torch_path_ab.py", "--workload", "cpu-small", "--iters", "0"], "--iters must be >= 1 and --warmup >= 0"),
    (["gemm_bench.py", "--workload", "qwen3-30b-a3b", "--workload", "deepseek-v3,mixtral"],
     "--workload: unknown 'mixtral'"),  # repeated and comma lists alike
    (["inference_bench.py", "--workload", "all,mixtral"], "--workload: unknown 'mixtral'; choose from"),
    (["inference_bench.py", "--workload", "cpu-small", "--modes", "grad,no-grad"], "--modes: unknown 'no-grad'"),
    (["layer_ab.py", "qwen3-30b-a3b", "default", "out.json", "--pass", "fwd,bwd"], "--pass: unknown 'bwd'"),
    (["comm_bench.py", "--workload", "mixtral"], "argument --workload: invalid choice: 'mixtral'"),
    (["tile_order_model.py", "--workload", "mixtral"], "--workload: unknown 'mixtral'"),
    (["tile_order_model.py", "--group-m", "0"], "--group-m and --sms must be >= 1 and --l2-mib > 0, got 0, 132, 30.0"),
], ids=["layer_ab-workload", "layer_ab-routing", "layer_ab-group_m", "layer_ab-gemm", "gemm_bench",
        "graph_vs_eager", "recompute_bench", "mem_trace", "mem_trace-mode", "one_step", "sustained",
        "bwd_sweep", "gather_ab", "profile_layer", "profile_layer-graph", "host_time", "kernel_breakdown",
        "kernel_breakdown-tokens", "kernel_breakdown-routing", "kernel_breakdown-weights", "kernel_breakdown-experts",
        "gemm_bench-tokens", "overlap_bench", "overlap_rounds",
        "pull_bench", "pull_rounds", "combine_bench", "combine_rounds", "dw_gather_bench", "dw_gather_rounds",
        "inference_tokens", "torch_path_tokens", "torch_path_iters", "gemm_bench-comma", "inference_bench-all",
        "inference_bench-modes", "layer_ab-pass", "comm_bench", "tile_order_model", "tile_order_model-group_m"])
def test_benchmark_scripts_check_their_options_before_timing(args, message):
    """A name the script does not know (or no rounds) is a usage error before anything runs: found at a later
    workload or routing it would end the run after the earlier ones were timed, before the JSON is written."""
    done = subprocess.run([sys.executable, REPO / "benchmarks" / args[0], *args[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_hf_train_bench_refuses_tokens_its_sequences_do_not_split():
    """Above one sequence (2048 tokens) --tokens must be a multiple of it: 3000 trained on one sequence of 2048 while
    the header and the JSON said 3000 tokens a step. A usage error before anything runs."""
    pytest.importorskip("transformers", reason="transformers is not installed (it is in megamoe's 'test' extra)")
    done = subprocess.run([sys.executable, REPO / "benchmarks" / "hf_train_bench.py", "--tiny", "--tokens", "3000",
                           "--steps", "3", "--impl", "eager"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--tokens must be at most 2048 or a multiple of it (sequences of 2048), got 3000" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--impl", "megamoe,eagr"], "--impl: unknown 'eagr'; choose from eager, "),
    (["--steps", "2"], "--steps must be > 2 (the first 2 are not timed), got 2"),
], ids=["impl", "steps"])
def test_hf_train_bench_checks_its_options_before_training(args, message):
    """An unknown --impl after a known one trained the known one and then raised inside transformers, the results of
    the trained ones never printed nor written; too few --steps raised a ValueError: both usage errors up front."""
    pytest.importorskip("transformers", reason="transformers is not installed (it is in megamoe's 'test' extra)")
    done = subprocess.run([sys.executable, REPO / "benchmarks" / "hf_train_bench.py", "--tiny", "--tokens", "64",
                           "--steps", "3", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


def test_every_benchmark_help_describes_it_in_whole_sentences():
    """`python benchmarks/X.py --help` prints the script's description: its docstring's first paragraph, not its first
    line, which in most scripts ended mid-sentence (recompute_bench.py's read "... default (gate_up kept for the")."""
    cut = {}
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                description = next(keyword.value for keyword in node.keywords if keyword.arg == "description")
                text = eval(compile(ast.Expression(description), str(path), "eval"),
                            {"__doc__": ast.get_docstring(tree, clean=False)})
                if not text.rstrip().endswith((".", "?")):
                    cut[path.name] = text[-60:]
    assert cut == {}
