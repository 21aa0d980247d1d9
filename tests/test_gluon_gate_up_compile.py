"""Ahead-of-time compile checks of the Gluon gate_up_fwd kernel (megamoe/backends/triton/kernels/gluon_gate_up.py),
on CPU.

Compiled as tests/test_gluon_compile.py compiles the GEMM prototype: a GluonASTSource through triton.compile for
GPUTarget("cuda", 90, 32), with the signature the launcher's host-side Gluon TensorDescriptors (built here on
CPU tensors) produce. Every tile of gluon_gate_up.TILES, with and without STORE_GATE_UP, x rows by TMA and
gathered (and the gathering kernel for an H that is not a multiple of 16); the assertions are about the code an
H200 would run:

  * wgmma: per K step 2 consumers x 2 accumulators x BLOCK_K / 16 wgmma.mma_async m64nBLOCK_Nk16 (the widest
    instruction), with a constant-true scale-d (zero-initialised accumulators, as the Triton kernel), kept in
    flight across K steps (wgmma.wait_group 2) -- and as many HGMMA in the SASS;
  * TMA: the weight tiles by 3-D bulk tensor copies completing on an mbarrier; x rows by a 2-D one, or with
    GATHER by 16-byte cp.async (zero-fill) whose completion arrives on the same barrier (.noinc); the outputs by
    3-D TMA stores, 3 (g, u, h) or 1 (h) per consumer;
  * mbarriers: 2 x STAGES initialised (ready count 1, or 1 + 128 gathering threads; empty count 2);
  * warp specialization: 12 warps, setmaxnreg 232 for the consumers and 40 for the producer;
  * ptxas -v: no spills, no stack frame, no wgmma serialisation (C7510), no local loads/stores in the SASS;
    shared memory within the 227 KB of an SM and at least the ring + staging buffers;
  * the epilogue is the Triton kernel's: for the production tile (BLOCK_N 128) the Gluon PTX holds exactly
    twice the production kernel's (tma_gemm.gate_up_fwd_tma_kernel, compiled here too) float instructions of
    every kind the epilogue uses (rounding, exp2, division, ...): the same per-element sequence, once per
    consumer warpgroup.

Python models of the ring's slot counters and of the staging buffers' rotation check the kernel's index
arithmetic. Run: pytest tests/test_gluon_gate_up_compile.py -s  (prints registers, shared memory, counts).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
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

from megamoe.backends.triton.configs import _SM90_TMA  # noqa: E402
from conftest import triton_tile  # noqa: E402
from megamoe.backends.triton.kernels import gluon_gate_up as G  # noqa: E402
from megamoe.backends.triton.kernels import tma_gemm  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90
# A qwen3-30b-a3b-like problem: the descriptors' block shapes and layouts are what matters, not the sizes.
R, H, I, E, T = 2048, 2048, 768, 4, 512
CASES = {f"{name}-{'gu' if gu else 'h'}-{'gather' if gather else 'tma'}": (name, gu, gather)
         for name in G.TILES for gu in (True, False) for gather in (False, True)}
# Float instructions of the epilogue (fp32 -> 16-bit rounding, SwiGLU), counted in both kernels.
EPILOGUE_OPS = ("cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32", "cvt.f32.bf16", "ex2.approx.f32", "ex2.approx.ftz.f32",
                "div.full.f32", "div.rn.f32", "rcp.approx.f32", "sub.f32", "neg.f32", "add.f32", "mul.f32", "fma.rn.f32")


def _attrs(arg_names, aligned):
    """16-byte divisibility of the pointers and of H, I, as the launcher's specialisation sees them."""
    return {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(arg_names) if name in aligned}


def _compile_gluon(tile, store_gate_up: bool, gather: bool, sizes_aligned: bool = True):
    """sizes_aligned: H and I specialised as multiples of 16 (the launch of any H, I % 16 == 0), else plain ints."""
    x = torch.empty(T if gather else R, H, dtype=torch.bfloat16)
    w = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    h = torch.empty(R, I, dtype=torch.bfloat16)
    gate_up = torch.empty(R, 2 * I, dtype=torch.bfloat16) if store_gate_up else None
    descs = dict(zip(("x_desc", "w_desc", "h_desc", "gu_desc"), G.descriptors(x, w, h, gate_up, tile)))
    fn = G.gate_up_fwd_ws_kernel
    consts = G.constexprs(tile, 1, store_gate_up, gather)
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in descs:
            signature[name] = mangle_type(descs[name])
        elif name == "x_ptr":
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "i32"
    aligned = {n for n in fn.arg_names if n.endswith("_ptr")} | ({"H", "I"} if sizes_aligned else set())
    src = GluonASTSource(fn, signature, consts, _attrs(fn.arg_names, aligned))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _compile_triton_production():
    """tma_gemm.gate_up_fwd_tma_kernel with its tile-table entry (STORE_GATE_UP, x rows by TMA)."""
    cfg = triton_tile(_SM90_TMA.gate_up_fwd)  # the Triton kernel of the Gluon entry's tile
    fn = tma_gemm.gate_up_fwd_tma_kernel
    consts = dict(STORE_GATE_UP=True, GATHER=False, SPLIT=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten)
    blocks = {"x_desc": [cfg.block_m, cfg.block_k], "w_desc": [1, cfg.block_n, cfg.block_k],
              "h_desc": [cfg.block_m, cfg.block_n], "gu_desc": [cfg.block_m, 1, cfg.block_n]}
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in blocks:
            signature[name] = f"tensordesc<bf16[{','.join(map(str, blocks[name]))}]>"
        elif name == "x_ptr":
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "i32"
    aligned = {n for n in fn.arg_names if n.endswith("_ptr")}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=_attrs(fn.arg_names, aligned))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


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


def _op_counts(ptx: str) -> collections.Counter:
    return collections.Counter(op for op in re.findall(r"^\s*(?:@%p\d+\s+)?([a-z][a-z0-9_.:]*)\s", ptx, re.M)
                               if op in EPILOGUE_OPS)


def _constant_true_scale_d(ptx: str) -> bool:
    """Every wgmma's scale-d predicate is only ever set by `mov.pred %p, -1` (D = A B + D, D zeroed before the K
    loop; the Triton kernel's form, not use_acc=False on the first step, which can differ in the sign of zeros)."""
    preds = set(re.findall(r"wgmma\.mma_async\.[^;]*, (%p\d+), 1, 1, 0, 0;", ptx))
    definitions = collections.defaultdict(list)
    for op, dst, operands in re.findall(r"^\s*([a-z][\w.:]*)\s+(%p\d+),\s*([^;]*);", ptx, re.M):
        definitions[dst].append((op, operands.strip()))
    return bool(preds) and all(definitions[p] and set(definitions[p]) == {("mov.pred", "-1")} for p in preds)


_CACHE: dict = {}


def _report(case: str) -> dict:
    """Compile once per case; what the assertions (and the printed summary) look at."""
    if case not in _CACHE:
        name, store_gate_up, gather = CASES[case]
        tile = G.TILES[name]
        compiled = _compile_gluon(tile, store_gate_up, gather)
        ptx = compiled.asm["ptx"]
        sass = _sass(compiled.asm["cubin"])

        def count(pattern, text=ptx):
            return len(re.findall(pattern, text))

        _CACHE[case] = dict(
            tile=tile, store_gate_up=store_gate_up, gather=gather, compiled=compiled, ptx=ptx, ptxas=_ptxas(ptx),
            wgmma=count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_n}k16\.f32\.bf16\.bf16"),
            wgmma_any=count(r"wgmma\.mma_async"),
            scale_d_true=_constant_true_scale_d(ptx),
            wait_groups=sorted(set(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
            tma_load_2d=count(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"),
            tma_load_3d=count(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"),
            tma_store_3d=count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group"),
            tma_store_wait=sorted(set(int(n) for n in re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+)", ptx))),
            cp_async_16=count(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10, %r\d+;"),
            cp_async_any=count(r"cp\.async\.(ca|cg)\.shared\.global"),
            cp_async_arrive_noinc=count(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64"),
            mbar_init=re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx),
            mbar_wait=count(r"mbarrier\.try_wait\.parity"),
            mbar_expect=count(r"mbarrier\.arrive\.expect_tx"),
            mbar_arrive=count(r"mbarrier\.arrive\.shared::cta\.b64"),
            setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            epilogue_ops=_op_counts(ptx),
            hgmma=count(rf"HGMMA\.64x{tile.block_n}x16\.F32\.BF16", sass),
            local=count(r"\b(STL|LDL)(\.[A-Z0-9]+)*\b", sass),
        )
    return _CACHE[case]


@pytest.mark.parametrize("case", list(CASES))
def test_gluon_gate_up_sm90a(case):
    r = _report(case)
    tile, meta, px = r["tile"], r["compiled"].metadata, r["ptxas"]
    print(f"\ngluon gate_up {case} {tile}: {meta.num_warps} warps, {px['registers']} registers/thread (kernel max), "
          f"setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, spills {px['spill_stores']}/{px['spill_loads']} B, "
          f"stack {px['stack']} B; PTX: {r['wgmma']} wgmma m64n{tile.block_n}k16, wait_group {r['wait_groups']}, "
          f"TMA loads 2d/3d {r['tma_load_2d']}/{r['tma_load_3d']}, cp.async {r['cp_async_any']} "
          f"(+{r['cp_async_arrive_noinc']} arrive.noinc), TMA stores {r['tma_store_3d']} "
          f"(wait_group.read {r['tma_store_wait']}), mbarrier init {r['mbar_init']} / try_wait {r['mbar_wait']} / "
          f"expect_tx {r['mbar_expect']} / arrive {r['mbar_arrive']}; SASS: {r['hgmma']} HGMMA, local {r['local']}")
    per_k_step = 2 * 2 * (G.BLOCK_K // 16)  # consumers x (gate, up) x k16 steps, one m64 row block each
    assert r["wgmma"] == r["wgmma_any"] == per_k_step, f"{case}: wgmma {r['wgmma']}/{r['wgmma_any']}"
    assert r["hgmma"] == per_k_step, f"{case}: {r['hgmma']} HGMMA in the SASS"
    assert r["scale_d_true"], f"{case}: a wgmma's scale-d is not a constant true (accumulators not zero-initialised)"
    assert 2 in r["wait_groups"], f"{case}: the K step's wgmma groups are not kept in flight ({r['wait_groups']})"
    # Operands: weights by 3-D TMA (gate and up tiles); x rows by 2-D TMA or by 16-byte cp.async + a .noinc arrive.
    assert r["tma_load_3d"] == 2, f"{case}: {r['tma_load_3d']} 3-D TMA loads"
    if r["gather"]:
        copies = G.BLOCK_M * G.BLOCK_K * 2 // 16 // (G.GATHER_WARPS * 32)
        assert r["tma_load_2d"] == 0 and r["cp_async_16"] == r["cp_async_any"] == copies, (
            f"{case}: {r['cp_async_16']}/{r['cp_async_any']} 16-byte cp.async for {copies} per thread and K step")
        assert r["cp_async_arrive_noinc"] == 1
        ready_count = 1 + G.GATHER_WARPS * 32
    else:
        assert r["tma_load_2d"] == 1 and r["cp_async_any"] == 0 and r["cp_async_arrive_noinc"] == 0
        ready_count = 1
    # Outputs: per consumer one 3-D TMA store per stored tensor; buffers reused after wait_group.read OUT_BUFS - 1.
    stores = 3 if r["store_gate_up"] else 1
    assert r["tma_store_3d"] == 2 * stores, f"{case}: {r['tma_store_3d']} TMA stores"
    assert tile.out_bufs - 1 in r["tma_store_wait"] and 0 in r["tma_store_wait"], r["tma_store_wait"]
    # mbarriers: ready and empty per stage with their counts; waits, the producer's expect, the releases.
    want_init = sorted([str(ready_count)] * tile.stages + ["2"] * tile.stages)
    assert sorted(r["mbar_init"]) == want_init, f"{case}: mbarrier.init counts {r['mbar_init']}"
    assert r["mbar_wait"] >= 3 and r["mbar_expect"] >= 1 and r["mbar_arrive"] >= 4
    # Warp specialization and its register split.
    assert meta.num_warps == 12, f"{case}: {meta.num_warps} warps"
    assert ("dec", str(tile.producer_regs)) in r["setmaxnreg"], f"{case}: producer registers {r['setmaxnreg']}"
    assert ("inc", str(tile.consumer_regs)) in r["setmaxnreg"], f"{case}: consumer registers {r['setmaxnreg']}"
    assert ("dec", str(tile.consumer_regs)) in r["setmaxnreg"], f"{case}: the default consumer {r['setmaxnreg']}"
    # No spills, nothing serialised, shared memory within the SM.
    assert px["spill_stores"] == 0 and px["spill_loads"] == 0 and px["stack"] == 0, f"{case} spills:\n{px['log']}"
    assert r["local"] == 0, f"{case}: local-memory loads/stores in the SASS"
    assert "C7510" not in px["log"] and "serialized" not in px["log"], f"{case}: wgmma serialised:\n{px['log']}"
    assert tile.smem_bytes() <= meta.shared <= SMEM_LIMIT, f"{case}: shared {meta.shared} B (ring + staging {tile.smem_bytes()})"


def test_epilogue_matches_triton_kernel():
    """Same epilogue instructions as the production kernel: for the 128-column tile, every float instruction kind
    of the epilogue appears exactly twice as often in the Gluon kernel (two consumer warpgroups, each 64 rows,
    compiled as two copies) as in the Triton kernel (one 8-warp copy of 128 rows)."""
    production = _op_counts(_compile_triton_production().asm["ptx"])
    assert production["ex2.approx.f32"] and production["div.full.f32"], production
    for case in ("s3b2-gu-tma", "s3b2-h-gather"):
        r = _report(case)
        assert r["tile"].block_n == _SM90_TMA.gate_up_fwd.block_n
        doubled = collections.Counter({op: 2 * n for op, n in production.items()})
        print(f"\n{case}: epilogue ops {dict(r['epilogue_ops'])}; Triton kernel {dict(production)}")
        assert r["epilogue_ops"] == doubled, f"{case}: {r['epilogue_ops']} != 2 x {production}"


def test_gather_copies_stay_16_bytes_for_any_h():
    """H a multiple of 8 but not of 16 (e.g. 2888: TMA-addressable, not specialised): the gathering producer still
    copies whole 16-byte chunks (its H is written as a multiple of 8), without spills."""
    compiled = _compile_gluon(G.TILES["s3b2"], True, True, sizes_aligned=False)
    ptx = compiled.asm["ptx"]
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)
    px = _ptxas(ptx)
    print(f"\ngather, H and I unspecialised: cp.async sizes {sizes}, spills {px['spill_stores']}/{px['spill_loads']} B")
    assert sizes == ["0x10"] * (G.BLOCK_M * G.BLOCK_K * 2 // 16 // (G.GATHER_WARPS * 32)), sizes
    assert px["spill_stores"] == 0 and px["spill_loads"] == 0 and px["stack"] == 0, px["log"]


# ----------------------------------------------------------------------------------------------------
# Models of the kernel's index arithmetic (in Python)


def _producer_slots(pid, nprog, tiles, k_steps):
    """{(tile, k): slot counter p} in the producer's order."""
    out, p = {}, 0
    for tile in range(pid, tiles, nprog):
        for k in range(k_steps):
            out[(tile, k)] = p
            p += 1
    return out


def test_slot_counters_model():
    """Both consumers read every (tile, K step) from the slot the producer filled for it, in increasing order;
    every slot is released by both (empty count 2) exactly once per use, the release of step c coming after
    step c + 1's wgmma was issued (or after the tile's last wait)."""
    for tiles, nprog, k_steps in [(1, 132, 32), (131, 132, 32), (1000, 132, 17), (1001, 7, 17), (5, 2, 1), (64, 3, 64)]:
        for pid in range(min(nprog, 4)):
            filled = _producer_slots(pid, nprog, tiles, k_steps)
            for wg in range(2):
                c, released, reads = 0, [], []
                for tile in range(pid, tiles, nprog):
                    for ki in range(k_steps):
                        reads.append(((tile, ki), c))
                        if ki > 0:
                            released.append(c - 1)
                        c += 1
                    released.append(c - 1)
                assert all(filled[key] == slot for key, slot in reads)
                assert [slot for _, slot in reads] == sorted(filled.values())
                assert released == list(range(len(filled)))


def test_staging_rotation_model():
    """A consumer's stores rotate through OUT_BUFS buffers (store n in buffer n % OUT_BUFS), each preceded by
    wait_group.read OUT_BUFS - 1 (at most OUT_BUFS - 1 stores still reading shared memory): the store that last
    used the buffer about to be overwritten has always finished reading it."""
    for out_bufs in (1, 2, 3):
        for stores_per_tile in (1, 3):
            pending: list[int] = []  # stores still reading their buffer, oldest first
            for n in range(40 * stores_per_tile):
                while len(pending) > out_bufs - 1:  # cp.async.bulk.wait_group.read OUT_BUFS - 1
                    pending.pop(0)
                assert all(p % out_bufs != n % out_bufs for p in pending), (out_bufs, stores_per_tile, n, pending)
                pending.append(n)
