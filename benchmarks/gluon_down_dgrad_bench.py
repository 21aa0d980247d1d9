"""Check the Gluon down_dgrad kernel (megamoe/backends/triton/kernels/gluon_down_dgrad.py) bit for bit against the
production Triton TMA kernel, then time both.

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/gluon_down_dgrad_bench.py OUT.json
    [--workload NAME ...] [--variant NAME ...] [--deadline SECONDS] [--alt-config KEY=VALUE[,KEY=VALUE...]]

Jobs, in order: the small irregular problem (every variant, then the router variant on a block sub-range),
then qwen3-30b-a3b and qwen3-235b-a22b (every variant). Variants:
    router-h_w  kernels.down_dgrad_router(store_h_w=True)   against down_dgrad_router_gluon  (the one-GPU backward)
    router      kernels.down_dgrad_router(store_h_w=False)  against down_dgrad_router_gluon
    plain       kernels.down_dgrad                          against down_dgrad_gluon
The production side runs through the launchers of kernels/grouped_gemm.py with the Triton TMA kernel's
tile (configs.triton_tile of configs.tma_kernel_configs(...).down_dgrad). Per job: the production outputs
and timing first, then the Gluon kernel: every output (d_gate_up, h_w, d_w_part) over the rows of the block
range must be bitwise equal (torch.equal) and bitwise repeatable, then it is timed (triton.testing.do_bench,
median). TF/s counts 2 * rows in use * H * I (padding rows included: both kernels compute them).
--alt-config names a second GluonDownDgradConfig (DEFAULT_CONFIG with those fields replaced): it is checked
bitwise the same way, and the two configs are then timed in --rounds alternating rounds (median per config).

Crashes and hangs: the jobs run in a child process that appends each record to a JSON-lines file as it
finishes (and a "started" line before). The parent watches it: a child that dies (a launch failure
poisons its CUDA context) or spends longer than --job-timeout on one job (a barrier-protocol hang) is
killed, the job is recorded as crashed / hung, that Gluon variant is skipped from then on (its production
side still runs), and a fresh child continues with the next job. A job that raises is recorded with the
error (a CUDA error on the Gluon side also skips the variant from then on). Past --deadline the parent
stops and writes what it has. The table is printed last, and OUT.json written, in every case.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

VARIANTS = ("router-h_w", "router", "plain")
WORKLOAD_NAMES = ("qwen3-30b-a3b", "qwen3-235b-a22b")
BLOCK_M = 128  # schedule rows per block (configs.block_m_for on every table entry)


def _log(*args) -> None:
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------------
# Problems (child process)


def _finish(d_rows, w_down, gate_up, row_src, weights, block_expert, blocks, used, name, H, I, E, row_range):
    """Padding rows (row_src -1) zero in d_rows and gate_up, as the fused path produces them."""
    pad = row_src < 0
    d_rows[pad] = 0
    gate_up[pad] = 0
    return dict(name=name, d_rows=d_rows, w_down=w_down, gate_up=gate_up, row_src=row_src, weights=weights,
                block_expert=block_expert, blocks=blocks, used=used, H=H, I=I, E=E, row_range=row_range)


def small_problem(device, sub_range: bool) -> dict:
    """Irregular segments (an empty expert, a 1-row one, a 129-row one), H = 1000 (15 full K steps and a
    40-wide tail), I = 552 (4 full column tiles; in the last one half 0 has 40 columns, half 1 none),
    three unused blocks at the end (block_expert -1). sub_range: the block range [2, used - 1) instead of
    [0, used)."""
    import torch
    import triton

    g = torch.Generator(device=device).manual_seed(1)
    counts = [300, 0, 129, 1, 640, 77]
    H, I, E = 1000, 552, len(counts)
    block_expert, row_src_host = [], []
    pairs = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(2)).tolist()
    for e, c in enumerate(counts):
        nb = triton.cdiv(c, BLOCK_M)
        block_expert += [e] * nb
        row_src_host += pairs[:c] + [-1] * (nb * BLOCK_M - c)
        pairs = pairs[c:]
    used = len(block_expert)
    block_expert += [-1] * 3
    rows = len(block_expert) * BLOCK_M
    row_src_host += [-1] * (rows - len(row_src_host))
    d_rows = torch.randn(rows, H, device=device, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(rows, 2 * I, device=device, generator=g) * 2).to(torch.bfloat16)
    w_down = (torch.randn(E, H, I, device=device, generator=g) * I**-0.5).to(torch.bfloat16)
    weights = torch.rand(287, 4, device=device, generator=g).softmax(-1)  # 1148 pairs >= sum(counts)
    first, end = (2, used - 1) if sub_range else (0, used)
    return _finish(d_rows, w_down, gate_up, torch.tensor(row_src_host, dtype=torch.int32, device=device), weights,
                   torch.tensor(block_expert, dtype=torch.int32, device=device),
                   torch.tensor([first, end], dtype=torch.int32, device=device), end - first,
                   "small-range" if sub_range else "small", H, I, E, (first * BLOCK_M, end * BLOCK_M))


def workload_problem(name: str, device) -> dict:
    """The schedule the fused one-GPU path builds for balanced routing (megamoe.build_schedule, block_m 128),
    random d_out rows and saved gate_up (both zero on padding rows), the routing's softmax weights."""
    import torch

    from megamoe.backends.triton.kernels._common import range_of
    from megamoe.bench.routing import route
    from megamoe.bench.workloads import WORKLOADS
    from megamoe.schedule import build_schedule

    w = WORKLOADS[name]
    T, H, I, k = w.tokens_per_gpu, w.hidden, w.intermediate, w.top_k
    E = w.one_gpu_experts or w.num_experts
    g = torch.Generator(device=device).manual_seed(0)
    ids, weights = route("balanced", T, E, k, g)
    s = build_schedule(ids, E, block_m=BLOCK_M)
    rows = s.row_src.numel()
    d_rows = torch.randn(rows, H, device=device, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(rows, 2 * I, device=device, generator=g) * 2).to(torch.bfloat16)
    w_down = (torch.randn(E, H, I, device=device, generator=g) * I**-0.5).to(torch.bfloat16)
    used = int(s.num_blocks.item())  # host read: setup, outside anything timed
    return _finish(d_rows, w_down, gate_up, s.row_src, weights, s.block_expert, range_of(s.num_blocks, "num_blocks"),
                   used, name, H, I, E, (0, used * BLOCK_M))


# ----------------------------------------------------------------------------------------------------
# One job (child process): production first, then the Gluon kernel


def _calls(p: dict, variant: str, tma_cfg, gluon_cfg):
    """(production fn, Gluon fn with gluon_cfg): production() -> (d_gate_up, h_w or None, d_w_part or None);
    gluon() -> (the same triple, the compiled kernel)."""
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.kernels import gluon_down_dgrad as gdd

    d, w, gu, rs, be, bl = p["d_rows"], p["w_down"], p["gate_up"], p["row_src"], p["block_expert"], p["blocks"]
    weights = p["weights"]
    if variant == "router" and p["name"].startswith("small"):
        weights = weights.to(d.dtype)  # the activations'-dtype weights path (pair_weights converts to fp32)
    if variant == "plain":
        def gluon_plain():
            d_gate_up, kernel = gdd.down_dgrad_gluon(d, w, gu, be, bl, config=gluon_cfg, return_kernel=True)
            return (d_gate_up, None, None), kernel
        return lambda: (kernels.down_dgrad(d, w, gu, be, bl, config=tma_cfg), None, None), gluon_plain
    store_h_w = variant == "router-h_w"
    return (lambda: kernels.down_dgrad_router(d, w, gu, rs, weights, be, bl, store_h_w=store_h_w, config=tma_cfg),
            lambda: gdd.down_dgrad_router_gluon(d, w, gu, rs, weights, be, bl, store_h_w=store_h_w,
                                                config=gluon_cfg, return_kernel=True))


def _compare(want, got, row_range) -> dict:
    """{output: bitwise equal over the rows of the block range} (+ mismatch counts where not)."""
    import torch

    r0, r1 = row_range
    out = {}
    for name, a, b in zip(("d_gate_up", "h_w", "d_w_part"), want, got):
        if a is None:
            continue
        a, b = a[r0:r1], b[r0:r1]
        equal = bool(torch.equal(a, b))
        out[name] = equal
        if not equal:
            out[f"{name}_mismatches"] = int((a.float() != b.float()).sum().item())
            out[f"{name}_max_abs_diff"] = (a.float() - b.float()).abs().max().item()
    return out


def _all_equal(cmp: dict) -> bool:
    return all(v for v in cmp.values() if isinstance(v, bool))


def _bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _check(gluon, want, row_range, rec: dict, prefix: str) -> None:
    """Run gluon twice: rec[prefix + "bitwise"] against want, prefix + "repeatable", the compiled kernel's
    registers, spills and shared memory."""
    import torch

    got, kernel = gluon()
    torch.cuda.synchronize()
    rec[prefix + "bitwise"] = _compare(want, got, row_range)
    again, _ = gluon()
    torch.cuda.synchronize()
    rec[prefix + "repeatable"] = _all_equal(_compare(got, again, row_range))
    rec.update({prefix + "n_regs": getattr(kernel, "n_regs", None), prefix + "n_spills": getattr(kernel, "n_spills", None),
                prefix + "shared": getattr(kernel.metadata, "shared", None)})


def run_job(p: dict, variant: str, skip_gluon: bool, rec: dict, emit, alt_fields: dict, rounds: int) -> None:
    """Fill rec: the production timing (emitted as a partial record before the Gluon kernel first runs), then
    the Gluon kernel's bitwise checks and timing; with alt_fields, the same checks for the alternate config
    and both configs timed in alternating rounds."""
    import dataclasses
    import statistics

    import torch

    from megamoe.backends.triton.configs import tma_kernel_configs, triton_tile
    from megamoe.backends.triton.kernels import gluon_down_dgrad as gdd

    H, I = p["H"], p["I"]
    tma_cfg = triton_tile(tma_kernel_configs(H, I, torch.bfloat16, p["d_rows"].device, BLOCK_M).down_dgrad)
    rows = p["row_range"][1] - p["row_range"][0]
    flops = 2 * rows * H * I
    rec.update(rows=rows, H=H, I=I, experts=p["E"], triton_config=dataclasses.asdict(tma_cfg),
               gluon_config=dataclasses.asdict(gdd.DEFAULT_CONFIG))
    production, gluon = _calls(p, variant, tma_cfg, gdd.DEFAULT_CONFIG)
    want = production()
    torch.cuda.synchronize()
    ms = _bench_ms(production)
    rec.update(triton_ms=ms, triton_tflops=flops / ms / 1e9)
    if skip_gluon:
        rec["status"] = "gluon skipped (this variant failed earlier)"
        return
    emit(dict(rec, status="production done; running the Gluon kernel"))
    _check(gluon, want, p["row_range"], rec, "")
    ok = _all_equal(rec["bitwise"]) and rec["repeatable"]
    if not alt_fields:
        del want
        ms = _bench_ms(gluon)
    else:
        alt_cfg = dataclasses.replace(gdd.DEFAULT_CONFIG, **alt_fields)
        rec["alt_config"] = dataclasses.asdict(alt_cfg)
        alt = _calls(p, variant, tma_cfg, alt_cfg)[1]
        _check(alt, want, p["row_range"], rec, "alt_")
        del want
        ok = ok and _all_equal(rec["alt_bitwise"]) and rec["alt_repeatable"]
        times: dict = {"gluon": [], "alt": []}
        for _ in range(rounds):
            times["gluon"].append(_bench_ms(gluon))
            times["alt"].append(_bench_ms(alt))
        ms, alt_ms = statistics.median(times["gluon"]), statistics.median(times["alt"])
        rec.update(rounds_ms=times, alt_ms=alt_ms, alt_tflops=flops / alt_ms / 1e9, alt_speedup=ms / alt_ms)
    rec.update(gluon_ms=ms, gluon_tflops=flops / ms / 1e9, speedup=rec["triton_ms"] / ms)
    rec["status"] = "ok" if ok else "NOT BITWISE EQUAL"


def child(jobs: list, skip: list, path: str, alt_fields: dict, rounds: int) -> int:
    """Run jobs [(problem, variant)], appending JSON lines to path; exit on the first exception (a failed
    launch leaves the CUDA context unusable)."""
    import torch

    device = torch.device("cuda")

    def emit(obj):
        with open(path, "a") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    problems: dict = {}
    for problem, variant in jobs:
        emit(dict(problem=problem, variant=variant, status="started", t=time.time()))
        rec = dict(problem=problem, variant=variant)
        try:
            if problem not in problems:
                problems.clear()
                torch.cuda.empty_cache()
                problems[problem] = (small_problem(device, problem == "small-range") if problem.startswith("small")
                                     else workload_problem(problem, device))
            run_job(problems[problem], variant, variant in skip, rec, emit, alt_fields, rounds)
        except Exception as error:  # noqa: BLE001 -- recorded; the parent continues in a fresh child
            rec.update(status=f"error: {type(error).__name__}: {str(error)[:400]}", done=True)
            emit(rec)
            return 1
        rec["done"] = True
        emit(rec)
        _log(json.dumps(rec))
    return 0


# ----------------------------------------------------------------------------------------------------
# Parent: jobs in children, crash / hang handling, table


def _read_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed child
                pass
    return out


def _open_job(lines: list[dict]) -> dict | None:
    """The last "started" line whose job has no final record after it (the job a child is in), or None."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].get("status") == "started":
            key = (lines[i]["problem"], lines[i]["variant"])
            finished = any(r.get("done") and (r["problem"], r["variant"]) == key for r in lines[i + 1:])
            return None if finished else lines[i]
    return None


def _kill(proc) -> None:
    """Kill the child this script started (and what it started: its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def parent(args) -> int:
    import torch

    from megamoe.bench.measure import run_facts

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        _log("needs a Hopper GPU (sm_90): the kernels use wgmma, TMA and setmaxnreg")
        return 2
    variants = args.variant or list(VARIANTS)
    jobs = [("small", v) for v in variants]
    if "router-h_w" in variants:
        jobs.append(("small-range", "router-h_w"))
    jobs += [(w, v) for w in (args.workload or list(WORKLOAD_NAMES)) for v in variants]
    result = dict(run_facts(torch.device("cuda")), jobs=jobs)
    t_start = time.time()
    skip: list[str] = []  # Gluon variants that crashed, hung or hit a CUDA error after their production side ran
    done: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.jsonl")
        while len(done) < len(jobs) and time.time() - t_start < args.deadline:
            todo = [j for j in jobs if j not in done]
            finished_before = len(done)
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(todo),
                                     json.dumps(skip), path, json.dumps(args.alt_config), str(args.rounds)],
                                    start_new_session=True)
            fate = None
            while proc.poll() is None:
                time.sleep(0.5)
                job = _open_job(_read_lines(path))
                if job is not None and time.time() - job["t"] > args.job_timeout:
                    fate = f"hung (no result within {args.job_timeout:.0f} s)"
                elif time.time() - t_start > args.deadline:
                    fate = f"stopped at the {args.deadline:.0f} s deadline"
                if fate:
                    _kill(proc)
                    break
            lines = _read_lines(path)
            for rec in lines:
                if rec.get("done"):
                    key = (rec["problem"], rec["variant"])
                    done[key] = rec
                    # A CUDA error on the Gluon side (after the production timing) would recur: skip the variant.
                    cuda_error = rec["status"].startswith("error") and "CUDA" in rec["status"].upper()
                    if cuda_error and "triton_ms" in rec and rec["variant"] not in skip:
                        skip.append(rec["variant"])
            job = _open_job(lines)
            if job is not None:  # the child died or was killed inside this job: keep what it reported
                key = (job["problem"], job["variant"])
                partial = [r for r in lines if (r["problem"], r["variant"]) == key and "triton_ms" in r]
                rec = dict(partial[-1]) if partial else dict(problem=key[0], variant=key[1])
                rec.update(status=fate or f"crashed (child exit code {proc.returncode})", done=True)
                done[key] = rec
                if "triton_ms" in rec and key[1] not in skip:
                    skip.append(key[1])
                _log(json.dumps(rec))
                if fate and fate.startswith("stopped"):
                    break
            if len(done) == finished_before:  # the child failed before its first job (e.g. an import error)
                result["child_error"] = f"a child exited with code {proc.returncode} before starting a job"
                _log(result["child_error"])
                break
    result["records"] = [done.get(j, dict(problem=j[0], variant=j[1], status="not run (deadline)")) for j in jobs]
    result["skipped_gluon_variants"] = skip
    result["wall_s"] = time.time() - t_start
    result["all_ok"] = all(r.get("status") == "ok" for r in result["records"])
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)

    _log(f"\n{'problem':16} {'variant':11} {'triton ms':>9} {'TF/s':>6} {'gluon ms':>9} {'TF/s':>6} {'speedup':>7} "
         f"{'regs':>4} {'shared':>7} {'alt ms':>8} {'alt x':>6}  bitwise / status")
    for r in result["records"]:
        def num(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        bitwise = " ".join(f"{k}={'ok' if v else 'DIFF'}" for k, v in r.get("bitwise", {}).items()
                           if isinstance(v, bool))
        _log(f"{r['problem']:16} {r['variant']:11} {num('triton_ms', '9.3f'):>9} {num('triton_tflops', '6.0f'):>6} "
             f"{num('gluon_ms', '9.3f'):>9} {num('gluon_tflops', '6.0f'):>6} {num('speedup', '7.2f'):>7} "
             f"{num('n_regs', '4d'):>4} {num('shared', '7d'):>7} {num('alt_ms', '8.3f'):>8} "
             f"{num('alt_speedup', '6.3f'):>6}  {bitwise} {r.get('status')}")
    _log(f"all bitwise equal and timed: {result['all_ok']}; {result['wall_s']:.0f} s; wrote {args.json_path}")
    return 0 if result["all_ok"] else 1


def alt_config(text: str) -> dict:
    """"producer_regs=24,stages=4" -> {"producer_regs": 24, "stages": 4}, the fields checked against
    GluonDownDgradConfig (its own __post_init__ checks the values when the config is built)."""
    import dataclasses

    from megamoe.backends.triton.kernels.gluon_down_dgrad import GluonDownDgradConfig

    fields = {f.name for f in dataclasses.fields(GluonDownDgradConfig)}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in fields or not value.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=INTEGER with KEY one of {sorted(fields)}")
        out[key] = int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child([tuple(j) for j in json.loads(argv[1])], json.loads(argv[2]), argv[3], json.loads(argv[4]),
                     int(argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", help="where to write the records (JSON)")
    parser.add_argument("--workload", action="append", choices=list(WORKLOAD_NAMES) + ["gpt-oss-120b", "deepseek-v3"],
                        help="default: qwen3-30b-a3b and qwen3-235b-a22b")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--deadline", type=float, default=110.0, help="seconds for the whole run")
    parser.add_argument("--job-timeout", type=float, default=60.0,
                        help="seconds one job may take (compiles included) before it counts as hung")
    parser.add_argument("--alt-config", type=alt_config, default={},
                        help="a second Gluon config to check and time against the default: KEY=VALUE[,KEY=VALUE...] "
                             "over GluonDownDgradConfig's integer fields")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds with --alt-config")
    return parent(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
