"""The Gluon row-block GEMMs (kernels/gluon_rows.py) against the production Triton TMA kernels: checks, timings.

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/gluon_rows_bench.py OUT.json
    [--tile NAME ...] [--workload NAME ...]

For both GEMMs, down_fwd (y_rows = h @ w_down[e]^T) and gate_up_dgrad (d_x_rows = d_gate_up @ w_gate_up[e]),
every Gluon tile of gluon_rows.TILES is compared with the Triton TMA kernel of the same tile
(kernels.down_fwd / kernels.gate_up_dgrad with configs.triton_tile of tma_kernel_configs' entry, i.e.
tma_gemm.row_gemm_tma_kernel):

  * small irregular problem (6 experts of 300, 0, 129, 1, 640 and 77 rows, unused blocks at the end,
    H 2880: column tails for 128- and 256-wide tiles, I 552: K tails for both GEMMs): bitwise equal to
    the Triton kernel over the whole block range and over a sub-range (first > 0); rows outside the range
    left as they were (NaN sentinel); bitwise repeatable; relative error against an fp32 torch reference;
  * qwen3-30b-a3b (H 2048, I 768) and qwen3-235b-a22b (H 4096, I 1536), 128 experts, 16384 tokens, top-8,
    balanced routing, the schedule of megamoe.schedule.build_schedule (block_m 128): bitwise equal to the
    Triton kernel on the rows in use, outside rows untouched; then timed (triton.testing.do_bench medians)
    with the Triton kernel and torch._grouped_mm (cuBLAS) on the same segments. TF/s counts 2 * rows * N * K
    over the rows in use (padding included: every variant computes it).

Crashes and hangs: the variants run in worker subprocesses of this script, one tile after the other: first
the baselines (Triton kernel, torch._grouped_mm) and "coop", then the ping-pong tiles. A worker writes each
record as a JSON line when it has it and exits as soon as its CUDA context is lost (a kernel fault); the
parent gives each worker a time limit (the watchdog: a hung worker is killed, its records so far kept),
starts a new worker for the tiles a dead one had not started, and starts none once the overall budget is
spent; so a kernel that faults or deadlocks loses only its own results. The parent writes OUT.json (with the GPU,
torch, Triton and commit of measure.run_facts) and prints the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

SCHEDULE_BLOCK_M = 128
WORKLOADS = {  # name: (tokens, experts, top_k, H, I), as megamoe.bench.workloads defines them
    "qwen3-30b-a3b": (16384, 128, 8, 2048, 768),
    "qwen3-235b-a22b": (16384, 128, 8, 4096, 1536),
}
GEMMS = ("down_fwd", "gate_up_dgrad")
MAX_REL_ERR = 1e-2  # the small problem against fp32 (the bf16 output's rounding alone: ~2e-3)
WORKER_LIMIT_S = 100  # the watchdog: a worker's wall-clock limit
TOTAL_BUDGET_S = 170  # no worker is started past this (a normal run: two workers, expected ~90 s)


# ----------------------------------------------------------------------------------------------------
# Worker (one subprocess per group of variants; needs the GPU)


def _emit(path: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _exit_if_context_lost(path: str, record: dict) -> None:
    """After an error: if the CUDA context is gone (a kernel fault is sticky), write the record and exit, so
    that the parent starts a new worker for the tiles left instead of every later variant failing here."""
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:
        _emit(path, dict(record, status=f"{record['status']} (CUDA context lost: the worker exits)"))
        os._exit(3)


def _small_problem(device):
    """Irregular segments through build_schedule: an empty expert, a 1-row one, tails in every dimension."""
    import torch
    from megamoe.schedule import build_schedule

    counts = [300, 0, 129, 1, 640, 77]
    hidden, inter = 2880, 552
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.cat([torch.full((c, 1), e, dtype=torch.int64) for e, c in enumerate(counts)]).to(device)
    ids = ids[torch.randperm(ids.shape[0], generator=g, device=device)]
    return _operands("small", build_schedule(ids, len(counts), block_m=SCHEDULE_BLOCK_M), len(counts), hidden, inter, g)


def _workload_problem(name: str, device):
    import torch
    from megamoe.bench.routing import route
    from megamoe.schedule import build_schedule

    tokens, experts, top_k, hidden, inter = WORKLOADS[name]
    g = torch.Generator(device=device).manual_seed(0)
    ids, _ = route("balanced", tokens, experts, top_k, g)
    return _operands(name, build_schedule(ids, experts, block_m=SCHEDULE_BLOCK_M), experts, hidden, inter, g)


def _operands(name, schedule, experts, hidden, inter, g) -> dict:
    """Random operands of both GEMMs over the schedule's rows (every row, padding and unused ones too)."""
    import torch

    device = schedule.block_expert.device
    rows = schedule.block_expert.numel() * SCHEDULE_BLOCK_M
    bf16 = torch.bfloat16
    used = int(schedule.num_blocks.item())  # host reads: setup, outside anything timed
    return dict(
        name=name, hidden=hidden, inter=inter, used=used, schedule=schedule,
        block_expert=schedule.block_expert, num_blocks=schedule.num_blocks.reshape(1),
        blocks_host=schedule.block_expert.tolist(),
        h=torch.randn(rows, inter, device=device, generator=g).to(bf16),
        w_down=(torch.randn(experts, hidden, inter, device=device, generator=g) * inter**-0.5).to(bf16),
        d_gate_up=torch.randn(rows, 2 * inter, device=device, generator=g).to(bf16),
        w_gate_up=(torch.randn(experts, 2 * inter, hidden, device=device, generator=g) * (2 * inter)**-0.5).to(bf16),
    )


def _gemm_operands(p: dict, gemm: str):
    """(a [R, K], w, w as torch._grouped_mm takes it [E, K, N], N, K)."""
    if gemm == "down_fwd":
        return p["h"], p["w_down"], p["w_down"].transpose(1, 2), p["hidden"], p["inter"]
    return p["d_gate_up"], p["w_gate_up"], p["w_gate_up"], p["hidden"], 2 * p["inter"]


def _fp32_reference(p: dict, gemm: str):
    """fp32 [used rows, N]: per expert, the matmul of its run of blocks."""
    import torch

    a, _, w_kn, n_dim, _ = _gemm_operands(p, gemm)
    out = torch.empty(p["used"] * SCHEDULE_BLOCK_M, n_dim, dtype=torch.float32, device=a.device)
    blocks, b = p["blocks_host"], 0
    while b < p["used"]:
        end = b
        while end < p["used"] and blocks[end] == blocks[b]:
            end += 1
        r0, r1 = b * SCHEDULE_BLOCK_M, end * SCHEDULE_BLOCK_M
        out[r0:r1] = a[r0:r1].float() @ w_kn[blocks[b]].float()
        b = end
    return out


def _check(p: dict, gemm: str, tile, triton_fn, gluon_fn, block_range, small: bool) -> dict:
    """The Gluon kernel over block_range (int32 [2]) against the Triton kernel: bitwise on the range's rows,
    rows outside untouched (NaN sentinel), (small) bitwise repeatable and close to fp32."""
    import torch

    first, end = (int(v) for v in block_range.tolist())
    r0, r1 = first * SCHEDULE_BLOCK_M, end * SCHEDULE_BLOCK_M
    a, w, _, n_dim, _ = _gemm_operands(p, gemm)
    want = triton_fn(a, w, p["block_expert"], block_range)
    sentinel = torch.full((a.shape[0], n_dim), float("nan"), dtype=a.dtype, device=a.device)
    got = gluon_fn(a, w, p["block_expert"], block_range, tile=tile, out=sentinel)
    torch.cuda.synchronize()
    rec = dict(rows=[r0, r1], bitwise_equal_to_triton=bool(torch.equal(got[r0:r1], want[r0:r1])),
               outside_rows_untouched=bool(got[:r0].isnan().all().item() and got[r1:].isnan().all().item()))
    if not rec["bitwise_equal_to_triton"]:
        diff = (got[r0:r1].float() - want[r0:r1].float()).abs()
        rec.update(mismatches=int((diff > 0).sum().item()) + int(got[r0:r1].isnan().sum().item()),
                   max_abs_diff=diff.nan_to_num(float("inf")).max().item())
    if small:
        again = gluon_fn(a, w, p["block_expert"], block_range, tile=tile)
        rec["bitwise_repeatable"] = bool(torch.equal(again[r0:r1], got[r0:r1]))
        if first == 0:
            ref = _fp32_reference(p, gemm)
            rec["rel_err_fp32"] = ((got[r0:r1].float() - ref).norm() / ref.norm()).item()
            rec["triton_rel_err_fp32"] = ((want[r0:r1].float() - ref).norm() / ref.norm()).item()
    rec["ok"] = (rec["bitwise_equal_to_triton"] and rec["outside_rows_untouched"] and rec.get("bitwise_repeatable", True)
                 and rec.get("rel_err_fp32", 0.0) <= MAX_REL_ERR)
    return rec


def worker(part_path: str, tile_names: list[str], baselines: bool, workloads: list[str]) -> int:
    """Tile by tile (so that a crash stops at a tile boundary): the small problem's checks, then per
    workload the checks and the timings; with baselines, first the Triton kernel and torch._grouped_mm."""
    import torch
    import triton

    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import tma_kernel_configs, triton_tile
    from megamoe.backends.triton.kernels import gluon_rows
    from megamoe.backends.triton.kernels._common import range_of

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        _emit(part_path, dict(kind="error", ok=False, status="needs a Hopper GPU (sm_90): wgmma, TMA, setmaxnreg"))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is real fp32
    device = torch.device("cuda")
    gluon_fns = {"down_fwd": gluon_rows.down_fwd, "gate_up_dgrad": gluon_rows.gate_up_dgrad}

    def triton_fn(p, gemm):
        table = tma_kernel_configs(p["hidden"], p["inter"], torch.bfloat16, device, SCHEDULE_BLOCK_M)
        cfg = triton_tile(getattr(table, gemm))
        launcher = getattr(kernels, gemm)
        return lambda a, w, block_expert, blocks: launcher(a, w, block_expert, blocks, config=cfg)

    def run_checks(p, tile_name, small):
        ranges = [(0, p["used"])] + ([(1, p["used"] - 1)] if small else [])
        for gemm in GEMMS:
            for first, end in ranges:
                rec = dict(kind="check", problem=p["name"], gemm=gemm, tile=tile_name, blocks=[first, end])
                _emit(part_path, dict(kind="start", tile=tile_name, what=rec))
                try:
                    block_range = torch.tensor([first, end], dtype=torch.int32, device=device)
                    rec.update(_check(p, gemm, gluon_rows.TILES[tile_name], triton_fn(p, gemm), gluon_fns[gemm],
                                      block_range, small))
                except Exception as error:  # a compile or launch error: reported, the others go on
                    rec.update(ok=False, status=f"{type(error).__name__}: {str(error)[:300]}")
                    _exit_if_context_lost(part_path, rec)
                _emit(part_path, rec)

    def run_timings(p, variants_of, tile_name):
        """variants_of(gemm, a, w, w_kn, blocks) -> {variant: fn}."""
        rows_used = p["used"] * SCHEDULE_BLOCK_M
        blocks = range_of(p["num_blocks"], "num_blocks")  # built once: the launchers then add no op
        for gemm in GEMMS:
            a, w, w_kn, n_dim, k_dim = _gemm_operands(p, gemm)
            for variant, fn in variants_of(gemm, a, w, w_kn, blocks).items():
                rec = dict(kind="timing", workload=p["name"], gemm=gemm, variant=variant, rows=rows_used, N=n_dim,
                           K=k_dim)
                _emit(part_path, dict(kind="start", tile=tile_name, what=rec))
                try:
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    rec.update(status="ok", ms=ms, tflops=2 * rows_used * n_dim * k_dim / ms / 1e9)
                except Exception as error:
                    rec.update(status=f"{type(error).__name__}: {str(error)[:300]}")
                    _exit_if_context_lost(part_path, rec)
                _emit(part_path, rec)

    small = _small_problem(device)
    large = [_workload_problem(name, device) for name in workloads]
    if baselines:
        for p in large:
            offs = p["schedule"].expert_offsets[1:].to(torch.int32).contiguous()
            rows_used = p["used"] * SCHEDULE_BLOCK_M

            def baseline_variants(gemm, a, w, w_kn, blocks, p=p, offs=offs, rows_used=rows_used):
                fn = triton_fn(p, gemm)
                return {"triton-tma": lambda: fn(a, w, p["block_expert"], blocks),
                        "torch._grouped_mm": lambda: torch._grouped_mm(a[:rows_used], w_kn, offs=offs)}

            run_timings(p, baseline_variants, None)
    for name in tile_names:
        tile = gluon_rows.TILES[name]
        run_checks(small, name, small=True)
        for p in large:
            run_checks(p, name, small=False)
            run_timings(p, lambda gemm, a, w, w_kn, blocks, p=p: {
                f"gluon-{name}": lambda: gluon_fns[gemm](a, w, p["block_expert"], blocks, tile=tile)}, name)
    return 0


# ----------------------------------------------------------------------------------------------------
# Parent (no GPU of its own): the workers, the watchdog, the table


def _run_worker(tiles: list[str], baselines: bool, workloads: list[str], limit_s: float) -> tuple[list, dict, set]:
    """One worker subprocess: (its records, what became of it, the tiles it started)."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as part:
        path = part.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--tiles", ",".join(tiles),
           "--workloads", ",".join(workloads)] + (["--baselines"] if baselines else [])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    info = dict(tiles=tiles, baselines=baselines, limit_s=round(limit_s))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=env)
        info.update(rc=proc.returncode, output_tail=(proc.stdout + proc.stderr)[-2000:])
    except subprocess.TimeoutExpired as error:  # the watchdog: killed, its records so far kept
        out = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        info.update(rc="killed after its time limit (hung?)", output_tail=out[-2000:])
    info["wall_s"] = round(time.time() - t0, 1)
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    os.unlink(path)
    records, pending, started = [], None, set()
    for line in lines:
        if line["kind"] == "start":
            pending = line["what"]
            started.add(line["tile"])
        else:
            records.append(line)
            pending = None
    if pending is not None:  # what the worker was running when it died or was killed
        records.append(dict(pending, ok=False, status=f"the worker died here: {info['rc']}"))
    return records, info, started


_KEYS = ("kind", "problem", "gemm", "tile", "blocks")


def _table(result: dict) -> None:
    """The checks (failures in full), the timings, and per GEMM and workload the best Gluon tile's ratios."""
    print(f"\n{'problem':16} {'gemm':14} {'tile':16} {'blocks':>12}  check")
    for r in result["checks"]:
        detail = "ok" if r.get("ok") else r.get("status") or {k: v for k, v in r.items() if k not in _KEYS}
        print(f"{r.get('problem', '-'):16} {r.get('gemm', '-'):14} {r.get('tile', '-'):16} "
              f"{str(r.get('blocks', '-')):>12}  {detail}")
    print(f"\n{'workload':16} {'gemm':14} {'variant':24} {'ms':>8} {'TF/s':>7}  status")
    for r in result["timings"]:
        ms = f"{r['ms']:8.3f}" if "ms" in r else f"{'-':>8}"
        tf = f"{r['tflops']:7.0f}" if "tflops" in r else f"{'-':>7}"
        print(f"{r['workload']:16} {r['gemm']:14} {r['variant']:24} {ms} {tf}  {r['status']}")
    by = {}
    for r in result["timings"]:
        if r["status"] == "ok":
            by.setdefault((r["workload"], r["gemm"]), {})[r["variant"]] = r["tflops"]
    for (workload, gemm), tf in by.items():
        gluon = {v: t for v, t in tf.items() if v.startswith("gluon-")}
        if gluon and "triton-tma" in tf:
            best = max(gluon, key=gluon.get)
            cublas = tf.get("torch._grouped_mm")
            vs_torch = f", {gluon[best] / cublas:.2f}x torch._grouped_mm" if cublas else ""
            print(f"{workload} {gemm}: best {best} {gluon[best]:.0f} TF/s = {gluon[best] / tf['triton-tma']:.2f}x "
                  f"triton-tma{vs_torch}")


def main(argv: list[str] | None = None) -> int:
    import torch

    from megamoe.backends.triton.kernels.gluon_rows import TILES  # CPU-safe: builds no GPU state
    from megamoe.bench.measure import run_facts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", nargs="?", help="where to write the records (JSON)")
    parser.add_argument("--tile", action="append", choices=list(TILES), help="Gluon tiles (default: all)")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="default: both")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run as a worker, records to this file
    parser.add_argument("--tiles", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", help=argparse.SUPPRESS)
    parser.add_argument("--baselines", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, [t for t in args.tiles.split(",") if t], args.baselines,
                      [w for w in args.workloads.split(",") if w])
    if not args.json_path:
        parser.error("OUT.json is required")
    tiles = args.tile or list(TILES)
    workloads = args.workload or list(WORKLOADS)
    # The baselines with the tiles that have run on a GPU before (coop), then the ping-pong tiles; after a
    # crash or a hang, the tiles the dead worker had not started get a new one.
    queue = [([t for t in tiles if not TILES[t].pingpong], True), ([t for t in tiles if TILES[t].pingpong], False)]
    result = dict(run_facts(torch.device("cuda" if torch.cuda.is_available() else "cpu")),  # the workers' device
                  tiles={t: dataclasses.asdict(TILES[t]) for t in tiles}, workloads=workloads, workers=[], checks=[],
                  timings=[])
    t_start = time.time()
    while queue:
        group, baselines = queue.pop(0)
        if not group and not baselines:
            continue
        left = TOTAL_BUDGET_S - (time.time() - t_start)
        if left < 20:
            result["workers"].append(dict(tiles=group, baselines=baselines, rc="not run: the time budget is spent"))
            continue
        limit = min(WORKER_LIMIT_S, left)
        print(f"worker: tiles {group}{' + baselines' if baselines else ''}, limit {limit:.0f} s", flush=True)
        records, info, started = _run_worker(group, baselines, workloads, limit)
        print(f"  rc {info['rc']}, {info['wall_s']:.0f} s, {len(records)} records", flush=True)
        result["workers"].append(info)
        result["checks"] += [r for r in records if r["kind"] in ("check", "error")]
        result["timings"] += [r for r in records if r["kind"] == "timing"]
        rest = [t for t in group if t not in started]
        if info["rc"] != 0 and rest and started:  # died in a variant, not in its setup: go on without it
            queue.insert(0, (rest, False))
    result["wall_s"] = time.time() - t_start
    result["all_checks_ok"] = bool(result["checks"]) and all(r.get("ok") for r in result["checks"])
    result["all_ok"] = result["all_checks_ok"] and all(w.get("rc") == 0 for w in result["workers"]) and all(
        r["status"] == "ok" for r in result["timings"])
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)
    _table(result)
    print(f"all checks ok: {result['all_checks_ok']}; all ok: {result['all_ok']}; {result['wall_s']:.0f} s; "
          f"wrote {args.json_path}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
