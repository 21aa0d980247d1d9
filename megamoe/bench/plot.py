"""`python -m megamoe bench --plot PATH`: TFLOP/s per workload and backend as grouped bars, from bench records.

One panel per (routing, pass): rows "balanced" then "skewed" (those present), columns "fwd" then "fwd+bwd".
In each panel a group of bars per workload, one bar per series: the backend, labelled "backend (EP=n)"
when the record's ep > 1 (and with the GPU name too when the records come from several GPUs). The bf16
matmul ceiling measured in the same run (`ceiling_tflops`, absent on CPU) is a dashed horizontal line.

Records are the JSON records of `python -m megamoe bench --json` (megamoe.bench.run.RECORD_FIELDS). matplotlib is imported
only when a plot is drawn: it is a test/extra dependency, not one of megamoe's.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from megamoe.bench.measure import short_commit

PASS_ORDER = ("fwd", "fwd+bwd")
ROUTING_ORDER = ("balanced", "skewed")
NEEDED_FIELDS = ("workload", "backend", "pass", "routing", "ep", "tflops", "ceiling_tflops", "gpu")
BASELINE = "torchtitan"  # what TorchTitan users run (megamoe.bench.baselines): drawn first in every group


def require_matplotlib():
    """matplotlib.pyplot on the non-interactive Agg backend; ImportError saying how to install it if missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib, which megamoe does not install: pip install matplotlib "
            "(or pip install -e '.[test]')"
        ) from e
    # Agg writes files without a display (and without touching an interactive backend a user picked).
    if matplotlib.get_backend().lower() != "agg":
        matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: str | Path) -> None:
    """Raise ValueError (naming --plot) unless path's suffix is a format matplotlib writes (no suffix: matplotlib's
    default, png). Checked before anything is timed, with the path itself (`python -m megamoe bench`), so that a
    typo fails in a second, not after the benchmark. Needs matplotlib (require_matplotlib)."""
    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix[1:].lower()
    if suffix and suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{suffix} files; use one of {', '.join(sorted(formats))}")


def load_records(paths: list[str | Path]) -> list[dict]:
    """The records of `python -m megamoe bench --json` files, in file order.

    Raises ValueError naming the file when one is not a JSON list of records with the fields a plot needs.
    """
    records = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read bench records ({e})") from e
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of bench records, got {type(data).__name__}")
        for i, record in enumerate(data):
            missing = [f for f in NEEDED_FIELDS if not isinstance(record, dict) or f not in record]
            if missing:
                raise ValueError(f"{path}: record {i} lacks {', '.join(missing)} (fields: megamoe.bench.run.RECORD_FIELDS)")
        records += data
    return records


def series_label(record: dict, with_gpu: bool) -> str:
    """"backend", "backend (EP=n)" for ep > 1, with the GPU name prefixed when with_gpu."""
    label = record["backend"] + (f" (EP={record['ep']})" if record["ep"] > 1 else "")
    return f"{record['gpu']}: {label}" if with_gpu else label


def _ordered(values, preferred) -> list:
    """Distinct values: those in `preferred` first, in its order, then the others in order of appearance."""
    seen = list(dict.fromkeys(values))
    return [v for v in preferred if v in seen] + [v for v in seen if v not in preferred]


def format_tflops(value: float) -> str:
    """A TFLOP/s figure to 3 significant digits (whole numbers from 100 on): a CPU's 0.0017 is not shown as 0.00."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def default_title(records: list[dict]) -> str:
    """What the records were measured on: GPU(s), torch version(s) and commit(s)."""

    def distinct(field, short=str):
        values = dict.fromkeys(short(str(r.get(field))) for r in records)
        return ", ".join(values)

    return f"megamoe bench: {distinct('gpu')}; torch {distinct('torch')}; commit {distinct('commit', short_commit)}"


def plot_records(records: list[dict], path: str | Path, *, title: str | None = None) -> Path:
    """Draw TFLOP/s of `records` (bench records) to `path` (format from its suffix: .png, .svg, .pdf; without one,
    matplotlib's default format, whose suffix is appended: "bench" -> "bench.png").

    A later record with the same (workload, series, pass, routing) as an earlier one replaces it, so
    `--from-json old.json new.json` shows the newer measurement; a ValueError if the two differ in tokens,
    experts_per_gpu or dtype (one bar cannot stand for two problems). Records without tflops are skipped.
    title: the figure's title (default: default_title). Returns the path of the file written.
    Raises ValueError when no record has a measured tflops.
    """
    measured = [r for r in records if r.get("tflops") is not None]
    if not measured:
        raise ValueError("no measured records to plot (every record lacks tflops)")
    plt = require_matplotlib()

    with_gpu = len({r["gpu"] for r in measured}) > 1
    workloads = _ordered([r["workload"] for r in measured], ())
    passes = _ordered([r["pass"] for r in measured], PASS_ORDER)
    routings = _ordered([r["routing"] for r in measured], ROUTING_ORDER)
    # Baseline first, then backends in order of appearance; one EP size after another within a backend.
    backends = _ordered([r["backend"] for r in measured], (BASELINE,))
    keys = sorted({(r["backend"], r["ep"], r["gpu"]) for r in measured},
                  key=lambda k: (backends.index(k[0]), k[1], k[2]))
    labels = {k: series_label({"backend": k[0], "ep": k[1], "gpu": k[2]}, with_gpu) for k in keys}
    tflops, problem = {}, {}
    for r in measured:
        key = (r["workload"], (r["backend"], r["ep"], r["gpu"]), r["pass"], r["routing"])
        size = (r.get("tokens"), r.get("experts_per_gpu"), r.get("dtype"))
        if problem.setdefault(key, size) != size:  # one bar cannot stand for two problems
            raise ValueError(
                f"records of {r['workload']} ({r['backend']}, ep={r['ep']}, {r['pass']}, {r['routing']}) of different "
                f"problems, (tokens, experts_per_gpu, dtype) {problem[key]} and {size}: plot them separately"
            )
        tflops[key] = r["tflops"]  # the same problem measured twice: the later record's bar
    # One line per GPU: runs merged from several files each measured their own ceiling; the highest is what
    # that GPU was shown to reach.
    runs_per_gpu: dict[str, set[float]] = {}
    for r in measured:
        if r.get("ceiling_tflops"):
            runs_per_gpu.setdefault(r["gpu"], set()).add(r["ceiling_tflops"])
    ceilings = [(gpu, max(values), len(values) > 1) for gpu, values in runs_per_gpu.items()]

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(keys)
    fig, axes = plt.subplots(
        len(routings), len(passes), squeeze=False, sharey="row",
        figsize=(max(6.0, 1.1 * len(workloads) * len(passes) + 1.5), 3.6 * len(routings) + 0.8),
    )
    for row, routing in enumerate(routings):
        for col, pass_name in enumerate(passes):
            ax = axes[row][col]
            for i, key in enumerate(keys):
                xs, heights = [], []
                for j, workload in enumerate(workloads):
                    value = tflops.get((workload, key, pass_name, routing))
                    if value is not None:  # a backend that did not run leaves a gap, never a zero bar
                        xs.append(j - 0.4 + (i + 0.5) * width)
                        heights.append(value)
                bars = ax.bar(xs, heights, width, color=colors[i % len(colors)], label=labels[key])
                ax.bar_label(bars, labels=[format_tflops(h) for h in heights], fontsize=6, padding=1)
            for k, (gpu, ceiling, several) in enumerate(ceilings):
                name = f" ({gpu})" if with_gpu else ""
                highest = " (the highest of its runs)" if several else ""
                ax.axhline(ceiling, color="black", linestyle=("--", ":", "-.")[k % 3], linewidth=1,
                           label=f"bf16 matmul ceiling{name}: {ceiling:.0f} TFLOP/s{highest}")
            ax.set_xticks(range(len(workloads)), workloads, rotation=20, ha="right", fontsize=8)
            ax.set_title(f"{pass_name}, {routing} routing", fontsize=10)
            ax.margins(y=0.08)  # room for the value labels above the tallest bar
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
            if col == 0:
                ax.set_ylabel("TFLOP/s per GPU")
    legend = {}  # label -> handle, over every panel: a series may be absent from some
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    handles = list(legend.values())
    ncol = min(4, len(handles))
    fig.legend(handles, list(legend), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    width_in, height_in = fig.get_size_inches()
    fig.suptitle(textwrap.fill(title or default_title(measured), int(14 * width_in)), fontsize=9)
    legend_rows = -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, (0.15 + 0.2 * legend_rows) / height_in, 1, 1))  # panels above the legend
    path = Path(path)
    if not path.suffix:  # matplotlib appends its default format's suffix: return the file it writes
        path = path.with_name(f"{path.name.rstrip('.')}.{plt.rcParams['savefig.format']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
