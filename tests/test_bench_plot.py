"""`python -m megamoe bench --plot`: the drawing (megamoe.bench.plot) on synthetic records, and the CLI around it."""

from __future__ import annotations

import json
import sys

import pytest

from megamoe.__main__ import main
from megamoe.bench.plot import load_records, plot_records, require_matplotlib, series_label
from megamoe.bench.run import RECORD_FIELDS

matplotlib = pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CEILING = 784.0


def make_records(ep: int, backends=("torchtitan", "torch", "triton"), workloads=("qwen3-30b-a3b", "mixtral-8x7b")) -> list[dict]:
    """Bench records (every field of megamoe.bench.run.RECORD_FIELDS) with made-up, distinct TFLOP/s."""
    records = []
    for w, workload in enumerate(workloads):
        for routing in ("balanced", "skewed"):
            for b, backend in enumerate(backends):
                for pass_name in ("fwd", "fwd+bwd"):
                    tflops = 100.0 + 50 * w + 20 * b + (5 if pass_name == "fwd+bwd" else 0) + 10 * ep
                    records.append({
                        "workload": workload, "backend": backend, "pass": pass_name, "routing": routing, "ep": ep,
                        "tokens": 16384, "experts_per_gpu": 128 // ep, "dtype": "bf16", "ms": 1.0, "round_ms": [1.0],
                        "iters": 20, "warmup": 5, "tflops": tflops,
                        "mfu": tflops / CEILING, "ceiling_tflops": CEILING, "peak_mem_bytes": 2**30,
                        "peak_mem_above_inputs_bytes": 2**29, "workspace_bytes": None,
                        "gpu": "NVIDIA H200", "torch": "2.13.0", "triton": "3.6.0", "commit": "0123456789abcdef",
                        "status": "ok", "detail": "",
                    })
    assert all(set(r) == set(RECORD_FIELDS) for r in records), "synthetic records must carry exactly RECORD_FIELDS"
    return records


def write_json(path, records) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def test_series_label_names_ep_above_one():
    assert series_label({"backend": "triton", "ep": 1, "gpu": "H200"}, with_gpu=False) == "triton"
    assert series_label({"backend": "torch", "ep": 2, "gpu": "H200"}, with_gpu=False) == "torch (EP=2)"
    assert series_label({"backend": "torch", "ep": 4, "gpu": "H200"}, with_gpu=True) == "H200: torch (EP=4)"


def test_plot_from_json_files_writes_a_png(tmp_path, capsys):
    one_gpu = write_json(tmp_path / "h200x1.json", make_records(ep=1))
    two_gpus = write_json(tmp_path / "h200x2.json", make_records(ep=2, backends=("torch",)))
    png = tmp_path / "bench.png"
    assert main(["bench", "--from-json", one_gpu, two_gpus, "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC), f"{png}: not a PNG (starts {data[:8]!r})"
    assert len(data) > 10_000, f"{png}: only {len(data)} bytes"
    assert "wrote the plot of 32 records from 2 file(s)" in capsys.readouterr().out


def test_plot_path_without_suffix_reports_the_file_written(tmp_path, capsys):
    """--plot PATH without a suffix: matplotlib writes PATH.png, and that is the path returned and printed."""
    records = write_json(tmp_path / "r.json", make_records(ep=1))
    assert plot_records(make_records(ep=1), tmp_path / "direct") == tmp_path / "direct.png"
    assert main(["bench", "--from-json", records, "--plot", str(tmp_path / "bench")]) == 0
    assert (tmp_path / "bench.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "bench").exists()
    assert capsys.readouterr().out.rstrip().endswith(f"to {tmp_path / 'bench.png'}")


def test_plot_draws_series_ceiling_and_panels(tmp_path):
    """The SVG's text (kept as text, not paths) names every series, the ceiling line and every panel."""
    records = make_records(ep=1) + make_records(ep=2, backends=("torch",))
    svg = tmp_path / "bench.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        plot_records(records, svg, title="synthetic")
    text = svg.read_text()
    for expected in ("torchtitan", "torch", "triton", "torch (EP=2)", f"bf16 matmul ceiling: {CEILING:.0f} TFLOP/s", "synthetic",
                     "fwd, balanced routing", "fwd+bwd, balanced routing", "fwd, skewed routing",
                     "fwd+bwd, skewed routing", "qwen3-30b-a3b", "mixtral-8x7b", "TFLOP/s per GPU"):
        assert f">{expected}<" in text, f"plot: no text {expected!r}"
    # Every bar is labelled with its value: 2 workloads x 2 routings x 2 passes x (3 + 1) series.
    assert text.count(">125<") == 2, "bar label of qwen3-30b-a3b / torch (EP=2) / fwd+bwd: one per routing"


def test_torchtitan_baseline_is_drawn_first(tmp_path):
    """Series order: the TorchTitan baseline first, wherever its records come in the files."""
    svg = tmp_path / "order.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        plot_records(make_records(ep=1, backends=("triton", "torch", "torchtitan")), svg, title="order")
    text = svg.read_text()
    legend = [text.index(f">{name}<") for name in ("torchtitan", "triton", "torch")]
    assert legend == sorted(legend), "legend order must be torchtitan, then the others as they come"


def test_plot_without_ceiling_or_skewed_routing(tmp_path):
    """CPU runs measure no ceiling; a balanced-only run gives one row of panels."""
    records = [dict(r, ceiling_tflops=None, mfu=None, gpu="cpu") for r in make_records(ep=1)
               if r["routing"] == "balanced"]
    svg = tmp_path / "cpu.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        plot_records(records, svg)
    text = svg.read_text()
    assert "ceiling" not in text and "skewed" not in text
    assert ">fwd, balanced routing<" in text and ">megamoe bench: cpu; torch 2.13.0; commit 0123456789ab<" in text


def test_routing_option_filters_saved_records(tmp_path):
    path = write_json(tmp_path / "run.json", make_records(ep=1))
    svg = tmp_path / "skewed.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        assert main(["bench", "--from-json", path, "--routing", "skewed", "--plot", str(svg)]) == 0
    text = svg.read_text()
    assert ">fwd, skewed routing<" in text and "balanced" not in text


def test_routing_that_no_saved_record_has_is_named(tmp_path, capsys):
    path = write_json(tmp_path / "run.json", [r for r in make_records(ep=1) if r["routing"] == "balanced"])
    with pytest.raises(SystemExit):
        main(["bench", "--from-json", path, "--routing", "skewed", "--plot", str(tmp_path / "x.png")])
    assert f"--routing skewed: no record of that routing in {path}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "give --plot PATH"),
        (["--plot", "x.png", "--iters", "3"], "--iters: not used with --from-json"),
        (["--plot", "x.png", "--json", "y.json"], "--json: not used with --from-json"),
    ],
    ids=["no-plot", "timing-option", "json-option"],
)
def test_from_json_option_errors(tmp_path, capsys, extra, message):
    path = write_json(tmp_path / "run.json", make_records(ep=1))
    with pytest.raises(SystemExit):
        main(["bench", "--from-json", path, *extra])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [("{}", "expected a JSON list"), ('[{"workload": "x"}]', "record 0 lacks backend"), ("[1", "cannot read")],
    ids=["not-a-list", "missing-fields", "bad-json"],
)
def test_bad_json_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_records([path])
    assert str(path) in str(info.value)


def test_nothing_measured_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no measured records"):
        plot_records([dict(r, tflops=None) for r in make_records(ep=1)], tmp_path / "x.png")


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        require_matplotlib()


def test_bench_run_draws_its_own_records(tmp_path):
    """The hook in run_bench: a tiny timed CPU run writes both the JSON and the plot of the same records."""
    png, records_path = tmp_path / "run.png", tmp_path / "run.json"
    code = main(["bench", "--workload", "cpu-small", "--tokens", "16", "--iters", "1", "--warmup", "0",
                 "--routing", "balanced", "--json", str(records_path), "--plot", str(png)])
    assert code == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert len(load_records([records_path])) == 4  # (torchtitan, torch) x (fwd, fwd+bwd)


def test_records_of_two_problem_sizes_in_one_bar_are_an_error(tmp_path):
    """Two records for the same bar (workload, backend, EP, GPU, pass, routing) from different problem sizes would
    silently replace one another: an error naming both sizes."""
    records = make_records(ep=1)
    other = [dict(r, tokens=4096) for r in records]
    with pytest.raises(ValueError, match=r"different problems.*\(16384, 128, 'bf16'\) and \(4096, 128, 'bf16'\)"):
        plot_records(records + other, tmp_path / "x.png")


def test_records_of_two_dtypes_in_one_bar_are_an_error(tmp_path):
    """A bf16 run and an fp32 run of the same workload (e.g. `--from-json bf16.json fp32.json`) are two problems: one
    bar cannot stand for both, and neither the labels nor the title name the dtype (the fp32 record silently replaced
    the bf16 one)."""
    records = make_records(ep=1)
    fp32 = [dict(r, dtype="fp32", tflops=r["tflops"] / 10) for r in records]
    with pytest.raises(ValueError, match=r"different problems.*\(16384, 128, 'bf16'\) and \(16384, 128, 'fp32'\)"):
        plot_records(records + fp32, tmp_path / "x.png")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plot", "{tmp}/x.foo"], "matplotlib cannot write .foo files"),
        (["--plot", "{tmp}/missing/x.png"], "does not exist"),
        (["--json", "{tmp}/missing/r.json"], "--json {tmp}/missing/r.json: folder"),
        (["--json", "{tmp}"], "--json {tmp}: is a folder"),
        (["--plot", "{tmp}"], "--plot {tmp}: is a folder"),
        (["--json", "{tmp}/new/"], "--json {tmp}/new/: ends with /, a folder's name"),
        (["--plot", "{tmp}/new/"], "--plot {tmp}/new/: ends with /, a folder's name"),
        (["--json", "/proc/r.json"], "--json /proc/r.json: cannot write in folder /proc"),
        (["--json", "{tmp}/r.png", "--plot", "{tmp}/r.png"], "--json {tmp}/r.png and --plot {tmp}/r.png name the same"),
        (["--json", ""], "--json: empty path"),
        (["--plot", ""], "--plot: empty path"),
    ],
    ids=["plot-format", "plot-folder", "json-folder", "json-is-a-folder", "plot-is-a-folder", "json-folder-name",
         "plot-folder-name", "json-folder-read-only", "json-is-the-plot",
         "json-empty", "plot-empty"],
)
def test_unwritable_outputs_fail_before_timing(tmp_path, capsys, monkeypatch, args, message):
    """A --plot or --json path that cannot be written is an argparse error at once, not a traceback after the
    whole benchmark has run (its results lost with it)."""
    def timed(**kwargs):
        raise AssertionError("the benchmark ran before its output paths were checked")

    monkeypatch.setattr("megamoe.__main__.run_bench", timed)
    with pytest.raises(SystemExit) as info:
        main(["bench", *(a.format(tmp=tmp_path) for a in args)])
    assert info.value.code == 2 and message.format(tmp=tmp_path) in capsys.readouterr().err


def test_json_through_a_dangling_link_fails_before_timing(tmp_path, capsys, monkeypatch):
    """--json naming a symbolic link into a folder that does not exist: checked where the link points (a dangling
    link's own folder exists, and the run would otherwise fail at its end, writing the JSON)."""
    monkeypatch.setattr("megamoe.__main__.run_bench", lambda **kwargs: pytest.fail("the benchmark ran"))
    link = tmp_path / "r.json"
    link.symlink_to(tmp_path / "missing" / "r.json")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--json", str(link)])
    assert info.value.code == 2 and f"--json {link}: folder" in capsys.readouterr().err


def test_from_json_plot_into_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    path = write_json(tmp_path / "run.json", make_records(ep=1))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--from-json", path, "--plot", str(tmp_path / "missing" / "x.png")])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err
