"""A probe: can Hopper's TMA gather token rows, one row per copy, fast enough to feed a gathering GEMM?

Hopper has no TMA row gather (Blackwell's gather4), so megamoe's gathering gate_up_fwd fills its A tiles by
cp.async from a warpgroup (8 16-byte copies a thread a K step, with their address arithmetic). This probe fills
the same [128, 64] A slots (bf16, the GEMMs' 128-byte swizzled layout) with one 2-D TMA copy per row instead, a
box of [1, 64] written into row r of the slot: where the TMA unit swizzles by shared-memory address, the slot then
holds what a whole-tile copy of those rows would. Issued by four one-warp partitions (32 rows each a K step), no
address arithmetic beyond the token index.

Modes, each filling a STAGES-deep ring of slots that a consumer warpgroup drains, per (tile of 128 rows, K step):
  tile   one TMA copy of 128 contiguous rows of x_rows (what the GEMM on rows loads: the bound)
  rows   128 TMA copies of one row each, x[src[r]] (src = -1: a coordinate past the end, zero-filled)
  cp     cp.async from a warpgroup, as gluon_gate_up's gathering producer (8 16-byte copies a thread)
With --store the consumer writes each slot out by TMA (a gather pass: out[r] = x[src[r]]), checked bitwise
against torch's gather; without it, it only releases the slot (the copies' rate alone).

Usage (an sm_90 GPU):  PYTHONPATH=$PWD python3 benchmarks/row_tma_probe.py OUT.json [--workloads qwen3-30b-a3b,...]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.backends.triton.kernels.gluon_common import cp_async_load, smem_reinterpret, tma_load, tma_store

BLOCK_M, BLOCK_K = gl.constexpr(128), gl.constexpr(64)  # the kernels' tile; .value on the host
ROW_WARPS = gl.constexpr(4)  # one-warp partitions issuing the row copies, BLOCK_M / ROW_WARPS rows each
CP_WARPS = gl.constexpr(4)  # the cp.async partition's warps
PLAIN = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))  # no swizzle
MODES = ("tile", "rows", "cp")


@gluon.jit
def _consume(out_desc, bufs, ready_bars, empty_bars, num_tiles, K, STORE: gl.constexpr, FENCE: gl.constexpr):
    STAGES: gl.constexpr = bufs.shape[0]
    c = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        for k in range(0, K, BLOCK_K):
            s = c % STAGES
            mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
            if STORE:
                if FENCE:
                    fence_async_shared()  # cp.async's generic-proxy writes before the TMA store reads
                tma_store(out_desc, [tile * BLOCK_M, k], bufs.index(s))
                tma.store_wait(pendings=0)
            mbarrier.arrive(empty_bars.index(s), count=1)
            c += 1


@gluon.jit
def _fill_tile(xr_desc, bufs, ready_bars, empty_bars, num_tiles, K):
    STAGES: gl.constexpr = bufs.shape[0]
    p = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        for k in range(0, K, BLOCK_K):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, xr_desc.block_type.nbytes)
            tma_load(xr_desc, [tile * BLOCK_M, k], bar, bufs.index(s))
            p += 1


@gluon.jit
def _fill_rows(x_row_desc, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K, FIRST: gl.constexpr,
               ROWS: gl.constexpr):
    """Rows [FIRST, FIRST + ROWS) of every slot, one TMA copy each; token_ptr: int32 [R], -1 for none."""
    STAGES: gl.constexpr = bufs.shape[0]
    p = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        base = token_ptr + tile * BLOCK_M + FIRST
        for k in range(0, K, BLOCK_K):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, ROWS * x_row_desc.block_type.nbytes)
            # Gluon does not slice a swizzled buffer within its 8-row pattern: row r's destination is taken from
            # the slot seen unswizzled (base + 128 r bytes); the copy itself swizzles by the descriptor's mode.
            slot = smem_reinterpret(bufs.index(s), bufs.dtype, [BLOCK_M, BLOCK_K], PLAIN)
            token = gl.load(base)
            for j in gl.static_range(ROWS):  # the next row's token loaded before this row's copy is issued
                if j + 1 < ROWS:
                    next_token = gl.load(base + j + 1)
                tma_load(x_row_desc, [token, k], bar, slot.slice(FIRST + j, 1))
                if j + 1 < ROWS:
                    token = next_token
            p += 1


@gluon.jit
def _fill_cp(x_ptr, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K):
    STAGES: gl.constexpr = bufs.shape[0]
    VEC: gl.constexpr = 8
    copy_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[4, 8],
                                                 warps_per_cta=[CP_WARPS, 1], order=[1, 0])
    tile_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    step_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
    K = K // VEC * VEC
    p = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        tok = gl.load(token_ptr + tile * BLOCK_M + tile_rows)
        has = gl.expand_dims(tok >= 0, 1)
        row_ptrs = gl.expand_dims(x_ptr + gl.where(tok >= 0, tok, 0).to(gl.int64) * K, 1)
        for k in range(0, K, BLOCK_K):
            s = p % STAGES
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            cols = gl.expand_dims(k + step_cols, 0)
            cp_async_load(bufs.index(s), row_ptrs + cols, mask=has & (cols < K))
            async_copy.mbarrier_arrive(ready_bars.index(s), increment_count=False)
            p += 1


@gluon.jit
def row_probe_kernel(xr_desc, x_row_desc, out_desc, x_ptr, token_ptr, num_tiles, K,
                     MODE: gl.constexpr, STORE: gl.constexpr, STAGES: gl.constexpr):
    bufs = gl.allocate_shared_memory(out_desc.dtype, [STAGES] + out_desc.block_type.shape, out_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        if MODE == "rows":
            mbarrier.init(ready_bars.index(i), count=ROW_WARPS)  # each row warp's expect
        elif MODE == "cp":
            mbarrier.init(ready_bars.index(i), count=CP_WARPS * 32)  # every copying thread's arrive
        else:
            mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    fence_async_shared()
    ROWS: gl.constexpr = BLOCK_M // ROW_WARPS
    if MODE == "rows":
        gl.warp_specialize([
            (_consume, (out_desc, bufs, ready_bars, empty_bars, num_tiles, K, STORE, False)),
            (_fill_rows, (x_row_desc, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K, 0, ROWS)),
            (_fill_rows, (x_row_desc, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K, ROWS, ROWS)),
            (_fill_rows, (x_row_desc, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K, 2 * ROWS, ROWS)),
            (_fill_rows, (x_row_desc, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K, 3 * ROWS, ROWS)),
        ], [1, 1, 1, 1], [48, 48, 48, 48])
    elif MODE == "cp":
        gl.warp_specialize([
            (_consume, (out_desc, bufs, ready_bars, empty_bars, num_tiles, K, STORE, True)),
            (_fill_cp, (x_ptr, bufs, ready_bars, empty_bars, token_ptr, num_tiles, K)),
        ], [CP_WARPS], [80])
    else:
        gl.warp_specialize([
            (_consume, (out_desc, bufs, ready_bars, empty_bars, num_tiles, K, STORE, False)),
            (_fill_tile, (xr_desc, bufs, ready_bars, empty_bars, num_tiles, K)),
        ], [1], [48])


def descriptors(x: torch.Tensor, x_rows: torch.Tensor, out: torch.Tensor) -> tuple:
    """(whole-tile box over x_rows, one-row box over x, whole-tile box over out), all with the slot's layout (the
    128-byte swizzle of a [128, 64] 16-bit tile)."""
    m, k = BLOCK_M.value, BLOCK_K.value
    layout = gl.NVMMASharedLayout.get_default_for([m, k], gl.bfloat16)
    return (TensorDescriptor.from_tensor(x_rows, [m, k], layout), TensorDescriptor.from_tensor(x, [1, k], layout),
            TensorDescriptor.from_tensor(out, [m, k], layout))


def run(mode: str, x: torch.Tensor, x_rows: torch.Tensor, token: torch.Tensor, out: torch.Tensor, store: bool,
        stages: int = 4) -> torch.Tensor:
    R, H = out.shape
    num_tiles = R // BLOCK_M.value
    grid = (min(torch.cuda.get_device_properties(x.device).multi_processor_count, num_tiles),)
    row_probe_kernel[grid](*descriptors(x, x_rows, out), x, token, num_tiles, H, MODE=mode, STORE=store,
                           STAGES=stages, num_warps=4)
    return out


def main() -> None:
    from megamoe.bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_path")
    parser.add_argument("--workloads", default="qwen3-30b-a3b,qwen3-235b-a22b,gpt-oss-120b")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    records = []
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        T, H, k = w.tokens_per_gpu, w.hidden, w.top_k
        R = T * k // BLOCK_M.value * BLOCK_M.value
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        token = torch.randperm(T * k, device="cuda", generator=gen)[:R].to(torch.int32) // k  # a pair's token
        token[torch.randperm(R, device="cuda", generator=gen)[: R // 16]] = -1  # padding rows
        want = torch.where((token >= 0)[:, None], x[token.clamp(min=0).long()], 0)
        x_rows = want.clone()
        out = torch.empty_like(want)
        for mode in MODES:
            out.fill_(1)
            run(mode, x, x_rows, token, out, store=True)
            torch.cuda.synchronize()
            equal = bool(torch.equal(out, want))
            records.append(dict(kind="check", workload=name, mode=mode, equal=equal))
            print(f"{name:16s} {mode:5s} bitwise {equal}", flush=True)
        moved = 2 * R * H * 2  # bytes: the rows read and written (the load-only mode reads half of it)
        times = {(m, s): [] for m in MODES for s in (True, False)}
        for r in range(args.rounds):
            order = list(times)[r % len(times):] + list(times)[:r % len(times)]
            for mode, store in order:
                ms = triton.testing.do_bench(lambda: run(mode, x, x_rows, token, out, store), warmup=5, rep=40)
                times[mode, store].append(ms)
        for (mode, store), ms in times.items():
            med = sorted(ms)[len(ms) // 2]
            gbs = (moved if store else moved / 2) / med / 1e6
            records.append(dict(kind="time", workload=name, mode=mode, store=store, ms=med, round_ms=ms, gb_s=gbs,
                                rows=R, hidden=H))
            print(f"{name:16s} {mode:5s} {'store' if store else 'load '} {med:7.3f} ms {gbs:7.0f} GB/s", flush=True)
        json.dump(records, open(args.json_path, "w"), indent=1)


if __name__ == "__main__":
    main()
