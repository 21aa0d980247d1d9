"""The benchmark's baseline and peers (megamoe.bench.baselines) against megamoe.reference, and the harness
around them: TorchTitan's path on 1 and 2 gloo ranks, transformers' grouped_mm, absent peers, the table
and README columns against "torchtitan"."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import (
    assert_close_budget,
    assert_close_tight,
    init_gloo,
    leave_gloo,
    make_problem,
    problem_id,
    run_experts,
    run_gloo_workers,
    run_reference,
)
from megamoe.bench import baselines
from megamoe.bench.baselines import hf_grouped_mm_experts, peer_unavailable_reason, torchtitan_experts
from megamoe.bench.run import format_table, run_bench

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

# (T, H, I, E, k), routing (conftest.routing), shared intermediate size
CASES = [
    ((33, 24, 16, 6, 3), "random", 8),  # T*k = 99: no expert's rows a multiple of 16
    ((40, 32, 16, 6, 2), "empty", 8),  # odd experts get no tokens
    ((17, 16, 8, 4, 2), "one", 0),  # skewed: expert 0 gets every token
    ((24, 12, 6, 5, 2), "random", 4),  # bf16 rows of 24 bytes: torch._grouped_mm refuses, the loop runs
]
CASE_IDS = [f"{problem_id(s)}-{r}-shared{sh}" for s, r, sh in CASES]


def torchtitan_on_megamoe_layout(x, topk_ids, topk_weights, w_gate_up, *args, **kwargs):
    """torchtitan_experts with its (w1, w3) the halves of megamoe's gate/up weight (views: autograd joins their
    gradients), so that conftest's problems and references apply as they are."""
    return torchtitan_experts(x, topk_ids, topk_weights, tuple(w_gate_up.chunk(2, dim=1)), *args, **kwargs)


def check_against_reference(fn, p, dtype, device=CPU) -> None:
    """fn on the fp64 problem p cast to dtype (run on device): fp32 within 1e-5 of the fp64 reference, bf16
    within the error budget (the references run on the CPU)."""
    ref64 = run_reference(p)
    low = p.cast(dtype)
    low.__dict__.update({n: None if v is None else v.to(device) for n, v in low.__dict__.items()})
    ours = {n: v.cpu() for n, v in run_experts(low, fn).items()}
    assert ours.keys() == ref64.keys()
    for name in ref64:
        if dtype == torch.float32:
            assert_close_tight(name, ours[name], ref64[name], 1e-5)
        else:
            assert_close_budget(name, ours[name], ref64[name], run_reference(p.cast(dtype))[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,route,shared", CASES, ids=CASE_IDS)
def test_torchtitan_one_rank_matches_reference(rng, shape, route, shared, dtype):
    check_against_reference(torchtitan_on_megamoe_layout,
                            make_problem(rng, *shape, shared_intermediate=shared, route=route), dtype)


@pytest.mark.parametrize("caller_setting", [(False, False), (True, True)], ids=["off", "warn-only"])
def test_torchtitan_combine_restores_the_deterministic_setting(rng, caller_setting):
    """The combine switches torch.use_deterministic_algorithms on for its scatter_add only (as TorchTitan's op does):
    the caller's setting, warn_only included, is back afterwards, after the backward too."""
    p = make_problem(rng, 64, 16, 8, 4, 3).cast(torch.float32)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(caller_setting[0], warn_only=caller_setting[1])
    try:
        run_experts(p, torchtitan_on_megamoe_layout)
        now = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert now == caller_setting


def test_torchtitan_rejects_bad_inputs(rng):
    p = make_problem(rng, 4, 8, 4, 2, 1)
    w1_w3 = tuple(p.w_gate_up.chunk(2, dim=1))
    with pytest.raises(ValueError, match="topk_weights_TK"):
        torchtitan_experts(p.x, p.topk_ids, p.topk_weights[:, :0], w1_w3, p.w_down)
    with pytest.raises(ValueError, match="w_down_EHI"):
        torchtitan_experts(p.x, p.topk_ids, p.topk_weights, w1_w3, p.w_down[:, :, :1])
    with pytest.raises(TypeError, match="topk_ids_TK"):
        torchtitan_experts(p.x, p.topk_ids.float(), p.topk_weights, w1_w3, p.w_down)
    # megamoe's one [E_l, 2I, H] tensor where TorchTitan holds two, and two halves that do not match.
    with pytest.raises(TypeError, match=r"w1_w3_EIH must be .* tuple \(w1, w3\).* got Tensor"):
        torchtitan_experts(p.x, p.topk_ids, p.topk_weights, p.w_gate_up, p.w_down)
    with pytest.raises(ValueError, match=r"w1_w3_EIH must be two \[E_l, I, H=8\] tensors of one shape"):
        torchtitan_experts(p.x, p.topk_ids, p.topk_weights, (w1_w3[0], w1_w3[1][:, :1]), p.w_down)


# --------------------------------------------------------------------------------------------- 2 gloo ranks

WORLD, T, H, I, K, E_LOCAL = 2, 32, 32, 16, 2, 2


def _ep_scenarios() -> dict[str, object]:
    """Global fp64 problems: rank r owns tokens [r*T, (r+1)*T) and experts [r*E_l, (r+1)*E_l)."""
    gen = torch.Generator().manual_seed(7)
    num_experts = WORLD * E_LOCAL

    def ids_from(allowed: list[int], weights: list[float]) -> torch.Tensor:
        probs = torch.tensor(weights, dtype=torch.float64)
        picks = [torch.multinomial(probs, K, replacement=False, generator=gen) for _ in range(WORLD * T)]
        return torch.tensor(allowed)[torch.stack(picks)]

    return {
        "random-shared": make_problem(gen, WORLD * T, H, I, num_experts, K, shared_intermediate=8),
        # Skewed, and the last expert (rank 1's) gets no token.
        "skewed-empty-expert": make_problem(gen, WORLD * T, H, I, num_experts, K, shared_intermediate=8,
                                            topk_ids=ids_from([0, 1, 2], [8.0, 1.0, 1.0])),
        # Every pair to rank 0's experts: rank 1 receives no row at all.
        "rank1-receives-nothing": make_problem(gen, WORLD * T, H, I, num_experts, K, topk_ids=ids_from([0, 1], [1, 1])),
    }


def _local(p, rank: int) -> object:
    """Rank `rank`'s part of the global problem p (the shared expert is replicated)."""
    tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    mine = make_problem(torch.Generator(), 1, 1, 1, 1, 1)
    mine.__dict__.update({n: (v[tok] if n in ("x", "topk_ids", "topk_weights", "d_out") else
                              v[exp] if n in ("w_gate_up", "w_down") else v) for n, v in p.__dict__.items()})
    return mine


def _ep_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results = {}
    try:
        for name, p in _ep_scenarios().items():
            for dtype in (torch.float32, torch.bfloat16):
                try:
                    results[name, dtype] = run_experts(_local(p, rank).cast(dtype), torchtitan_on_megamoe_layout,
                                                       group=dist.group.WORLD)
                except Exception as e:  # noqa: BLE001 - reported by the parent
                    results[name, dtype] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        leave_gloo(rank, world)


def _ep_expected(p, dtype) -> list[dict[str, torch.Tensor]]:
    """Per rank: the reference (in dtype) on its tokens with every expert; the routed weights' gradients
    summed over the ranks (in fp32 at least) and cut to the rank's experts."""
    per_rank = []
    for rank in range(WORLD):
        tok_only = _local(p, rank)
        tok_only.w_gate_up, tok_only.w_down = p.w_gate_up, p.w_down
        per_rank.append(run_reference(tok_only.cast(dtype)))
    acc = torch.promote_types(dtype, torch.float32)
    for name in ("d_w_gate_up", "d_w_down"):
        total = sum(r[name].to(acc) for r in per_rank)
        for rank, r in enumerate(per_rank):
            r[name] = total[rank * E_LOCAL : (rank + 1) * E_LOCAL]
    return per_rank


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("baseline_ep")
    return run_gloo_workers(_ep_worker, WORLD, (str(out_dir),), out_dir, 120, "torchtitan baseline, 2 ranks")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(_ep_scenarios()))
def test_torchtitan_two_gloo_ranks_match_reference(ep_results, name, dtype):
    p = _ep_scenarios()[name]
    ref64 = _ep_expected(p, torch.float64)
    ref_low = _ep_expected(p, dtype)
    for rank in range(WORLD):
        ours = ep_results[rank][name, dtype]
        assert "error" not in ours, f"rank {rank}: {ours.get('error')}"
        assert ours.keys() == ref64[rank].keys()
        for tensor in ours:
            label = f"rank {rank}: {tensor}"
            if dtype == torch.float32:
                assert_close_tight(label, ours[tensor], ref64[rank][tensor], 1e-5)
            else:
                assert_close_budget(label, ours[tensor], ref64[rank][tensor], ref_low[rank][tensor])


# --------------------------------------------------------------------------------------------- peers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,route,shared", CASES[:3], ids=CASE_IDS[:3])
def test_hf_grouped_mm_matches_reference(rng, shape, route, shared, dtype):
    pytest.importorskip("transformers.integrations.moe", reason="transformers >= 5 not installed")
    check_against_reference(hf_grouped_mm_experts, make_problem(rng, *shape, shared_intermediate=shared, route=route),
                            dtype)


def test_hf_grouped_mm_gets_the_router_weights_in_x_dtype(rng):
    """As transformers' Qwen3-MoE router hands them to the experts: fp32 ones would run transformers' combine
    (product, gather and sum over [T*k, H], and their backward) in fp32, slower than such a model runs it."""
    pytest.importorskip("transformers.integrations.moe", reason="transformers >= 5 not installed")
    p = make_problem(rng, 64, 32, 16, 6, 3).cast(torch.bfloat16)
    out = hf_grouped_mm_experts(p.x, p.topk_ids, p.topk_weights, p.w_gate_up, p.w_down)
    as_qwen3 = hf_grouped_mm_experts(p.x, p.topk_ids, p.topk_weights.to(torch.bfloat16), p.w_gate_up, p.w_down)
    assert p.topk_weights.dtype == torch.float32 and torch.equal(out, as_qwen3)


def test_liger_when_installed(rng):
    pytest.importorskip("liger_kernel", reason="liger-kernel not installed")
    if not torch.cuda.is_available():
        pytest.skip("liger's fused MoE runs Triton kernels: needs a CUDA GPU")
    p = make_problem(rng, 64, 64, 32, 8, 2, shared_intermediate=16)
    check_against_reference(baselines.liger_experts, p, torch.bfloat16, device=torch.device("cuda"))


def test_absent_peer_is_a_one_line_note(monkeypatch, capsys):
    monkeypatch.setitem(baselines.PEER_PACKAGES, "hf-grouped_mm", ("no_such_module_for_megamoe", "transformers"))
    assert peer_unavailable_reason("hf-grouped_mm", CPU, None) == "transformers not installed"
    code = run_bench(workloads=["cpu-small"], backends=["torch"], routing="balanced", tokens=16, iters=1, warmup=0,
                     dtype=None, experts_per_gpu=None, json_path=None, peers=["hf-grouped_mm"])
    out = capsys.readouterr().out
    assert code == 0
    assert "note: hf-grouped_mm: transformers not installed" in out, out
    assert " hf-grouped_mm " not in out, "an absent peer must not get table rows"


def test_peers_run_on_one_gpu_only(monkeypatch):
    monkeypatch.setitem(baselines.PEER_PACKAGES, "hf-grouped_mm", ("torch", "transformers"))  # "installed"
    assert peer_unavailable_reason("hf-grouped_mm", CPU, group=object()) == "unavailable: one GPU only"
    with pytest.raises(ValueError, match="group: hf-grouped_mm runs on one GPU only"):
        hf_grouped_mm_experts(*(None,) * 5, group=object())


def test_unknown_peer_is_a_value_error():
    with pytest.raises(ValueError, match="peers: unknown 'nope'"):
        run_bench(workloads=["cpu-small"], backends=None, routing="balanced", tokens=16, iters=1, warmup=0,
                  dtype=None, experts_per_gpu=None, json_path=None, peers=["nope"])


# --------------------------------------------------------------------------------------------- harness


def test_bench_times_torchtitan_first_and_gates_peers(tmp_path, capsys):
    """A tiny CPU run: torchtitan records come first; an installed peer is gated and timed like a backend."""
    import json

    has_hf = importlib.util.find_spec("transformers") is not None
    path = tmp_path / "run.json"
    code = run_bench(workloads=["cpu-small"], backends=None, routing="skewed", tokens=32, iters=1, warmup=0,
                     dtype=None, experts_per_gpu=None, json_path=str(path), peers=["hf-grouped_mm", "liger"])
    out = capsys.readouterr().out
    assert code == 0, out
    records = json.loads(path.read_text())
    backends = list(dict.fromkeys(r["backend"] for r in records))
    assert backends[:2] == ["torchtitan", "torch"] and ("hf-grouped_mm" in backends) == has_hf, backends
    assert "vs torchtitan" in out and " portable " in out, out
    if importlib.util.find_spec("liger_kernel") is None:
        assert "note: liger: liger-kernel not installed" in out, out


def test_speedup_column_is_against_torchtitan():
    def row(backend, pass_name, ms):
        return {"workload": "w", "experts_per_gpu": 8, "routing": "balanced", "load": 1.0, "backend": backend,
                "pass": pass_name, "ms": ms, "tflops": 1.0, "status": "ok"}

    rows = [row("torchtitan", "fwd", 3.0), row("torch", "fwd", 4.0), row("triton", "fwd", 1.5),
            row("torch", "fwd+bwd", 2.0)]
    lines = format_table(rows, on_gpu=False).splitlines()
    assert lines[0].split()[-2:] == ["vs", "torchtitan"]
    assert [line.split()[4] for line in lines[1:]] == ["torchtitan", "portable", "triton", "portable"]
    assert [line.split()[-1] for line in lines[1:]] == ["1.00x", "0.75x", "2.00x", "-"]


def test_cpu_tflops_are_not_printed_as_zero():
    """A CPU's rates are thousandths of a TFLOP/s: the table shows 3 significant digits, not "0.00"."""
    rows = [{"workload": "cpu-small", "experts_per_gpu": 8, "routing": "balanced", "load": 1.0, "backend": backend,
             "pass": "fwd", "ms": 5.0, "tflops": tflops, "status": "ok"}
            for backend, tflops in (("torchtitan", 0.0016897), ("torch", 523.4))]
    lines = format_table(rows, on_gpu=False).splitlines()
    assert [line.split()[7] for line in lines[1:]] == ["0.00169", "523"]


def _readme_table_module():
    spec = importlib.util.spec_from_file_location("readme_table", REPO / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_against_torchtitan_and_old_files():
    def record(backend, ms, source):
        return {"gpu": "H200", "ep": 1, "workload": "qwen3-30b-a3b", "experts_per_gpu": 128, "tokens": 16384,
                "routing": "balanced", "pass": "fwd", "backend": backend, "ms": ms, "tflops": 100 / ms,
                "mfu": 0.5, "peak_mem_bytes": 2**30, "source": source}

    def with_memory(r, above, workspace=None):
        return dict(r, peak_mem_above_inputs_bytes=above, workspace_bytes=workspace)

    table = _readme_table_module().table([
        with_memory(record("torchtitan", 6.0, "new.json"), 2**29),
        with_memory(record("torch", 5.0, "new.json"), 2**28),
        with_memory(record("triton", 2.0, "new.json"), 2**27, workspace=2**30),
        record("torch", 5.0, "old.json"), record("triton", 2.5, "old.json"),
    ])
    header, _, new, old = table.splitlines()
    assert "| torchtitan ms (TFLOP/s) | portable torch ms (TFLOP/s) | triton ms (TFLOP/s) |" in header
    assert ("| peak mem torchtitan / torch / triton, GiB (above inputs) | triton EP workspace, GiB "
            "| triton vs torchtitan | source |") in header
    assert ("| 6.00 (17) | 5.00 (20) | 2.00 (50) | 50% | 1.0 (0.50) / 1.0 (0.25) / 1.0 (0.12) | 1.00 | 3.00x "
            "| new.json |") in new
    assert "| - | 5.00 (20) | 2.50 (40) | 50% | - / 1.0 / 1.0 | - | - | old.json |" in old


def test_readme_table_shows_a_failed_backend_without_a_ratio():
    """A backend that failed its gate is a record with ms None: its cell says so and no speed-up is made up."""
    base = {"gpu": "H200", "ep": 1, "workload": "qwen3-30b-a3b", "experts_per_gpu": 128, "tokens": 16384,
            "routing": "balanced", "pass": "fwd", "mfu": None, "peak_mem_bytes": None, "source": "run.json"}
    table = _readme_table_module().table([
        dict(base, backend="torchtitan", ms=6.0, tflops=100 / 6.0, status="ok"),
        dict(base, backend="triton", ms=None, tflops=None, status="FAILED"),
    ])
    row = table.splitlines()[2]
    assert "| 6.00 (17) | - | FAILED | - |" in row and row.endswith("| - | run.json |"), row



def _readme_row(title: str) -> str:
    return next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith(f"| {title}"))


def _fwd_bwd_balanced(records: list[dict]) -> dict:
    """{(workload, backend): record} of a bench result file's fwd+bwd balanced records."""
    return {(r["workload"], r["backend"]): r for r in records if r["pass"] == "fwd+bwd" and r["routing"] == "balanced"}


@pytest.mark.parametrize("gpu", ["H200", "H100 80GB"])
def test_readme_layer_speed_rows_quote_their_result_file(gpu):
    """The README's "Layer speed" row of each GPU quotes the bench file it names: each workload's triton ms and MFU,
    the range of speed-ups over torchtitan, and the range of the MFU ceilings to within 10 TF/s (was: 670-790 TF/s,
    v22's range, left when the row moved to v23, whose ceilings go down to 663)."""
    row = _readme_row(f"Layer speed, one {gpu} ")
    source = re.search(r"fwd\+bwd balanced \(([\w.-]+\.json)\)", row).group(1)
    records = json.loads((REPO / "benchmarks" / "results" / source).read_text())
    by = _fwd_bwd_balanced(records)
    quoted = re.findall(r"([a-z][\w.-]*) (\d+\.\d\d)(?: ms)? \((\d+)%", row)
    assert {workload for workload, _, _ in quoted} == {workload for workload, _ in by}
    for workload, ms, mfu in quoted:
        triton = by[workload, "triton"]
        assert (ms, int(mfu)) == (f"{triton['ms']:.2f}", round(100 * triton["mfu"])), workload
    speedups = [by[workload, "torchtitan"]["ms"] / by[workload, "triton"]["ms"] for workload, _, _ in quoted]
    low, high = re.search(r"(\d+\.\d\d)x-(\d+\.\d\d)x the TorchTitan-style path", row).groups()
    assert (low, high) == (f"{min(speedups):.2f}", f"{max(speedups):.2f}")
    ceilings = [r["ceiling_tflops"] for r in records if r["ceiling_tflops"]]
    lowest, highest = min(ceilings), max(ceilings)
    low, high = map(int, re.search(r"\((\d+)-(\d+) TF/s", row).groups())
    assert low <= lowest < low + 10 and high - 10 < highest < high + 10, (lowest, highest)


def test_readme_memory_row_quotes_its_result_file():
    """The README's "Memory (one GPU)" row quotes each workload's triton peak above the inputs from the file it names."""
    row = _readme_row("Memory (one GPU)")
    source, figures = re.search(r"weight gradients included \(([\w.-]+\.json)\): ([^(]*) \(SonicMoE", row).groups()
    by = _fwd_bwd_balanced(json.loads((REPO / "benchmarks" / "results" / source).read_text()))
    quoted = re.findall(r"([a-z][\w.-]*) (\d+\.\d\d)", figures)
    assert quoted, figures
    for workload, gib in quoted:
        assert gib == f"{by[workload, 'triton']['peak_mem_above_inputs_bytes'] / 2**30:.2f}", workload


def test_readme_cites_result_files_that_exist():
    """Every bench result the README names (a file of benchmarks/results, or a glob of them) is there: a figure's source
    renamed or dropped would leave the README citing nothing."""
    readme = (REPO / "README.md").read_text()
    # results.json: the file `python -m megamoe bench --json` writes in the README's example
    cited = {Path(name).name for name in re.findall(r"[\w./*-]+\.json", readme)} - {"results.json"}
    assert cited
    results = REPO / "benchmarks" / "results"
    assert [name for name in sorted(cited) if not list(results.glob(name))] == []


def test_readme_table_needs_its_end_marker_after_the_start_marker(tmp_path, monkeypatch):
    """A README whose end marker comes only before the start marker has no block to rewrite: the script says so
    (was a ValueError about unpacking) and leaves the file as it was."""
    module = _readme_table_module()
    readme = tmp_path / "README.md"
    readme.write_text(f"{module.END}\ntext\n{module.START}\n")
    monkeypatch.setattr(sys, "argv", ["readme_table.py", str(REPO / "benchmarks/results/h200-1gpu-v23.json"),
                                      "--readme", str(readme)])
    with pytest.raises(SystemExit, match="has no"):
        module.main()
    assert readme.read_text() == f"{module.END}\ntext\n{module.START}\n"


def test_readme_perf_table_is_what_readme_table_makes_of_the_files_it_names():
    """The README's performance table is benchmarks/readme_table.py's output for the result files its command names
    (not edited by hand, nor left behind when the files or the script's columns change)."""
    readme = (REPO / "README.md").read_text()
    command = re.search(r"`python benchmarks/readme_table\.py ([^`]+)`", readme).group(1)
    module = _readme_table_module()
    block = readme.split(module.START, 1)[1].split(module.END, 1)[0].strip()
    assert block == module.table(module.load([REPO / path for path in command.split()]))
