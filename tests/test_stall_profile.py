"""benchmarks/stall_profile.py on CPU: the kernel filter it hands Nsight Compute and its reading of ncu's raw CSV
(the profiling itself needs a GPU and ncu)."""
import importlib.util
import pathlib
import re

import pytest

pytest.importorskip("triton")

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sp():
    spec = importlib.util.spec_from_file_location("stall_profile", REPO / "benchmarks" / "stall_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_filter_matches_the_gemm_kernels_and_nothing_of_torch(sp):
    names = sp.kernel_names()
    for kernel in ("down_dgrad_ws_kernel", "row_gemm_ws_kernel", "gate_up_fwd_ws_kernel", "gate_up_fwd_handoff_kernel",
                   "dw_ws_kernel", "combine_kernel", "spread_rows_kernel"):
        assert kernel in names, kernel
    value = sp.kernel_filter(names)
    assert value.startswith("regex:")
    pattern = re.compile(value[len("regex:"):])
    assert pattern.match("down_dgrad_ws_kernel") and pattern.match("dw_ws_kernel")
    for other in ("vectorized_elementwise_kernel", "down_dgrad_ws_kernel_2", "xdw_ws_kernel", "nvjet_sm90_tst"):
        assert not pattern.match(other), other


def _csv(launches):
    """ncu --page raw --csv as it prints: a header row, a units row, a row per launch (numbers with thousands
    separators)."""
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", stall.format("no_instruction"),
              stall.format("long_scoreboard"), stall.format("barrier"), stall.format("selected")]
    lines = [",".join(f'"{h}"' for h in header), '"","","ns","","","",""']
    for i, (name, ns, stalls) in enumerate(launches):
        lines.append(",".join(f'"{v}"' for v in (i, name, f"{ns:,}", *stalls)))
    return "\n".join(lines) + "\n"


def test_parse_raw_gives_durations_and_stall_shares_in_launch_order(sp):
    text = _csv([("row_gemm_ws_kernel", 1_500_000, (1.0, 3.0, 0.0, 9.0)),
                 ("down_dgrad_ws_kernel", 800_000, (6.0, 2.0, 2.0, 9.0))])
    launches = sp.parse_raw(text)
    assert [l["kernel"] for l in launches] == ["row_gemm_ws_kernel", "down_dgrad_ws_kernel"]
    assert launches[0]["duration_us"] == pytest.approx(1500.0)
    # "selected" (a warp issuing) is no stall: the shares are of the others.
    assert launches[1]["stall_share"] == pytest.approx({"no_instruction": 0.6, "long_scoreboard": 0.2, "barrier": 0.2})


def test_parse_raw_refuses_scaled_units(sp):
    text = _csv([("row_gemm_ws_kernel", 1_500, (1.0, 3.0, 0.0, 9.0))]).replace('"ns"', '"us"')
    with pytest.raises(ValueError, match="in 'us', not ns"):
        sp.parse_raw(text)


def test_last_iteration_takes_the_second_half_and_refuses_an_odd_count(sp):
    text = _csv([(f"k{i}_kernel", 1000 * (i + 1), (1.0, 1.0, 1.0, 1.0)) for i in range(4)])
    assert [l["kernel"] for l in sp.last_iteration(sp.parse_raw(text))] == ["k2_kernel", "k3_kernel"]
    with pytest.raises(ValueError, match="3 profiled launches do not split into 2 iterations"):
        sp.last_iteration(sp.parse_raw(_csv([("a_kernel", 1, (1, 1, 1, 1))] * 3)))


def test_parse_raw_refuses_output_without_the_metrics(sp):
    with pytest.raises(ValueError, match="no 'Kernel Name' header"):
        sp.parse_raw("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="lacks the WarpStateStats stall ratios"):
        sp.parse_raw('"ID","Kernel Name","gpu__time_duration.sum"\n"","","ns"\n')


def test_unknown_workload_is_refused_before_anything_runs(sp, capsys):
    with pytest.raises(SystemExit):
        sp.main(["qwen3-30b-a3b,no-such-model", "out.json"])
    assert "unknown workloads ['no-such-model']" in capsys.readouterr().err
