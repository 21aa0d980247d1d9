"""benchmarks/sonicmoe_ab.py on CPU: the side-by-side harness with the TorchTitan-style path, and its SonicMoE
weight layout (gate and up rows interleaved, the gradients mapped back) checked against a torch model of that
layout, since SonicMoE's own kernels need a Hopper GPU."""
import argparse
import collections
import dataclasses
import importlib.util
import json
import pathlib
import weakref

import pytest
import torch
import torch.nn.functional as F

from megamoe.bench.workloads import WORKLOADS, Workload, layer_flops

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def ab(monkeypatch):
    spec = importlib.util.spec_from_file_location("sonicmoe_ab", REPO / "benchmarks" / "sonicmoe_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "WORKLOADS", {**WORKLOADS, "tiny": Workload("tiny", 64, 32, 4, 2, 0, 48)})
    return module


def sonic_layout_model(x, ids, scores, w1, w2):
    """SonicMoE's experts as its layouts define them: w1 [2I, H, E], gate and up interleaved (row 2j gate j, row
    2j + 1 up j); w2 [H, I, E]; out[t] = sum_j scores[t, j] * expert ids[t, j] of x[t]."""
    out = torch.zeros_like(x)
    for e in range(w2.shape[-1]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ w1[:, :, e].T
        out = out.index_add(0, tok, (F.silu(h[:, ::2]) * h[:, 1::2]) @ w2[:, :, e].T * scores[tok, slot, None])
    return out


def test_sonic_layout_and_torchtitan_agree_with_megamoe(ab, monkeypatch, tmp_path):
    monkeypatch.setattr(ab, "SONIC_PATHS", {"model": sonic_layout_model})
    out_json = tmp_path / "ab.json"
    records = ab.main(["tiny,cpu-small", str(out_json), "--sonic", "model", "--torchtitan", "--pass", "fwd+bwd,fwd",
                       "--rounds", "2", "--iters", "1"])
    assert records == json.loads(out_json.read_text())
    assert sorted((r["workload"], r["routing"], r["pass_name"], r["path"]) for r in records) == sorted(
        (name, routing, pass_name, path) for name in ("tiny", "cpu-small") for routing in ("balanced", "skewed")
        for pass_name in ("fwd+bwd", "fwd") for path in ("megamoe", "torchtitan", "sonicmoe-model"))
    # cpu-small has a shared expert, which SonicMoE does not run: every path runs its routed experts alone, and
    # its FLOPs count those (megamoe's shared expert would show as a difference in out and d_x otherwise).
    routed = dataclasses.replace(WORKLOADS["cpu-small"], shared_intermediate=0)
    for r in records:
        assert r["routed_only"] == (r["workload"] == "cpu-small")
        if r["routed_only"]:
            flops = layer_flops(routed, routed.tokens_per_gpu, r["pass_name"])
            assert r["tflops"] == pytest.approx(flops / r["ms"] / 1e9)
        assert r["commit"] and r["gpu"] == "cpu" and r["dtype"] == "float32" and r["megamoe_backend"] == "auto", r
        keys = {"out", "d_x", "d_topk_weights", "d_w_gate_up", "d_w_down"} if r["pass_name"] == "fwd+bwd" else {"out"}
        assert r["ms"] > 0 and r["peak_above_inputs_gib"] is None
        assert r["ceiling_tflops"] is None and r["mfu"] is None  # the ceiling's turn runs on GPUs only
        assert len(r["ms_rounds"]) == 2 and r["ms"] == pytest.approx(sum(r["ms_rounds"]) / 2)  # one iteration a round
        assert r["ceiling_ms_rounds"] is None
        if r["path"] == "megamoe":
            assert r["rel_diff_to_megamoe"] is None and r["agrees"] is None
        else:  # fp32 on CPU: the same math in other orders
            assert set(r["rel_diff_to_megamoe"]) == keys and r["agrees"], r
            assert max(r["rel_diff_to_megamoe"].values()) < 1e-5, r


def test_swapped_gate_and_up_rows_are_caught(ab, monkeypatch, tmp_path):
    """The comparison fails a layout mistake: a model reading up rows as gate rows disagrees with megamoe."""
    def swapped(x, ids, scores, w1, w2):
        return sonic_layout_model(x, ids, scores, w1.view(-1, 2, *w1.shape[1:]).flip(1).reshape(w1.shape), w2)

    monkeypatch.setattr(ab, "SONIC_PATHS", {"swapped": swapped})
    records = ab.main(["tiny", str(tmp_path / "ab.json"), "--sonic", "swapped", "--pass", "fwd", "--routing", "balanced",
                       "--rounds", "1", "--iters", "1"])
    assert [r["agrees"] for r in records if r["path"] == "sonicmoe-swapped"] == [False]


def test_a_name_given_twice_runs_once(ab, capsys, tmp_path):
    """A workload, pass or routing named twice is timed once: run twice, its records repeated and the speed line
    read the later run's times only."""
    records = ab.main(["tiny,tiny", str(tmp_path / "ab.json"), "--sonic", "none", "--torchtitan", "--pass", "fwd,fwd",
                       "--routing", "balanced,balanced", "--rounds", "1", "--iters", "1"])
    assert sorted(r["path"] for r in records) == ["megamoe", "torchtitan"]
    assert capsys.readouterr().out.count("megamoe's speed") == 1


def test_no_speed_line_without_a_path_to_compare(ab, capsys, tmp_path):
    """megamoe timed alone (--sonic none without --torchtitan; with --graph, every other path not captured) has no
    speed to state against another path: no line that names none."""
    ab.main(["tiny", str(tmp_path / "ab.json"), "--sonic", "none", "--pass", "fwd", "--routing", "balanced",
             "--rounds", "1", "--iters", "1"])
    assert "megamoe's speed" not in capsys.readouterr().out


def test_a_run_stopped_by_a_later_pass_keeps_the_records_it_finished(ab, monkeypatch, tmp_path):
    """The JSON is written after every pass: SonicMoE out of memory in a workload's second pass kept nothing of its
    first (one workload, the usual run, wrote its JSON only once all its passes were timed)."""
    timed = ab.sonic_run

    def out_of_memory_in_fwd(entry, backward, *args, **kwargs):
        if not backward:
            raise torch.OutOfMemoryError("out of memory")
        return timed(entry, backward, *args, **kwargs)

    monkeypatch.setattr(ab, "SONIC_PATHS", {"model": sonic_layout_model})
    monkeypatch.setattr(ab, "sonic_run", out_of_memory_in_fwd)
    out_json = tmp_path / "ab.json"
    with pytest.raises(torch.OutOfMemoryError):
        ab.main(["tiny", str(out_json), "--sonic", "model", "--pass", "fwd+bwd,fwd", "--routing", "balanced",
                 "--rounds", "1", "--iters", "1"])
    kept = json.loads(out_json.read_text())
    assert sorted((r["pass_name"], r["path"]) for r in kept) == [("fwd+bwd", "megamoe"), ("fwd+bwd", "sonicmoe-model")]


def test_bad_arguments_are_usage_errors(ab, capsys):
    for argv, message in ((["tiny", "x.json", "--sonic", "fast"], "unknown entry points ['fast']"),
                          (["tiny", "x.json", "--pass", "fwd,bwd"], "unknown passes ['bwd']"),
                          (["tiny", "x.json", "--sonic", "none", "--routing", "balanced,skewd"],
                           "--routing: unknown routings ['skewd']"),
                          (["qwen3-31b", "x.json"], "unknown workloads ['qwen3-31b']"),
                          (["tiny", "x.json", "--iters", "0"], "--rounds and --iters must be >= 1"),
                          # a baseline of the bench is no megamoe backend: it would be timed as "megamoe"
                          (["tiny", "x.json", "--sonic", "none", "--backend", "torchtitan"],
                           "argument --backend: invalid choice: 'torchtitan'"),
                          (["tiny", "x.json", "--profile", "2"], "needs a CUDA GPU, got 2 on cpu"),
                          (["tiny", "x.json", "--graph"], "--graph needs a CUDA GPU"),
                          # the default --sonic fixed-k: SonicMoE's own kernels, which a CPU cannot run
                          (["tiny", "x.json"], "--sonic fixed-k runs SonicMoE, which needs a CUDA GPU (sm_90)")):
        with pytest.raises(SystemExit):
            ab.main(argv)
        assert message in capsys.readouterr().err


def test_timed_sonic_calls_leave_the_gate_up_gradient_interleaved(ab, monkeypatch):
    """Only the comparison reorders SonicMoE's gate/up gradient (a copy of the whole gradient, which a timed
    call must not pay for); the timed call's gradient is autograd's, in SonicMoE's interleaved order."""
    from megamoe.bench.problem import make_tokens, make_weights

    monkeypatch.setattr(ab, "SONIC_PATHS", {"model": sonic_layout_model})
    w = ab.WORKLOADS["tiny"]
    weights = make_weights(w, range(w.num_experts), torch.float32, torch.device("cpu"))
    tokens = make_tokens(w, w.tokens_per_gpu, w.num_experts, "balanced", torch.float32, torch.Generator().manual_seed(0))
    E, two_i, H = weights.w_gate_up_E2IH.shape
    w1 = weights.w_gate_up_E2IH.detach().view(E, 2, two_i // 2, H).transpose(1, 2).reshape(E, two_i, H).requires_grad_()
    timed = ab.sonic_run("model", True, w1, weights.w_down_EHI, tokens)
    compared = ab.sonic_run("model", True, w1, weights.w_down_EHI, tokens, compare=True)
    assert "d_w_gate_up" not in timed and "d_w_gate_up_interleaved" not in compared
    interleaved = timed["d_w_gate_up_interleaved"]
    assert torch.equal(interleaved[:, 0::2], compared["d_w_gate_up"][:, :two_i // 2])
    assert torch.equal(interleaved[:, 1::2], compared["d_w_gate_up"][:, two_i // 2:])


@pytest.mark.parametrize("num_paths", [1, 2, 3, 4])
def test_every_path_follows_every_other_turn_equally_often(ab, num_paths):
    """The rounds run back to back: a round's first turn follows the last turn of the round before. Over two of
    round_order's periods every path follows each other path and the ceiling's matmul equally often, the rounds'
    boundaries included (at the GPU's power cap the turn before sets the clock a turn starts at; with the ceiling
    inside the rotation, three paths and 8 rounds had SonicMoE follow the matmul in 4 rounds, megamoe in 2)."""
    paths = [f"path{i}" for i in range(num_paths)]
    period = num_paths if num_paths % 2 == 0 else 2 * num_paths
    turns = [t for rnd in range(2 * period) for t in ab.round_turns(paths, rnd, on_gpu=True)]
    assert collections.Counter(turns) == {ab.CEILING: 2 * period, **dict.fromkeys(paths, 2 * period)}
    follows = collections.Counter(zip(turns, turns[1:]))
    for p in paths:
        before = {q: follows[q, p] for q in [*paths, ab.CEILING] if q != p}
        assert follows[p, p] == 0 and len(set(before.values())) == 1, (p, before)
    assert ab.round_turns(paths, 0, on_gpu=False) == ab.round_order(paths, 0)  # no ceiling on a CPU


def test_replay_check_catches_a_graph_that_left_work_out(ab):
    """--graph times a path only if a replay refreshes what its capture returned to an eager call's values: a
    replay that rewrites the results passes, one that leaves them as they were (work left out of the graph, as
    SonicMoE's count_cumsum on the legacy stream was) shows the full difference."""
    eager = {"out": torch.arange(1.0, 9.0), "d_x": torch.ones(3, 2)}
    captured = {key: torch.zeros_like(t) for key, t in eager.items()}

    def replay():
        for key, t in captured.items():
            t.copy_(eager[key])

    assert ab._replay_diff(replay, captured, eager) == {"out": 0.0, "d_x": 0.0}
    stale = {key: torch.zeros_like(t) for key, t in eager.items()}
    diffs = ab._replay_diff(lambda: None, stale, eager)
    assert diffs == {"out": 1.0, "d_x": 1.0} and all(d > ab.MAX_REL_DIFF for d in diffs.values())


def test_a_graph_that_another_graphs_replay_breaks_is_not_timed(ab, monkeypatch):
    """--graph captures every path into one memory pool; a path is timed only if its replay, after every other
    graph's, still gives its eager call's token results. Here (a stand-in for CUDA graphs on the CPU) the second
    graph's replay overwrites what the first graph's replay reads, as a pool handing memory one graph still reads
    to another would: the first graph's replays then compute zeros; the first path is reported, the second timed."""
    captures, overwritten = [], []

    def stand_in_graph(step, warmup=2, pool=None):
        assert pool == "the pool"
        index, result = len(captures), step()
        captures.append(index)

        def replay():
            for key, t in step().items():
                if isinstance(t, torch.Tensor):
                    result[key].copy_(t.zero_() if index in overwritten else t)
            if index == 1:
                overwritten.append(0)
        return replay, result

    monkeypatch.setattr(ab, "cuda_graph", stand_in_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the pool")
    args = argparse.Namespace(sonic=[], torchtitan=True, backend="auto", routing=["balanced"], graph=True, rounds=1,
                              iters=1, profile=0, facts={})
    records = ab.run_workload("tiny", "fwd+bwd", args, torch.device("cpu"), torch.float32)
    assert [(r["path"], "ms" in r) for r in records] == [("torchtitan", True), ("megamoe", False)]
    assert records[1]["graph_error"].startswith("its replay after the other graphs' differs from its eager call: out")


def test_no_path_left_to_time_reports_every_paths_error(ab, monkeypatch):
    """--graph with every path's replay differing from its eager call (here a stand-in graph on the CPU whose
    replay zeroes its results): no path is timed, and each is reported with its error."""
    def zeroing_graph(step, warmup=2, pool=None):
        result = step()

        def replay():
            for t in result.values():
                if isinstance(t, torch.Tensor):  # not TorchTitan's pair of gate/up gradients
                    t.zero_()
        return replay, result

    monkeypatch.setattr(ab, "cuda_graph", zeroing_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    args = argparse.Namespace(sonic=[], torchtitan=True, backend="auto", routing=["balanced"], graph=True, rounds=1,
                              iters=1, profile=0, facts={})
    records = ab.run_workload("tiny", "fwd+bwd", args, torch.device("cpu"), torch.float32)
    assert [r["path"] for r in records] == ["megamoe", "torchtitan"] and not any("ms" in r for r in records)
    assert all(r["graph_error"].startswith("its replay differs from its eager call: out 1.0e+00") for r in records)


def test_a_routings_graphs_are_gone_before_the_next_routing_runs(ab, monkeypatch):
    """--graph over several routings: a routing's graphs share one memory pool, kept (every path's memory in it)
    while any of them lives, so none may outlive its routing into the next one's eager calls and captures. Stand-in
    graphs on the CPU: none is alive when the next routing makes its tokens."""
    graphs, alive = [], []

    def stand_in_graph(step, warmup=2, pool=None):
        result = step()

        def replay():
            for key, t in step().items():
                if isinstance(t, torch.Tensor):
                    result[key].copy_(t)
        graphs.append(weakref.ref(replay))
        return replay, result

    make_tokens = ab.make_tokens

    def make_tokens_counting_graphs(*args):
        alive.append(sum(graph() is not None for graph in graphs))
        return make_tokens(*args)

    monkeypatch.setattr(ab, "make_tokens", make_tokens_counting_graphs)
    monkeypatch.setattr(ab, "cuda_graph", stand_in_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    args = argparse.Namespace(sonic=[], torchtitan=True, backend="auto", routing=["balanced", "skewed"], graph=True,
                              rounds=1, iters=1, profile=0, facts={})
    records = ab.run_workload("tiny", "fwd+bwd", args, torch.device("cpu"), torch.float32)
    assert len(graphs) == 4 and [r["routing"] for r in records if "ms" in r] == ["balanced"] * 2 + ["skewed"] * 2
    assert alive == [0] * 6  # three token sets per routing


def test_the_paths_after_a_failed_capture_take_a_new_pool(ab, monkeypatch):
    """A capture that raised may keep its claim on the shared pool: the paths captured after it use a new one."""
    handles, pools = iter(range(100)), []

    def stand_in_graph(step, warmup=2, pool=None):
        pools.append(pool)
        if len(pools) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        result = step()
        return (lambda: None), result

    monkeypatch.setattr(ab, "cuda_graph", stand_in_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    args = argparse.Namespace(sonic=[], torchtitan=True, backend="auto", routing=["balanced"], graph=True, rounds=1,
                              iters=1, profile=0, facts={})
    records = ab.run_workload("tiny", "fwd", args, torch.device("cpu"), torch.float32)
    assert pools == [0, 1]
    assert [(r["path"], "ms" in r) for r in records] == [("torchtitan", True), ("megamoe", False)]
