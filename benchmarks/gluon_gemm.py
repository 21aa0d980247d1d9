"""Prototype: a warp-specialized Hopper GEMM core in Gluon for the down-projection forward, and its benchmark.

Usage (one H200, torch + Triton 3.6):  PYTHONPATH=$PWD python3 benchmarks/gluon_gemm.py OUT.json
    [--config NAME ...] [--workload NAME ...] [--skip-large-check]
Checks every Gluon config on a small irregular problem and on qwen3-30b-a3b against an fp32 per-expert
reference, then times them against megamoe's TMA kernel (kernels.down_fwd with tma_kernel_configs) and
torch._grouped_mm on the same segments, and writes the records to OUT.json. Compile-only checks of the
same kernels (no GPU): tests/test_gluon_compile.py.

The GEMM (the simplest grouped GEMM of the fused path, `kernels.down_fwd`):

    y_rows[r, :] = h[r, :] @ w[e, :, :]^T      e = block_expert[r // 128], for the rows of blocks < num_blocks

h [R, K] bf16 (expert-major rows, every expert's segment padded to a multiple of 128 rows), w [E, N, K],
block_expert int32 [R // 128] (-1 past the rows in use), num_blocks int32 [1] on the device (no host sync:
tiles of row blocks >= num_blocks exit). fp32 accumulation in a fixed K order, one program per output tile,
no split-K: bitwise deterministic. Persistent grid (one CTA per SM) over tiles (row block, column block) in
the grouped order of kernels/_common.tile_coords (GROUP_M row blocks swept per column block).

Structure of a CTA (gl.warp_specialize):
  * producer: 1 warp (40 registers) walks the CTA's tiles and K steps in order and, per step, waits for a
    free slot of a STAGES-deep shared-memory ring (its "empty" mbarrier), arms the slot's "ready" mbarrier
    with the byte count and issues two TMA copies into it: the h tile [BLOCK_M, 64] (2-D descriptor) and
    the weight tile [1, BLOCK_N, 64] (3-D descriptor over [E, N, K]: an N or K tail reads zeros, never the
    next expert).
  * consumers: 1 or 2 warpgroups (232 registers each with 2), each: wait "ready", async wgmma from the
    slot (B is the K-major [BLOCK_N, 64] tile viewed transposed), keep one wgmma group in flight, release
    the previous slot ("empty" arrive) once its wgmma retired; then the epilogue: fp32 -> bf16 registers ->
    its own shared buffer (stmatrix) -> TMA store (clipped at the tensor's edge).
  Two ways to use two consumer warpgroups:
  * "coop" (CUTLASS "cooperative"): both work on the same tile, 64 rows each (tile 128 x 256, each
    warpgroup 64 x 256 = 128 accumulator registers); a slot is released when both arrived (count 2).
  * "pingpong": each warpgroup owns whole tiles, alternating (local tile j -> warpgroup j % 2), so one
    warpgroup's epilogue overlaps the other's main loop. The producer fills the ring in tile order, so
    warpgroup 1's first slot of tile j+1 follows warpgroup 0's last of tile j: the main loops take turns
    on the tensor cores while the epilogues hide behind them. A consumer's slot counter for its i-th tile
    is (2 i + wg) * k_steps; every slot gets exactly one arrive (count 1).
  "ws" is the single-consumer version (1 producer warp + 1 warpgroup; the epilogue is not overlapped).

Synchronisation notes (from the compiled code, tests/test_gluon_compile.py): Gluon's mbarrier.arrive is
issued by thread 0 of the partition after a partition-wide named barrier (bar.sync id, 128) that Triton's
barrier analysis inserts, so one arrive per warpgroup covers all its warps' wgmma reads. Registers:
kernel-wide .maxnreg 168 for 12 warps (3 warpgroups x 128 threads x 168 = the 64K register file); setmaxnreg
moves them to 232 / 232 / 40 (two consumers, producer warpgroup).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SCHEDULE_BLOCK_M = 128  # rows per schedule block (block_expert entry); every kernel row tile divides it


# ----------------------------------------------------------------------------------------------------
# Kernels


@gluon.jit
def _tile_mn(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """(row block, column block) of a linear tile index; the order of kernels/_common.tile_coords."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    in_group = tile % per_group
    return first_m + in_group % size_m, in_group // size_m


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, num_blocks_ptr,
              SPLIT: gl.constexpr, GROUP_M: gl.constexpr):
    """One warp: TMA copies of every (tile, K step) of this CTA, in order, into the slot ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_m = gl.load(num_blocks_ptr) * SPLIT
    num_n = gl.cdiv(b_desc.shape[1], BLOCK_N)
    k_steps = gl.cdiv(a_desc.shape[1], BLOCK_K)
    p = 0  # slot counter: slot p % STAGES, its use number p // STAGES
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_mn(tile, num_m, num_n, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m // SPLIT)
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        for ki in range(k_steps):
            s = p % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0: the first pass over
            # the ring (parity 1) does not wait.
            mbarrier.wait(empty_bars.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, NBYTES)
            tma.async_copy_global_to_shared(a_desc, [row, ki * BLOCK_K], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [expert, col, ki * BLOCK_K], bar, b_bufs.index(s))
            p += 1


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem, num_blocks_ptr, N, K,
              WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr, SPLIT: gl.constexpr,
              GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              INSTR_N: gl.constexpr):
    """One warpgroup (4 warps): async wgmma over the slots of its tiles, then the TMA-store epilogue.
    PINGPONG: whole tiles, local tiles WG, WG + NUM_WG, ...; else rows [WG * BLOCK_M / NUM_WG, ...) of
    every tile."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    WG_M: gl.constexpr = BLOCK_M if PINGPONG else BLOCK_M // NUM_WG
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, INSTR_N, 16])
    num_m = gl.load(num_blocks_ptr) * SPLIT
    num_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    if PINGPONG:
        first = gl.program_id(0) + WG * gl.num_programs(0)
        stride = NUM_WG * gl.num_programs(0)
        c = WG * k_steps  # the producer's slot counter at this warpgroup's first K step
        skip = (NUM_WG - 1) * k_steps  # the other warpgroups' K steps between two tiles of this one
    else:
        first = gl.program_id(0)
        stride = gl.num_programs(0)
        c = 0
        skip = 0
    for tile in range(first, num_m * num_n, stride):
        pid_m, pid_n = _tile_mn(tile, num_m, num_n, GROUP_M)
        acc = gl.zeros([WG_M, BLOCK_N], gl.float32, acc_layout)
        for ki in range(k_steps):
            s = c % STAGES
            mbarrier.wait(ready_bars.index(s), (c // STAGES) & 1)
            a = a_bufs.index(s)
            if not PINGPONG:
                a = a.slice(WG * WG_M, WG_M)
            b = b_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # The wgmma of step c - 1 has retired: its slot goes back to the producer.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES), pred=ki > 0)
            c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((c + STAGES - 1) % STAGES))
        c += skip
        out = acc.to(c_desc.dtype)
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(out)
        fence_async_shared()
        row = pid_m * BLOCK_M
        if not PINGPONG:
            row += WG * WG_M
        tma.async_copy_shared_to_global(c_desc, [row, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def down_fwd_ws_kernel(a_desc, b_desc, c_desc, block_expert_ptr, num_blocks_ptr,
                       SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       NUM_WG: gl.constexpr, PINGPONG: gl.constexpr, INSTR_N: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """y[r, n] = h[r] . w[block_expert[r // (BLOCK_M * SPLIT)], n] for the row blocks < num_blocks * SPLIT.
    a_desc: h [R, K] block [BLOCK_M, BLOCK_K]; b_desc: w [E, N, K] block [1, BLOCK_N, BLOCK_K];
    c_desc: y [R, N] block [BLOCK_M (pingpong) or BLOCK_M / NUM_WG (coop), BLOCK_N]. Launch with num_warps=4
    (the default partition is consumer 0)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [NUM_WG] + c_desc.block_type.shape, c_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)  # the producer's expect; the bytes complete it
        mbarrier.init(empty_bars.index(i), count=1 if PINGPONG else NUM_WG)  # one arrive per reader
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before use
    N = b_desc.shape[1]
    K = a_desc.shape[1]
    if NUM_WG == 1:
        gl.warp_specialize([
            (_consumer, (c_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_bufs.index(0), num_blocks_ptr, N, K,
                         0, NUM_WG, PINGPONG, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, INSTR_N)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, num_blocks_ptr,
                         SPLIT, GROUP_M)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.static_assert(NUM_WG == 2, "one or two consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (c_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_bufs.index(0), num_blocks_ptr, N, K,
                         0, NUM_WG, PINGPONG, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, INSTR_N)),
            (_consumer, (c_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_bufs.index(1), num_blocks_ptr, N, K,
                         1, NUM_WG, PINGPONG, SPLIT, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, INSTR_N)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, block_expert_ptr, num_blocks_ptr,
                         SPLIT, GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------
# Configs and the host launcher


@dataclasses.dataclass(frozen=True)
class GluonTile:
    """block_m x block_n: the CTA's output tile (pingpong: each warpgroup's). num_wg consumer warpgroups."""

    block_m: int
    block_n: int
    stages: int
    num_wg: int
    pingpong: bool
    block_k: int = 64
    group_m: int = 8
    producer_regs: int = 40
    consumer_regs: int = 232

    @property
    def store_m(self) -> int:
        """Rows of one consumer's output tile (its TMA store box)."""
        return self.block_m if self.pingpong else self.block_m // self.num_wg

    @property
    def num_warps(self) -> int:
        """Warps the kernel runs with: consumers' warpgroups + the producer's (rounded up to a warpgroup)."""
        return 4 * self.num_wg + 4

    def smem_bytes(self, elem: int = 2) -> int:
        """Operand ring + epilogue buffers (without the barriers)."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * elem
        return ring + self.num_wg * self.store_m * self.block_n * elem


# The variants the benchmark times (NAME: tile). Shared memory: ring + epilogue buffers <= 227 KB.
CONFIGS = {
    "ws": GluonTile(128, 128, stages=4, num_wg=1, pingpong=False),  # 1 producer warp + 1 consumer warpgroup
    "coop": GluonTile(128, 256, stages=3, num_wg=2, pingpong=False),  # 2 warpgroups x 64 rows of one tile
    "pingpong": GluonTile(128, 128, stages=4, num_wg=2, pingpong=True),  # 2 warpgroups, alternate tiles
    "pingpong-s5": GluonTile(128, 128, stages=5, num_wg=2, pingpong=True),
    "pingpong-64x256": GluonTile(64, 256, stages=4, num_wg=2, pingpong=True),
}


def constexprs(cfg: GluonTile, split: int) -> dict:
    """The kernel's constexpr arguments for a tile (the launcher and tests/test_gluon_compile.py share them)."""
    return dict(SPLIT=split, GROUP_M=cfg.group_m, STAGES=cfg.stages, NUM_WG=cfg.num_wg, PINGPONG=cfg.pingpong,
                INSTR_N=min(cfg.block_n, 256), PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs)


def descriptors(h_RK: torch.Tensor, w_ENK: torch.Tensor, y_RN: torch.Tensor, cfg: GluonTile) -> tuple:
    """Host-side TMA descriptors (Gluon's TensorDescriptor carries the shared-memory layout)."""
    dt = gl.bfloat16 if h_RK.dtype == torch.bfloat16 else gl.float16
    a_block = [cfg.block_m, cfg.block_k]
    b_block = [1, cfg.block_n, cfg.block_k]
    c_block = [cfg.store_m, cfg.block_n]
    return (
        TensorDescriptor.from_tensor(h_RK, a_block, gl.NVMMASharedLayout.get_default_for(a_block, dt)),
        TensorDescriptor.from_tensor(w_ENK, b_block, gl.NVMMASharedLayout.get_default_for(b_block, dt)),
        TensorDescriptor.from_tensor(y_RN, c_block, gl.NVMMASharedLayout.get_default_for(c_block, dt)),
    )


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def down_fwd_gluon(h_RK: torch.Tensor, w_ENK: torch.Tensor, block_expert: torch.Tensor, num_blocks: torch.Tensor,
                   cfg: GluonTile = CONFIGS["pingpong"], out: torch.Tensor | None = None, return_kernel: bool = False):
    """y [R, N] = h[r] @ w[block_expert[r // 128]]^T for the rows of the first num_blocks[0] blocks; other rows
    of y are not written (out, if given, keeps them). No host sync: num_blocks stays on the device."""
    if h_RK.dtype not in (torch.bfloat16, torch.float16) or w_ENK.dtype != h_RK.dtype:
        raise ValueError(f"bf16/fp16 operands of one dtype, got {h_RK.dtype}, {w_ENK.dtype}")
    if h_RK.dim() != 2 or w_ENK.dim() != 3 or not h_RK.is_contiguous() or not w_ENK.is_contiguous():
        raise ValueError("h must be a contiguous [R, K], w a contiguous [E, N, K] tensor")
    rows, k_dim = h_RK.shape
    n_dim = w_ENK.shape[1]
    if w_ENK.shape[2] != k_dim or k_dim % 8 or n_dim % 8 or k_dim == 0:
        raise ValueError(f"w {tuple(w_ENK.shape)} must be [E, N, K={k_dim}] with K, N multiples of 8")
    if block_expert.dtype != torch.int32 or block_expert.dim() != 1 or rows != block_expert.numel() * SCHEDULE_BLOCK_M:
        raise ValueError(f"block_expert must be int32 [R / {SCHEDULE_BLOCK_M}]")
    if num_blocks.dtype != torch.int32 or num_blocks.numel() != 1:
        raise ValueError("num_blocks must be an int32 [1] device tensor")
    if SCHEDULE_BLOCK_M % cfg.block_m:
        raise ValueError(f"the row tile {cfg.block_m} must divide {SCHEDULE_BLOCK_M}")
    y = out if out is not None else torch.empty(rows, n_dim, dtype=h_RK.dtype, device=h_RK.device)
    a_desc, b_desc, c_desc = descriptors(h_RK, w_ENK, y, cfg)
    tiles = rows // cfg.block_m * triton.cdiv(n_dim, cfg.block_n)
    grid = (max(1, min(_num_sms(h_RK.device), tiles)), )
    kernel = down_fwd_ws_kernel[grid](a_desc, b_desc, c_desc, block_expert, num_blocks,
                                      **constexprs(cfg, SCHEDULE_BLOCK_M // cfg.block_m), num_warps=4)
    return (y, kernel) if return_kernel else y


# ----------------------------------------------------------------------------------------------------
# Benchmark (GPU)

MAX_REL_ERR = 1e-2  # relative Frobenius error against the fp32 reference (bf16 output rounding: ~1e-3)
ELEM_RTOL, ELEM_ATOL = 2e-2, 2e-2  # per element (outputs are ~N(0, 1)); a wrong tile is off by O(1)
WORKLOADS = {  # name: (tokens, experts, top_k, K = intermediate, N = hidden), as benchmarks/gemm_bench.py builds them
    "qwen3-30b-a3b": (16384, 128, 8, 768, 2048),
    "qwen3-235b-a22b": (16384, 128, 8, 1536, 4096),
}


def _log(*args) -> None:
    print(*args, flush=True)


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


def reference_fp32(h_RK: torch.Tensor, w_ENK: torch.Tensor, block_expert_host: list[int],
                   used_blocks: int) -> torch.Tensor:
    """fp32 [used_blocks * 128, N]: per-expert matmul of the blocks in use (runs of blocks of one expert)."""
    out = torch.empty(used_blocks * SCHEDULE_BLOCK_M, w_ENK.shape[1], dtype=torch.float32, device=h_RK.device)
    b = 0
    while b < used_blocks:
        e = block_expert_host[b]
        end = b
        while end < used_blocks and block_expert_host[end] == e:
            end += 1
        r0, r1 = b * SCHEDULE_BLOCK_M, end * SCHEDULE_BLOCK_M
        out[r0:r1] = h_RK[r0:r1].float() @ w_ENK[e].float().t()
        b = end
    return out


def compare(y: torch.Tensor, ref: torch.Tensor) -> dict:
    rows = ref.shape[0]
    got = y[:rows].float()
    diff = got - ref
    bad = (diff.abs() > ELEM_ATOL + ELEM_RTOL * ref.abs()) | got.isnan()
    rel = (diff.norm() / ref.norm()).item()
    return dict(rel_err=rel, max_abs_err=diff.abs().max().item(), bad_elements=int(bad.sum().item()),
                ok=bool(rel <= MAX_REL_ERR and int(bad.sum().item()) == 0))


def small_problem(device) -> dict:
    """Irregular segments (an empty expert, a 1-row one), K = 1088 (17 K steps), N = 2880 (not a multiple of
    128 or 256: clipped stores, zero-filled weight rows), unused blocks at the end (block_expert -1)."""
    g = torch.Generator(device=device).manual_seed(1)
    counts = [300, 0, 129, 1, 640, 77]
    k_dim, n_dim = 1088, 2880
    blocks = []
    for e, c in enumerate(counts):
        blocks += [e] * triton.cdiv(c, SCHEDULE_BLOCK_M)
    used = len(blocks)
    blocks += [-1] * 5
    rows = len(blocks) * SCHEDULE_BLOCK_M
    h = torch.randn(rows, k_dim, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(len(counts), n_dim, k_dim, device=device, generator=g) * k_dim**-0.5).to(torch.bfloat16)
    return dict(name="small", h=h, w=w, block_expert=torch.tensor(blocks, dtype=torch.int32, device=device),
                num_blocks=torch.tensor([used], dtype=torch.int32, device=device), blocks_host=blocks, used=used)


def workload_problem(name: str, device) -> dict:
    """The schedule the fused path builds for balanced routing (megamoe.build_schedule, block_m 128)."""
    from megamoe.bench.routing import route
    from megamoe.schedule import build_schedule

    T, E, k, k_dim, n_dim = WORKLOADS[name]
    g = torch.Generator(device=device).manual_seed(0)
    ids, _ = route("balanced", T, E, k, g)
    s = build_schedule(ids, E, block_m=SCHEDULE_BLOCK_M)
    rows = s.block_expert.numel() * SCHEDULE_BLOCK_M
    h = torch.randn(rows, k_dim, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, n_dim, k_dim, device=device, generator=g) * k_dim**-0.5).to(torch.bfloat16)
    used = int(s.num_blocks.item())  # host reads: setup, outside anything timed
    blocks_host = s.block_expert.tolist()
    assert int(s.expert_offsets[-1].item()) == used * SCHEDULE_BLOCK_M
    return dict(name=name, h=h, w=w, block_expert=s.block_expert, num_blocks=s.num_blocks.reshape(1),
                blocks_host=blocks_host, used=used, expert_offsets=s.expert_offsets, schedule=s)


def check_config(p: dict, cfg: GluonTile, ref: torch.Tensor) -> dict:
    """Correct against the fp32 reference; rows of unused blocks untouched (NaN sentinel); bitwise repeatable."""
    sentinel = torch.full((p["h"].shape[0], p["w"].shape[1]), float("nan"), dtype=p["h"].dtype, device=p["h"].device)
    y, kernel = down_fwd_gluon(p["h"], p["w"], p["block_expert"], p["num_blocks"], cfg, out=sentinel.clone(),
                               return_kernel=True)
    y2 = down_fwd_gluon(p["h"], p["w"], p["block_expert"], p["num_blocks"], cfg)
    torch.cuda.synchronize()
    rec = compare(y, ref)
    rows = ref.shape[0]
    rec["unused_rows_untouched"] = bool(y[rows:].isnan().all().item())
    rec["bitwise_repeatable"] = bool(torch.equal(y[:rows], y2[:rows]))
    rec["ok"] = rec["ok"] and rec["unused_rows_untouched"] and rec["bitwise_repeatable"]
    rec.update(n_regs=getattr(kernel, "n_regs", None), n_spills=getattr(kernel, "n_spills", None),
               shared=getattr(kernel.metadata, "shared", None), num_warps=getattr(kernel.metadata, "num_warps", None))
    return rec


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_workload(name: str, configs: dict, full_check: bool, records: list, device) -> None:
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import tma_kernel_configs
    from megamoe.backends.triton.kernels._common import range_of

    p = workload_problem(name, device)
    T, E, k, k_dim, n_dim = WORKLOADS[name]
    rows_used = p["used"] * SCHEDULE_BLOCK_M
    flops = 2 * rows_used * n_dim * k_dim  # padding rows included: every variant computes them
    h, w = p["h"], p["w"]
    tma_cfg = tma_kernel_configs(n_dim, k_dim, h.dtype, h.device, SCHEDULE_BLOCK_M).down_fwd
    offs = p["expert_offsets"][1:].to(torch.int32).contiguous()
    w_t = w.transpose(1, 2)
    variants = {f"gluon-{n}": (lambda c=c: down_fwd_gluon(h, w, p["block_expert"], p["num_blocks"], c))
                for n, c in configs.items()}
    block_range = range_of(p["num_blocks"], "num_blocks")  # built once, as benchmarks/gemm_bench.py does
    variants["megamoe-tma"] = lambda: kernels.down_fwd(h, w, p["block_expert"], block_range, config=tma_cfg)
    variants["torch._grouped_mm"] = lambda: torch._grouped_mm(h[:rows_used], w_t, offs=offs)
    ref = None
    if full_check:
        ref = reference_fp32(h, w, p["blocks_host"], p["used"])
    megamoe_out = variants["megamoe-tma"]()
    for variant, fn in variants.items():
        rec = dict(workload=name, variant=variant, rows=rows_used, K=k_dim, N=n_dim, experts=E)
        if variant.startswith("gluon-"):
            cfg = configs[variant.removeprefix("gluon-")]
            rec["config"] = dataclasses.asdict(cfg)
        try:
            t0 = time.time()
            if variant.startswith("gluon-") and ref is not None:
                rec.update(check_config(p, cfg, ref))
            else:
                y = fn()
                torch.cuda.synchronize()
                if ref is not None:
                    rec.update(compare(y, ref))
            if variant.startswith("gluon-"):
                y = fn()
                rec["bitwise_equal_to_megamoe_tma"] = bool(torch.equal(y[:rows_used], megamoe_out[:rows_used]))
            rec["first_call_s"] = time.time() - t0
            ms = bench_ms(fn)
            rec.update(status="ok" if rec.get("ok", True) else "WRONG", ms=ms, tflops=flops / ms / 1e9)
        except Exception as error:  # a compile failure or launch error of one variant: report and go on
            rec.update(status=f"{type(error).__name__}: {str(error)[:300]}")
        records.append(rec)
        _log(json.dumps(rec))
    del ref
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_path", help="where to write the records (JSON)")
    parser.add_argument("--config", action="append", choices=list(CONFIGS), help="Gluon configs (default: all)")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="default: both")
    parser.add_argument("--skip-large-check", action="store_true",
                        help="time the workloads without the fp32 reference check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        _log("needs a Hopper GPU (sm_90): the kernels use wgmma, TMA and setmaxnreg")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is real fp32
    device = torch.device("cuda")
    configs = {n: CONFIGS[n] for n in (args.config or CONFIGS)}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "configs": {n: dataclasses.asdict(c) for n, c in configs.items()}, "checks": [], "records": []}
    t_start = time.time()

    # (a) small irregular problem: every config, before anything is timed
    p = small_problem(device)
    ref = reference_fp32(p["h"], p["w"], p["blocks_host"], p["used"])
    for name, cfg in configs.items():
        _log(f"checking {name} on the small problem ...")
        rec = dict(problem="small", config=name)
        try:
            with _Watchdog(180, f"config {name} on the small problem", result, args.json_path):
                rec.update(check_config(p, cfg, ref))
        except Exception as error:
            rec.update(ok=False, status=f"{type(error).__name__}: {str(error)[:300]}")
        result["checks"].append(rec)
        _log(json.dumps(rec))

    # (a) large problems (qwen3-30b-a3b checked in full) and (b) timings
    for i, name in enumerate(args.workload or list(WORKLOADS)):
        full_check = not args.skip_large_check and i == 0
        with _Watchdog(300, f"workload {name} (see the last record printed)", result, args.json_path):
            run_workload(name, configs, full_check, result["records"], device)

    _log(f"\n{'workload':16} {'variant':26} {'ms':>8} {'TF/s':>7}  status")
    for r in result["records"]:
        ms = f"{r['ms']:8.3f}" if "ms" in r else f"{'-':>8}"
        tf = f"{r['tflops']:7.0f}" if "tflops" in r else f"{'-':>7}"
        _log(f"{r['workload']:16} {r['variant']:26} {ms} {tf}  {r['status']}")
    for name in dict.fromkeys(r["workload"] for r in result["records"]):
        by = {r["variant"]: r.get("tflops") for r in result["records"] if r["workload"] == name and r["status"] == "ok"}
        gluon = [(v, t) for v, t in by.items() if v.startswith("gluon-") and t]
        gluon_best = max(gluon, key=lambda x: x[1], default=None)
        if gluon_best and by.get("megamoe-tma") and by.get("torch._grouped_mm"):
            _log(f"{name}: best {gluon_best[0]} {gluon_best[1]:.0f} TF/s = {gluon_best[1] / by['megamoe-tma']:.2f}x "
                 f"megamoe-tma, {gluon_best[1] / by['torch._grouped_mm']:.2f}x torch._grouped_mm")
    ok = all(c.get("ok") for c in result["checks"]) and all(r["status"] == "ok" for r in result["records"])
    result["all_ok"] = ok
    result["wall_s"] = time.time() - t_start
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)
    _log(f"all checks ok: {ok}; {result['wall_s']:.0f} s; wrote {args.json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
