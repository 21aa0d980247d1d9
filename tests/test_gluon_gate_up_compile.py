"""Ahead-of-time compile checks of the Gluon gate_up_fwd kernel (megamoe/backends/triton/kernels/gluon_gate_up.py),
on CPU.

Compiled as tests/test_gluon_rows_compile.py compiles the row-block GEMMs (tests/compile_checks.py): a
GluonASTSource through triton.compile for GPUTarget("cuda", 90, 32), with the signature the launcher's
host-side Gluon TensorDescriptors (built here on CPU tensors) produce. Every tile of gluon_gate_up.TILES, with
and without STORE_GATE_UP, x rows by TMA and gathered (and the gathering kernel for an H that is not a
multiple of 16); the assertions are about the code an H200 would run:

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

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
import torch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from megamoe.backends.triton.configs import _SM90_TMA, triton_tile  # noqa: E402
from megamoe.backends.triton.kernels import gluon_gate_up as G  # noqa: E402
from megamoe.backends.triton.kernels import tma_gemm  # noqa: E402
from compile_checks import (  # noqa: E402
    KNOWN_SPILLS, SMEM_LIMIT, MBarrier, assert_no_spills_or_serialisation, assert_register_split, compile_gluon, compile_triton,
    count, divisible_by_16, int32_arg, kernel_signature, pointers, ptxas_report, tensordesc, warp_specialized_report,
    wgmma_operand_types,
)
# A qwen3-30b-a3b-like problem: the descriptors' block shapes and layouts are what matters, not the sizes.
R, H, I, E, T = 2048, 2048, 768, 4, 512
CASES = {f"{name}-{'gu' if gu else 'h'}-{'gather' if gather else 'tma'}": (name, gu, gather)
         for name, tile in G.TILES.items() if not tile.handoff for gu in (True, False) for gather in (False, True)}
HANDOFF_CASES = {f"{name}-{'gu' if gu else 'h'}": (name, gu) for name, tile in G.TILES.items() if tile.handoff
                 for gu in (True, False)}
# Float instructions of the epilogue (fp32 -> 16-bit rounding, SwiGLU), counted in both kernels.
EPILOGUE_OPS = ("cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32", "cvt.f32.bf16", "ex2.approx.f32", "ex2.approx.ftz.f32",
                "div.full.f32", "div.rn.f32", "rcp.approx.f32", "sub.f32", "neg.f32", "add.f32", "mul.f32", "fma.rn.f32")


def _arg_type(name: str) -> str:
    """x_ptr: the activations (bf16); every other pointer: int32."""
    return "*bf16" if name == "x_ptr" else int32_arg(name)


def _compile_gluon(tile, store_gate_up: bool, gather: bool, sizes_aligned: bool = True, dtype=torch.bfloat16):
    """sizes_aligned: H and I specialised as multiples of 16 (the launch of any H, I % 16 == 0), else plain ints;
    dtype: the operands' (bf16, or fp16, which the Hopper table runs on the same kernels)."""
    x = torch.empty(T if gather else R, H, dtype=dtype)
    w = torch.empty(E, 2 * I, H, dtype=dtype)
    h = torch.empty(R, I, dtype=dtype)
    gate_up = torch.empty(R, 2 * I, dtype=dtype) if store_gate_up else None
    descs = dict(zip(("x_desc", "w_desc", "h_desc", "gu_desc"), G.descriptors(x, w, h, gate_up, tile)))
    fn = G.gate_up_fwd_handoff_kernel if tile.handoff else G.gate_up_fwd_ws_kernel
    consts = G.constexprs(tile, 1, store_gate_up, gather)
    x_type = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    arg_type = lambda name: x_type if name == "x_ptr" else _arg_type(name)  # noqa: E731
    signature = kernel_signature(fn, consts, {name: mangle_type(d) for name, d in descs.items()}, arg_type)
    aligned = pointers(fn) | ({"H", "I"} if sizes_aligned else set())
    return compile_gluon(fn, signature, consts, divisible_by_16(fn, aligned))


def _compile_triton_production():
    """tma_gemm.gate_up_fwd_tma_kernel with its tile-table entry (STORE_GATE_UP, x rows by TMA)."""
    cfg = triton_tile(_SM90_TMA.gate_up_fwd)  # the Triton kernel of the Gluon entry's tile
    fn = tma_gemm.gate_up_fwd_tma_kernel
    consts = dict(STORE_GATE_UP=True, GATHER=False, SPLIT=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten)
    blocks = {"x_desc": [cfg.block_m, cfg.block_k], "w_desc": [1, cfg.block_n, cfg.block_k],
              "h_desc": [cfg.block_m, cfg.block_n], "gu_desc": [cfg.block_m, 1, cfg.block_n]}
    signature = kernel_signature(fn, consts, {name: tensordesc(b) for name, b in blocks.items()}, _arg_type)
    return compile_triton(fn, signature, consts, divisible_by_16(fn, pointers(fn)), cfg.num_warps, cfg.num_stages)


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
        r = warp_specialized_report(_compile_gluon(tile, store_gate_up, gather))
        ptx, sass = r["ptx"], r["sass"]
        _CACHE[case] = dict(
            r, tile=tile, store_gate_up=store_gate_up, gather=gather,
            wgmma=count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_n}k16\.f32\.bf16\.bf16", ptx),
            scale_d_true=_constant_true_scale_d(ptx),
            tma_store_3d=count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx),
            tma_store_wait=sorted(set(int(n) for n in re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+)", ptx))),
            cp_async_16=count(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10, %r\d+;", ptx),
            cp_async_arrive_noinc=count(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", ptx),
            mbar_init_counts=re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx),
            epilogue_ops=_op_counts(ptx),
            hgmma=count(rf"HGMMA\.64x{tile.block_n}x16\.F32\.BF16", sass),
        )
    return _CACHE[case]


@pytest.mark.parametrize("case", list(CASES))
def test_gluon_gate_up_sm90a(case):
    r = _report(case)
    tile, meta, px = r["tile"], r["compiled"].metadata, r["ptxas"]
    print(f"\ngluon gate_up {case} {tile}: {meta.num_warps} warps, {px['registers']} registers/thread (kernel max), "
          f"setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, spills {px['spill_stores']}/{px['spill_loads']} B, "
          f"stack {px['stack']} B; PTX: {r['wgmma']} wgmma m64n{tile.block_n}k16, wait_group {r['wait_groups']}, "
          f"TMA loads 2d/3d {r['tma_load_2d']}/{r['tma_load_3d']}, cp.async {r['cp_async']} "
          f"(+{r['cp_async_arrive_noinc']} arrive.noinc), TMA stores {r['tma_store_3d']} "
          f"(wait_group.read {r['tma_store_wait']}), mbarrier init {r['mbar_init_counts']} / try_wait {r['mbar_wait']} / "
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
        assert r["tma_load_2d"] == 0 and r["cp_async_16"] == r["cp_async"] == copies, (
            f"{case}: {r['cp_async_16']}/{r['cp_async']} 16-byte cp.async for {copies} per thread and K step")
        assert r["cp_async_arrive_noinc"] == 1
        ready_count = 1 + G.GATHER_WARPS * 32
    else:
        assert r["tma_load_2d"] == 1 and r["cp_async"] == 0 and r["cp_async_arrive_noinc"] == 0
        ready_count = 1
    # Outputs: per consumer one 3-D TMA store per stored tensor; buffers reused after wait_group.read OUT_BUFS - 1.
    stores = 3 if r["store_gate_up"] else 1
    assert r["tma_store_3d"] == 2 * stores, f"{case}: {r['tma_store_3d']} TMA stores"
    assert tile.out_bufs - 1 in r["tma_store_wait"] and 0 in r["tma_store_wait"], r["tma_store_wait"]
    # mbarriers: ready and empty per stage with their counts; waits, the producer's expect, the releases.
    want_init = sorted([str(ready_count)] * tile.stages + ["2"] * tile.stages)
    assert sorted(r["mbar_init_counts"]) == want_init, f"{case}: mbarrier.init counts {r['mbar_init_counts']}"
    assert r["mbar_wait"] >= 3 and r["mbar_expect"] >= 1 and r["mbar_arrive"] >= 4
    # Warp specialization and its register split.
    assert meta.num_warps == 12, f"{case}: {meta.num_warps} warps"
    assert_register_split(case, r, tile.producer_regs, tile.consumer_regs)
    assert ("dec", str(tile.consumer_regs)) in r["setmaxnreg"], f"{case}: the default consumer {r['setmaxnreg']}"
    # No spills, nothing serialised, shared memory within the SM (one release's exceptions: KNOWN_SPILLS).
    assert_no_spills_or_serialisation(case, r, **KNOWN_SPILLS.get(case, {}))
    assert tile.smem_bytes() <= meta.shared <= SMEM_LIMIT, f"{case}: shared {meta.shared} B (ring + staging {tile.smem_bytes()})"


@pytest.mark.parametrize("case", list(HANDOFF_CASES))
def test_gluon_gate_up_handoff_sm90a(case):
    """The hand-off kernel: the consumers' main loop as the production kernel's (the same wgmma, kept in flight),
    x rows and weights by TMA, the stores all issued by the epilogue warps (one box of the whole tile per
    tensor), the hand-off barriers beside the ring's, 12 warps within the register file (two consumer
    warpgroups at CONSUMER_REGS, the producer's warp and the epilogue's in one warpgroup at PRODUCER_REGS), no
    spills, the shared memory of the ring and the two [128, BLOCK_N] buffers."""
    name, store_gate_up = HANDOFF_CASES[case]
    tile = G.TILES[name]
    r = warp_specialized_report(_compile_gluon(tile, store_gate_up, gather=False))
    ptx, meta = r["ptx"], r["compiled"].metadata
    per_k_step = 2 * 2 * (G.BLOCK_K // 16)
    wgmma = count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile.block_n}k16\.f32\.bf16\.bf16", ptx)
    stores = count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx)
    inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx)
    print(f"\ngluon gate_up hand-off {case}: {meta.num_warps} warps, setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, "
          f"{wgmma} wgmma, TMA loads 2d/3d {r['tma_load_2d']}/{r['tma_load_3d']}, stores {stores}, mbarrier init {inits}")
    assert wgmma == r["wgmma_any"] == per_k_step and 2 in r["wait_groups"], (wgmma, r["wait_groups"])
    assert _constant_true_scale_d(ptx), "a wgmma's scale-d is not a constant true"
    assert r["tma_load_2d"] == 1 and r["tma_load_3d"] == 2 and r["cp_async"] == 0
    assert stores == (3 if store_gate_up else 1), f"{case}: {stores} TMA stores"
    assert sorted(inits) == sorted(["1"] * tile.stages + ["2"] * tile.stages + ["2", "1"]), inits
    assert meta.num_warps == 12, meta.num_warps
    assert 2 * tile.consumer_regs + tile.producer_regs <= 512, "the three warpgroups' registers exceed the file"
    assert_register_split(case, r, tile.producer_regs, tile.consumer_regs)
    assert_no_spills_or_serialisation(case, r)
    assert tile.smem_bytes() <= meta.shared <= SMEM_LIMIT, f"{case}: shared {meta.shared} B ({tile.smem_bytes()})"


def test_table_runs_the_compiled_tiles(monkeypatch):
    """The Hopper table's gate_up_fwd entries launch tiles these checks compile: on x rows (H > 2048) the hand-off
    kernel's (TILES["s3-handoff"]), gathering x (H <= 2048) the 4-stage, one-buffer consumers'-epilogue tile
    (TILES["s4b1"])."""
    from megamoe.backends.triton import configs

    monkeypatch.setattr(configs, "_arch", lambda device: (9, 0))  # an H100/H200, without one

    def launched(hidden, inter):
        cfg = configs.tma_kernel_configs(hidden, inter, torch.bfloat16, torch.device("cpu"), 128).gate_up_fwd
        return cfg, G.tile_of(cfg)

    rows_cfg, rows_tile = launched(4096, 1536)
    assert not rows_cfg.gather and rows_tile == G.TILES["s3-handoff"], rows_cfg
    gather_cfg, gather_tile = launched(2048, 768)
    assert gather_cfg.gather and gather_tile == G.TILES["s4b1"], gather_cfg


def test_gate_up_fwd_gluon_names_a_bad_gather_row_src():
    """gate_up_fwd_gluon gathering x: a row_src not a contiguous int32 [R] is a ValueError that says what was given, as
    grouped_gemm.gate_up_fwd's (check_row_src; before: 'row_src: int32 [R]' for a strided or an int64 one alike),
    raised before any launch (runs without a GPU)."""
    from megamoe.schedule import build_schedule

    s = build_schedule(torch.zeros(4, 1, dtype=torch.int64), 1, block_m=128)
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(1, 128, 64, dtype=torch.bfloat16)
    for row_src, given in ((torch.stack([s.row_src, s.row_src], 1)[:, 0], r"torch.int32 \(128,\) \(not contiguous\)"),
                           (s.row_src.long(), r"torch.int64 \(128,\)")):
        with pytest.raises(ValueError, match=r"row_src must be a contiguous int32 \[128\] tensor, got " + given):
            G.gate_up_fwd_gluon(x, w, s.block_expert, s.num_blocks, store_gate_up=False, gather=(row_src, 1))


def test_handoff_model():
    """The hand-off protocol under random interleavings, with mbarrier parity waits as the hardware does them
    (try_wait.parity(x) passes while the barrier's current phase parity differs from x): each consumer writes
    tile t's rows only after the epilogue released tile t - 1 (gu_free), the epilogue reads tile t only after
    both consumers wrote it (gu_ready, count 2), and every run ends (no deadlock)."""
    import random

    for tiles in (1, 2, 3, 7, 20):
        for seed in range(200):
            rnd = random.Random(seed)
            ready, free = MBarrier("gu_ready", 2), MBarrier("gu_free", 1)
            written = {0: -1, 1: -1}  # the tile each consumer's rows of the buffer hold
            read = -1  # the last tile the epilogue finished
            # Each agent: a program counter over its steps; a step runs only when its wait passes.
            cons = {wg: [0, "wait"] for wg in (0, 1)}
            epi = [0, "wait"]
            while True:
                runnable = [("c", wg) for wg, (t, st) in cons.items() if t < tiles and (st != "wait" or free.passes((t & 1) ^ 1))]
                if epi[0] < tiles and ready.passes(epi[0] & 1):
                    runnable.append(("e", None))
                if not runnable:
                    break
                who, wg = rnd.choice(runnable)
                if who == "c":
                    t, st = cons[wg]
                    if st == "wait":
                        assert read == t - 1, f"consumer {wg} overwrites tile {read + 1} before the epilogue read it"
                        written[wg] = t
                        cons[wg][1] = "arrive"
                    else:
                        ready.arrive()
                        cons[wg] = [t + 1, "wait"]
                else:
                    t = epi[0]
                    assert written == {0: t, 1: t}, f"the epilogue reads tile {t} from {written}"
                    read = t
                    free.arrive()
                    epi[0] = t + 1
            assert epi[0] == tiles and all(t == tiles for t, _ in cons.values()), ("deadlock", tiles, seed)


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
    px = ptxas_report(ptx)
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


# fp16 operands run the same kernels on Hopper (configs.tma_kernel_configs takes float16): the tiles the table
# launches (test_table_runs_the_compiled_tiles), with and without gate_up stored. Known exceptions: with Triton
# 3.9's ptxas s4b1 without gate_up has 8 local-memory instructions in fp16 (no spills, no stack frame; 3.6: none);
# those of one release alone are compile_checks.KNOWN_SPILLS.
FP16_CASES = {f"{name}-{'gu' if gu else 'h'}": (name, gu) for name in ("s3-handoff", "s4b1") for gu in (True, False)}
FP16_LOCAL = {"s4b1-h": 8}


@pytest.mark.parametrize("case", list(FP16_CASES))
def test_gluon_gate_up_fp16_sm90a(case):
    name, store_gate_up = FP16_CASES[case]
    tile = G.TILES[name]
    r = warp_specialized_report(_compile_gluon(tile, store_gate_up, gather=not tile.handoff, dtype=torch.float16))
    forms = wgmma_operand_types(r["ptx"])
    assert forms == {("f16", "f16")}, f"{case} fp16: wgmma forms {forms}"
    allowed = KNOWN_SPILLS.get(f"{case} fp16", dict(local=FP16_LOCAL.get(case, 0)))
    assert_no_spills_or_serialisation(f"{case} fp16", r, **allowed)
