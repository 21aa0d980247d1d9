"""The Gluon gate_up_fwd kernel (megamoe/backends/triton/kernels/gluon_gate_up.py) against the production Triton TMA
kernel: bitwise checks, then timings.

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/gluon_gate_up_bench.py OUT.json
[--parts triton,gluon-gather]

Three parts, each in its own subprocess (a kernel that faults takes the CUDA context with it, and a barrier bug
hangs the GPU: the parent kills a part that outlives its watchdog and keeps the others' records), in order of
risk:
  * "triton": the production kernels, kernels.gate_up_fwd with the TMA tile of configs.tma_kernel_configs,
    x rows by TMA and gathering x in its loads (gather=(row_src, k)), with and without store_gate_up; and
    torch._grouped_mm (cuBLAS) on the same segments, the GEMM alone without the SwiGLU epilogue;
  * "gluon": the Gluon kernel, x rows by TMA, every tile of the variant list;
  * "gluon-gather": the Gluon kernel gathering x (cp.async producer warpgroup).
Each Gluon part checks every variant, in both store modes, bitwise (h and gate_up, as 16-bit patterns: -0 and
+0 differ) against the production kernel on the same inputs (the gathering variants against the production
gathering kernel):
  * a small irregular problem: 6 experts with 300, 0 (empty), 129, 1, 500, 78 rows (k = 2, tokens shuffled),
    H = 1040 (a K tail of 16), I = 208 (a column tail of 80 in the second gate/up block), unused blocks after
    the schedule's last; outputs pre-filled with NaN: the rows past the block range must keep it; then a
    sub-range of the blocks ([2, used - 1)) against the production kernel on the same range;
  * qwen3-30b-a3b (H 2048, I 768, 128 experts, 16384 tokens, top-8, balanced routing) and qwen3-235b-a22b
    (H 4096, I 1536), the schedules megamoe.schedule.build_schedule builds;
then times the variants (triton.testing.do_bench, median) in ROUNDS alternating rounds on the two workloads.
TF/s counts 2 x rows x H x 2I over the rows in use, padding included (every variant computes it). The table
comes last; OUT.json holds every record, and in "env" the GPU, torch, Triton and commit (measure.run_facts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

WORKLOADS = {  # name: (tokens, experts, top_k, H, I)
    "qwen3-30b-a3b": (16384, 128, 8, 2048, 768),
    "qwen3-235b-a22b": (16384, 128, 8, 4096, 1536),
}
SMALL_COUNTS = [300, 0, 129, 1, 500, 78]  # rows per expert of the small problem (k = 2: 504 tokens)
SMALL_H, SMALL_I = 1040, 208
# Gluon variants: (tile name in gluon_gate_up.TILES, store modes). Tiles s3b2 / s4b1 are the launcher's defaults
# with / without gate_up; n64-s5b3 tests the register argument for BLOCK_N 128; s3-handoff runs the epilogue on
# warps of its own (gate_up_fwd_handoff_kernel).
GLUON_VARIANTS = {
    "gluon": [("s3b2", (True, False)), ("s4b1", (True, False)), ("n64-s5b3", (True, )), ("s3-handoff", (True, False))],
    "gluon-gather": [("s3b2", (True, False)), ("s4b1", (True, False))],
}
ROUNDS = 3  # alternating timing rounds of the Gluon variants
PART_SECONDS = {"triton": 90, "gluon": 300, "gluon-gather": 200}  # watchdog per part
RECORD = "RECORD "  # stdout prefix of a part's records


# ----------------------------------------------------------------------------------------------------
# Problems and runs (inside a part)


def _schedule_problem(name: str, topk_ids, num_experts: int, top_k: int, hidden: int, inter: int, generator) -> dict:
    """Operands of gate_up_fwd for a routing: x [T, H], the schedule, x_rows (the gathered rows, padding zero),
    w_gate_up [E, 2I, H] (entries ~ N(0, 1/H): g, u ~ N(0, 1))."""
    import torch

    from megamoe.backends.triton import kernels
    from megamoe.schedule import build_schedule

    device = generator.device
    x = torch.randn(topk_ids.shape[0], hidden, device=device, generator=generator).to(torch.bfloat16)
    w = (torch.randn(num_experts, 2 * inter, hidden, device=device, generator=generator) * hidden**-0.5).to(torch.bfloat16)
    s = build_schedule(topk_ids, num_experts, block_m=128)
    in_use = s.expert_offsets[-1:]
    x_rows = kernels.spread_rows(x, s.dest_row, s.row_src, in_use)
    used = int(s.num_blocks.item())  # host reads: setup, outside anything timed
    return dict(name=name, x=x, w=w, x_rows=x_rows, s=s, top_k=top_k, H=hidden, I=inter, used_blocks=used,
                rows_used=used * 128, rows=s.row_src.numel(), offs=s.expert_offsets[1:].to(torch.int32).contiguous())


def small_problem(device) -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(1)
    experts = torch.cat([torch.full((c, ), e) for e, c in enumerate(SMALL_COUNTS)])
    tokens = experts.numel() // 2
    # token t takes pairs t and t + T of the expert-sorted list: two distinct experts (no expert has > T rows)
    ids = torch.stack([experts[:tokens], experts[tokens:]], dim=1)
    ids = ids[torch.randperm(tokens, generator=torch.Generator().manual_seed(2))].to(device)
    return _schedule_problem("small", ids, len(SMALL_COUNTS), 2, SMALL_H, SMALL_I, g)


def workload_problem(name: str, device) -> dict:
    import torch

    from megamoe.bench.routing import route

    tokens, num_experts, top_k, hidden, inter = WORKLOADS[name]
    g = torch.Generator(device=device).manual_seed(0)
    ids, _ = route("balanced", tokens, num_experts, top_k, g)
    return _schedule_problem(name, ids, num_experts, top_k, hidden, inter, g)


def _tma_config(p):
    import torch

    from megamoe.backends.triton.configs import tma_kernel_configs, triton_tile

    return triton_tile(tma_kernel_configs(p["H"], p["I"], torch.bfloat16, p["x"].device, 128).gate_up_fwd)


def run_production(p, store_gate_up: bool, gather: bool, blocks=None):
    from megamoe.backends.triton import kernels

    s = p["s"]
    blocks = s.num_blocks if blocks is None else blocks
    if gather:
        return kernels.gate_up_fwd(p["x"], p["w"], s.block_expert, blocks, store_gate_up=store_gate_up,
                                   config=_tma_config(p), gather=(s.row_src, p["top_k"]))
    return kernels.gate_up_fwd(p["x_rows"], p["w"], s.block_expert, blocks, store_gate_up=store_gate_up,
                               config=_tma_config(p))


def run_gluon(p, tile_name: str, store_gate_up: bool, gather: bool, blocks=None, out=None):
    from megamoe.backends.triton.kernels import gluon_gate_up

    s = p["s"]
    blocks = s.num_blocks if blocks is None else blocks
    tile = gluon_gate_up.TILES[tile_name]
    if gather:
        return gluon_gate_up.gate_up_fwd_gluon(p["x"], p["w"], s.block_expert, blocks, store_gate_up=store_gate_up,
                                               gather=(s.row_src, p["top_k"]), tile=tile, out=out)
    return gluon_gate_up.gate_up_fwd_gluon(p["x_rows"], p["w"], s.block_expert, blocks, store_gate_up=store_gate_up,
                                           tile=tile, out=out)


def bits(t):
    import torch

    return t.view(torch.int16)


def compare(got, want, rows: slice) -> dict:
    """Bitwise comparison of rows (16-bit patterns), with the size of a difference where there is one."""
    a, b = got[rows], want[rows]
    differ = bits(a) != bits(b)
    rec = dict(equal=not bool(differ.any().item()))
    if not rec["equal"]:
        rec.update(mismatches=int(differ.sum().item()), max_abs_diff=(a.float() - b.float()).abs().max().item())
    return rec


def untouched(t, rows: list[slice]) -> bool:
    """The NaN sentinel survives in these rows."""
    return all(bool(t[r].isnan().all().item()) for r in rows if r.stop > r.start)


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def emit(rec: dict) -> None:
    print(RECORD + json.dumps(rec), flush=True)


def check_small(p, tile_name: str, store_gate_up: bool, gather: bool) -> dict:
    """Whole block range and a sub-range: bitwise equal to the production kernel in range, NaN sentinel kept out of
    it; a second call gives the same bits."""
    import torch

    rec = {}
    used, rows = p["used_blocks"], p["rows"]
    full_h = None
    for label, first, end in (("full", 0, used), ("subrange", 2, used - 1)):
        blocks = torch.tensor([first, end], dtype=torch.int32, device=p["x"].device)
        want_h, want_gu = run_production(p, store_gate_up, gather, blocks)
        out = (torch.full((rows, p["I"]), float("nan"), dtype=torch.bfloat16, device=p["x"].device),
               torch.full((rows, 2 * p["I"]), float("nan"), dtype=torch.bfloat16, device=p["x"].device)
               if store_gate_up else None)
        h, gu = run_gluon(p, tile_name, store_gate_up, gather, blocks, out=out)
        in_range = slice(first * 128, end * 128)
        outside = [slice(0, first * 128), slice(end * 128, rows)]
        rec[f"{label}_h"] = compare(h, want_h, in_range)
        rec[f"{label}_untouched"] = untouched(h, outside)
        if store_gate_up:
            rec[f"{label}_gate_up"] = compare(gu, want_gu, in_range)
            rec[f"{label}_untouched"] &= untouched(gu, outside)
        full_h = h if full_h is None else full_h
    again = run_gluon(p, tile_name, store_gate_up, gather)
    rec["repeatable"] = bool(torch.equal(bits(again[0][:used * 128]), bits(full_h[:used * 128])))
    rec["ok"] = all(v["equal"] if isinstance(v, dict) else v for v in rec.values())
    return rec


def time_triton_workload(name: str, device) -> None:
    """The production kernels (x rows by TMA, gathering; both store modes) and cuBLAS on one workload."""
    import torch

    p = workload_problem(name, device)
    flops = 2 * p["rows_used"] * p["H"] * 2 * p["I"]
    base = dict(kind="time", workload=name, rows=p["rows_used"], H=p["H"], I=p["I"], tile=str(_tma_config(p)))
    x_rows, w_t, offs = p["x_rows"][:p["rows_used"]], p["w"].transpose(1, 2), p["offs"]
    timings = {("cublas-gemm (no epilogue)", None): lambda: torch._grouped_mm(x_rows, w_t, offs=offs)}
    for store_gate_up in (True, False):
        for gather in (False, True):
            variant = "triton-tma" + ("-gather" if gather else "")
            timings[(variant, store_gate_up)] = lambda s=store_gate_up, g=gather: run_production(p, s, g)
    for (variant, store_gate_up), fn in timings.items():
        fn()
        ms = bench_ms(fn)
        emit(dict(base, variant=variant, store_gate_up=store_gate_up, status="ok", ms=ms, tflops=flops / ms / 1e9))


def check_and_time_gluon_workload(name: str, device, gather: bool) -> None:
    """Every Gluon variant on one workload: bitwise against the production kernel, then timed."""
    from megamoe.bench.measure import alternating_rounds

    p = workload_problem(name, device)
    prefix = "gluon" + ("-gather" if gather else "")
    flops = 2 * p["rows_used"] * p["H"] * 2 * p["I"]
    rows = slice(0, p["rows_used"])
    for store_gate_up in (True, False):
        want_h, want_gu = run_production(p, store_gate_up, gather)
        checked = {}  # tile name: bitwise equal
        for tile_name, modes in GLUON_VARIANTS[prefix]:
            if store_gate_up not in modes:
                continue
            h, gu = run_gluon(p, tile_name, store_gate_up, gather)
            check = dict(kind="check", problem=name, variant=f"{prefix}-{tile_name}", store_gate_up=store_gate_up,
                         h=compare(h, want_h, rows))
            if store_gate_up:
                check["gate_up"] = compare(gu, want_gu, rows)
            check["ok"] = checked[tile_name] = check["h"]["equal"] and (not store_gate_up or check["gate_up"]["equal"])
            emit(check)
            del h, gu
        # The variants alternate over ROUNDS rounds (in round_order's order); the median round is reported.
        round_ms = alternating_rounds({t: lambda t=t, s=store_gate_up: run_gluon(p, t, s, gather) for t in checked},
                                      ROUNDS, bench_ms)
        for tile_name in checked:
            ms = statistics.median(round_ms[tile_name])
            emit(dict(kind="time", workload=name, rows=p["rows_used"], H=p["H"], I=p["I"],
                      variant=f"{prefix}-{tile_name}", store_gate_up=store_gate_up, tile=tile_name,
                      bitwise_equal=checked[tile_name],
                      status="ok" if checked[tile_name] else "WRONG", ms=ms, round_ms=round_ms[tile_name],
                      tflops=flops / ms / 1e9))


def run_part(part: str) -> int:
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU (sm_90): the kernels use wgmma, TMA and setmaxnreg", flush=True)
        return 2
    device = torch.device("cuda")
    if part == "triton":
        for name in WORKLOADS:
            time_triton_workload(name, device)
            torch.cuda.empty_cache()
        return 0
    gather = part == "gluon-gather"
    small = small_problem(device)
    for tile_name, modes in GLUON_VARIANTS[part]:
        for store_gate_up in modes:
            rec = dict(kind="check", problem="small", variant=f"{part}-{tile_name}", store_gate_up=store_gate_up)
            t0 = time.time()
            rec.update(check_small(small, tile_name, store_gate_up, gather), seconds=time.time() - t0)
            emit(rec)
    del small
    for name in WORKLOADS:
        check_and_time_gluon_workload(name, device, gather)
        torch.cuda.empty_cache()
    return 0


# ----------------------------------------------------------------------------------------------------
# The parent: parts in subprocesses, the table, the JSON


def spawn(part: str, records: list, failures: list) -> None:
    """Run one part in a subprocess, echo its output, collect its records; kill it past its watchdog."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--part", part], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    timer = threading.Timer(PART_SECONDS[part], proc.kill)
    timer.start()
    tail: list[str] = []
    for line in proc.stdout:
        if line.startswith(RECORD):
            rec = dict(json.loads(line[len(RECORD):]), part=part)
            records.append(rec)
            print(json.dumps(rec), flush=True)
        else:
            print(f"[{part}] {line}", end="", flush=True)
            tail = (tail + [line.rstrip()])[-20:]
    rc = proc.wait()
    timer.cancel()
    seconds = time.time() - t0
    if rc != 0:
        hung = seconds >= PART_SECONDS[part]
        failures.append(dict(part=part, rc=rc, seconds=seconds,
                             reason=f"killed after {PART_SECONDS[part]} s (hung?)" if hung else f"exited with rc {rc}",
                             last_record=records[-1] if records and records[-1]["part"] == part else None,
                             output_tail=tail))
        print(f"PART {part} FAILED (rc {rc}, {seconds:.0f} s); the other parts go on", flush=True)


def table(records: list) -> list[str]:
    lines = [f"{'workload':16} {'store':6} {'variant':28} {'ms':>8} {'TF/s':>6}  status"]
    for r in records:
        if r["kind"] != "time":
            continue
        store = "-" if r["store_gate_up"] is None else ("gu+h" if r["store_gate_up"] else "h")
        lines.append(f"{r['workload']:16} {store:6} {r['variant']:28} {r['ms']:8.3f} {r['tflops']:6.0f}  {r['status']}")
    for name in WORKLOADS:
        for store in (True, False):
            times = {r["variant"]: r["tflops"] for r in records
                     if r["kind"] == "time" and r["workload"] == name and r["store_gate_up"] == store and r["status"] == "ok"}
            for mode in ("", "-gather"):
                best = max(((v, t) for v, t in times.items() if v.startswith("gluon" + mode + "-")
                            and (mode or not v.startswith("gluon-gather"))), key=lambda x: x[1], default=None)
                triton_tf = times.get("triton-tma" + mode)
                if best and triton_tf:
                    lines.append(f"{name} {'gu+h' if store else 'h'}: best {best[0]} {best[1]:.0f} TF/s = "
                                 f"{best[1] / triton_tf:.3f} x triton-tma{mode} ({triton_tf:.0f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", nargs="?", help="where to write the records (JSON)")
    parser.add_argument("--parts", default=",".join(PART_SECONDS),
                        help=f"comma-separated parts to run, of {', '.join(PART_SECONDS)} (default: all)")
    parser.add_argument("--part", choices=list(PART_SECONDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PART_SECONDS]
    if unknown:
        parser.error(f"--parts: unknown part(s) {unknown}; the parts are {list(PART_SECONDS)}")
    if args.part:
        return run_part(args.part)
    if not args.json_path:
        parser.error("the JSON output path is required")
    import torch

    from megamoe.bench.measure import run_facts

    env = run_facts(torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # the parts' device
    t0 = time.time()
    records: list = []
    failures: list = []
    for part in parts:
        spawn(part, records, failures)
    checks = [r for r in records if r["kind"] == "check"]
    ok = (not failures and bool(checks) and all(c["ok"] for c in checks)
          and all(r["status"] == "ok" for r in records if r["kind"] == "time"))
    result = dict(all_ok=ok, wall_s=time.time() - t0, variants=GLUON_VARIANTS, failures=failures,
                  env=env, records=records)
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)
    print()
    for c in checks:
        print(f"check {c['problem']:16} {c['variant']:24} {'gu+h' if c['store_gate_up'] else 'h':5} "
              f"{'ok' if c['ok'] else 'MISMATCH ' + json.dumps(c)}")
    for f in failures:
        print(f"FAILED part {f['part']}: {f['reason']} (rc {f['rc']})")
    for line in table(records):
        print(line)
    print(f"all checks ok: {ok}; {result['wall_s']:.0f} s; wrote {args.json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
