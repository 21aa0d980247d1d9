"""Ahead-of-time compile checks of the Gluon warp-specialized GEMM prototype (benchmarks/gluon_gemm.py), on CPU.

Gluon kernels compile without a GPU the way Triton kernels do (tests/test_triton_compile.py): a
GluonASTSource (triton.experimental.gluon._runtime) through triton.compile for GPUTarget("cuda", 90, 32),
with the tensor-descriptor signatures the launcher would produce (triton.runtime.jit.mangle_type of the
host-side Gluon TensorDescriptors, built here on CPU tensors). Every config of gluon_gemm.CONFIGS is
compiled with the constexprs the launcher passes, and the assertions are about the code an H200 would run:

  * wgmma: exactly NUM_WG x (rows per warpgroup / 64) x (BLOCK_K / 16) wgmma.mma_async of shape
    m64n{BLOCK_N}k16 per K step (the widest instruction: the tile is not split into narrower MMAs), kept in
    flight across K steps (wgmma.wait_group 1) -- and the same count of HGMMA in the SASS;
  * TMA: operand tiles by cp.async.bulk.tensor (2-D rows, 3-D weights) completing on an mbarrier, outputs by
    TMA stores (one per consumer warpgroup), no cp.async;
  * mbarriers: 2 x STAGES initialised, try_wait.parity (consumers, producer), arrive.expect_tx (producer),
    arrive (slot release);
  * warp specialization: 12 warps (two consumer warpgroups + the producer's) or 8, setmaxnreg to 232 / 40;
  * ptxas -v: no spills, no stack frame, no wgmma-serialisation warning (C7510); no local loads/stores in
    the SASS; shared memory within the 227 KB of an SM and at least the ring + epilogue buffers.

A Python model of the producer's and consumers' slot counters checks the index arithmetic the kernel uses
(every (tile, K step) a consumer waits for is the slot the producer filled for it).

Run: pytest tests/test_gluon_compile.py -s  (prints registers, shared memory and instruction counts).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402


def _load_prototype():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gluon_gemm.py"
    spec = importlib.util.spec_from_file_location("gluon_gemm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gluon_gemm"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


G = _load_prototype()
SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90
# A qwen3-30b-a3b-like problem: the descriptors' block shapes and layouts are what matters, not the sizes.
R, K, N, E = 2048, 768, 2048, 4


def _compile(cfg):
    h = torch.empty(R, K, dtype=torch.bfloat16)
    w = torch.empty(E, N, K, dtype=torch.bfloat16)
    y = torch.empty(R, N, dtype=torch.bfloat16)
    descs = dict(zip(("a_desc", "b_desc", "c_desc"), G.descriptors(h, w, y, cfg)))
    fn = G.down_fwd_ws_kernel
    consts = G.constexprs(cfg, G.SCHEDULE_BLOCK_M // cfg.block_m)
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in descs:
            signature[name] = mangle_type(descs[name])
        else:
            assert name.endswith("_ptr"), name
            signature[name] = "*i32"
    # 16-byte aligned int32 pointers, as the launcher's specialisation sees torch allocations.
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    src = GluonASTSource(fn, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _ptxas(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr

    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    return dict(registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"), log=log)


def _sass(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


_CACHE: dict = {}


def _report(name: str) -> dict:
    """Compile once per config; what the assertions (and the printed summary) look at."""
    if name not in _CACHE:
        cfg = G.CONFIGS[name]
        compiled = _compile(cfg)
        ptx = compiled.asm["ptx"]
        sass = _sass(compiled.asm["cubin"])

        def count(pattern, text=ptx):
            return len(re.findall(pattern, text))

        _CACHE[name] = dict(
            cfg=cfg, compiled=compiled, ptx=ptx, sass=sass, ptxas=_ptxas(ptx),
            wgmma=count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.block_n}k16\.f32\.bf16\.bf16"),
            wgmma_any=count(r"wgmma\.mma_async"),
            wait_groups=sorted(set(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
            tma_load_2d=count(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"),
            tma_load_3d=count(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"),
            tma_store=count(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group"),
            cp_async=count(r"cp\.async\.(ca|cg)\.shared\.global"),
            mbar_init=count(r"mbarrier\.init\.shared"),
            mbar_wait=count(r"mbarrier\.try_wait\.parity"),
            mbar_expect=count(r"mbarrier\.arrive\.expect_tx"),
            mbar_arrive=count(r"mbarrier\.arrive\.shared::cta\.b64"),
            setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            hgmma=count(rf"HGMMA\.64x{cfg.block_n}x16\.F32\.BF16", sass),
            utmaldg_2d=count(r"UTMALDG\.2D", sass),
            utmaldg_3d=count(r"UTMALDG\.3D", sass),
            utmastg=count(r"UTMASTG\.2D", sass),
            local=count(r"\b(STL|LDL)(\.[A-Z0-9]+)*\b", sass),
        )
    return _CACHE[name]


def _wgmma_per_k_step(cfg) -> int:
    rows_per_wg = cfg.block_m if cfg.pingpong else cfg.block_m // cfg.num_wg
    return cfg.num_wg * (rows_per_wg // 64) * (cfg.block_k // 16)


@pytest.mark.parametrize("name", list(G.CONFIGS))
def test_gluon_kernel_sm90a(name):
    r = _report(name)
    cfg, meta, px = r["cfg"], r["compiled"].metadata, r["ptxas"]
    print(f"\ngluon {name} {cfg}: {meta.num_warps} warps, {px['registers']} registers/thread (kernel max), "
          f"setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, spills {px['spill_stores']}/{px['spill_loads']} B, "
          f"stack {px['stack']} B; PTX: {r['wgmma']} wgmma m64n{cfg.block_n}k16, wait_group {r['wait_groups']}, "
          f"TMA loads 2d/3d {r['tma_load_2d']}/{r['tma_load_3d']}, TMA stores {r['tma_store']}, mbarrier init "
          f"{r['mbar_init']} / try_wait {r['mbar_wait']} / expect_tx {r['mbar_expect']} / arrive {r['mbar_arrive']}; "
          f"SASS: {r['hgmma']} HGMMA, UTMALDG 2d/3d {r['utmaldg_2d']}/{r['utmaldg_3d']}, UTMASTG {r['utmastg']}, "
          f"local {r['local']}")
    # wgmma: one K step is (rows / 64) x (BLOCK_K / 16) m64nNk16 per consumer, each in its own partition.
    assert r["wgmma"] == r["wgmma_any"] == _wgmma_per_k_step(cfg), f"{name}: wgmma {r['wgmma']}/{r['wgmma_any']}"
    assert r["hgmma"] == _wgmma_per_k_step(cfg), f"{name}: {r['hgmma']} HGMMA in the SASS"
    assert 1 in r["wait_groups"], f"{name}: wgmma not kept in flight across K steps ({r['wait_groups']})"
    # TMA: the operands by bulk tensor copies into the ring, the outputs by bulk tensor stores.
    assert r["tma_load_2d"] == 1 and r["tma_load_3d"] == 1, f"{name}: TMA loads {r['tma_load_2d']}/{r['tma_load_3d']}"
    assert r["tma_store"] == cfg.num_wg, f"{name}: {r['tma_store']} TMA stores for {cfg.num_wg} consumers"
    assert r["cp_async"] == 0, f"{name}: cp.async copies besides TMA"
    assert r["utmaldg_2d"] >= 1 and r["utmaldg_3d"] >= 1 and r["utmastg"] >= cfg.num_wg
    # mbarriers: ready + empty per stage; waits in the producer and every consumer; the producer's expect;
    # the consumers' releases (in the K loop and after the last step).
    assert r["mbar_init"] == 2 * cfg.stages, f"{name}: {r['mbar_init']} mbarrier.init"
    assert r["mbar_wait"] >= 1 + cfg.num_wg and r["mbar_expect"] >= 1 and r["mbar_arrive"] >= 2 * cfg.num_wg
    # Warp specialization and its register split.
    assert meta.num_warps == cfg.num_warps, f"{name}: {meta.num_warps} warps"
    assert ("dec", str(cfg.producer_regs)) in r["setmaxnreg"], f"{name}: producer registers {r['setmaxnreg']}"
    if cfg.num_wg == 2:
        assert ("inc", str(cfg.consumer_regs)) in r["setmaxnreg"], f"{name}: consumer registers {r['setmaxnreg']}"
    # No spills, nothing serialised, shared memory within the SM.
    assert px["spill_stores"] == 0 and px["spill_loads"] == 0 and px["stack"] == 0, f"{name} spills:\n{px['log']}"
    assert r["local"] == 0, f"{name}: local-memory loads/stores in the SASS"
    assert "C7510" not in px["log"] and "serialized" not in px["log"], f"{name}: wgmma serialised:\n{px['log']}"
    assert cfg.smem_bytes() <= meta.shared <= SMEM_LIMIT, (
        f"{name}: shared {meta.shared} B (ring + epilogue {cfg.smem_bytes()})")


# ----------------------------------------------------------------------------------------------------
# A model of the slot counters (the kernel's index arithmetic, in Python)


def _producer_slots(pid, nprog, tiles, k_steps):
    """{(tile, k): slot counter p} in the producer's order."""
    out, p = {}, 0
    for tile in range(pid, tiles, nprog):
        for k in range(k_steps):
            out[(tile, k)] = p
            p += 1
    return out


def _consumer_slots(pid, nprog, tiles, k_steps, wg, num_wg, pingpong):
    """[(tile, k, c)] in the consumer's order, with c as _consumer computes it."""
    if pingpong:
        first, stride, c, skip = pid + wg * nprog, num_wg * nprog, wg * k_steps, (num_wg - 1) * k_steps
    else:
        first, stride, c, skip = pid, nprog, 0, 0
    out = []
    for tile in range(first, tiles, stride):
        for k in range(k_steps):
            out.append((tile, k, c))
            c += 1
        c += skip
    return out


@pytest.mark.parametrize("num_wg,pingpong", [(1, False), (2, False), (2, True)])
def test_slot_counters_model(num_wg, pingpong):
    for tiles, nprog, k_steps in [(1, 132, 12), (131, 132, 12), (1000, 132, 12), (1001, 7, 17), (5, 2, 1), (64, 3, 24)]:
        for pid in range(min(nprog, 5)):
            filled = _producer_slots(pid, nprog, tiles, k_steps)
            seen: dict = {}
            for wg in range(num_wg):
                for tile, k, c in _consumer_slots(pid, nprog, tiles, k_steps, wg, num_wg, pingpong):
                    assert filled[(tile, k)] == c, (tiles, nprog, k_steps, pid, wg, tile, k)
                    seen.setdefault((tile, k), []).append(wg)
            # pingpong: every step read by exactly one warpgroup (one arrive: count 1); coop: by all (count NUM_WG).
            want = 1 if pingpong else num_wg
            assert set(seen) == set(filled) and all(len(v) == want for v in seen.values())
            # Each consumer's counters increase, so its waits follow the producer's fill order (no deadlock on
            # the ring: a consumer never waits for a slot the producer fills after one this consumer holds).
            for wg in range(num_wg):
                cs = [c for _, _, c in _consumer_slots(pid, nprog, tiles, k_steps, wg, num_wg, pingpong)]
                assert cs == sorted(cs)
