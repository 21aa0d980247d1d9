"""Regenerate README.md's performance table from the committed JSON results (never typed by hand).

Usage: python benchmarks/readme_table.py RESULT.json [RESULT.json ...] [--readme README.md]
Rewrites the block between `<!-- perf-table:start -->` and `<!-- perf-table:end -->`: one row per
(gpu, ep, workload, routing, pass) with the ms and TFLOP/s of the TorchTitan baseline ("torchtitan",
megamoe.bench.baselines), megamoe's portable torch path and the triton path, triton's MFU, their peak
memory (and in brackets the part above the weights and inputs, where the file has it), the fused EP path's
symmetric-memory workspace (which the bench adds to both peaks: the allocator's peak does not see it), and
triton's speed-up over the TorchTitan baseline measured in the same run ("-" where a result file has no record
of that backend or field, e.g. files from before the baseline or the field existed).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

from megamoe.bench.workloads import WORKLOADS

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
NA = "-"


def load(paths: list[pathlib.Path]) -> list[dict]:
    records = []
    for path in paths:
        data = json.loads(path.read_text())
        if not (isinstance(data, list) and data and "workload" in data[0] and "backend" in data[0]):
            raise SystemExit(f"{path} is not a `python -m megamoe bench --json` result")
        records += [dict(r, source=path.name) for r in data]
    return records


def table(records: list[dict]) -> str:
    rows = collections.defaultdict(dict)
    for r in records:
        key = (r["gpu"], r["ep"], r["workload"], r["experts_per_gpu"], r["tokens"], r["routing"], r["pass"], r["source"])
        rows[key][r["backend"]] = r
    lines = [
        "| GPU | EP | workload | experts/GPU | tokens/GPU | routing | pass | torchtitan ms (TFLOP/s) "
        "| portable torch ms (TFLOP/s) | triton ms (TFLOP/s) | triton MFU "
        "| peak mem torchtitan / torch / triton, GiB (above inputs) | triton EP workspace, GiB | triton vs torchtitan "
        "| source |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate(WORKLOADS)}
    for key in sorted(rows, key=lambda k: (k[0], k[1], order.get(k[2], len(order)), k[5] != "balanced", k[6])):
        gpu, ep, workload, experts, tokens, routing, pass_name, source = key
        by = rows[key]
        # Results measured before the TorchTitan baseline existed have no "torchtitan" records: "-" cells.
        titan_r, torch_r, triton_r = by.get("torchtitan"), by.get("torch"), by.get("triton")

        def cell(r):
            if r and r.get("ms") is None:  # a backend that failed its gate or could not run: its status
                return r.get("status", NA)
            return f"{r['ms']:.2f} ({r['tflops']:.0f})" if r else NA

        def mem(r):
            if not (r and r.get("peak_mem_bytes")):
                return NA
            above = r.get("peak_mem_above_inputs_bytes")
            return f"{r['peak_mem_bytes'] / 2**30:.1f}" + (f" ({above / 2**30:.2f})" if above is not None else "")

        workspace = triton_r.get("workspace_bytes") if triton_r else None
        workspace = f"{workspace / 2**30:.2f}" if workspace is not None else NA

        mfu = f"{100 * triton_r['mfu']:.0f}%" if triton_r and triton_r.get("mfu") else NA
        timed = titan_r and triton_r and titan_r.get("ms") and triton_r.get("ms")
        speedup = f"{titan_r['ms'] / triton_r['ms']:.2f}x" if timed else NA
        lines.append(
            f"| {gpu} | {ep} | {workload} | {experts} | {tokens} | {routing} | {pass_name} | {cell(titan_r)} | "
            f"{cell(torch_r)} | {cell(triton_r)} | {mfu} | {mem(titan_r)} / {mem(torch_r)} / {mem(triton_r)} | "
            f"{workspace} | {speedup} | {source} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=pathlib.Path)
    parser.add_argument("--readme", type=pathlib.Path, default=pathlib.Path("README.md"))
    args = parser.parse_args()
    readme = args.readme
    text = readme.read_text()
    if START not in text or END not in text.split(START, 1)[1]:
        raise SystemExit(f"{readme} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{table(load(args.results))}\n{END}{tail}")


if __name__ == "__main__":
    main()
