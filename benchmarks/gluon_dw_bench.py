"""Check and time the Gluon weight-gradient kernel (megamoe/backends/triton/kernels/gluon_dw.py) against the
production Triton TMA kernel (kernels.dw_down / kernels.dw_gate_up with the TMA tile config).

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/gluon_dw_bench.py OUT.json
    [--config NAME ...] [--workload NAME ...] [--routing balanced|skewed]
Compile-only checks of the same kernel (no GPU): tests/test_gluon_dw_compile.py.

The production kernel is timed first, in this process; then every Gluon config runs in its own subprocess (a
worker: this script with --worker), one after the other, so that a kernel that crashes the CUDA context
("unspecified launch failure") or hangs loses only its own results; the default config ("coop") runs first,
the pingpong ones after it. A worker:
  1. small irregular problem: H = 328, I = 200 (column tails in both tile dimensions of both GEMMs: M = 328
     or 400, N = 200 or 328); 7 experts with 0, 128, 1152, 256, 0, 640, 384 rows (empty experts first and in
     the middle, a one-block expert, uneven step counts); about one row in ten zero (like padding); NaN rows
     past the rows in use, which neither kernel may read. dw_down and dw_gate_up: the Gluon output, written
     into a NaN-filled buffer (every element must be written; empty experts zeros), against the production
     kernel's, bitwise (torch.equal on the values and on the 16-bit patterns), repeatable, and both against
     an fp32 per-expert reference;
  2. qwen3-30b-a3b, qwen3-235b-a22b (16384 tokens, 128 experts, top-8) and gpt-oss-120b (top-4) under the
     --routing of megamoe.bench.routing (balanced by default; skewed: uneven rows per expert, so uneven tile
     costs), the schedule of megamoe.schedule.build_schedule with block_m 128; random operand rows, zero on
     padding rows): dw_down
     (d_y [R, H]^T h [R, I]) and dw_gate_up (d_gate_up [R, 2I]^T x_rows [R, H]) bitwise against the
     production kernel, then timed with triton.testing.do_bench (median).
A watchdog in each worker writes what it has and exits if a step hangs; the parent also kills a worker that
overruns and starts no worker near the 2-minute budget. The parent prints a table last and writes OUT.json
(after every worker, so partial results survive).

TF/s counts 2 * rows in use (padding included: both kernels compute it) * M * N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import torch
import triton

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megamoe.backends.triton import kernels  # noqa: E402
from megamoe.backends.triton.configs import tma_kernel_configs, triton_tile  # noqa: E402
from megamoe.backends.triton.kernels import gluon_dw  # noqa: E402
from megamoe.backends.triton.kernels.gluon_common import ConsumerTile  # noqa: E402
from megamoe.bench.measure import run_facts  # noqa: E402
from megamoe.bench.routing import ROUTINGS, route  # noqa: E402
from megamoe.schedule import build_schedule  # noqa: E402

WORKLOADS = {  # name: (tokens, experts, top_k, hidden H, intermediate I), as megamoe.bench.workloads has them
    "qwen3-30b-a3b": (16384, 128, 8, 2048, 768),
    "qwen3-235b-a22b": (16384, 128, 8, 4096, 1536),
    "gpt-oss-120b": (16384, 128, 4, 2880, 2880),
}
SCHEDULE_BLOCK_M = 128
SMALL_COUNTS = [0, 128, 1152, 256, 0, 640, 384]  # rows per expert (multiples of 128, as the schedule pads them)
SMALL_H, SMALL_I = 328, 200
SMALL_UNUSED_ROWS = 256
MAX_REL_ERR = 1e-2  # against the fp32 reference (bf16 output rounding: ~2e-3)
TOTAL_BUDGET_S = 115  # the parent starts no worker after this much wall time
WORKER_TIMEOUT_S = 75  # the parent kills a worker after this long
STEP_TIMEOUT_S = 45  # a worker's watchdog: one check or timing step


def _log(*args) -> None:
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------------
# Worker (one Gluon config, in its own process)


class _Watchdog:
    """A hung kernel (a barrier-protocol bug deadlocks the CTA) must not eat the device time: after `seconds`
    write what was measured so far, say what hung, and exit(3)."""

    def __init__(self, seconds: float, what: str, result: dict, path: str):
        self.seconds, self.what, self.result, self.path = seconds, what, result, path

    def _fire(self) -> None:
        _log(f"TIMEOUT: {self.what} did not finish within {self.seconds:.0f} s (hung?); writing partial results")
        self.result["hung"] = self.what
        with open(self.path, "w") as f:
            json.dump(self.result, f, indent=1)
        os._exit(3)

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()


def _gemm_fns(gemm: str):
    """(production launcher, Gluon launcher) of one weight gradient."""
    return {"dw_down": kernels.dw_down, "dw_gate_up": kernels.dw_gate_up}[gemm], gluon_dw.dw_gluon


def _args(gemm: str, p: dict) -> tuple:
    """The launchers' arguments (a [R, M], b [R, N], expert_offsets, num_experts) of a weight gradient:
    dw_down = d_y^T h, dw_gate_up = d_gate_up^T x_rows."""
    a, b = (p["d_y"], p["h"]) if gemm == "dw_down" else (p["d_gu"], p["x_rows"])
    return a, b, p["offsets"], p["E"]


def _random_rows(rows: int, cols: int, valid, generator, device):
    t = torch.randn(rows, cols, device=device, generator=generator).to(torch.bfloat16)
    return t.masked_fill_(~valid[:, None], 0.0)


def small_problem(device) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    offsets = [0]
    for n in SMALL_COUNTS:
        offsets.append(offsets[-1] + n)
    used = offsets[-1]
    rows = used + SMALL_UNUSED_ROWS
    # About one row in ten is zero, like the schedule's padding rows.
    valid = torch.rand(rows, device=device, generator=g) > 0.1
    valid[used:] = True
    p = dict(name="small", E=len(SMALL_COUNTS), H=SMALL_H, I=SMALL_I, used=used,
             offsets=torch.tensor(offsets, dtype=torch.int32, device=device), offsets_host=offsets,
             tma_cfgs=tma_kernel_configs(SMALL_H, SMALL_I, torch.bfloat16, device, SCHEDULE_BLOCK_M))
    for name, cols in (("d_y", SMALL_H), ("h", SMALL_I), ("d_gu", 2 * SMALL_I), ("x_rows", SMALL_H)):
        t = _random_rows(rows, cols, valid, g, device)
        t[used:] = float("nan")  # rows past the rows in use: never read
        p[name] = t
    return p


def workload_problem(name: str, routing: str, device) -> dict:
    """Operand rows of the fused path's weight gradients under the schedule of this routing."""
    T, E, k, H, I = WORKLOADS[name]
    g = torch.Generator(device=device).manual_seed(0)
    ids, _ = route(routing, T, E, k, g)
    s = build_schedule(ids, E, block_m=SCHEDULE_BLOCK_M)
    rows = s.row_src.numel()
    valid = s.row_src >= 0
    p = dict(name=name, routing=routing, E=E, H=H, I=I, offsets=s.expert_offsets, used=int(s.expert_offsets[-1].item()),
             tma_cfgs=tma_kernel_configs(H, I, torch.bfloat16, device, SCHEDULE_BLOCK_M))
    for n, cols in (("d_y", H), ("h", I), ("d_gu", 2 * I), ("x_rows", H)):
        p[n] = _random_rows(rows, cols, valid, g, device)
    return p


def _bits_equal(x, y) -> bool:
    """The same 16-bit patterns (torch.equal compares values: -0.0 == 0.0)."""
    return bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))


def _reference_fp32(a, b, offsets_host: list[int]):
    out = torch.empty(len(offsets_host) - 1, a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    for e in range(len(offsets_host) - 1):
        r0, r1 = offsets_host[e], offsets_host[e + 1]
        out[e] = a[r0:r1].float().t() @ b[r0:r1].float()
    return out


def check_gemm(p: dict, gemm: str, cfg: ConsumerTile, with_reference: bool) -> dict:
    """The Gluon output (into a NaN-filled buffer) against the production kernel's, bitwise; repeatable."""
    production, gluon = _gemm_fns(gemm)
    args = _args(gemm, p)
    want = production(*args, config=triton_tile(getattr(p["tma_cfgs"], gemm)))
    got = torch.full_like(want, float("nan"))
    _, kernel = gluon_dw.dw_gluon(*args, cfg, out=got, return_kernel=True)
    again = gluon(*args, cfg)
    torch.cuda.synchronize()
    rec = dict(equal_to_production=bool(torch.equal(got, want)), bits_equal_to_production=_bits_equal(got, want),
               repeatable=_bits_equal(got, again), nan_left=int(got.isnan().sum().item()),
               n_regs=getattr(kernel, "n_regs", None), n_spills=getattr(kernel, "n_spills", None),
               shared=getattr(kernel.metadata, "shared", None))
    if not rec["equal_to_production"]:
        diff = (got.float() - want.float()).abs()
        rec.update(mismatches=int((got != want).sum().item()), max_abs_diff=diff.nan_to_num(float("inf")).max().item())
    if with_reference:
        ref = _reference_fp32(*args[:2], p["offsets_host"])
        for label, y in (("gluon", got), ("production", want)):
            rec[f"rel_err_{label}"] = ((y.float() - ref).norm() / ref.norm()).item()
        rec["empty_experts_zero"] = all(bool((got[e] == 0).all().item()) for e, n in enumerate(SMALL_COUNTS) if n == 0)
    rec["ok"] = (rec["bits_equal_to_production"] and rec["repeatable"] and rec["nan_left"] == 0
                 and rec.get("rel_err_gluon", 0.0) <= MAX_REL_ERR and rec.get("empty_experts_zero", True))
    return rec


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _record(p: dict, gemm: str, variant: str) -> dict:
    a, b, _, _ = _args(gemm, p)
    return dict(workload=p["name"], routing=p.get("routing"), gemm=gemm, variant=variant, rows=p["used"],
                M=a.shape[1], N=b.shape[1], experts=p["E"], flops=2 * p["used"] * a.shape[1] * b.shape[1])


def run_worker(config: str, workloads: list[str], routing: str, path: str) -> int:
    """One Gluon config: the small problem's checks, then per workload and GEMM the bitwise check and the timing."""
    cfg = gluon_dw.CONFIGS[config]
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is real fp32
    result = dict(config=config, checks=[], records=[])

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    def checked(p: dict, gemm: str, with_reference: bool) -> dict:
        rec = dict(problem=p["name"], gemm=gemm, config=config)
        try:
            with _Watchdog(STEP_TIMEOUT_S, f"{config} {gemm} check on {p['name']}", result, path):
                rec.update(check_gemm(p, gemm, cfg, with_reference))
        except Exception as error:  # a compile failure or launch error: report and go on
            rec.update(ok=False, status=f"{type(error).__name__}: {str(error)[:300]}")
        result["checks"].append(rec)
        _log(json.dumps(rec))
        save()
        return rec

    t0 = time.time()
    p = small_problem(device)
    for gemm in ("dw_down", "dw_gate_up"):
        checked(p, gemm, with_reference=True)
    for name in workloads:
        p = workload_problem(name, routing, device)
        for gemm in ("dw_down", "dw_gate_up"):
            check = checked(p, gemm, with_reference=False)
            rec = _record(p, gemm, f"gluon-{config}")
            if not check.get("ok"):
                rec.update(status="WRONG (not timed)")
            else:
                gluon, args = _gemm_fns(gemm)[1], _args(gemm, p)
                try:
                    with _Watchdog(STEP_TIMEOUT_S, f"timing {config} {gemm} on {name}", result, path):
                        ms = _time(lambda: gluon(*args, cfg))
                    rec.update(status="ok", ms=ms, tflops=rec["flops"] / ms / 1e9)
                except Exception as error:
                    rec.update(status=f"{type(error).__name__}: {str(error)[:300]}")
            result["records"].append(rec)
            _log(json.dumps(rec))
            save()
    result["wall_s"] = time.time() - t0
    save()
    return 0


# ----------------------------------------------------------------------------------------------------
# Parent: the production kernel's timings, one worker per Gluon config, then the table


def time_production(workloads: list[str], routing: str, device) -> list[dict]:
    """megamoe-tma: kernels.dw_down / dw_gate_up with the TMA tile config, in the parent (no Gluon kernel
    runs in this process, so its CUDA context stays healthy whatever the workers do)."""
    records = []
    for name in workloads:
        p = workload_problem(name, routing, device)
        for gemm in ("dw_down", "dw_gate_up"):
            production, args = _gemm_fns(gemm)[0], _args(gemm, p)
            tile = triton_tile(getattr(p["tma_cfgs"], gemm))
            rec = _record(p, gemm, "megamoe-tma")
            rec["tile"] = dataclasses.asdict(tile)
            ms = _time(lambda: production(*args, config=tile))
            rec.update(status="ok", ms=ms, tflops=rec["flops"] / ms / 1e9)
            records.append(rec)
            _log(json.dumps(rec))
    return records


def _table(result: dict) -> str:
    records = result["records"]
    lines = [f"{'workload':16} {'gemm':11} {'variant':24} {'ms':>8} {'TF/s':>6} {'vs tma':>7}  status"]
    base = {(r["workload"], r["gemm"]): r["ms"] for r in records if r["variant"] == "megamoe-tma" and "ms" in r}
    for r in sorted(records, key=lambda r: (r["workload"], r["gemm"], r["variant"] != "megamoe-tma")):
        ms = f"{r['ms']:8.3f}" if "ms" in r else f"{'-':>8}"
        tf = f"{r['tflops']:6.0f}" if "tflops" in r else f"{'-':>6}"
        b = base.get((r["workload"], r["gemm"]))
        ratio = f"{b / r['ms']:6.2f}x" if b and "ms" in r else f"{'-':>7}"
        lines.append(f"{r['workload']:16} {r['gemm']:11} {r['variant']:24} {ms} {tf} {ratio}  {r['status']}")
    for w in dict.fromkeys(r["workload"] for r in records):  # both GEMMs, as a layer's backward runs them
        by: dict = {}
        for r in records:
            if r["workload"] == w and "ms" in r:
                by.setdefault(r["variant"], {})[r["gemm"]] = r["ms"]
        totals = {v: sum(g.values()) for v, g in by.items() if len(g) == 2}
        lines.append(f"{w}: dw_down + dw_gate_up: " + ", ".join(f"{v} {t:.3f} ms" for v, t in totals.items()))
    lines.append("checks (bitwise against megamoe-tma): " + ", ".join(
        f"{c['config']}/{c['problem']}/{c['gemm']}={'ok' if c.get('ok') else 'FAIL'}" for c in result["checks"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", help="where to write the records (JSON)")
    parser.add_argument("--config", action="append", choices=list(gluon_dw.CONFIGS), help="default: all, coop first")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="default: all")
    parser.add_argument("--routing", choices=ROUTINGS, default="balanced")
    parser.add_argument("--worker", choices=list(gluon_dw.CONFIGS), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    workloads = args.workload or list(WORKLOADS)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        _log("needs a Hopper GPU (sm_90): the kernels use wgmma, TMA and setmaxnreg")
        return 2
    if args.worker:
        return run_worker(args.worker, workloads, args.routing, args.json_path)

    configs = args.config or list(gluon_dw.CONFIGS)
    result = {**run_facts(torch.device("cuda")), "routing": args.routing,
              "configs": {n: dataclasses.asdict(gluon_dw.CONFIGS[n]) for n in configs},
              "workers": {}, "checks": [], "records": []}

    def save():
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)

    t_start = time.time()
    result["records"] += time_production(workloads, args.routing, torch.device("cuda"))
    torch.cuda.empty_cache()  # the workers need the memory
    save()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            left = TOTAL_BUDGET_S - (time.time() - t_start)
            if left < 30:
                result["workers"][config] = dict(rc=None, status=f"skipped: {TOTAL_BUDGET_S - left:.0f} s of the budget used")
                _log(f"--- worker {config}: skipped (time budget)")
                continue
            out = os.path.join(tmp, f"{config}.json")
            cmd = [sys.executable, __file__, out, "--worker", config, "--routing", args.routing]
            cmd += sum((["--workload", w] for w in workloads), [])
            _log(f"--- worker {config}")
            t0 = time.time()
            try:
                rc = subprocess.run(cmd, env=env, timeout=min(WORKER_TIMEOUT_S, left)).returncode
            except subprocess.TimeoutExpired:
                rc = "killed (timeout)"
            worker = dict(rc=rc, wall_s=round(time.time() - t0, 1))
            if os.path.exists(out):
                with open(out) as f:
                    got = json.load(f)
                worker["hung"] = got.get("hung")
                result["checks"] += got["checks"]
                result["records"] += got["records"]
            result["workers"][config] = worker
            save()
    ok = (all(c.get("ok") for c in result["checks"]) and all(r["status"] == "ok" for r in result["records"])
          and all(w["rc"] == 0 for w in result["workers"].values()))
    result.update(all_ok=ok, wall_s=round(time.time() - t_start, 1))
    save()
    _log("\n" + _table(result))
    _log(f"workers: {json.dumps(result['workers'])}")
    _log(f"all checks ok: {ok}; {result['wall_s']:.0f} s; wrote {args.json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
