"""Ahead-of-time compile checks of the Gluon down_dgrad kernel (kernels/gluon_down_dgrad.py), on CPU.

The kernel is compiled for sm_90a the way tests/test_gluon_rows_compile.py compiles the row-block GEMMs (a
GluonASTSource through triton.compile, with the signatures of the host-side Gluon TensorDescriptors the
launcher builds, here on CPU tensors), in its three variants: the router epilogue with h_w stored (what the
one-GPU backward runs), the router epilogue without h_w, and plain down_dgrad (no router). The assertions are
about the code an H200 would run:

  * wgmma: per K step, 8 wgmma.mma_async m64n128k16 (two row halves x four k16) in the MMA partition only
    (16 in the PTX: K step 0 is peeled out of the loop; HGMMA 64x128x16 in the SASS), kept in flight across
    K steps (wgmma.wait_group 1);
  * TMA: d_y rows by one 2-D copy, the weight tile by a 3-D copy, g and u of a piece by 3-D copies (three
    call sites in each epilogue partition: the first tile, the second piece, the next tile), all completing
    on mbarriers; d_gate_up by 3-D stores (2 epilogue partitions x 2 pieces x gate/up), h_w by 2-D stores
    (2 x 2, only with ROUTER and STORE_H_W); the stores' shared-memory reads awaited with
    cp.async.bulk.wait_group.read before the staging buffers and pieces are reused; no cp.async;
  * the accumulator through shared memory: 8-byte stores (STS.64) from the MMA partition and 8-byte loads
    (LDS.64) in the epilogue partitions; g and u by ldmatrix, d_g, d_u, h_w by stmatrix;
  * mbarriers: ready + empty per stage, acc_ready, acc_empty, one gu_ready per epilogue partition;
  * warp specialization: 16 warps, setmaxnreg 152 (epilogue partitions) / 40 (producer), the MMA partition
    the rest (168);
  * ptxas -v: no spills, no stack frame, no C7510 (wgmma serialisation); no local memory in the SASS;
    shared memory within the 227 KB of an SM and at least the buffers the config accounts for.

Bitwise equality with tma_gemm.down_dgrad_tma_kernel (checked on a GPU by benchmarks/gluon_down_dgrad_bench.py
and tests/gpu) rests on the same fp32 K loop (m64n128k16 wgmmas, K steps in order) and the same epilogue
math in the same layout: test_epilogue_matches_the_triton_kernel compiles the production kernel with its
TMA table entry and compares the d_w_part row sums' layout, the reduction's lane shuffles and the count of
fused multiply-adds (LLVM's contractions decide bits) per epilogue.

A Python model of the barrier protocol (test_barrier_protocol_model) runs the four partitions' loops, with
the kernel's counters and parities, against a model of mbarriers, TMA copies and stores in random
interleavings: no deadlock, every read sees the data of its own tile, nothing overwritten while a TMA
store or an in-flight wgmma still reads it.

Run: pytest tests/test_gluon_down_dgrad_compile.py -s  (prints registers, shared memory and instruction counts).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
import torch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from megamoe.backends.triton.configs import _SM90_TMA, triton_tile  # noqa: E402
from megamoe.backends.triton.kernels import gluon_down_dgrad as G  # noqa: E402
from megamoe.backends.triton.kernels import tma_gemm  # noqa: E402
from compile_checks import (  # noqa: E402
    SMEM_LIMIT, assert_no_spills_or_serialisation, assert_register_split, compile_gluon, compile_triton, count,
    divisible_by_16, kernel_signature, pointers, tensordesc, warp_specialized_report,
)
# A qwen3-30b-a3b-like problem: the descriptors' block shapes and layouts are what matters, not the sizes.
R, H, I, E = 2048, 2048, 768, 4
VARIANTS = {"router-h_w": (True, True), "router": (True, False), "plain": (False, False)}
_POINTERS = {"weights_ptr": "*fp32", "d_w_part_ptr": "*fp32"}  # every other pointer: int32


def _pointer_type(name: str) -> str:
    assert name.endswith("_ptr"), name
    return _POINTERS.get(name, "*i32")


def _compile_gluon(router: bool, store_h_w: bool, cfg=G.DEFAULT_CONFIG):
    bf16 = dict(dtype=torch.bfloat16)
    descs = G.descriptors(torch.empty(R, H, **bf16), torch.empty(E, H, I, **bf16), torch.empty(R, 2 * I, **bf16),
                          torch.empty(R, 2 * I, **bf16), torch.empty(R, I, **bf16), cfg)
    fn = G.down_dgrad_ws_kernel
    consts = G.constexprs(cfg, 1, router, store_h_w)
    signature = kernel_signature(fn, consts, {name: mangle_type(d) for name, d in descs.items()}, _pointer_type)
    return compile_gluon(fn, signature, consts, divisible_by_16(fn, pointers(fn)))


def _compile_triton_kernel():
    """tma_gemm.down_dgrad_tma_kernel with the TMA table's down_dgrad entry, ROUTER and STORE_H_W (as
    tests/test_triton_compile.py compiles it)."""
    cfg = triton_tile(_SM90_TMA.down_dgrad)  # the Triton kernel of the Gluon entry's tile
    m, n, k = cfg.block_m, cfg.block_n, cfg.block_k
    blocks = {"d_y_desc": [m, k], "w_desc": [1, k, n], "gu_desc": [m, 1, n // 2], "d_gu_desc": [m, 1, n // 2],
              "h_w_desc": [m, n // 2]}
    fn = tma_gemm.down_dgrad_tma_kernel
    consts = dict(ROUTER=True, STORE_H_W=True, SPLIT=1, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=cfg.group_m,
                  FLATTEN=cfg.flatten)
    signature = kernel_signature(fn, consts, {name: tensordesc(b) for name, b in blocks.items()},
                                 lambda name: _pointer_type(name) if name.endswith("_ptr") else "i32")
    attrs = divisible_by_16(fn, pointers(fn) | {"H", "I"})
    return compile_triton(fn, signature, consts, attrs, cfg.num_warps, cfg.num_stages)


_CACHE: dict = {}


def _report(name: str) -> dict:
    """Compile once per variant; what the assertions (and the printed summary) look at."""
    if name not in _CACHE:
        router, store_h_w = VARIANTS[name]
        r = warp_specialized_report(_compile_gluon(router, store_h_w))
        ptx, sass = r["ptx"], r["sass"]
        _CACHE[name] = dict(
            r, router=router, store_h_w=store_h_w,
            wgmma=count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx),
            tma_store_2d=count(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group", ptx),
            tma_store_3d=count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx),
            store_wait_read=count(r"cp\.async\.bulk\.wait_group\.read", ptx),
            ldmatrix=count(r"ldmatrix\.sync", ptx), stmatrix=count(r"stmatrix\.sync", ptx),
            hgmma=count(r"HGMMA\.64x128x16\.F32\.BF16", sass),
            utmaldg=count(r"UTMALDG", sass), utmastg=count(r"UTMASTG", sass),
            sts64=count(r"\bSTS\.64\b", sass), lds64=count(r"\bLDS\.64\b", sass),
        )
    return _CACHE[name]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gluon_down_dgrad_sm90a(name):
    r = _report(name)
    cfg, meta, px = G.DEFAULT_CONFIG, r["compiled"].metadata, r["ptxas"]
    h_w = r["router"] and r["store_h_w"]
    print(f"\ngluon down_dgrad {name} (stages {cfg.stages}): {meta.num_warps} warps, {px['registers']} "
          f"registers/thread (kernel max), setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, spills "
          f"{px['spill_stores']}/{px['spill_loads']} B, stack {px['stack']} B; PTX: {r['wgmma']} wgmma m64n128k16, "
          f"wait_group {r['wait_groups']}, TMA loads 2d/3d {r['tma_load_2d']}/{r['tma_load_3d']}, TMA stores 2d/3d "
          f"{r['tma_store_2d']}/{r['tma_store_3d']}, store waits {r['store_wait_read']}, ldmatrix {r['ldmatrix']}, "
          f"stmatrix {r['stmatrix']}, mbarrier init {r['mbar_init']} / try_wait {r['mbar_wait']} / expect_tx "
          f"{r['mbar_expect']} / arrive {r['mbar_arrive']}; SASS: {r['hgmma']} HGMMA, UTMALDG {r['utmaldg']}, "
          f"UTMASTG {r['utmastg']}, STS.64 {r['sts64']}, LDS.64 {r['lds64']}, local {r['local']}")
    # wgmma: a K step is 2 x 4 m64n128k16 (two row halves, BLOCK_K 64 / 16), twice in the code (K step 0 peeled).
    assert r["wgmma"] == r["wgmma_any"] == 2 * 8, f"{name}: wgmma {r['wgmma']}/{r['wgmma_any']}"
    assert r["hgmma"] == 2 * 8, f"{name}: {r['hgmma']} HGMMA in the SASS"
    assert 1 in r["wait_groups"], f"{name}: wgmma not kept in flight across K steps ({r['wait_groups']})"
    # TMA: d_y (2-D) and the weight tile (3-D, two 64-column messages) in the producer; g and u (3-D) once per
    # piece in each epilogue partition; d_gate_up (3-D) and h_w (2-D) out, per partition and piece.
    assert r["tma_load_2d"] == 1 and r["tma_load_3d"] == 2 + 2 * 2 * 2, (
        f"{name}: TMA loads {r['tma_load_2d']}/{r['tma_load_3d']}")
    assert r["tma_store_3d"] == 2 * 2 * 2, f"{name}: {r['tma_store_3d']} d_gate_up stores"
    assert r["tma_store_2d"] == (2 * 2 if h_w else 0), f"{name}: {r['tma_store_2d']} h_w stores"
    # The stores' reads awaited: per partition at the end of a tile, and with h_w after each piece's h_w store
    # (d_g goes into the box it was read from).
    assert r["store_wait_read"] == 2 * (1 + (2 if h_w else 0)) and r["cp_async"] == 0, f"{name}: store waits"
    assert r["utmaldg"] >= 3 and r["utmastg"] >= 2 * 2 * 2
    # The accumulator through shared memory in 8-byte accesses (128 fp32 registers: 64 stores in the MMA
    # partition; 2 pieces x 32 registers: 32 loads in each epilogue partition); g, u by ldmatrix, the outputs
    # by stmatrix.
    assert r["sts64"] >= 64 and r["lds64"] == 2 * 32, f"{name}: STS.64 {r['sts64']}, LDS.64 {r['lds64']}"
    assert r["ldmatrix"] > 0 and r["stmatrix"] > 0, f"{name}: ldmatrix {r['ldmatrix']}, stmatrix {r['stmatrix']}"
    # mbarriers: ready + empty per stage, acc_ready, acc_empty, gu_ready x 2.
    assert r["mbar_init"] == 2 * cfg.stages + 4, f"{name}: {r['mbar_init']} mbarrier.init"
    assert r["mbar_expect"] >= 1 + 2 * 2, f"{name}: expect_tx for the ring and for each g, u copy"
    assert r["mbar_wait"] >= 2 + 2 + 2 * 2 and r["mbar_arrive"] >= 2 + 2
    # Warp specialization and its register split.
    assert meta.num_warps == 16, f"{name}: {meta.num_warps} warps"
    assert_register_split(name, r, cfg.producer_regs, cfg.epilogue_regs)
    # No spills, nothing serialised, shared memory within the SM.
    assert_no_spills_or_serialisation(name, r)
    want = cfg.smem_bytes()
    assert want <= meta.shared <= SMEM_LIMIT, f"{name}: shared {meta.shared} B (buffers {want} B)"


# ----------------------------------------------------------------------------------------------------
# The epilogue against the Triton kernel's


_LAYOUT_ALIAS = re.compile(r"^(#[\w]+) = #ttg\.linear<\{register = (\[.*?\]\]), lane = (\[.*?\]\]), "
                           r"warp = (\[.*?\]\]|\[\])", re.M)


def _reduce_operand_layouts(ttgir: str) -> list[tuple[str, str, str]]:
    """(register, lane, warp bases) of the operand of every tt.reduce (the d_w_part row sums)."""
    aliases = {m.group(1): (m.group(2), m.group(3), m.group(4)) for m in _LAYOUT_ALIAS.finditer(ttgir)}
    operands = re.findall(r'"tt\.reduce"\(.*?\n(?:.*\n)*?\s*\}\) : \(tensor<\d+x\d+xf32, (#\w+)>\)', ttgir)
    return [aliases[name] for name in operands]


def _fma_count(ptx: str) -> int:
    return len(re.findall(r"\bfma\.rn\.f32\b", ptx))


def test_epilogue_matches_the_triton_kernel():
    """The d_w_part sums run in the Triton kernel's layout (same register and lane bases: the same order of
    in-thread adds and lane shuffles; the warp bases only place rows), and LLVM fuses the same multiply-adds.
    """
    triton_compiled = _compile_triton_kernel()
    ours = _report("router-h_w")
    theirs = _reduce_operand_layouts(triton_compiled.asm["ttgir"])
    mine = _reduce_operand_layouts(ours["compiled"].asm["ttgir"])
    print(f"\nTriton kernel's reduce layouts {theirs}\nGluon kernel's {mine}")
    assert len(theirs) == 2 and len(mine) == 2 * 2, (theirs, mine)  # two halves (x two consumer partitions)
    for reg, lane, warp in mine:
        t_reg, t_lane, t_warp = theirs[0]
        assert (reg, lane) == (t_reg, t_lane), f"row sums in another order: {reg} {lane} vs {t_reg} {t_lane}"
        assert warp == "[[16, 0], [32, 0]]" and t_warp == "[[16, 0], [32, 0], [64, 0]]", (warp, t_warp)
    # Lane shuffles of the row sums (two rows per thread and half): xor 2 then xor 1 in both kernels.
    theirs_shuffles = re.findall(r"shfl\.sync\.bfly\.b32\s+\S+ \S+ (\d+),", triton_compiled.asm["ptx"])
    shuffles = re.findall(r"shfl\.sync\.bfly\.b32\s+\S+ \S+ (\d+),", ours["ptx"])
    assert theirs_shuffles == ["2", "1"] * 4 and shuffles == theirs_shuffles * 2, (theirs_shuffles, shuffles)
    # One consumer partition's epilogue fuses as many multiply-adds as the Triton kernel's epilogue (the
    # K loops have none): (1 + g (1 - s)) per element and the in-thread row sums.
    assert _fma_count(ours["ptx"]) == 2 * _fma_count(triton_compiled.asm["ptx"]) > 0
    # The same approximate transcendental and division instructions (Triton's lowering of exp and "/").
    for instr in ("ex2.approx.f32", "div.full.f32"):
        assert instr in ours["ptx"] and instr in triton_compiled.asm["ptx"], instr


# ----------------------------------------------------------------------------------------------------
# A model of the barrier protocol (the kernel's counters and parities, in Python)


class _MBarrier:
    """count arrivals (arrive.expect_tx is one) plus the expected transaction bytes complete a phase."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._advance()

    def expect(self, units: int) -> None:
        self.tx += units
        self.arrive()

    def complete_tx(self, units: int) -> None:
        self.tx -= units
        self._advance()

    def _advance(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity has completed (the current phase has the other one)."""
        return (self.completed & 1) != parity


class _Cell:
    """A shared-memory buffer: its content tag and the async readers (TMA stores, wgmmas) not done yet."""

    def __init__(self):
        self.tag, self.readers = None, 0

    def write(self, tag) -> None:
        assert self.readers == 0, f"overwritten ({self.tag} -> {tag}) while still being read"
        self.tag = tag


class _Model:
    """The kernel's four partitions: producer, MMA warpgroup, epilogue warpgroups 0 and 1."""

    def __init__(self, tiles: int, k_steps: int, stages: int, router: bool, seed: int, store_h_w: bool = True):
        self.tiles, self.k_steps, self.stages, self.router, self.store_h_w = tiles, k_steps, stages, router, store_h_w
        self.rng = random.Random(seed)
        self.ready = [_MBarrier(1) for _ in range(stages)]
        self.empty = [_MBarrier(1) for _ in range(stages)]
        self.acc_ready, self.acc_empty = _MBarrier(1), _MBarrier(2)
        self.gu_ready = [_MBarrier(1), _MBarrier(1)]
        self.slots = [_Cell() for _ in range(stages)]
        # Accumulator piece p is boxes 2p (g, then h_w, then d_g) and 2p + 1 (u, then d_u).
        self.boxes = [_Cell() for _ in range(8)]
        self.events: list = []  # async completions: TMA copies landing, TMA stores reading shared memory
        self.stores = [[], []]  # per warpgroup, in issue order: [done] of each TMA store

    # async operations
    def _tma_load(self, cells, tag, bar) -> None:
        def land():
            for cell in cells:
                cell.write(tag)
            bar.complete_tx(1)
        self.events.append(land)

    def _tma_store(self, wg: int, cell: _Cell, tag) -> None:
        cell.readers += 1
        done = [False]
        self.stores[wg].append(done)

        def read():
            assert cell.tag == tag, f"a TMA store read {cell.tag}, not {tag}"
            cell.readers -= 1
            done[0] = True
        self.events.append(read)

    # the partitions (their loops as the kernel's, waits yielded)
    def producer(self):
        p = 0
        for j in range(self.tiles):
            for ki in range(self.k_steps):
                s = p % self.stages
                yield ("bar", self.empty[s], ((p // self.stages) & 1) ^ 1)
                self.ready[s].expect(1)
                self._tma_load([self.slots[s]], (j, ki), self.ready[s])
                p += 1

    def mma(self):
        c = 0
        for j in range(self.tiles):
            in_flight = None  # the wgmma not retired yet: (slot cell, tag)
            for ki in range(self.k_steps):
                s = c % self.stages
                yield ("bar", self.ready[s], (c // self.stages) & 1)
                assert self.slots[s].tag == (j, ki), f"wgmma of {(j, ki)} read {self.slots[s].tag}"
                self.slots[s].readers += 1
                if in_flight is not None:  # warpgroup_mma_wait(1): the previous wgmma retires
                    in_flight[0].readers -= 1
                    assert in_flight[0].tag == in_flight[1]
                in_flight = (self.slots[s], (j, ki))
                if ki > 0:
                    self.empty[(c + self.stages - 1) % self.stages].arrive()
                c += 1
            in_flight[0].readers -= 1  # warpgroup_mma_wait(0)
            assert in_flight[0].tag == in_flight[1]
            self.empty[(c + self.stages - 1) % self.stages].arrive()
            yield ("bar", self.acc_empty, (j & 1) ^ 1)
            for box in self.boxes:
                box.write(("acc", j))
            self.acc_ready.arrive()

    def epilogue(self, wg: int):
        for j in range(self.tiles):
            yield ("bar", self.acc_ready, j & 1)
            for half in range(2):
                g_box, u_box = self.boxes[4 * wg + 2 * half], self.boxes[4 * wg + 2 * half + 1]
                assert g_box.tag == u_box.tag == ("acc", j), f"tile {j} read the accumulator {g_box.tag} / {u_box.tag}"
                # (fence, barrier) then g and u by TMA into the piece's boxes
                self.gu_ready[wg].expect(2)
                self._tma_load([g_box], ("g", j, half), self.gu_ready[wg])
                self._tma_load([u_box], ("u", j, half), self.gu_ready[wg])
                yield ("bar", self.gu_ready[wg], half)
                assert (g_box.tag, u_box.tag) == (("g", j, half), ("u", j, half)), f"read {g_box.tag} / {u_box.tag}"
                h_w = self.router and self.store_h_w
                if h_w:
                    g_box.write(("h_w", j, half))
                    self._tma_store(wg, g_box, ("h_w", j, half))
                u_box.write(("d_u", j, half))
                if h_w:
                    yield ("stores", wg, 0, "h_w")  # tma.store_wait(0): the h_w store has read the g box
                g_box.write(("d_g", j, half))
                self._tma_store(wg, g_box, ("d_g", j, half))
                self._tma_store(wg, u_box, ("d_u", j, half))
            yield ("stores", wg, 0, "tile")  # every store has read its box
            self.acc_empty.arrive()

    def run(self) -> None:
        procs = [self.producer(), self.mma(), self.epilogue(0), self.epilogue(1)]
        waiting = {i: None for i in range(len(procs))}  # what each process waits for (None: runnable)

        def runnable(i):
            w = waiting[i]
            if w is None:
                return True
            if w[0] == "bar":
                return w[1].passed(w[2])
            stores = self.stores[w[1]]  # ("stores", wg, n): all but the n most recent stores have read
            return all(done[0] for done in stores[:len(stores) - w[2]])

        while waiting:
            ready = [i for i in waiting if runnable(i)]
            if self.events and (not ready or self.rng.random() < 0.5):
                self.events.pop(self.rng.randrange(len(self.events)))()
                continue
            assert ready, f"deadlock: {[waiting[i] for i in waiting]}"
            i = self.rng.choice(ready)
            try:
                waiting[i] = next(procs[i])
            except StopIteration:
                del waiting[i]
        while self.events:
            self.events.pop()()


@pytest.mark.parametrize("router", [True, False])
def test_barrier_protocol_model(router):
    runs = 0
    for tiles in (0, 1, 2, 3, 6):
        for k_steps in (1, 2, 3, 7):
            for stages in (2, 3, G.DEFAULT_CONFIG.stages):
                for seed in range(8):
                    _Model(tiles, k_steps, stages, router, seed).run()
                    runs += 1
    print(f"\n{runs} random interleavings of the partitions: no deadlock, no stale or overwritten buffer")


@pytest.mark.parametrize("dropped", ["h_w", "tile"])
def test_barrier_protocol_model_catches_a_missing_wait(dropped):
    """The model fails where the kernel would without either of the epilogue's store waits: d_g written over
    the g box while the h_w store still reads it ("h_w"), or the next tile's accumulator over boxes whose
    stores have not read them ("tile")."""
    class Unwaited(_Model):
        def epilogue(self, wg):
            for item in super().epilogue(wg):
                if item[0] != "stores" or item[3] != dropped:
                    yield item

    failures = 0
    for seed in range(20):
        try:
            Unwaited(3, 2, 2, True, seed).run()
        except AssertionError:
            failures += 1
    assert failures > 0


def test_config_fits_and_matches_the_triton_tile():
    """The tile is the TMA table's (d_w_part's column blocks and the bitwise match depend on it)."""
    cfg, table = G.DEFAULT_CONFIG, _SM90_TMA.down_dgrad
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (table.block_m, table.block_n, table.block_k)
    assert cfg.stages == table.num_stages and cfg.group_m == table.group_m  # the launcher's config is the table's
    assert cfg.smem_bytes() + 1024 <= SMEM_LIMIT, dataclasses.asdict(cfg)
