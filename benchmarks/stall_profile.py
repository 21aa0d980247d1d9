"""Where each of megamoe's kernels stalls in one fwd+bwd of the fused one-GPU path, from Nsight Compute: for every
launch of the last of two iterations (benchmarks/one_step.py), its duration and the share of each warp stall reason
of ncu's WarpStateStats section: "no_instruction" (instruction fetch: the kernel's code does not fit the instruction
cache, as down_dgrad's unrolled epilogue did, docs/perf-notes.md "GEMM core v17"), "long_scoreboard" (waiting on
global or local memory), "barrier", "wait", "gmma" and the rest. Only the package's own jit kernels are profiled
(ncu --kernel-name with a regex of their names): the problem's set-up kernels run unprofiled, which keeps a run to
about a minute a workload.

Usage: python benchmarks/stall_profile.py WORKLOAD[,WORKLOAD...] OUT.json [--ncu PATH]   (a CUDA GPU and ncu)

Under ncu the kernels run serialised, replayed and at locked clocks: compare stall shares, not durations.
OUT.json: each workload's launches under its name, beside "gpu", "torch", "triton" and "commit"
(megamoe.bench.measure.run_facts).
"""
from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import os
import pkgutil
import subprocess
import sys
import tempfile

ITERATIONS = 2  # one_step.py's iterations under ncu; the last one is reported
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def kernel_names() -> list[str]:
    """The names of the jit kernels (Triton and Gluon; interpreted ones under TRITON_INTERPRET=1 too) of
    megamoe.backends.triton.kernels."""
    from triton.runtime.jit import KernelInterface

    import megamoe.backends.triton.kernels as kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        names.update(obj.__name__ for obj in vars(module).values()
                     if isinstance(obj, KernelInterface) and obj.__name__.endswith("_kernel"))
    return sorted(names)


def kernel_filter(names: list[str]) -> str:
    """ncu's --kernel-name value matching exactly these function names."""
    return "regex:^(" + "|".join(names) + ")$"


def parse_raw(text: str) -> list[dict]:
    """ncu --page raw --csv --print-units base output (a header row, a units row, a row per profiled launch; times
    in ns) -> per launch, in order: kernel name, duration in us and each stall reason's share of the warps' stalled
    cycles ("selected", a warp issuing, is not a stall and left out)."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if start is None:
        raise ValueError("no 'Kernel Name' header in ncu's CSV output")
    header = rows[start]
    column = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX)
               and h != STALL_PREFIX + "selected" + STALL_SUFFIX]
    if not reasons or "gpu__time_duration.sum" not in column:
        raise ValueError("ncu's CSV lacks the WarpStateStats stall ratios or gpu__time_duration.sum")
    units = rows[start + 1][column["gpu__time_duration.sum"]]
    if units != "ns":
        raise ValueError(f"gpu__time_duration.sum in {units!r}, not ns: read ncu's CSV with --print-units base")

    def number(row, name):
        return float(row[column[name]].replace(",", "") or 0)

    launches = []
    for row in rows[start + 2:]:  # after the units row
        if len(row) != len(header):
            continue
        stalls = {h[len(STALL_PREFIX):-len(STALL_SUFFIX)]: number(row, h) for h in reasons}
        total = sum(stalls.values())
        launches.append(dict(
            kernel=row[column["Kernel Name"]], duration_us=number(row, "gpu__time_duration.sum") / 1e3,
            stall_share={reason: value / total for reason, value in stalls.items()} if total else {}))
    return launches


def last_iteration(launches: list[dict], iterations: int = ITERATIONS) -> list[dict]:
    """The launches of the last of `iterations` identical iterations."""
    if not launches or len(launches) % iterations:
        raise ValueError(f"{len(launches)} profiled launches do not split into {iterations} iterations")
    return launches[-len(launches) // iterations:]


def profile(workload: str, ncu: str) -> list[dict]:
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report")
        subprocess.run([ncu, "--kernel-name", kernel_filter(kernel_names()), "--section", "WarpStateStats",
                        "--section", "SpeedOfLight", "-f", "-o", report, sys.executable,
                        os.path.join(here, "one_step.py"), workload, str(ITERATIONS)], check=True)
        raw = subprocess.run([ncu, "-i", report + ".ncu-rep", "--page", "raw", "--csv", "--print-units", "base"],
                             check=True, capture_output=True, text=True).stdout
    return last_iteration(parse_raw(raw))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", help="comma-separated workload names")
    parser.add_argument("json_path")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command line (default: ncu on PATH)")
    args = parser.parse_args(argv)
    import torch

    from megamoe.bench.measure import run_facts
    from megamoe.bench.workloads import WORKLOADS

    names = args.workloads.split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    facts = run_facts(torch.device("cuda"))  # one_step.py's device
    results = {name: profile(name, args.ncu) for name in names}
    with open(args.json_path, "w") as f:
        json.dump({**facts, **results}, f, indent=1)
    for name, launches in results.items():
        print(f"{name}: kernel, ms under ncu, stall shares (the three largest)")
        for launch in launches:
            top = sorted(launch["stall_share"].items(), key=lambda item: -item[1])[:3]
            shares = ", ".join(f"{reason} {100 * share:.0f}%" for reason, share in top)
            print(f"  {launch['kernel'][:40]:40s} {launch['duration_us'] / 1e3:7.3f}  no_instruction "
                  f"{100 * launch['stall_share'].get('no_instruction', 0):4.1f}%  {shares}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
