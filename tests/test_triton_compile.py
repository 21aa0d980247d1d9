"""Ahead-of-time compile checks of every Triton kernel, on CPU (no GPU needed).

Each kernel is compiled for Hopper (sm_90a) with the bf16 tile table entry it runs with, and the
assertions are about the code a GPU would run: the GEMM kernels must issue wgmma (not mma.sync), and
ptxas must report no register spills (spills put the accumulators in local memory). Blackwell
(sm_100a) is compiled too and must use tcgen05.mma, where the installed Triton can compile for it (probed
with a trivial kernel: only a Triton without sm_100a is a skip; a megamoe kernel failing there fails).

Run: pytest tests/test_triton_compile.py  (about a minute on 2 cores; needs Triton's bundled ptxas).
"""

from __future__ import annotations

import importlib
import os
import re

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from megamoe.backends.triton import kernels  # noqa: E402
from megamoe.backends.triton.configs import _DEFAULT, _SM90, _SM90_TMA, TileConfig, kernel_configs, triton_tile  # noqa: E402,E501
combine_module = importlib.import_module("megamoe.backends.triton.kernels.combine")  # kernels.combine is the launcher
from megamoe.backends.triton.kernels import gather, row_copy, tma_gemm  # noqa: E402
from compile_checks import KNOWN_SPILLS, SMEM_LIMIT, compile_triton, ptxas_report, sass  # noqa: E402


def _fused(a: str, b: str, table=_SM90, **extra) -> dict:
    """Constexprs of a fused expert-parallel kernel (kernels/ep_fused.py) running the table's tiles a
    then b (bf16 rows of H = 2048: 16 rows x 1024 columns per copy step)."""
    ta, tb = getattr(table, a), getattr(table, b)
    return dict(
        SPLIT=1, BLOCK_M=ta.block_m, GROUP_M=ta.group_m,
        A_EVEN_K=True, A_BLOCK_N=ta.block_n, A_BLOCK_K=ta.block_k, A_STAGES=ta.num_stages,
        B_EVEN_K=True, B_BLOCK_N=tb.block_n, B_BLOCK_K=tb.block_k, B_STAGES=tb.num_stages,
        PULL_ALIGNED=True, PULL_ROWS=16, PULL_BLOCK=1024, PUSH_ALIGNED=True, **extra,
    )


GEMM_KERNELS = {
    # name: (kernel, the tile-table field it runs with (the fused kernels: the deeper pipeline), constexprs)
    "gate_up_fwd": (kernels.gate_up_fwd_kernel, "gate_up_fwd", {}),
    "down_fwd": (kernels.down_fwd_kernel, "down_fwd", {}),
    "down_dgrad": (kernels.down_dgrad_kernel, "down_dgrad", {"ROUTER": False, "STORE_H_W": False}),
    "down_dgrad-router": (kernels.down_dgrad_kernel, "down_dgrad", {"ROUTER": True, "STORE_H_W": True}),
    "gate_up_dgrad": (kernels.gate_up_dgrad_kernel, "gate_up_dgrad", {}),
    "dw_down": (kernels.dw_kernel, "dw_down", {}),
    "dw_gate_up": (kernels.dw_kernel, "dw_gate_up", {}),
    "ep_fwd": (kernels.ep_fwd_kernel, "gate_up_fwd", _fused("gate_up_fwd", "down_fwd")),
    "ep_bwd": (kernels.ep_bwd_kernel, "dw_down", _fused(
        "down_dgrad", "gate_up_dgrad", W_BLOCK_M=_SM90.dw_down.block_m, W_BLOCK_N=_SM90.dw_down.block_n,
        W_BLOCK_K=_SM90.dw_down.block_k, W_GROUP_M=_SM90.dw_down.group_m, W_STAGES=_SM90.dw_down.num_stages)),
}
# Spill bytes allowed (stores and loads each), per kernel; every other kernel must not spill. The fused
# backward holds down_dgrad's 128 x 128 tile (255 registers alone) beside gate_up_dgrad's, the
# weight-grad tile and the communication role; with the router epilogue (g, u, the accumulator and h_w
# live together, as in the one-GPU down_dgrad_router) 268 / 244 bytes spill. Where a spill is allowed,
# the SASS must show no spill instruction inside a K loop (test_spills_stay_out_of_k_loops). This kernel
# runs on Hopper only where the Gluon core cannot (ep.ep_configs: fp32, rows TMA cannot address); the
# spill-free 128 x 64 down_dgrad tile measured slower when it was the Hopper path (qwen3-30b-a3b EP=2
# fwd+bwd 10.12 ms against 9.73, without the router epilogue; docs/perf-notes.md).
SPILL_BUDGET = {"ep_bwd": 280}
# GEMMs whose K loop reads contiguous rows only: Triton must pipeline them (async copies, async wgmma).
PIPELINED = {"gate_up_fwd", "down_fwd", "down_dgrad", "down_dgrad-router", "gate_up_dgrad", "dw_down", "dw_gate_up",
             "ep_fwd", "ep_bwd"}
OTHER_KERNELS = {
    "combine": kernels.combine_kernel,
    "spread_rows": kernels.spread_rows_kernel,
}
# Pointer arguments that are not activations/weights (bf16).
_POINTER_TYPES = {
    "row_src_ptr": "*i32", "dest_row_ptr": "*i32", "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32", "block_range_ptr": "*i32",
    "expert_offsets_ptr": "*i32", "weights_ptr": "*fp32", "d_w_part_ptr": "*fp32",
    "index_ptr": "*i32", "rows_in_use_ptr": "*i32",
    "w_ptr": "*bf16", "d_w_ptr": "*fp32",
    "pull_table_ptr": "*i64", "push_table_ptr": "*i64",
    "pull_rank_ptr": "*i32", "pull_token_ptr": "*i32", "work_ptr": "*i32", "row_index_ptr": "*i32",
    "weight_rows_ptr": "*fp32",
    "push_rank_ptr": "*i32", "push_pair_ptr": "*i32",
}
_INT_TYPES = {"timeout_ns": "i64"}


def _signature(fn, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = _POINTER_TYPES.get(name, "*bf16")
            if fn is kernels.combine_kernel and name == "w_ptr":
                sig[name] = "*fp32"
        else:
            sig[name] = _INT_TYPES.get(name, "i32")
    return sig


def _gemm_constexprs(fn, cfg: TileConfig, extra: dict) -> dict:
    names = set(fn.arg_names)
    if "A_BLOCK_N" in names:  # a fused kernel: everything is in extra
        return dict(extra)
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **extra)
    if "STAGES" in names:
        consts["STAGES"] = cfg.num_stages
    if "EVEN_K" in names:
        consts.update(EVEN_K=True, SPLIT=1)
    if "STORE_GATE_UP" in names:
        consts["STORE_GATE_UP"] = True
    return consts


# Integer arguments that are multiples of 16 at every benchmarked workload (H, I); Triton's launcher
# specialises such arguments (and 16-byte aligned pointers) the same way at run time, which is what
# lets the K loop use 16-byte cp.async copies and be software-pipelined.
_DIVISIBLE_INTS = {"H", "I", "M", "N"}


def _attrs(fn, signature: dict) -> dict:
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or name in _DIVISIBLE_INTS
    }


def _compile(fn, constexprs: dict, num_warps: int, num_stages: int, arch: int):
    signature = _signature(fn, constexprs)
    return compile_triton(fn, signature, constexprs, _attrs(fn, signature), num_warps, num_stages, arch)


TABLES = {"sm90": _SM90}


def _pipeline_report(compiled) -> dict:
    """What the K loop became: async global->shared copies (cp.async) and async wgmma groups kept in
    flight (a wgmma.wait_group with a non-zero count means the next MMA overlaps the previous one)."""
    ptx = compiled.asm["ptx"]
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    return dict(cp_async="cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx,
                bulk="cp.async.bulk.tensor" in ptx, async_wgmma=any(n > 0 for n in waits))


@pytest.mark.parametrize("name", ["gate_up_fwd", "down_fwd", "down_dgrad-router", "gate_up_dgrad", "dw_down"])
def test_fp32_gemm_kernel_does_not_round_to_tf32(name):
    """fp32 operands (backend="triton" in fp32 runs the pointer-load kernels) multiply in fp32, as torch's float32
    matmul does by default: Triton's default for tl.dot on NVIDIA GPUs would round them to TF32 (kernels/_common.py
    mma). The tile is the fp32 table's (block_k clipped); spills are not checked: fp32 is not a speed path."""
    fn, field, extra = GEMM_KERNELS[name]
    cfg = kernel_configs(2048, 768, torch.float32, torch.device("cpu"), 128)
    cfg = getattr(cfg, field)
    constexprs = _gemm_constexprs(fn, cfg, extra)
    signature = {k: "*fp32" if v == "*bf16" else v for k, v in _signature(fn, constexprs).items()}
    compiled = compile_triton(fn, signature, constexprs, _attrs(fn, signature), cfg.num_warps, cfg.num_stages, 90)
    ptx = compiled.asm["ptx"]
    assert "tf32" not in ptx, f"{name}: fp32 operands rounded to TF32 in the sm_90a PTX"
    assert "fma.rn.f32" in ptx, f"{name}: no fp32 fused multiply-adds in the sm_90a PTX"


@pytest.mark.parametrize("table", list(TABLES), ids=list(TABLES))
@pytest.mark.parametrize("name", list(GEMM_KERNELS), ids=list(GEMM_KERNELS))
def test_gemm_kernel_sm90_uses_wgmma_without_spills(name, table):
    fn, field, extra = GEMM_KERNELS[name]
    cfg = getattr(TABLES[table], field)
    compiled = _compile(fn, _gemm_constexprs(fn, cfg, extra), cfg.num_warps, cfg.num_stages, 90)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx, f"{name}[{table}]: no wgmma in the sm_90a PTX (tl.dot fell back to mma.sync)"
    report = ptxas_report(ptx)
    pipe = _pipeline_report(compiled)
    print(f"{name}[{table}] {cfg}: {report['registers']} registers, shared {compiled.metadata.shared} B, {pipe}")
    budget = SPILL_BUDGET.get(name, 0)
    assert report["spill_stores"] <= budget and report["spill_loads"] <= budget, f"{name}[{table}] spills:\n{report['log']}"
    # C7510: ptxas serialises the wgmma pipeline (e.g. around a call such as a device_print's printf).
    assert "C7510" not in report["log"], f"{name}[{table}]: wgmma serialised by ptxas:\n{report['log']}"
    assert compiled.metadata.shared <= SMEM_LIMIT, f"{name}[{table}] needs {compiled.metadata.shared} B of shared memory"
    if name in PIPELINED:
        assert pipe["cp_async"] or pipe["bulk"], f"{name}[{table}]: K loop loads are not asynchronous copies"
        assert pipe["async_wgmma"], f"{name}[{table}]: wgmma is not kept in flight across K steps"
        # Every stage holds one A tile and the B tile(s): the shared footprint says how many stages Triton built.
        b_tiles = 2 if fn is kernels.gate_up_fwd_kernel else 1
        stage = 2 * cfg.block_k * (cfg.block_m + b_tiles * cfg.block_n)
        if fn is kernels.dw_kernel:  # tiles: [rows x block_m], [rows x block_n]
            stage = 2 * cfg.block_k * (cfg.block_m + cfg.block_n)
        assert compiled.metadata.shared >= cfg.num_stages * stage, (
            f"{name}[{table}]: {compiled.metadata.shared} B of shared memory < {cfg.num_stages} stages x {stage} B"
        )


# The TMA core (kernels/tma_gemm.py): descriptor arguments (name: block shape from the tile), and the
# table entry each kernel runs with.
def _tma_descriptors(name: str, cfg: TileConfig) -> dict:
    m, n, k = cfg.block_m, cfg.block_n, cfg.block_k
    return {
        "gate_up_fwd": {"x_desc": [m, k], "w_desc": [1, n, k], "h_desc": [m, n], "gu_desc": [m, 1, n]},
        "down_fwd": {"a_desc": [m, k], "w_desc": [1, n, k], "out_desc": [m, n]},
        "down_dgrad": {"d_y_desc": [m, k], "w_desc": [1, k, n], "gu_desc": [m, 1, n // 2], "d_gu_desc": [m, 1, n // 2],
                       "h_w_desc": [m, n // 2]},
        "gate_up_dgrad": {"a_desc": [m, k], "w_desc": [1, k, n], "out_desc": [m, n]},
        "dw_down": {"a_desc": [k, m], "b_desc": [k, n], "dw_desc": [1, m, n]},
        "dw_gate_up": {"a_desc": [k, m], "b_desc": [k, n], "dw_desc": [1, m, n]},
    }[name]


TMA_KERNELS = {
    "gate_up_fwd": tma_gemm.gate_up_fwd_tma_kernel, "down_fwd": tma_gemm.row_gemm_tma_kernel,
    "down_dgrad": tma_gemm.down_dgrad_tma_kernel, "gate_up_dgrad": tma_gemm.row_gemm_tma_kernel,
    "dw_down": tma_gemm.dw_tma_kernel, "dw_gate_up": tma_gemm.dw_tma_kernel,
}
# The constexprs the one-GPU path runs each with (experts.py): down_dgrad with the router epilogue; down_fwd
# and gate_up_dgrad are one kernel, over weights stored [E_l, N, K] and [E_l, K, N].
TMA_CONSTEXPRS = {"gate_up_fwd": {"STORE_GATE_UP": True, "GATHER": False}, "down_dgrad": {"ROUTER": True, "STORE_H_W": True},
                  "down_fwd": {"W_NK": True}, "gate_up_dgrad": {"W_NK": False}}
# Every entry of the TMA table, plus gate_up_fwd gathering x in its loads. Entries that run a Gluon kernel
# (checked by tests/test_gluon_*_compile.py) are compiled here as the Triton TMA kernel of the same tile
# (configs.triton_tile): the bitwise reference of the Gluon kernel on the GPU (tests/gpu/test_triton_gpu.py)
# and the TMA core the interpreter suites run.
TMA_ENTRIES = {name: triton_tile(getattr(_SM90_TMA, name)) for name in TMA_KERNELS}
TMA_ENTRIES["gate_up_fwd-gather"] = TMA_ENTRIES["gate_up_fwd"]


def _compile_tma(name: str, cfg: TileConfig, arch: int):
    kernel_name = name.removesuffix("-flat").removesuffix("-gather")
    fn = TMA_KERNELS[kernel_name]
    descriptors = _tma_descriptors(kernel_name, cfg)
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      FLATTEN=cfg.flatten, **TMA_CONSTEXPRS.get(kernel_name, {}))
    if name.endswith("-gather"):
        constexprs["GATHER"] = True
    if "SPLIT" in fn.arg_names:
        constexprs["SPLIT"] = 1
    signature = {}
    for name_ in fn.arg_names:
        if name_ in constexprs:
            signature[name_] = "constexpr"
        elif name_ in descriptors:
            signature[name_] = f"tensordesc<bf16[{','.join(map(str, descriptors[name_]))}]>"
        elif name_.endswith("_ptr"):
            signature[name_] = {"weights_ptr": "*fp32", "d_w_part_ptr": "*fp32", "x_ptr": "*bf16"}.get(name_, "*i32")
        else:
            signature[name_] = "i32"
    return compile_triton(fn, signature, constexprs, _attrs(fn, signature), cfg.num_warps, cfg.num_stages, arch)


@pytest.mark.parametrize("name", list(TMA_ENTRIES), ids=list(TMA_ENTRIES))
def test_tma_kernel_sm90_uses_tma_and_wgmma_without_spills(name):
    cfg = TMA_ENTRIES[name]
    compiled = _compile_tma(name, cfg, 90)
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    pipe = _pipeline_report(compiled)
    print(f"tma {name} {cfg}: {report['registers']} registers, shared {compiled.metadata.shared} B, {pipe}")
    assert "wgmma.mma_async" in ptx, f"tma {name}: no wgmma in the sm_90a PTX"
    # gate_up_fwd-gather: the gathered x rows by cp.async (pointer loads, pipelined), the weights by TMA.
    gathers = name.endswith("-gather")
    assert pipe["bulk"] and pipe["cp_async"] == gathers, f"tma {name}: operands not copied as expected ({pipe})"
    assert pipe["async_wgmma"], f"tma {name}: wgmma is not kept in flight across K steps"
    spills = KNOWN_SPILLS.get(f"tma {name}", {}).get("spills", 0)
    assert report["spill_stores"] <= spills and report["spill_loads"] <= spills, f"tma {name} spills:\n{report['log']}"
    assert "C7510" not in report["log"], f"tma {name}: wgmma serialised by ptxas:\n{report['log']}"
    assert compiled.metadata.shared <= SMEM_LIMIT, f"tma {name} needs {compiled.metadata.shared} B of shared memory"
    b_tiles = 2 if name.startswith("gate_up_fwd") else 1
    stage = 2 * cfg.block_k * (cfg.block_m + b_tiles * cfg.block_n)
    assert compiled.metadata.shared >= cfg.num_stages * stage, (
        f"tma {name}: {compiled.metadata.shared} B of shared memory < {cfg.num_stages} stages x {stage} B"
    )


@triton.jit
def _sm100_probe_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


_SM100_UNSUPPORTED: list = []  # [] not probed yet; [None] this Triton compiles for sm_100; [reason] it cannot


def _skip_unless_triton_targets_sm100() -> None:
    """sm_100 support depends on the installed Triton: skip (naming why) only when it cannot compile even a
    trivial kernel for sm_100a. Where it can, a megamoe kernel that fails to compile there is a failure, not a
    skip (a broad except around the kernel's own compile turned every such regression into a skip)."""
    if not _SM100_UNSUPPORTED:
        try:
            compile_triton(_sm100_probe_kernel, {"x_ptr": "*fp32"}, {}, {}, 4, 1, 100)
            _SM100_UNSUPPORTED.append(None)
        except Exception as exc:  # noqa: BLE001 - the installed Triton's limitation, reported as the skip reason
            _SM100_UNSUPPORTED.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    if _SM100_UNSUPPORTED[0] is not None:
        pytest.skip(f"this Triton cannot compile for sm_100a: {_SM100_UNSUPPORTED[0]}")


@pytest.mark.parametrize("name", list(TMA_ENTRIES), ids=list(TMA_ENTRIES))
def test_tma_kernel_sm100_compiles(name):
    _skip_unless_triton_targets_sm100()
    compiled = _compile_tma(name, TMA_ENTRIES[name], 100)
    assert "tcgen05.mma" in compiled.asm["ptx"], f"tma {name}: sm_100a PTX does not use tcgen05.mma"


def _sass_k_loops(cubin: bytes, mma: str = "HGMMA") -> tuple[list[tuple[int, int]], list[int]]:
    """(address ranges of the innermost loops that issue `mma` (HGMMA: sm_90a's wgmma; UTCHMMA: sm_100a's
    tcgen05.mma), addresses of spill instructions) in the kernel's SASS (cuobjdump bundled with Triton's ptxas).
    A loop is a backward branch's range."""
    code = [(int(m.group(1), 16), line) for line in sass(cubin).splitlines() if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))]
    loops = [(int(m.group(1), 16), addr) for addr, line in code
             if (m := re.search(r"BRA\s+0x([0-9a-f]+)", line)) and int(m.group(1), 16) < addr]
    hgmma = [addr for addr, line in code if mma in line]
    with_mma = [(a, b) for a, b in loops if any(a <= h <= b for h in hgmma)]
    innermost = [(a, b) for a, b in with_mma
                 if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in with_mma)]
    spills = [addr for addr, line in code if re.search(r"\b(STL|LDL)\b", line)]
    return innermost, spills


@pytest.mark.parametrize("name", list(SPILL_BUDGET))
def test_spills_stay_out_of_k_loops(name):
    fn, field, extra = GEMM_KERNELS[name]
    cfg = getattr(_SM90, field)
    compiled = _compile(fn, _gemm_constexprs(fn, cfg, extra), cfg.num_warps, cfg.num_stages, 90)
    k_loops, spills = _sass_k_loops(compiled.asm["cubin"])
    assert k_loops, f"{name}: found no loop issuing HGMMA in the SASS"
    inside = [hex(s) for s in spills for a, b in k_loops if a <= s <= b]
    assert not inside, f"{name}: spill instructions inside a K loop at {inside} (loops {k_loops})"


@pytest.mark.parametrize("name", list(OTHER_KERNELS), ids=list(OTHER_KERNELS))
def test_memory_kernel_sm90_compiles_without_spills(name):
    fn = OTHER_KERNELS[name]
    cfg = _SM90.combine
    if fn is kernels.spread_rows_kernel:  # the tile the launcher ships
        consts = dict(zip(("BLOCK_T", "BLOCK_H"), gather._SPREAD_TILE[:2]))
    else:
        consts = dict(BLOCK_T=cfg.block_m, BLOCK_H=cfg.block_n)
    if "HAS_WEIGHTS" in fn.arg_names:
        consts.update(HAS_WEIGHTS=True, HAS_SHARED=True)
    tiles = [(consts, cfg)]
    if "TOP_K" in fn.arg_names:  # combine: top-8, the pointer table's tile (EP) and the Hopper TMA table's
        consts["TOP_K"] = 8
        tma = _SM90_TMA.combine
        tiles.append((dict(consts, BLOCK_T=tma.block_m, BLOCK_H=tma.block_n), tma))
    for consts, tile in tiles:
        compiled = _compile(fn, consts, tile.num_warps, tile.num_stages, 90)
        report = ptxas_report(compiled.asm["ptx"])
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{name} spills:\n{report['log']}"


@pytest.mark.parametrize("name", list(GEMM_KERNELS), ids=list(GEMM_KERNELS))
def test_gemm_kernel_sm100_compiles(name):
    fn, field, extra = GEMM_KERNELS[name]
    cfg = getattr(_SM90, field)
    _skip_unless_triton_targets_sm100()
    compiled = _compile(fn, _gemm_constexprs(fn, cfg, extra), cfg.num_warps, cfg.num_stages, 100)
    assert "tcgen05.mma" in compiled.asm["ptx"], f"{name}: sm_100a PTX does not use tcgen05.mma"


# ----------------------------------------------------------------------------------------------------
# Blackwell (sm_100a): what the product runs there. tma_kernel_configs / ep_tma_kernel_configs are Hopper-only
# (the Gluon kernels are wgmma kernels), so on a compute capability 10.x GPU autograd's "auto" picks the triton
# backend (capability >= 9.0) and every GEMM runs the pointer-load core with the _DEFAULT table, the
# expert-parallel path the fused kernels of kernels/ep_fused.py with the same tiles. The tests above compile the
# pointer-load kernels for sm_100a only at the _SM90 tiles, which Blackwell never runs.


@pytest.mark.parametrize("workload", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b",
                                      "kimi-k2"])
def test_blackwell_runs_the_pointer_load_default_table(workload, monkeypatch):
    """On a Blackwell GPU (configs._arch patched: there is none here) no TMA/Gluon table applies and the
    benchmarked workloads' tiles are _DEFAULT's, bf16 and fp16 alike: the entries compiled below."""
    from megamoe.backends.triton import configs
    from megamoe.bench.workloads import WORKLOADS

    monkeypatch.setattr(configs, "_arch", lambda device: (10, 0))
    w = WORKLOADS[workload]
    for dtype in (torch.bfloat16, torch.float16):
        block_m = configs.block_m_for(w.hidden, w.intermediate, dtype)
        args = (w.hidden, w.intermediate, dtype, torch.device("cuda"), block_m)
        assert configs.tma_kernel_configs(*args) is None and configs.ep_tma_kernel_configs(*args) is None
        assert configs._kernel_configs(w.hidden, w.intermediate, dtype, (10, 0), block_m) == _DEFAULT


SM100_GEMM_KERNELS = dict(GEMM_KERNELS)
SM100_GEMM_KERNELS["ep_fwd"] = (kernels.ep_fwd_kernel, "gate_up_fwd", _fused("gate_up_fwd", "down_fwd", _DEFAULT))
SM100_GEMM_KERNELS["ep_bwd"] = (kernels.ep_bwd_kernel, "dw_down", _fused(
    "down_dgrad", "gate_up_dgrad", _DEFAULT, W_BLOCK_M=_DEFAULT.dw_down.block_m, W_BLOCK_N=_DEFAULT.dw_down.block_n,
    W_BLOCK_K=_DEFAULT.dw_down.block_k, W_GROUP_M=_DEFAULT.dw_down.group_m, W_STAGES=_DEFAULT.dw_down.num_stages))
# Spill bytes allowed on sm_100a (stores and loads each). The fused backward spills 304 / 292 bytes at the
# _DEFAULT tiles with Triton 3.6's ptxas (255 registers, 272-byte stack frame; a release's own in
# compile_checks.KNOWN_SPILLS), more than on Hopper (280), none inside a tcgen05 K loop
# (test_sm100_spills_stay_out_of_k_loops); the bound is that state until the Blackwell tiles are measured (configs:
# "Blackwell until measured").
SM100_SPILL_BUDGET = {**SPILL_BUDGET, "ep_bwd": 304}


def _compile_sm100_default(name: str):
    fn, field, extra = SM100_GEMM_KERNELS[name]
    cfg = getattr(_DEFAULT, field)
    return _compile(fn, _gemm_constexprs(fn, cfg, extra), cfg.num_warps, cfg.num_stages, 100), cfg


@pytest.mark.parametrize("name", list(SM100_GEMM_KERNELS))
def test_gemm_kernel_sm100_default_table_uses_tcgen05_within_spill_budget(name):
    _skip_unless_triton_targets_sm100()
    compiled, cfg = _compile_sm100_default(name)
    ptx = compiled.asm["ptx"]
    assert "tcgen05.mma" in ptx, f"{name}: sm_100a PTX does not use tcgen05.mma"
    report = ptxas_report(ptx, 100)
    print(f"sm100 {name} {cfg}: {report['registers']} registers, shared {compiled.metadata.shared} B, "
          f"spills {report['spill_stores']}/{report['spill_loads']} B")
    budget = KNOWN_SPILLS.get(f"{name} sm100", {}).get("spills", SM100_SPILL_BUDGET.get(name, 0))
    assert report["spill_stores"] <= budget and report["spill_loads"] <= budget, f"{name}[sm100] spills:\n{report['log']}"
    assert compiled.metadata.shared <= SMEM_LIMIT, f"{name}[sm100] needs {compiled.metadata.shared} B of shared memory"


@pytest.mark.parametrize("name", list(SM100_SPILL_BUDGET))
def test_sm100_spills_stay_out_of_k_loops(name):
    _skip_unless_triton_targets_sm100()
    compiled, _ = _compile_sm100_default(name)
    k_loops, spills = _sass_k_loops(compiled.asm["cubin"], "UTCHMMA")
    assert k_loops, f"{name}: found no loop issuing UTCHMMA in the sm_100a SASS"
    inside = [hex(s) for s in spills for a, b in k_loops if a <= s <= b]
    assert not inside, f"{name}: spill instructions inside a K loop at {inside} (loops {k_loops})"


# The memory-bound kernels every path launches, as their launchers specialise them: combine (forward with the
# router weights, backward's d_x without; with and without a shared expert; the benchmarked workloads' k),
# row_sums (d_topk_weights: the one-GPU path in the router's dtype, EP in fp32), spread_rows, and the row copies of
# the expert-parallel exchanges (comm/exchange.py: bf16 token rows pulled or pushed, the fp32 router weights one a
# row, the int32 routing rows; a table of peer buffers on either side). Each on the combine tile of the table the
# target runs (Hopper: the TMA table's 4 x 512 and the pointer table's 8 x 256; Blackwell: _DEFAULT's).
def _copy_rows_case(src_table: bool, dst_table: bool, elem: int, row_elems: int, aligned: bool) -> tuple:
    block = min(triton.next_power_of_2(row_elems), 4096 // elem)
    rows = max(1, min(row_copy._MAX_ROWS, row_copy.COPY_SHAPE.step_bytes // (block * elem)))
    raw = {2: "*i16", 4: "*i32", 8: "*i64"}[elem]
    signature = {"src_ptr": "*i64" if src_table else raw, "src_peer_ptr": "*i32", "src_row_ptr": "*i32",
                 "dst_ptr": "*i64" if dst_table else raw, "dst_peer_ptr": "*i32", "dst_row_ptr": "*i32",
                 "num_rows": "i32", "row_elems": "i32"}
    consts = dict(SRC_TABLE=src_table, DST_TABLE=dst_table, RAW=row_copy._RAW_TYPES[elem], ALIGNED=aligned,
                  ROWS=rows, BLOCK=block)
    return row_copy._copy_rows_kernel, signature, consts, row_copy.COPY_SHAPE.num_warps


def _combine_case(top_k: int, weights: bool, shared: bool, tile: TileConfig) -> tuple:
    fn = kernels.combine_kernel
    signature = {"y_ptr": "*bf16", "w_ptr": "*fp32" if weights else "*bf16", "index_ptr": "*i32", "shared_ptr": "*bf16",
                 "out_ptr": "*bf16", "T": "i32", "H": "i32"}
    consts = dict(TOP_K=top_k, HAS_WEIGHTS=weights, HAS_SHARED=shared, BLOCK_T=tile.block_m, BLOCK_H=tile.block_n)
    return fn, signature, consts, tile.num_warps


def _row_sums_case(out: str) -> tuple:
    signature = {"parts_ptr": "*fp32", "index_ptr": "*i32", "out_ptr": out, "num_pairs": "i32", "P": "i32"}
    consts = dict(BLOCK=combine_module.ROW_SUMS_BLOCK, BLOCK_P=combine_module.ROW_SUMS_BLOCK_P)
    return kernels.row_sums_kernel, signature, consts, 4


def _spread_case() -> tuple:
    fn = kernels.spread_rows_kernel
    signature = {"src_ptr": "*bf16", "dest_row_ptr": "*i32", "row_src_ptr": "*i32", "rows_in_use_ptr": "*i32",
                 "out_ptr": "*bf16", "T": "i32", "H": "i32", "top_k": "i32"}
    return fn, signature, dict(zip(("BLOCK_T", "BLOCK_H"), gather._SPREAD_TILE[:2])), 4


def _memory_cases(arch: int) -> dict:
    tiles = {"tma": _SM90_TMA.combine, "ptr": _SM90.combine} if arch == 90 else {"ptr": _DEFAULT.combine}
    cases = {}
    for tile_name, tile in tiles.items():
        for top_k in (8, 4, 2):  # qwen3 / deepseek-v3 / kimi-k2, gpt-oss-120b, mixtral-8x7b
            for weights, shared in ((True, False), (True, True), (False, False), (False, True)):
                name = f"combine-{tile_name}-k{top_k}-{'w' if weights else 'dx'}{'-shared' if shared else ''}"
                cases[name] = _combine_case(top_k, weights, shared, tile)
    cases["row_sums-fp32"] = _row_sums_case("*fp32")
    cases["row_sums-bf16"] = _row_sums_case("*bf16")
    if arch != 90:  # sm_90a: test_memory_kernel_sm90_compiles_without_spills
        cases["spread_rows"] = _spread_case()
    cases["copy_rows-pull-bf16"] = _copy_rows_case(True, False, 2, 2048, True)  # pull_rows: d_out / x token rows
    cases["copy_rows-push-bf16"] = _copy_rows_case(False, True, 2, 2048, True)  # push dispatch, pairs
    cases["copy_rows-local-bf16"] = _copy_rows_case(False, False, 2, 2048, True)  # push dispatch's padding rows
    cases["copy_rows-pull-fp32"] = _copy_rows_case(True, False, 4, 1, False)  # the router weights, one a row
    cases["copy_rows-push-fp32"] = _copy_rows_case(False, True, 4, 1, False)  # d_topk_weights' partial sums
    cases["copy_rows-routing"] = _copy_rows_case(True, False, 4, 3 + 16384 * 8, False)  # gather_routing's rows
    return cases


MEMORY_CASES = {arch: _memory_cases(arch) for arch in (90, 100)}


@pytest.mark.parametrize("case", [(arch, name) for arch in MEMORY_CASES for name in MEMORY_CASES[arch]],
                         ids=[f"sm{arch}-{name}" for arch in MEMORY_CASES for name in MEMORY_CASES[arch]])
def test_memory_kernels_compile_without_spills(case):
    arch, name = case
    if arch == 100:
        _skip_unless_triton_targets_sm100()
    fn, signature, consts, num_warps = MEMORY_CASES[arch][name]
    sig = {n: "constexpr" if n in consts else signature[n] for n in fn.arg_names}
    compiled = compile_triton(fn, sig, consts, _attrs(fn, sig), num_warps, 1, arch)
    report = ptxas_report(compiled.asm["ptx"], arch)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0 and report["stack"] == 0, (
        f"sm{arch} {name} spills:\n{report['log']}")


# ----------------------------------------------------------------------------------------------------
# GPUs with ~100 KB of shared memory a block (compute capability 12.x: RTX 50xx / RTX PRO Blackwell; also 8.6 / 8.9)
# run the _DEFAULT table too (configs: "tiles that fit 100 KB of shared memory"), fp32 inputs at its K step of 32
# (twice bf16's bytes a stage).
SM120_SMEM_LIMIT = 99 * 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(SM100_GEMM_KERNELS))
def test_default_table_fits_sm120_shared_memory(name, dtype):
    from megamoe.backends.triton import configs

    fn, field, extra = SM100_GEMM_KERNELS[name]
    cfg = getattr(configs._kernel_configs(4096, 1536, dtype, (12, 0), configs.block_m_for(4096, 1536, dtype)), field)
    constexprs = _gemm_constexprs(fn, cfg, extra)
    element = "*fp32" if dtype == torch.float32 else "*bf16"
    signature = {k: element if v == "*bf16" else v for k, v in _signature(fn, constexprs).items()}
    compiled = compile_triton(fn, signature, constexprs, _attrs(fn, signature), cfg.num_warps, cfg.num_stages, 120)
    assert compiled.metadata.shared <= SM120_SMEM_LIMIT, (
        f"{name}[sm120, {dtype}] at {cfg} needs {compiled.metadata.shared} B of shared memory, over {SM120_SMEM_LIMIT}")
